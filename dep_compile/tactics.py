"""Tactic tables: which GEMM each DepProjection runs at each batch size.

A table maps a max-rows bin to a tactic: ``{max_rows: SplitK(...) | CUBLAS}``. A batch of
``m`` rows uses the entry of the smallest bin ``>= m``; a batch larger than every bin uses
cuBLAS. Tables are measured on the GPU they serve (``benchmarks/bench_projection.py``); the
measurement that chose each entry is recorded in ``docs/perf.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Union


@dataclasses.dataclass(frozen=True)
class SplitK:
    """A split-K GEMM tactic: ``split_k`` K-slices, each a ``block_n x block_k`` tiled stream."""

    split_k: int
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("split_k", "block_n", "block_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SplitK.{name} must be a positive int, got {value!r}")

    def __str__(self) -> str:
        return f"splitk{self.split_k}/n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


CUBLAS = "cublas"
"""The cuBLAS tactic: ``torch.mm`` into the output buffer."""

Tactic = Union[SplitK, str]
TacticTable = Mapping[int, Tactic]

# Until a table is measured on the GPU it serves, every bin is cuBLAS: never a guessed win.
DEP_PROJECTION: dict[str, dict[int, Tactic]] = {
    "dsa_qkv_a_g_index": {},  # 14560 x 7168
    "kda_in_proj": {},  # 49376 x 7168
    "moe_front": {},  # 15872 x 7168
}
DEP_OPROJ: dict[int, Tactic] = {}  # 7168 x 12288


def lookup(table: TacticTable, rows: int) -> Tactic:
    """The tactic a table names for a batch of ``rows`` rows (cuBLAS past the last bin)."""
    for bound in sorted(table):
        if rows <= bound:
            return table[bound]
    return CUBLAS


def dep_policies(table: TacticTable, batches: "list[int] | tuple[int, ...]") -> dict[int, Tactic]:
    """The tactic for each batch a step specializes for (the ``wide`` batches)."""
    return {int(b): lookup(table, int(b)) for b in batches}


def validate_table(table: TacticTable, where: str) -> dict[int, Tactic]:
    """Check a user-given table: positive int bins, each a SplitK or ``"cublas"``."""
    out: dict[int, Tactic] = {}
    for bound, tactic in dict(table).items():
        if not isinstance(bound, int) or bound < 1:
            raise ValueError(f"{where}: bin {bound!r} must be a positive int (max rows)")
        if isinstance(tactic, dict):
            tactic = SplitK(**tactic)
        if not (isinstance(tactic, SplitK) or tactic == CUBLAS):
            raise ValueError(f"{where}: bin {bound} has tactic {tactic!r}; valid: SplitK(...) or 'cublas'")
        out[bound] = tactic
    return out
