"""The MoE router on CUDA in two launches (Triton, SM90), instead of stock's chain of ~15
(GEMM, split-K reduce, sigmoid, bias add, top-k, sort, gather, sum, divide, scale).

1. :func:`~dep_compile.ops.splitk_triton.splitk_partials`: the FP32 logit partials
   ``[S, T, E]`` of ``x @ gate_w^T`` (BF16 operands, FP32 accumulation), ``S`` K-slices;
2. ``_select_kernel``, one program per token: sums the ``S`` partials in slice order, takes the
   sigmoid, adds the correction bias for selection only, picks the top-k by repeated arg-max
   over the experts not yet picked (ties to the lower expert id; ids in descending key order,
   as ``torch.topk``; a NaN key ranks lowest), and
   renormalizes and scales the selected scores, as stock's router does.

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


@triton.jit
def _select_kernel(part_ptr, bias_ptr, w_ptr, ids_ptr, T, E, scale, S: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(S):  # fixed order: deterministic
        logits += tl.load(part_ptr + (s * T + t) * E + e, mask=ok, other=0.0)
    scores = tl.sigmoid(logits)
    keyed = scores + tl.load(bias_ptr + e, mask=ok, other=0.0)
    keyed = tl.where(keyed == keyed, keyed, float("-inf"))  # a NaN key ranks lowest (torch.topk: highest)
    free = ok  # experts not picked yet: ids stay distinct even when the best key left is -inf
    slot = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, keyed, float("-inf")), 0)
        idx = tl.min(tl.where(free & (keyed == best), e, BLOCK_E), 0)  # the lowest free id holding it
        hit = e == idx
        picked_w = tl.where(slot == i, tl.sum(tl.where(hit, scores, 0.0), 0), picked_w)
        picked_id = tl.where(slot == i, idx, picked_id)
        free = free & (e != idx)
    kept = slot < TOP_K
    weights = picked_w / tl.sum(tl.where(kept, picked_w, 0.0), 0) * scale
    tl.store(w_ptr + t * TOP_K + slot, weights, mask=kept)
    tl.store(ids_ptr + t * TOP_K + slot, picked_id.to(tl.int64), mask=kept)


def route_sigmoid_topk(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                       tactic: SplitK = ROUTER_TACTIC) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] BF16, gate_w [E, hidden] BF16, bias [E] FP32 -> (weights [T, top_k] FP32,
    ids [T, top_k] int64)."""
    T, E = x.shape[0], gate_w.shape[0]
    if not 0 < top_k <= E:
        raise ValueError(f"route_sigmoid_topk: top_k {top_k} must be in 1..{E}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        parts = splitk_partials(x.contiguous(), gate_w, tactic)  # [S, T, E] fp32
        _select_kernel[(T,)](parts, bias.float().contiguous(), weights, ids, T, E, float(scale), S=tactic.split_k,
                             TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                             num_warps=4)
    return weights, ids
