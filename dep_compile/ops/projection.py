"""DepProjection: a decode GEMM y = x W^T that runs split-K or cuBLAS per its tactic table."""

from __future__ import annotations

import dataclasses

import torch

from .. import tactics
from ..tactics import CUBLAS, SplitK
from .registry import prepared


def splitk_reference(x: torch.Tensor, w: torch.Tensor, split_k: int) -> torch.Tensor:
    """The split-K contract on any device: FP32 partials over ``split_k`` K-slices, summed, one cast.

    x: [M, K]; w: [N, K]. Returns [M, N] in x's dtype.
    """
    K = x.shape[-1]
    step = -(-K // split_k)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for k0 in range(0, K, step):
        acc += x[:, k0 : k0 + step].float() @ w[:, k0 : k0 + step].float().t()
    return acc.to(x.dtype)


@prepared
@dataclasses.dataclass
class DepProjection:
    """One projection of a rewritten layer: its name (for the report) and its tactic table."""

    name: str
    table: dict

    def tactic(self, rows: int):
        return tactics.lookup(self.table, rows)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] BF16, w [N, K] BF16 (may be a row slice of a packed weight) -> [M, N] BF16."""
        tactic = self.tactic(x.shape[0])
        if isinstance(tactic, SplitK):
            if x.is_cuda:
                from .splitk_triton import splitk_linear

                out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                return splitk_linear(x.contiguous(), w, out, tactic)
            return splitk_reference(x, w, tactic.split_k)
        assert tactic == CUBLAS
        return torch.mm(x, w.t())

    def policies(self, batches) -> dict[int, str]:
        return {b: str(t) for b, t in tactics.dep_policies(self.table, batches).items()}
