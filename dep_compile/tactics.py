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

# Measured on an H200 (SXM 141 GB; torch 2.11, Triton 3.6) on 2026-11-30 with
# benchmarks/bench_projection.py; docs/perf_projection.md has every number. Each split-K entry
# beat cuBLAS by more than the noise (max(0.5 %, spread between interleaved rounds)) at its bin
# and at the in-between batches measured (1-64 rows); ties go to cuBLAS. At these N (>= 7168
# rows) the best tactic does not split K at all (split_k = 1): N / block_n >= 112 row tiles
# already keep HBM busy, and every split_k > 1 measured slower (2-8 % at 1 row, more at 64).
# TB/s below: weight bytes / time, CUDA-graph replays, weights rotated past L2 (validation run).
DEP_PROJECTION: dict[str, dict[int, Tactic]] = {
    # 14560 x 7168: 4.16-4.20 TB/s at 1-16 rows, 4.11 at 32, 3.97 at 64; 1.03-1.13x cuBLAS.
    "dsa_qkv_a_g_index": {64: SplitK(1, 128, 128, 8, 4)},
    # 49376 x 7168: 4.31-4.42 TB/s at 1-32 rows, 4.14 at 64; 1.05-1.09x cuBLAS.
    "kda_in_proj": {32: SplitK(1, 64, 128, 4, 4), 64: SplitK(1, 128, 128, 8, 4)},
    # 15872 x 7168: 4.15-4.25 TB/s at 1-32 rows, 1.005-1.012x cuBLAS (small, but in two runs);
    # a tie from 40 rows on.
    "moe_front": {32: SplitK(1, 128, 128, 8, 4), 64: CUBLAS},
}
# 7168 x 12288: 4.09-4.15 TB/s at 1-16 rows (1.07-1.10x cuBLAS), 4.05 at 24-32 (1.04x); a tie
# at 41-56 rows (cuBLAS); at 57-64 rows 1.21x (cuBLAS picks a slow kernel at 64).
DEP_OPROJ: dict[int, Tactic] = {
    16: SplitK(1, 64, 256, 4, 4),
    40: SplitK(1, 64, 128, 4, 6),
    56: CUBLAS,
    64: SplitK(1, 64, 128, 4, 6),
}

# FP8 block-scaled weights (``ops/splitk_fp8_triton.py``: block_k 128-512, whole scale blocks a step; the GEMM a PDL
# launch after the quantizer), measured on the H200 on 2026-12-04 with benchmarks/bench_projection_fp8.py (16 tactics
# at 1 / 8 / 32 / 64 rows; docs/perf.md): the winner of the sweep per bin, within 0.1 µs of the best at every row
# count it covers. Every split-K entry beat stock's FP8 path (cuBLAS's blockwise GEMM, torch._scaled_mm, at 4+ rows;
# the plain Triton GEMM at 1-2) at every row count. A table's rows past its last bin, and every CPU call, run
# stock's FP8 op (the CUBLAS tactic of FP8 weights).
DEP_PROJECTION_FP8: dict[str, dict[int, Tactic]] = {
    # 14560 x 7168: 3.49 TB/s (weight + scale bytes) at 1 row, 3.34 at 32, 2.92 at 64; 1.6-1.9x stock.
    "dsa_qkv_a_g_index": {32: SplitK(1, 64, 256, 4, 4), 64: SplitK(1, 64, 256, 4, 3)},
    # 49376 x 7168: 4.25 TB/s at 1 row, 3.97 at 32, 3.37 at 64; 1.13-1.68x stock.
    "kda_in_proj": {64: SplitK(1, 64, 256, 4, 3)},
    # 15872 x 7168: 3.60 TB/s at 1 row, 3.41 at 32, 3.12 at 64; 1.16-1.66x stock.
    "moe_front": {32: SplitK(1, 64, 256, 4, 4), 64: SplitK(1, 64, 256, 4, 3)},
}
# 7168 x 12288: 3.21 TB/s at 1 row, 2.88 at 32, 2.32 at 64; 1.07-1.40x stock.
DEP_OPROJ_FP8: dict[int, Tactic] = {
    32: SplitK(2, 64, 256, 4, 4),
    64: SplitK(2, 128, 128, 4, 4),
}


# The FP8 projections the rewritten ops run one at a time (``ops/dense.py``), by weight shape (N, K): q_b, wq_b, f_b,
# the shared expert's down and the latent up. Measured as the tables above. No entry splits K: the shared expert's
# down runs on a side stream beside the latent up (same N), and split-K calls of one width and tactic share a
# workspace that only stream-ordered calls may share (``ops/projection._workspace``).
DEP_DENSE_FP8: dict[tuple[int, int], dict[int, Tactic]] = {
    # q_b 18432 x 1536: 11.6-15.6 µs at 1-64 rows, 1.24-1.77x stock.
    (18432, 1536): {32: SplitK(1, 64, 128, 4, 4), 64: SplitK(1, 64, 256, 4, 3)},
    # wq_b 4096 x 1536: 7.1-8.0 µs, 1.47-1.94x stock.
    (4096, 1536): {64: SplitK(1, 64, 256, 4, 4)},
    # f_b 12288 x 128 (one K block): 4.3-5.3 µs, 1.16-1.28x stock.
    (12288, 128): {32: SplitK(1, 64, 128, 4, 4), 64: SplitK(1, 128, 128, 8, 4)},
    # shared expert down 7168 x 6144: 17.9-23.3 µs, 1.04-1.49x stock.
    (7168, 6144): {64: SplitK(1, 64, 256, 4, 4)},
    # latent up 7168 x 3584: 13.1-14.3 µs, 1.23-1.50x stock.
    (7168, 3584): {64: SplitK(1, 64, 256, 4, 4)},
}

# The KDA core's form by a step's tokens a request (``ops/kda_triton.kda_decode_core``): the one-launch fused kernel,
# or, from this many tokens up, its two launches (prep + state, ``split``); None: the fused kernel at every q_len.
# Measured on the H200 (docs/perf.md, "The KDA core in two launches, timed"): split faster at q = 2 and 4 at 1-64
# requests (64 x q = 4: 523 vs 615 µs; 64 x q = 2: 337 vs 465), slower at q = 1 (64 requests: 308 vs 258). Read
# when the op runs: a CUDA graph keeps the form it was captured with. The prep launch over 16 token rows (2026-12-06)
# took the split form at 64 requests 21 % (q = 4) and 17 % (q = 2) further on an H100; q = 1 not re-timed.
KDA_SPLIT_FROM_Q: int | None = 2


def kda_split(q_len: int) -> bool:
    """Whether a KDA core call of ``q_len`` tokens a request runs the split form (``KDA_SPLIT_FROM_Q``)."""
    return KDA_SPLIT_FROM_Q is not None and q_len >= KDA_SPLIT_FROM_Q


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
