"""Reference AttnRes: cross-layer residual attention over block snapshots of the residual stream."""

from __future__ import annotations

import torch

from .common import rms_norm


def attn_res_ref(
    prefix: torch.Tensor, bank: torch.Tensor, delta: torch.Tensor, query: torch.Tensor,
    eps: float, num_blocks: int, write_slot: int,
) -> torch.Tensor:
    """One AttnRes point ahead of a sublayer; mutates ``prefix`` and ``bank``.

    prefix: [T, D] BF16, the running residual (sum of every sublayer output so far);
    bank: [NB, T, D] BF16, snapshots of the prefix at block starts; delta: [T, D], the last
    sublayer's output; query: [D], this point's pseudo-query.
    1. prefix += delta, rounded to BF16 in place;
    2. if write_slot >= 0: bank[write_slot] = prefix (a new block starts here);
    3. sources = bank[:num_blocks] + [prefix]; logits = RMSNorm(source) . query (FP32);
       returns sum softmax(logits) * source (un-normalized sources), BF16 [T, D].
    """
    prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    if write_slot >= 0:
        bank[write_slot].copy_(prefix)
    sources = torch.cat([bank[:num_blocks], prefix.unsqueeze(0)], 0).float()  # [n, T, D]
    logits = (rms_norm(sources, None, eps) * query.float()).sum(-1)  # [n, T]
    weights = torch.softmax(logits, 0).unsqueeze(-1)
    return (weights * sources).sum(0).to(prefix.dtype)
