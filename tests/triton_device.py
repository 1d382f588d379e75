"""Where the Triton kernel tests run: CUDA (marked ``cuda``), or Triton's CPU interpreter.

``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest tests/test_<kernels>.py`` runs the
kernel tests on the CPU (small sizes). :func:`use_triton` prepares the interpreter to round as
the GPU does, so the CPU run checks the same numerics.
"""

from __future__ import annotations

import os

import pytest
import torch

TRITON_DEV = os.environ.get("TRITON_TEST_DEVICE", "cuda")
ON_CPU = TRITON_DEV == "cpu"
# pytestmark of a kernel test module (conftest skips ``cuda`` tests cleanly without a GPU, as in CI)
DEVICE_MARKS = [] if ON_CPU else [pytest.mark.cuda]


def _round_like_the_gpu() -> None:
    """Triton's CPU interpreter truncates FP32 -> BF16 and rounds FP32 -> FP8 e4m3 ties away (and
    worse near powers of two); the GPU and torch round to nearest even. Convert through torch."""
    import numpy as np  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415

    if getattr(interpreter, "_dep_rne", False):
        return
    orig = interpreter._convert_float

    def convert(x, src, dst, rounding_mode):
        if src == tl.float32 and dst in (tl.bfloat16, tl.float8e4nv):
            t = torch.from_numpy(np.ascontiguousarray(x).view(np.float32).copy())
            if dst == tl.bfloat16:
                return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return orig(x, src, dst, rounding_mode)

    interpreter._convert_float = convert
    interpreter._dep_rne = True


def use_triton() -> None:
    """Skip without Triton; on the CPU, require the interpreter and make it round like the GPU."""
    pytest.importorskip("triton")
    if ON_CPU:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_TEST_DEVICE=cpu needs TRITON_INTERPRET=1")
        _round_like_the_gpu()


def ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in BF16 ulps of ref (ulp = 2^(exponent - 7)), on the CPU."""
    ref = ref.float().cpu()
    return (got.float().cpu() - ref).abs() / torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2 ** -126))) - 7)


def device_test(fn):
    """Mark one test as a kernel test (CUDA, or the interpreter when opted in)."""
    for mark in DEVICE_MARKS:
        fn = mark(fn)
    return fn
