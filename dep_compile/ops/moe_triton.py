"""Triton SiTU for the MoE op's shared expert (SM90): one launch instead of stock's chain of
elementwise kernels (casts, tanh, sigmoid, products), with stock's numerics: FP32 math on the
BF16 gate|up, one rounding to BF16 at the end.

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tanh_fp32(x):
    """tanh to FP32 precision: from exp where |x| >= 0.05 (sign-symmetric, no overflow), a Taylor
    polynomial below (where 1 - exp(-2|x|) would cancel; its truncation error is < 1e-10 relative)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 - a2 * (1.0 / 3.0 - a2 * (2.0 / 15.0 - a2 * (17.0 / 315.0))))
    y = tl.where(a < 0.05, small, big)
    return tl.where(x < 0, -y, y)


@triton.jit
def situ_fp32(g, u, beta, beta_lin):
    """SiTU of FP32 gate and up, in FP32: ``beta * tanh(g / beta) * sigmoid(g) * beta_lin * tanh(u / beta_lin)``."""
    return beta * tanh_fp32(g / beta) * (1.0 / (1.0 + tl.exp(-g))) * (beta_lin * tanh_fp32(u / beta_lin))


@triton.jit
def _situ_kernel(x_ptr, out_ptr, stride_x, stride_out, beta, beta_lin, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(x_ptr + t * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + c, mask=ok, other=0.0).to(tl.float32)
    y = situ_fp32(g, u, beta, beta_lin)
    tl.store(out_ptr + t * stride_out + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def situ_fused(gate_up: torch.Tensor, beta: float, beta_lin: float, *, block: int = 1024) -> torch.Tensor:
    """SiTU of a packed ``[T, 2I]`` gate|up projection (unit inner stride) -> ``[T, I]`` in its dtype."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _situ_kernel[(T, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), float(beta),
                                                     float(beta_lin), I=inter, BLOCK=block, num_warps=4)
    return out
