"""Triton RMSNorm (SM90): FP32 statistics and scale on a BF16 row, rounded once, in one launch.

Stock's ``RMSNorm`` runs a cast, the norm and a cast back (three launches); in a decode step
each launch costs a few µs on the critical path (the MoE's latent norm sits between the experts
and the up-projection; the DSA query norm between the two projections).

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, eps, D: tl.constexpr, DP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, DP)
    ok = d < D
    x = tl.load(x_ptr + t * stride_x + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w
    tl.store(out_ptr + t * stride_out + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [T, D]`` (unit inner stride) in FP32 times ``weight [D]``, rounded to x's dtype."""
    T, D = x.shape
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, weight, out, x.stride(0), out.stride(0), float(eps), D=D,
                               DP=triton.next_power_of_2(D), num_warps=8)
    return out
