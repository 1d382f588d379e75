"""Reference AttnRes: cross-layer residual attention over block snapshots of the residual stream."""

from __future__ import annotations

import torch

from .common import rms_norm


PART_EXTRA = 4  # FP32 words after a bank part's mix: its max and sum, then padding (16-byte rows)


def empty_bank_part(bank: torch.Tensor) -> torch.Tensor:
    """An uninitialized bank part for ``bank`` [NB, T, D]: [T, D + PART_EXTRA] FP32 on its device."""
    _, T, D = bank.shape
    return torch.empty(T, D + PART_EXTRA, dtype=torch.float32, device=bank.device)


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


def bank_part_ref(bank: torch.Tensor, query: torch.Tensor, eps: float, num_blocks: int,
                  write_slot: int) -> torch.Tensor:
    """The bank part of an AttnRes point: [T, D + PART_EXTRA] FP32, row t = (the softmax mix of bank slots
    ``0 .. num_blocks - 1`` but ``write_slot``, un-normalized: sum exp(logit - max) * source; max; sum of exp; 0, 0).
    No slot: mix 0, max -inf, sum 0. With the point's own sources (its prefix, twice where it writes a slot below
    ``num_blocks``), it gives the point's mix (``merge_part_ref``)."""
    D = bank.shape[-1]
    slots = [s for s in range(num_blocks) if s != write_slot]
    part = empty_bank_part(bank).zero_()
    part[:, D] = float("-inf")
    if slots:
        sources = bank[slots].float()  # [n, T, D]
        logits = (rms_norm(sources, None, eps) * query.float()).sum(-1)  # [n, T]
        m = logits.max(0).values
        w = torch.exp(logits - m)
        part[:, :D] = (w.unsqueeze(-1) * sources).sum(0)
        part[:, D] = m
        part[:, D + 1] = w.sum(0)
    return part


def merge_part_ref(prefix: torch.Tensor, part: torch.Tensor, query: torch.Tensor, eps: float, num_blocks: int,
                   write_slot: int) -> torch.Tensor:
    """The mix of an AttnRes point from its updated ``prefix`` [T, D] and its bank part (``bank_part_ref``): BF16."""
    D = prefix.shape[-1]
    p = prefix.float()
    lp = (rms_norm(p, None, eps) * query.float()).sum(-1)  # [T]
    n = 2.0 if 0 <= write_slot < num_blocks else 1.0  # the slot it writes is the prefix again
    m = torch.maximum(lp, part[:, D])
    kp, kb = torch.exp(lp - m), torch.exp(part[:, D] - m)
    mix = (n * kp).unsqueeze(-1) * p + kb.unsqueeze(-1) * part[:, :D]
    return (mix / (n * kp + kb * part[:, D + 1]).unsqueeze(-1)).to(prefix.dtype)
