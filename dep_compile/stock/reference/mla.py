"""Reference MLA decode: latent cache insert, absorbed attention over the paged latent cache, W_UV.

The latent cache holds BF16 rows, or FP8 e4m3 rows with one FP32 power-of-two scale per token in
``kv_scale [NB, BS]`` (:func:`insert_latent` quantizes, :func:`gather_latent` dequantizes; the
attention math is the same for both).
"""

from __future__ import annotations

import torch

from .common import fp8_pow2_quantize


def insert_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [T, W]`` into a paged ``cache [NB, BS, W]`` at flat slots (-1 = skip)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    bs = cache.shape[1]
    cache[slots // bs, slots % bs] = rows[valid].to(cache.dtype)  # any strides: caches may be pool views


def insert_fp8_rows(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize ``rows [T, W]`` to FP8 e4m3 with one power-of-two scale per row (``fp8_pow2_quantize``)
    and insert values into ``cache [NB, BS, W]``, scales into ``scales [NB, BS]``."""
    values, scale = fp8_pow2_quantize(rows)  # [T, W] FP8, [T] FP32
    insert_rows(cache, slot_mapping, values)
    insert_rows(scales.unsqueeze(-1), slot_mapping, scale.unsqueeze(-1))


def insert_latent(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                  latent: torch.Tensor) -> None:
    """Insert latent rows ``[T, W]``: as they are, or (``kv_scale`` given) as FP8 rows and scales."""
    if kv_scale is None:
        insert_rows(kv_cache, slot_mapping, latent)
    else:
        insert_fp8_rows(kv_cache, kv_scale, slot_mapping, latent)


def token_positions(seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """Position of each step token in its request: [B * q_len], seq_len - q_len + i."""
    i = torch.arange(q_len, device=seq_lens.device)
    return (seq_lens.long().view(-1, 1) - q_len + i).reshape(-1)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Cache rows of request ``b`` at ``positions [n]`` through its block table: [n, W]."""
    bs = cache.shape[1]
    blocks = block_table[b].long()[positions // bs]
    return cache[blocks, positions % bs]


def gather_latent(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, block_table: torch.Tensor, b: int,
                  positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Latent rows of request ``b`` at ``positions [n]``: [n, W], as stored, or FP8 rows times their
    scales in ``dtype`` (exact in BF16: an e4m3 value times a power of two)."""
    rows = gather_context(kv_cache, block_table, b, positions)
    if kv_scale is None:
        return rows
    scale = gather_context(kv_scale.unsqueeze(-1), block_table, b, positions)  # [n, 1]
    return (rows.float() * scale).to(dtype)


def split_kv_b(kv_b_weight: torch.Tensor, heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H*(nope+v), L] as W_UK [H, nope, L] and W_UV [H, v, L]."""
    w = kv_b_weight.view(heads, -1, kv_b_weight.shape[-1])
    return w[:, :nope], w[:, nope:]


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor, nope: int) -> torch.Tensor:
    """Absorbed query [T, H, L+R] BF16: (q_nope @ W_UK) | q_rope, from q [T, H, nope+R]."""
    q_lat = torch.einsum("thn,hnl->thl", q[..., :nope].float(), w_uk.float()).to(q.dtype)
    return torch.cat([q_lat, q[..., nope:]], -1)


def attend_latent(query: torch.Tensor, ctx: torch.Tensor, kv_lora: int, scale: float) -> torch.Tensor:
    """Softmax attention of one token's query [H, L+R] over latent rows ctx [n, L+R]: [H, L] FP32."""
    scores = query.float() @ ctx.float().t() * scale  # [H, n]
    return torch.softmax(scores, -1) @ ctx[:, :kv_lora].float()


def project_out(o_lat: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W_UV: o_lat [T, H, L] (rounded to ``dtype``) -> [T, H*v] in ``dtype``."""
    o = torch.einsum("thl,hvl->thv", o_lat.to(dtype).float(), w_uv.float())
    return o.reshape(o.shape[0], -1).to(dtype)


def mla_decode_ref(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    q_len: int, scale: float, nope: int, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode; inserts ``latent`` into the cache first.

    q: [T, H, nope+R]; latent: [T, L+R] (normed c_kv | k_rope); kv_b_weight: [H*(nope+v), L];
    kv_cache: [NB, BS, L+R] BF16, or FP8 e4m3 with ``kv_scale [NB, BS]`` FP32; slot_mapping: [T]
    (-1 = padding, output 0); block_table: [B, MB];
    seq_lens: [B] including this step's tokens. Token i of request b sits at position
    seq_lens[b] - q_len + i and attends causally. Returns [T, H*v].
    """
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    insert_latent(kv_cache, kv_scale, slot_mapping, latent)
    w_uk, w_uv = split_kv_b(kv_b_weight, H, nope)
    query = absorb_query(q, w_uk, nope)
    pos = token_positions(seq_lens, q_len)
    o_lat = torch.zeros(T, H, L, device=q.device)
    for t in range(T):
        if int(slot_mapping[t]) < 0:
            continue
        ctx = gather_latent(kv_cache, kv_scale, block_table, t // q_len, torch.arange(int(pos[t]) + 1, device=q.device),
                            q.dtype)
        o_lat[t] = attend_latent(query[t], ctx, L, scale)
    out = project_out(o_lat, w_uv, q.dtype)
    out[slot_mapping < 0] = 0
    return out
