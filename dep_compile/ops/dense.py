"""The rewritten ops' dense weights in either format: a BF16 tensor, or FP8 block-scaled codes with their scales.

A layer rewritten from FP8 block-scaled projections (``stock/fp8_block.py``) hands its ops each weight's e4m3
codes where the BF16 weight would go and the FP32 block scales in a ``scales`` list beside; ``Fp8Weight``
pairs them again, and ``dense_linear`` runs whichever it is given: BF16 as stock runs it, FP8 through kimi_dep's FP8
split-K where ``tactics.DEP_DENSE_FP8`` has a tactic for the weight's shape and the batch on CUDA, else stock's op.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import tactics
from .projection import DepProjection


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One FP8 block-scaled projection of one segment: e4m3 codes [N, K] and FP32 scales [ceil(N/128), ceil(K/128)]."""

    codes: Tensor
    scale: Tensor


def dense_weight(w: Tensor, scale: Tensor | None) -> Tensor | Fp8Weight:
    """``w`` itself (BF16), or ``w`` paired with its block scales (FP8)."""
    return w if scale is None else Fp8Weight(w, scale)


def dense_linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
    """x [T, K] @ w^T -> [T, N] BF16: ``F.linear``, or for FP8 a one-segment ``DepProjection`` (module doc)."""
    if isinstance(w, Fp8Weight):
        n, k = w.codes.shape  # DepProjection.fp8 runs stock's op off CUDA whatever the table says
        return DepProjection(f"fp8 {n}x{k}", tactics.DEP_DENSE_FP8.get((n, k), {}), (n,)).fp8(x, w.codes, w.scale)
    return F.linear(x, w)
