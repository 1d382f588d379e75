"""The MoE router on CUDA in two launches (Triton, SM90), instead of stock's chain of ~15
(GEMM, split-K reduce, sigmoid, bias add, top-k, sort, gather, sum, divide, scale).

1. :func:`~dep_compile.ops.splitk_triton.splitk_partials`: the FP32 logit partials
   ``[S, T, E]`` of ``x @ gate_w^T`` (BF16 operands, FP32 accumulation), ``S`` K-slices;
2. ``_select_kernel``, one program per token: sums the ``S`` partials in slice order, takes the
   sigmoid, adds the correction bias for selection only, picks the top-k by repeated max
   over the experts not yet picked (ties to the lower expert id; ids in descending key order,
   as ``torch.topk``; a NaN key counts as -inf), and
   renormalizes and scales the selected scores, as stock's router does. Each expert is one
   int64, its key's bits made monotone above its reversed id, so a pick is one reduction (it
   was three: the max key, the lowest id holding it, its score; 8.6 -> 6.2 µs a launch alone at
   top-16 of 896 on the H200, 2026-12-04); the picked scores are re-summed from the partials.

On the side stream beside the MoE front GEMM, the front's CTAs hold most SMs: each short
launch of stock's chain waits for a free SM, so the chain outlasts the front at 64 rows. Two
launches do not.

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dep_compile.tactics import SplitK

from .splitk_triton import splitk_partials

# N = 896 experts, K = 7168: 14 row tiles x 8 K-slices = 112 programs, one wave on 132 SMs
ROUTER_TACTIC = SplitK(split_k=8, block_n=64, block_k=128, num_warps=4, num_stages=4)
SELECT_WARPS = 4  # warps of the one program a token that picks its experts


@triton.jit
def _select_kernel(part_ptr, bias_ptr, w_ptr, ids_ptr, T, E, scale, S: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ID_BITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(S):  # fixed order: deterministic
        logits += tl.load(part_ptr + (s * T + t) * E + e, mask=ok, other=0.0)
    keyed = tl.sigmoid(logits) + tl.load(bias_ptr + e, mask=ok, other=0.0)
    keyed = tl.where(keyed == keyed, keyed, float("-inf"))  # a NaN key counts as -inf (torch.topk: highest)
    # one int64 a candidate: the key's bits made monotone (negatives' magnitudes reversed), then the id reversed,
    # so one max picks the largest key and, among equal keys, the lowest id; -1 marks an expert taken or absent
    bits = keyed.to(tl.int32, bitcast=True).to(tl.int64)
    mono = tl.where(bits >= 0, bits + 2147483648, 2147483647 - (bits & 2147483647))  # [0, 2^32)
    id_max: tl.constexpr = (1 << ID_BITS) - 1
    cand = tl.where(ok, (mono << ID_BITS) | (id_max - e), -1)
    slot = tl.arange(0, BLOCK_K)
    picked_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(cand, 0)
        picked_id = tl.where(slot == i, (id_max - (best & id_max)).to(tl.int32), picked_id)
        cand = tl.where(cand == best, -1, cand)
    kept = slot < TOP_K
    # the picked experts' scores, summed and squashed as above from the same partials: the same bits
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    for s in tl.static_range(S):
        picked += tl.load(part_ptr + (s * T + t) * E + picked_id, mask=kept, other=0.0)
    picked_w = tl.where(kept, tl.sigmoid(picked), 0.0)
    weights = picked_w / tl.sum(picked_w, 0) * scale
    tl.store(w_ptr + t * TOP_K + slot, weights, mask=kept)
    tl.store(ids_ptr + t * TOP_K + slot, picked_id.to(tl.int64), mask=kept)


def select_experts(parts: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                   num_warps: int = SELECT_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``_select_kernel`` on FP32 logit partials ``parts [S, T, E]`` (summed in slice order) and the bias [E]:
    (weights [T, top_k] FP32, ids [T, top_k] int64)."""
    S, T, E = parts.shape
    if not 0 < top_k <= E:
        raise ValueError(f"select_experts: top_k {top_k} must be in 1..{E}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=parts.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=parts.device)
    if T:
        block_e = triton.next_power_of_2(E)
        _select_kernel[(T,)](parts.contiguous(), bias.float().contiguous(), weights, ids, T, E, float(scale), S=S,
                             TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                             ID_BITS=block_e.bit_length() - 1, num_warps=num_warps)
    return weights, ids


def route_sigmoid_topk(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                       tactic: SplitK = ROUTER_TACTIC) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] BF16, gate_w [E, hidden] BF16, bias [E] FP32 -> (weights [T, top_k] FP32,
    ids [T, top_k] int64)."""
    T, E = x.shape[0], gate_w.shape[0]
    parts = (splitk_partials(x.contiguous(), gate_w, tactic) if T  # [S, T, E] FP32
             else x.new_empty(tactic.split_k, 0, E, dtype=torch.float32))
    return select_experts(parts, bias, top_k, scale)
