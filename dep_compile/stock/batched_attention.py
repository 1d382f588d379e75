"""Vectorized MLA decode, DSA indexer and sparse MLA decode: the stock CUDA path (no host sync, graph-capturable).

Same signatures and contracts as ``reference.mla.mla_decode_ref``, ``reference.dsa.dsa_indexer_ref``
and ``reference.dsa.sparse_mla_decode_ref``, vectorized over tokens with static shapes:

* the context of every request is its whole block table (``C = MB * BS`` positions), read
  through the table and masked to positions <= the token's own; positions past the request's
  last token are read as that token's row (clamped), so unwritten cache rows never enter a
  product, not even multiplied by 0;
* products take BF16 (or FP8-valued BF16) operands with FP32 accumulation, as the references'
  FP32 products of the same values; scores, softmax and index logits are FP32; the attention
  probabilities are rounded to BF16 for the value product (as FlashAttention-style kernels do),
  one rounding more than the references, within BF16 tolerance of them;
* requests (or tokens) are processed in static Python chunks of about ``CHUNK_BYTES`` of FP32
  scores plus gathered rows (the softmax and the BF16 probabilities add about as much again),
  so a step of 64 requests x 4 tokens x 32K context needs about 1 GiB of temporaries.

Checked against the references in tests/test_stock_batched_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged_insert import insert_rows_paged
from .reference.common import FP8, fp8_pow2_quantize
from .reference.mla import absorb_query, project_out, split_kv_b, token_positions

CHUNK_BYTES = 512 << 20  # temporaries per chunk (FP32 scores + gathered rows)


def _chunks(n: int, item_bytes: int) -> list[tuple[int, int]]:
    """Static ranges covering ``0 .. n`` of about ``CHUNK_BYTES / item_bytes`` items each."""
    step = max(1, CHUNK_BYTES // item_bytes)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a [n, M, K] @ b [n, K, N] with FP32 products and accumulation: [n, M, N] FP32."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)  # tensor cores; 16-bit products are exact in FP32
    return torch.bmm(a.float(), b.float())  # CPU has no out_dtype kernel


def _context_positions(width: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Block-table positions ``0 .. width-1`` of each request, clamped to its last token: [n, width] int64."""
    j = torch.arange(width, device=seq_lens.device)
    return torch.minimum(j, seq_lens.long().unsqueeze(1) - 1)


def _gather_rows(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache [NB, BS, ...]`` at ``positions [n, C]`` through ``block_table [n, MB]``: [n, C, ...]."""
    bs = cache.shape[1]
    blocks = torch.gather(block_table.long(), 1, positions // bs)  # [n, C]
    return cache[blocks, positions % bs]


def _attend(query: torch.Tensor, ctx: torch.Tensor, valid: torch.Tensor, kv_lora: int, scale: float) -> torch.Tensor:
    """Masked softmax attention of query [n, G, H, L+R] over latent rows ctx [n, C, L+R]: [n, G, H, L] FP32.

    ``valid [n, G, C]`` masks the rows of each group of H heads (a group = one token).
    """
    n, G, H, W = query.shape
    scores = _bmm_fp32(query.reshape(n, G * H, W), ctx.transpose(1, 2)).view(n, G, H, -1)  # [n, G, H, C]
    scores.mul_(scale).masked_fill_(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, -1).to(ctx.dtype).view(n, G * H, -1)  # BF16 [n, G*H, C]
    return _bmm_fp32(probs, ctx[..., :kv_lora]).view(n, G, H, kv_lora)


def _insert_and_absorb(q, latent, kv_b_weight, kv_cache, slot_mapping, nope: int):
    """Both MLA decodes' start: insert this step's latents, then (absorbed query [T, H, L+R] BF16, W_UV [H, v, L])."""
    insert_rows_paged(kv_cache, slot_mapping, latent)
    w_uk, w_uv = split_kv_b(kv_b_weight, q.shape[1], nope)
    return absorb_query(q, w_uk, nope), w_uv


def mla_decode_batched(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    q_len: int, scale: float, nope: int,
) -> torch.Tensor:
    """Absorbed MLA decode over each request's whole block table, causally masked; [T, H*v] (see mla_decode_ref)."""
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    query, w_uv = _insert_and_absorb(q, latent, kv_b_weight, kv_cache, slot_mapping, nope)  # [T, H, W]
    W = query.shape[-1]
    B, MB = block_table.shape
    C = MB * kv_cache.shape[1]
    pos = token_positions(seq_lens, q_len)  # [T]
    j = torch.arange(C, device=q.device)
    o_lat = torch.empty(T, H, L, dtype=torch.float32, device=q.device)
    for b0, b1 in _chunks(B, q_len * H * C * 4 + C * W * kv_cache.element_size()):
        t0, t1 = b0 * q_len, b1 * q_len
        ctx = _gather_rows(kv_cache, block_table[b0:b1], _context_positions(C, seq_lens[b0:b1]))  # [nb, C, W]
        valid = j <= pos[t0:t1].view(-1, q_len, 1)  # [nb, q_len, C]
        o_lat[t0:t1] = _attend(query[t0:t1].view(-1, q_len, H, W), ctx, valid, L, scale).flatten(0, 1)
    live = (slot_mapping >= 0).view(T, 1, 1)
    return project_out(torch.where(live, o_lat, 0.0), w_uv, q.dtype)


def sparse_mla_decode_batched(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, topk_indices: torch.Tensor,
    q_len: int, scale: float, nope: int,
) -> torch.Tensor:
    """Absorbed MLA decode over each token's selected positions ``topk_indices [T, K]`` (-1 = none); [T, H*v]."""
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    K = topk_indices.shape[1]
    query, w_uv = _insert_and_absorb(q, latent, kv_b_weight, kv_cache, slot_mapping, nope)  # [T, H, W]
    W = query.shape[-1]
    tables = block_table[torch.arange(T, device=q.device) // q_len]  # [T, MB]
    o_lat = torch.empty(T, H, L, dtype=torch.float32, device=q.device)
    for t0, t1 in _chunks(T, H * K * 4 + K * W * kv_cache.element_size()):
        sel = topk_indices[t0:t1].long()  # [n, K]
        ctx = _gather_rows(kv_cache, tables[t0:t1], sel.clamp_min(0))  # [n, K, W]; -1 reads position 0, masked
        o_lat[t0:t1] = _attend(query[t0:t1].unsqueeze(1), ctx, (sel >= 0).unsqueeze(1), L, scale).squeeze(1)
    live = ((slot_mapping >= 0) & (topk_indices >= 0).any(-1)).view(T, 1, 1)
    return project_out(torch.where(live, o_lat, 0.0), w_uv, q.dtype)


def _index_logits(
    q_fp8: torch.Tensor, w_fold: torch.Tensor, index_cache: torch.Tensor, index_scale: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int,
) -> torch.Tensor:
    """logits[t, s] = sum_h w_fold[t, h] * ReLU(q[t, h] . k[s]) * k_scale[s] over all table positions: [T, C] FP32."""
    T, Hi, Di = q_fp8.shape
    B, MB = block_table.shape
    C = MB * index_cache.shape[1]
    q = q_fp8.to(torch.bfloat16)  # e4m3 values are exact in BF16
    logits = torch.empty(T, C, dtype=torch.float32, device=q.device)
    for b0, b1 in _chunks(B, q_len * Hi * C * 4 + C * Di * 3):
        t0, t1 = b0 * q_len, b1 * q_len
        ctx_pos = _context_positions(C, seq_lens[b0:b1])  # [nb, C]
        keys = _gather_rows(index_cache.view(torch.uint8), block_table[b0:b1], ctx_pos)  # gathered as bytes
        keys = keys.view(FP8).to(torch.bfloat16)  # [nb, C, Di]
        k_scale = _gather_rows(index_scale, block_table[b0:b1], ctx_pos)  # [nb, C]
        dots = _bmm_fp32(q[t0:t1].reshape(-1, q_len * Hi, Di), keys.transpose(1, 2)).view(-1, q_len, Hi, C)
        head_sum = dots.relu_().mul_(w_fold[t0:t1].view(-1, q_len, Hi, 1)).sum(2)  # [nb, q_len, C]
        logits[t0:t1] = head_sum.mul_(k_scale.unsqueeze(1)).flatten(0, 1)
    return logits


def select_topk_positions(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-``topk`` positions of each row of ``logits [T, N]`` (``-inf`` = not visible): [T, topk] int32.

    Ascending, -1 padded at the end; a row with at most ``topk`` visible positions selects all
    of them (as ``select_topk`` in the reference).
    """
    T, N = logits.shape
    k = min(topk, N)
    vals, idx = torch.topk(logits, k, dim=-1, sorted=False)
    keyed = torch.where(vals > float("-inf"), idx, N).sort(-1).values  # invisible entries sort last as N
    sel = torch.where(keyed < N, keyed, -1).to(torch.int32)
    return F.pad(sel, (0, topk - k), value=-1)


def dsa_indexer_batched(
    q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, index_cache: torch.Tensor,
    index_scale: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, q_len: int, topk: int,
) -> torch.Tensor:
    """FP8 index-key insert + ReLU-weighted logits + top-k; [T, topk] int32 (see dsa_indexer_ref)."""
    _, Hi, Di = q_idx.shape
    values, k_scale = fp8_pow2_quantize(k)  # [T, Di] FP8, [T] FP32
    insert_rows_paged(index_cache, slot_mapping, values)
    insert_rows_paged(index_scale.unsqueeze(-1), slot_mapping, k_scale.unsqueeze(-1))
    q_fp8, q_scale = fp8_pow2_quantize(q_idx)  # [T, Hi, Di], [T, Hi]
    w_fold = weights.float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)  # [T, Hi]
    pos = token_positions(seq_lens, q_len)  # [T]
    logits = _index_logits(q_fp8, w_fold, index_cache, index_scale, block_table, seq_lens, q_len)
    unseen = (torch.arange(logits.shape[1], device=pos.device) > pos.unsqueeze(1)) | (slot_mapping < 0).unsqueeze(1)
    return select_topk_positions(logits.masked_fill_(unseen, float("-inf")), topk)
