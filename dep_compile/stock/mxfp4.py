"""MXFP4 weights as Kimi K3 ships its routed experts (compressed-tensors ``mxfp4-pack-quantized``).

A weight ``W [N, K]`` is stored as two uint8 tensors:

- ``weight_packed [N, K/2]``: two E2M1 codes a byte along K, element ``2j`` in the low nibble and
  ``2j+1`` in the high one. A code is a sign bit (bit 3) over three bits indexing the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0);
- ``weight_scale [N, K/32]``: one E8M0 biased exponent ``s`` per 32 consecutive inputs of a row,
  the scale ``2^(s - 127)``.

``W[n, k] = E2M1[code(n, k)] * 2^(s[n, k // 32] - 127)``, exact in BF16 (a two-bit significand times a
power of two). Both the nibble order and the code table are compressed-tensors' (0.17, the version
vLLM 0.32 pins), checked against its decompressor in tests/test_mxfp4.py. Experts stack these per
expert as vLLM names them: ``w13_weight_packed [E, 2I, Lat/2]``, ``w13_weight_scale [E, 2I, Lat/32]``,
``w2_weight_packed [E, Lat, I/2]``, ``w2_weight_scale [E, Lat, I/32]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

GROUP = 32  # inputs per E8M0 scale
E8M0_BIAS = 127
# E2M1 code -> value (sign bit 3, magnitude index bits 0-2)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Weight(NamedTuple):
    """A weight ``[..., N, K]`` in MXFP4: ``packed [..., N, K/2]`` uint8 codes and ``scale [..., N, K/32]`` E8M0."""

    packed: Tensor
    scale: Tensor

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[..., N, K]``."""
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return dequantize(self.packed, self.scale, dtype)


def group_size(packed: Tensor, scale: Tensor) -> int | None:
    """The inputs per scale of ``packed [..., N, K/2]`` with ``scale [..., N, K/g]`` (None if they do not tile K)."""
    k = 2 * packed.shape[-1]
    groups = scale.shape[-1]
    return k // groups if groups and k % groups == 0 else None


def check_mxfp4(what: str, packed: Tensor, scale: Tensor) -> None:
    """ValueError naming ``what`` unless ``packed`` / ``scale`` are uint8 codes and scales of one shape family."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"{what}: packed weights are {packed.dtype}, not uint8 (two E2M1 codes a byte)")
    if scale.dtype != torch.uint8 and not scale.is_floating_point():
        raise ValueError(f"{what}: scales are {scale.dtype}, neither uint8 (E8M0) nor floating point")
    if packed.shape[:-1] != scale.shape[:-1] or group_size(packed, scale) is None:
        raise ValueError(f"{what}: scales {tuple(scale.shape)} do not tile packed weights {tuple(packed.shape)}")


def unpack_codes(packed: Tensor) -> Tensor:
    """E2M1 codes [..., K] (int64) of ``packed [..., K/2]``: low nibble first."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()


def scale_values(scale: Tensor) -> Tensor:
    """The FP32 scale of each group: ``2^(s - 127)`` for E8M0 codes, the value itself for float scales."""
    return torch.exp2(scale.float() - E8M0_BIAS) if scale.dtype == torch.uint8 else scale.float()


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``[..., N, K]`` in ``dtype`` from ``packed [..., N, K/2]`` and ``scale [..., N, K/g]`` (g = 32 for MXFP4;
    E8M0 uint8 scales, or float scales as multipliers)."""
    check_mxfp4("dequantize", packed, scale)
    g = group_size(packed, scale)
    values = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)[unpack_codes(packed)]
    return (values * scale_values(scale).repeat_interleave(g, -1)).to(dtype)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator, std: float) -> tuple[Tensor, Tensor]:
    """Random MXFP4 codes and scales for a weight of ``shape [..., N, K]``, on ``generator``'s device:
    (packed uint8, E8M0 uint8).

    Codes are drawn uniformly (their values have an RMS of 2.93); each group's scale is ``random_e8m0``'s, so the
    weights' RMS is within 1.4x of ``std``.
    """
    *lead, n, k = shape
    if k % GROUP:
        raise ValueError(f"MXFP4 weights need K divisible by {GROUP}, got {k}")
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=generator, dtype=torch.int32, device=generator.device)
    return packed.to(torch.uint8), random_e8m0((*lead, n, k // GROUP), generator, std)


def random_e8m0(shape: tuple[int, ...], generator: torch.Generator, std: float) -> Tensor:
    """Random E8M0 group scales (uint8 ``shape``) for uniform E2M1 codes: the power of two nearest ``std / 2.93``,
    times 2^-1, 1 or 2 at random."""
    rms = (sum(v * v for v in E2M1) / len(E2M1)) ** 0.5
    center = E8M0_BIAS + round(torch.tensor(std / rms).log2().item())
    return (center + torch.randint(-1, 2, shape, generator=generator, device=generator.device)).to(torch.uint8)


__all__ = ["GROUP", "E8M0_BIAS", "E2M1", "Mxfp4Weight", "group_size", "check_mxfp4", "unpack_codes", "scale_values", "dequantize",
           "random_mxfp4", "random_e8m0"]
