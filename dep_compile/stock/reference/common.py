"""Numerics shared by the references: RMSNorm, SiTU, L2 norm, FP8 power-of-two quantization."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in FP32; returns FP32 (callers round)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU: beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin), FP32 math, FP32 out."""
    g, u = gate.float(), up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, FP32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def fp8_pow2_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of ``x [..., D]`` to FP8 e4m3 with one power-of-two scale per row.

    Returns (values [..., D] float8_e4m3fn, scale [...] float32) with x ~= values * scale.
    The scale is the smallest power of two with amax / scale <= 448.
    """
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    values = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale

