"""Reference DSA: FP8 lightning indexer (key insert, ReLU-weighted logits, top-k) and sparse MLA decode."""

from __future__ import annotations

import torch

from .common import fp8_pow2_quantize
from .mla import (absorb_query, attend_latent, gather_context, gather_latent, insert_fp8_rows, insert_latent,
                  project_out, split_kv_b, token_positions)


def insert_index_keys(
    k: torch.Tensor, index_cache: torch.Tensor, index_scale: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize normed index keys k [T, Di] to FP8 (pow2 scale per token) and insert them."""
    insert_fp8_rows(index_cache, index_scale, slot_mapping, k)


def index_logits(
    q_fp8: torch.Tensor, w_fold: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """logits[s] = sum_h w_fold[h] * ReLU(q[h] . k[s]) * k_scale[s] for one token.

    q_fp8: [Hi, Di]; w_fold: [Hi] (weights x q scale x Di^-1/2 x Hi^-1/2); k_fp8: [n, Di];
    k_scale: [n]. Returns [n] FP32.
    """
    dots = torch.relu(q_fp8.float() @ k_fp8.float().t())  # [Hi, n]
    return (w_fold.view(-1, 1) * dots).sum(0) * k_scale


def select_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices of the top-``topk`` logits, ascending, padded with -1: [topk] int32."""
    n = logits.shape[0]
    out = torch.full((topk,), -1, dtype=torch.int32, device=logits.device)
    if n <= topk:
        out[:n] = torch.arange(n, device=logits.device, dtype=torch.int32)
    else:
        out[:] = torch.topk(logits, topk).indices.sort().values.to(torch.int32)
    return out


def dsa_indexer_ref(
    q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, index_cache: torch.Tensor,
    index_scale: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, q_len: int, topk: int,
) -> torch.Tensor:
    """The DSA indexer for one step; inserts this step's keys first.

    q_idx: [T, Hi, Di] BF16; weights: [T, Hi] (weights_proj output); k: [T, Di] (key LayerNorm
    applied); index_cache: [NB, BS, Di] float8_e4m3fn; index_scale: [NB, BS] FP32.
    Returns topk_indices [T, topk] int32: positions in the request, ascending, -1 padded; a
    request with at most ``topk`` tokens selects every token.
    """
    T, Hi, Di = q_idx.shape
    insert_index_keys(k, index_cache, index_scale, slot_mapping)
    q_fp8, q_scale = fp8_pow2_quantize(q_idx)  # [T, Hi, Di], [T, Hi]
    w_fold = weights.float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)
    pos = token_positions(seq_lens, q_len)
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q_idx.device)
    for t in range(T):
        if int(slot_mapping[t]) < 0:
            continue
        ctx_pos = torch.arange(int(pos[t]) + 1, device=q_idx.device)
        keys = gather_context(index_cache, block_table, t // q_len, ctx_pos)
        scales = gather_context(index_scale.unsqueeze(-1), block_table, t // q_len, ctx_pos).squeeze(-1)
        out[t] = select_topk(index_logits(q_fp8[t], w_fold[t], keys, scales), topk)
    return out


def sparse_mla_decode_ref(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, topk_indices: torch.Tensor,
    q_len: int, scale: float, nope: int, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over each token's selected positions ``topk_indices [T, K]`` (-1 = none).

    Shapes as ``mla_decode_ref`` (an FP8 latent cache with ``kv_scale`` too); inserts ``latent``
    into the cache first. Returns [T, H*v].
    """
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    insert_latent(kv_cache, kv_scale, slot_mapping, latent)
    w_uk, w_uv = split_kv_b(kv_b_weight, H, nope)
    query = absorb_query(q, w_uk, nope)
    o_lat = torch.zeros(T, H, L, device=q.device)
    for t in range(T):
        sel = topk_indices[t]
        sel = sel[sel >= 0].long()
        if int(slot_mapping[t]) < 0 or sel.numel() == 0:
            continue
        ctx = gather_latent(kv_cache, kv_scale, block_table, t // q_len, sel, q.dtype)
        o_lat[t] = attend_latent(query[t], ctx, L, scale)
    out = project_out(o_lat, w_uv, q.dtype)
    out[slot_mapping < 0] = 0
    return out
