"""Routed experts as two ``torch._grouped_mm`` calls: the stock GPU path (no host sync, graph-capturable).

Checked against ``reference/moe.routed_experts_partial`` (tests/test_grouped_experts.py). It
differs from the reference by one BF16 rounding of each expert's output (grouped GEMMs
return BF16) before the FP32 weighted sum.
"""

from __future__ import annotations

import torch

from .reference.common import situ


def routed_experts_grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_start: int, beta: float, beta_lin: float,
) -> torch.Tensor:
    """Weighted sum of each token's selected local experts, FP32 [T, Lat].

    x: [T, Lat] BF16; w13: [E, 2I, Lat]; w2: [E, Lat, I]; topk_weights: [T, K]; topk_ids: [T, K]
    global ids (those outside ``expert_start .. + E`` are another rank's and add nothing).
    The T*K (token, expert) pairs are sorted by expert; pairs of other ranks sort last, past
    the last group, and are masked out.
    """
    T, K = topk_ids.shape
    E, two_i, _ = w13.shape
    local = topk_ids.long() - expert_start
    valid = (local >= 0) & (local < E)
    key = torch.where(valid, local, E).flatten()  # [T*K]
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = counts[:E].cumsum(0).to(torch.int32)  # group ends (bincount would sync with the host)
    tok = order // K
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [T*K, 2I] BF16
    a = situ(h[:, : two_i // 2], h[:, two_i // 2 :], beta, beta_lin).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float()  # [T*K, Lat]
    w = topk_weights.float().flatten()[order]  # rows of other ranks' experts are zeroed below
    y = torch.where(valid.flatten()[order].unsqueeze(1), y * w.unsqueeze(1), 0.0)
    return torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)
