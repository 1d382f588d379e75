"""MLA decode, DSA indexer and sparse MLA decode in plain torch: the stock CUDA path (no host sync, graph-capturable).

Same signatures and contracts as ``reference.mla.mla_decode_ref``, ``reference.dsa.dsa_indexer_ref``
and ``reference.dsa.sparse_mla_decode_ref``, vectorized over tokens with static shapes, written as a
competent engineer would without custom kernels (what the stock baseline must be, docs/design.md §7):

* sparse MLA gathers only each token's selected (top-k) latent rows through the block table;
  dense MLA and the indexer read each request's whole block table (``C = MB * BS`` positions,
  the static shape), masked to positions <= the token's own;
* the FP8 keys are gathered once per request and converted to BF16 once (in one fused kernel on
  CUDA);
* products take BF16 (or FP8-valued BF16) operands with FP32 accumulation (tensor cores; the
  references' FP32 products of the same values), so the weights ``W_UK`` / ``W_UV`` are read as
  stored, never copied to FP32; scores, softmax and index logits are FP32; the only full-context
  FP32 tensors are the indexer's per-head dot products and its logits;
* the value product runs over the whole gathered latent rows and keeps the first ``kv_lora``
  columns of its result (no copy of a column slice);
* dense MLA reads positions past a request's last token as that token's row (clamped), so
  unwritten cache rows never enter a product, not even multiplied by 0; the attention
  probabilities are rounded to BF16 for the value product (as FlashAttention-style kernels do),
  one rounding more than the references, within BF16 tolerance of them;
* an FP8 latent cache (e4m3 rows, one power-of-two scale per token in ``kv_scale [NB, BS]``) is
  quantized on insert and its gathered rows dequantized to BF16 (exact) before the products;
* requests (or tokens) are processed in static Python chunks of about ``CHUNK_BYTES`` of
  temporaries, so a step of 64 requests x 4 tokens x 32K context stays near 1 GiB.

On CUDA the op bodies after the cache inserts run compiled by Inductor (one graph per shape,
:func:`_inductor_on_cuda`): the stock ops are opaque to the Inductor that compiles the layer around
them, so without this their ~90 small launches per DSA layer stay unfused, where a plainly written
layer compiled by Inductor fuses them (docs/perf_dsa_stock.md). The inserts stay eager (a compiled
in-place write into a cache argument would be functionalized).

Checked against the references in tests/test_stock_batched_attention.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .paged_insert import insert_rows_paged
from .reference.common import FP8, fp8_pow2_quantize
from .reference.mla import token_positions

CHUNK_BYTES = 512 << 20  # temporaries per chunk (FP32 scores / dots + gathered rows)


def _chunks(n: int, item_bytes: int) -> list[tuple[int, int]]:
    """Static ranges covering ``0 .. n`` of about ``CHUNK_BYTES / item_bytes`` items each."""
    step = max(1, CHUNK_BYTES // item_bytes)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a [n, M, K] @ b [n, K, N] with FP32 products and accumulation: [n, M, N] FP32."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)  # tensor cores; 16-bit products are exact in FP32
    return torch.bmm(a.float(), b.float())  # CPU has no out_dtype kernel


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' results along dim 0 (no copy for a single chunk)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _gather_rows(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache [NB, BS, W]`` at ``positions [n, C]`` through ``block_table [n, MB]``: [n, C, W]."""
    bs = cache.shape[1]
    blocks = torch.gather(block_table, 1, positions // bs).long()  # [n, C]
    return cache[blocks, positions % bs]


def _gather_latent(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, block_table: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Latent rows [n, C, W] at ``positions [n, C]``: as stored (BF16), or FP8 rows (gathered as bytes)
    times their per-token scales, in BF16 (exact: an e4m3 value times a power of two)."""
    if kv_scale is None:
        return _gather_rows(kv_cache, block_table, positions)
    rows = _gather_rows(kv_cache.view(torch.uint8), block_table, positions).view(FP8)  # [n, C, W]
    scale = _gather_rows(kv_scale, block_table, positions).unsqueeze(-1)  # [n, C, 1]
    return (rows.float() * scale).to(torch.bfloat16)


def _row_bytes(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> int:
    """Bytes of temporaries per gathered latent element: the row itself, or FP8 + FP32 + BF16 dequantized."""
    return kv_cache.element_size() if kv_scale is None else 7


def _insert_fp8_rows(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows [T, W]`` as FP8 values into ``cache [NB, BS, W]`` and power-of-two scales into ``scales [NB, BS]``."""
    values, scale = _quantize_keys(rows)  # [T, W] FP8, [T] FP32
    insert_rows_paged(cache, slot_mapping, values)
    insert_rows_paged(scales.unsqueeze(-1), slot_mapping, scale.unsqueeze(-1))


def _insert_latent(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                   latent: torch.Tensor) -> None:
    """The latent insert: rows as they are, or FP8 values and their power-of-two scales (``kv_scale``)."""
    if kv_scale is None:
        insert_rows_paged(kv_cache, slot_mapping, latent)
    else:
        _insert_fp8_rows(kv_cache, kv_scale, slot_mapping, latent)


def _inductor_on_cuda(fn):
    """``fn`` compiled by Inductor (``dynamic=False``: one graph per shape) for CUDA tensors, as written elsewhere."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)

    @functools.wraps(fn)
    def call(*args):
        return (compiled if args[0].is_cuda else fn)(*args)

    return call


def _context_positions(width: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Block-table positions ``0 .. width-1`` of each request, clamped to its last token: [n, width] int64."""
    j = torch.arange(width, device=seq_lens.device)
    return torch.minimum(j, seq_lens.long().unsqueeze(1) - 1)


def _absorb(q: torch.Tensor, w: torch.Tensor, nope: int) -> torch.Tensor:
    """Absorbed query [T, H, L+R] BF16: (q_nope @ W_UK) | q_rope, from q [T, H, nope+R] and w [H, nope+v, L]."""
    q_lat = _bmm_fp32(q[..., :nope].transpose(0, 1), w[:, :nope])  # [H, T, L] FP32
    return torch.cat([q_lat.to(q.dtype).transpose(0, 1), q[..., nope:]], -1)


def _project(o_lat: torch.Tensor, w: torch.Tensor, nope: int, live: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W_UV: o_lat [T, H, L] FP32 (rounded to ``dtype``) -> [T, H*v] ``dtype``, tokens not ``live [T]`` exactly 0."""
    T = o_lat.shape[0]
    o = _bmm_fp32(o_lat.to(dtype).transpose(0, 1), w[:, nope:].transpose(1, 2))  # [H, T, v] FP32
    out = o.to(dtype).transpose(0, 1).reshape(T, -1)
    return out.masked_fill_(~live.view(T, 1), 0)  # NaN rows (nothing attended) become 0 too


def _attend(query: torch.Tensor, ctx: torch.Tensor, invalid: torch.Tensor, kv_lora: int, scale: float) -> torch.Tensor:
    """Masked softmax attention of query [n, G*H, L+R] over latent rows ctx [n, C, L+R]: [n, G*H, L] FP32.

    ``invalid [n, G, C]`` masks the rows of each group of H heads (a group = one token). The value
    product runs over the whole rows and keeps the first L columns (no copy of a column slice).
    """
    n, GH, _ = query.shape
    G = invalid.shape[1]
    scores = _bmm_fp32(query, ctx.transpose(1, 2)).view(n, G, GH // G, -1)  # [n, G, H, C]
    scores = (scores * scale).masked_fill(invalid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, -1).to(ctx.dtype).view(n, GH, -1)  # BF16 [n, G*H, C]
    return _bmm_fp32(probs, ctx)[..., :kv_lora]


@_inductor_on_cuda
def _mla_core(q, kv_b_weight, kv_cache, slot_mapping, block_table, seq_lens, q_len: int, scale: float,
              nope: int, kv_scale=None) -> torch.Tensor:
    """mla_decode_batched after the insert: [T, H*v]."""
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    w = kv_b_weight.view(H, -1, L)  # [H, nope+v, L]
    query = _absorb(q, w, nope)  # [T, H, W]
    W = query.shape[-1]
    B, MB = block_table.shape
    C = MB * kv_cache.shape[1]
    pos = token_positions(seq_lens, q_len).view(B, q_len, 1)
    j = torch.arange(C, device=q.device)
    parts = []
    for b0, b1 in _chunks(B, q_len * H * C * 10 + C * W * _row_bytes(kv_cache, kv_scale)):
        positions = _context_positions(C, seq_lens[b0:b1])
        ctx = _gather_latent(kv_cache, kv_scale, block_table[b0:b1], positions)  # [nb, C, W]
        invalid = j > pos[b0:b1]  # [nb, q_len, C]
        parts.append(_attend(query[b0 * q_len:b1 * q_len].reshape(b1 - b0, q_len * H, W), ctx, invalid, L, scale))
    o_lat = _cat(parts).reshape(T, H, L)
    return _project(o_lat, w, nope, slot_mapping >= 0, q.dtype)


def mla_decode_batched(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    q_len: int, scale: float, nope: int, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over each request's whole block table, causally masked; [T, H*v] (see mla_decode_ref)."""
    _insert_latent(kv_cache, kv_scale, slot_mapping, latent)
    return _mla_core(q, kv_b_weight, kv_cache, slot_mapping, block_table, seq_lens, q_len, scale, nope, kv_scale)


@_inductor_on_cuda
def _sparse_core(q, kv_b_weight, kv_cache, slot_mapping, block_table, topk_indices, q_len: int, scale: float,
                 nope: int, kv_scale=None) -> torch.Tensor:
    """sparse_mla_decode_batched after the insert: [T, H*v]."""
    T, H, _ = q.shape
    L = kv_b_weight.shape[-1]
    K = topk_indices.shape[1]
    w = kv_b_weight.view(H, -1, L)  # [H, nope+v, L]
    query = _absorb(q, w, nope)  # [T, H, W]
    W = query.shape[-1]
    tables = block_table.repeat_interleave(q_len, 0)  # [T, MB]
    parts = []
    for t0, t1 in _chunks(T, H * K * 10 + K * W * _row_bytes(kv_cache, kv_scale)):
        sel = topk_indices[t0:t1].long()  # [n, K]
        # [n, K, W]; -1 reads position 0, masked
        ctx = _gather_latent(kv_cache, kv_scale, tables[t0:t1], sel.clamp_min(0))
        parts.append(_attend(query[t0:t1], ctx, (sel < 0).unsqueeze(1), L, scale))
    o_lat = _cat(parts)  # [T, H, L]
    live = (slot_mapping >= 0) & (topk_indices >= 0).any(-1)
    return _project(o_lat, w, nope, live, q.dtype)


def sparse_mla_decode_batched(
    q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, topk_indices: torch.Tensor,
    q_len: int, scale: float, nope: int, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over each token's selected positions ``topk_indices [T, K]`` (-1 = none); [T, H*v]."""
    _insert_latent(kv_cache, kv_scale, slot_mapping, latent)
    return _sparse_core(q, kv_b_weight, kv_cache, slot_mapping, block_table, topk_indices, q_len, scale, nope,
                        kv_scale)


def _index_logits(
    q_fp8: torch.Tensor, w_fold: torch.Tensor, index_cache: torch.Tensor, index_scale: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int,
) -> torch.Tensor:
    """logits[t, s] = sum_h w_fold[t, h] * ReLU(q[t, h] . k[s]) * k_scale[s] over all table positions: [T, C] FP32."""
    T, Hi, Di = q_fp8.shape
    B, MB = block_table.shape
    C = MB * index_cache.shape[1]
    q = q_fp8.to(torch.bfloat16)  # e4m3 values are exact in BF16
    parts = []
    for b0, b1 in _chunks(B, q_len * Hi * C * 4 + C * Di * 3):
        t0, t1, nb = b0 * q_len, b1 * q_len, b1 - b0
        ctx_pos = _context_positions(C, seq_lens[b0:b1])  # [nb, C]
        keys = _gather_rows(index_cache.view(torch.uint8), block_table[b0:b1], ctx_pos)  # gathered as bytes
        keys = keys.view(FP8).to(torch.bfloat16)  # [nb, C, Di]
        k_scale = _gather_rows(index_scale, block_table[b0:b1], ctx_pos).view(nb, 1, C)
        dots = _bmm_fp32(q[t0:t1].reshape(nb, q_len * Hi, Di), keys.transpose(1, 2)).view(nb, q_len, Hi, C)
        head_sum = (dots.relu() * w_fold[t0:t1].view(nb, q_len, Hi, 1)).sum(2)  # [nb, q_len, C] FP32
        parts.append((head_sum * k_scale).view(nb * q_len, C))
    return _cat(parts)


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


@_inductor_on_cuda
def _indexer_core(q_idx, weights, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len: int,
                  topk: int) -> torch.Tensor:
    """dsa_indexer_batched after the key insert: [T, topk] int32."""
    _, Hi, Di = q_idx.shape
    q_fp8, q_scale = fp8_pow2_quantize(q_idx)  # [T, Hi, Di], [T, Hi]
    w_fold = weights.float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)  # [T, Hi]
    pos = token_positions(seq_lens, q_len)  # [T]
    logits = _index_logits(q_fp8, w_fold, index_cache, index_scale, block_table, seq_lens, q_len)
    unseen = (torch.arange(logits.shape[1], device=pos.device) > pos.unsqueeze(1)) | (slot_mapping < 0).unsqueeze(1)
    return select_topk_positions(logits.masked_fill(unseen, float("-inf")), topk)


@_inductor_on_cuda
def _quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [T, W] (index keys, FP8 latents) as FP8 values and power-of-two scales [T] (one fused launch on CUDA)."""
    return fp8_pow2_quantize(k)


def dsa_indexer_batched(
    q_idx: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, index_cache: torch.Tensor,
    index_scale: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, q_len: int, topk: int,
) -> torch.Tensor:
    """FP8 index-key insert + ReLU-weighted logits + top-k; [T, topk] int32 (see dsa_indexer_ref)."""
    _insert_fp8_rows(index_cache, index_scale, slot_mapping, k)
    return _indexer_core(q_idx, weights, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len, topk)
