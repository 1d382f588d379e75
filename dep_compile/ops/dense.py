"""The rewritten ops' dense weights in either format: a BF16 tensor, or FP8 block-scaled codes with their scales.

A layer rewritten from FP8 block-scaled projections (``stock/fp8_block.py``) hands its ops each weight's e4m3
codes where the BF16 weight would go and the FP32 block scales in a ``scales`` list beside; ``Fp8Weight``
pairs them again, and ``dense_linear`` runs whichever it is given as stock runs it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One FP8 block-scaled projection of one segment: e4m3 codes [N, K] and FP32 scales [ceil(N/128), ceil(K/128)]."""

    codes: Tensor
    scale: Tensor


def dense_weight(w: Tensor, scale: Tensor | None) -> Tensor | Fp8Weight:
    """``w`` itself (BF16), or ``w`` paired with its block scales (FP8)."""
    return w if scale is None else Fp8Weight(w, scale)


def dense_linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
    """x [T, K] @ w^T -> [T, N] BF16, as stock computes it: ``F.linear``, or ``kimi_k3::fp8_block_linear``."""
    if isinstance(w, Fp8Weight):
        return torch.ops.kimi_k3.fp8_block_linear(x, w.codes, w.scale, [w.codes.shape[0]])
    return F.linear(x, w)
