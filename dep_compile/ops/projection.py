"""DepProjection: a decode GEMM y = x W^T that runs split-K or cuBLAS per its tactic table, on BF16 weights or on
FP8 block-scaled ones (``stock/fp8_block.py``: e4m3 codes with one FP32 scale per 128 x 128 block of each segment)."""

from __future__ import annotations

import dataclasses

import torch

from .. import tactics
from ..stock.fp8_block import scale_row_index
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


_WORKSPACES: dict[tuple, list[torch.Tensor]] = {}  # (device, N, tactic) -> every workspace made, newest last


def _workspace(rows: int, n: int, tactic: SplitK, device: torch.device) -> torch.Tensor:
    """A zeroed FP32 split-K workspace for ``rows`` x ``n`` at ``tactic``, shared by the projections of that width
    and tactic (a workspace serves every batch up to the one it was made for, and its calls are stream-ordered:
    one stream, graph replays in order; each call leaves its counters zero). A larger one is made when needed,
    outside graph capture (earlier ones stay alive: captured graphs point at them); inside a capture a too-small
    workspace is a fresh zeroed buffer, captured with its memset."""
    from .splitk_triton import splitk_workspace_numel  # noqa: PLC0415 - imports Triton

    numel = splitk_workspace_numel(rows, n, tactic)
    made = _WORKSPACES.setdefault((device, n, tactic), [])
    if made and made[-1].numel() >= numel:
        return made[-1]
    fresh = torch.zeros(numel, dtype=torch.float32, device=device)
    if not torch.cuda.is_current_stream_capturing():
        made.append(fresh)
    return fresh


@prepared
@dataclasses.dataclass
class DepProjection:
    """One projection of a rewritten layer: its name (for the report), its tactic table, and for FP8 block-scaled
    weights the row counts of the segments packed in it (None: BF16)."""

    name: str
    table: dict
    segments: tuple[int, ...] | None = None

    def tactic(self, rows: int):
        return tactics.lookup(self.table, rows)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] BF16, w [N, K] BF16 or e4m3 codes (may be a row slice of a packed weight), scale: the FP8 block
        scales [R, ceil(K/128)] -> [M, N] BF16."""
        if self.segments is not None:
            return self.fp8(x, w, scale)
        tactic = self.tactic(x.shape[0])
        if isinstance(tactic, SplitK):
            if x.is_cuda:
                from .splitk_triton import splitk_linear

                out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                return splitk_linear(x.contiguous(), w, out, tactic, self.workspace(x, w, tactic))
            return splitk_reference(x, w, tactic.split_k)
        assert tactic == CUBLAS
        return torch.mm(x, w.t())

    def fp8(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The FP8 path: the FP8 split-K kernel on CUDA where the table says split-K, else stock's op (on CPU its
        reference, what stock computes to the bit; on CUDA cuBLAS's blockwise FP8 GEMM, the fallback tactic)."""
        if scale is None:
            raise ValueError(f"{self.name}: an FP8 block-scaled projection needs its weight scales")
        tactic = self.tactic(x.shape[0])
        if x.is_cuda and isinstance(tactic, SplitK):
            from .splitk_fp8_triton import fp8_splitk_linear  # noqa: PLC0415 - imports Triton

            out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
            rows = scale_row_index(self.segments, x.device)
            return fp8_splitk_linear(x.contiguous(), w, scale, rows, out, tactic, self.workspace(x, w, tactic))
        return torch.ops.kimi_k3.fp8_block_linear(x, w, scale, list(self.segments))

    @staticmethod
    def workspace(x: torch.Tensor, w: torch.Tensor, tactic: SplitK) -> torch.Tensor | None:
        """The shared split-K workspace of a call (``_workspace``), None when the tactic does not split K."""
        return _workspace(x.shape[0], w.shape[0], tactic, x.device) if tactic.split_k > 1 else None

    def policies(self, batches) -> dict[int, str]:
        return {b: str(t) for b, t in tactics.dep_policies(self.table, batches).items()}
