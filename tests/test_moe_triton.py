"""The Triton SiTU and RMSNorm (``dep_compile.ops.moe_triton``, ``norm_triton``) against stock's torch.

Random BF16 inputs at K3 widths (SiTU 2 x 6144, latent 3584) and a small odd width; every
output element within one BF16 ulp of stock's (only the FP32 summation order and the tanh
implementation differ before the single rounding, which can flip it by one ulp). CUDA only (marked ``cuda``), or the
small width in Triton's CPU interpreter with ``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1``.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dep_compile.stock.layers import situ

from triton_device import DEVICE_MARKS, TRITON_DEV as _DEV, ulps, use_triton

pytestmark = DEVICE_MARKS
WIDTHS = [w for w in ((6144, 3584), (100, 72)) if _DEV != "cpu" or w[0] < 1000]


def _mt():
    use_triton()
    from dep_compile.ops import moe_triton  # noqa: PLC0415 - CUDA / interpreter only

    return moe_triton


def within_one_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element of ``got`` within one BF16 ulp of ``ref``."""
    worst = float(ulps(got, ref).max())
    assert worst <= 1, f"an element is {worst:.2f} BF16 ulps off"


@pytest.mark.parametrize("inter,latent", WIDTHS)
@pytest.mark.parametrize("T", [1, 7, 64])
def test_situ_fused(inter, latent, T):
    mt = _mt()
    g = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(T, 2 * inter + 8, generator=g) * 3).to(torch.bfloat16)[:, : 2 * inter]  # row stride
    ref = situ(gate_up, 4.0, 25.0)
    within_one_ulp(mt.situ_fused(gate_up.to(_DEV), 4.0, 25.0), ref)


@pytest.mark.parametrize("latent", [latent for _, latent in WIDTHS])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_rms_norm_fused(latent, T):
    _mt()
    g = torch.Generator().manual_seed(T + 1)
    x = (torch.randn(T, latent, generator=g) * 2).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(latent, generator=g)).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (latent,), w.float(), 1e-5).to(torch.bfloat16)
    from dep_compile.ops.norm_triton import rms_norm_fused  # noqa: PLC0415

    within_one_ulp(rms_norm_fused(x.to(_DEV), w.to(_DEV), 1e-5), ref)
