"""Triton DSA decode kernels (SM90): split query, fused FP8 indexer, top-k, split-KV sparse MLA, W_UV + gate.

Each a single launch with no host synchronisation and outputs allocated up front (CUDA-graph
capturable):

* :func:`latent_insert`: the latent entry (RMSNorm of c_kv | k_rope) written straight into the
  paged latent cache (slot -1 skips).
* :func:`absorb_query`: the absorbed query ``[q_nope @ W_UK | q_rope]`` per head.
* :func:`index_key_insert`: key LayerNorm (FP32, rounded to BF16), FP8 e4m3 quantization with
  one power-of-two scale per token, and the insert into the paged index cache (slot -1 skips).
* :func:`index_logits`: one program per (request, run of key blocks) scores every step token
  of the request against the blocks' FP8 keys, loaded once for all ``q_len`` tokens: the
  queries are quantized in-kernel once per program (per-head power-of-two scale), one
  tensor-core dot ``[BLOCK_N, Di] x [Di, q_len*Hi]`` a block of the FP8 values (as FP16:
  exact, with FP32 accumulation), ReLU, the folded head weights, the key scale. Positions
  after the token's own (and padding tokens) get ``-inf``.
* :func:`select_rows`: the top-k positions, ascending, -1 padded, stored as the latent-cache rows they
  live in: :func:`select_topk_triton` (one program a row, the row held in registers: radix select on the
  float bits, 4 bits a pass, then compaction in position order) up to ``TOPK_TRITON_MAX_N`` positions,
  :func:`select_topk_chunked` (many programs a row) beyond.
* :func:`sparse_mla_decode_latent`: absorbed MLA decode over each token's selected latent rows
  (given as cache rows, the sparse loop has no block-table load between the index and the row
  it gathers), flash-decoding style: the 96 query heads are tiled (``BLOCK_H`` heads per
  program), the ``topk`` selected entries are split over as many programs as fill one wave of
  SMs, each program keeps an online softmax over its entries, and a combine kernel merges the
  splits into the BF16 latent output (one launch, no combine, where one split fills the wave).
* :func:`uv_gate`: W_UV (latent -> 128 per head) and ``* sigmoid(gate)`` in one launch, the
  input of o_proj.

An FP8 latent cache (e4m3 rows, one power-of-two FP32 scale per token in ``kv_scale [NB, BS]``,
docs/fp8_latent_cache.md): :func:`latent_insert` quantizes the row it writes (the scale from the
BF16 row's amax, as ``fp8_pow2_quantize``) and :func:`sparse_mla_decode_latent` loads FP8 rows
and their scales and dequantizes them to BF16 (exact) before the dots. Checked in Triton's
interpreter only, not yet run on the H200.

Numerics follow ``dep_compile.stock.reference.dsa``: the power-of-two scales are computed from
the float bits (the smallest power of two >= amax / 448, exact), FP8 products are exact and
accumulate in FP32 (a different order than the reference: logits move by FP32 ulps, which can
flip a near-tie at the top-k boundary), and the softmax weights enter the value dot as BF16
(as flash attention does) with FP32 accumulation.

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..stock.batched_attention import select_topk_positions
from .topk_triton import select_topk_chunked, select_topk_triton

__all__ = ["absorb_query", "latent_insert", "index_key_insert", "index_logits", "select_topk_positions",
           "select_rows", "select_topk_triton", "physical_rows",
           "sparse_mla_decode_latent", "uv_gate", "dsa_triton_unsupported"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _sm_count(t: torch.Tensor) -> int:
    """SMs of ``t``'s GPU (8 in Triton's CPU interpreter): what the launch grids are sized to fill."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 8


@triton.jit
def _pow2_scale(amax):
    """Smallest power of two >= amax / 448, from the float bits (exact); amax clamped to 1e-12."""
    r = tl.maximum(amax, 1e-12) / 448.0
    bits = r.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp = tl.where((bits & 0x7FFFFF) != 0, exp + 1, exp)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def dot_fp32_acc(a, b, F32: tl.constexpr):
    """a @ b with FP32 accumulation; BF16 / FP16 tensor cores, or FP32 operands in Triton's interpreter
    (whose BF16 dot is wrong: 16-bit values are exact in FP32, so the result is the same up to order)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _key_insert_kernel(k_ptr, w_ptr, b_ptr, slot_ptr, cache_ptr, scale_ptr,
                       stride_k, stride_c_blk, stride_c_off, stride_s_blk, stride_s_off, eps,
                       BS: tl.constexpr, DI: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DI)
        x = tl.load(k_ptr + t.to(tl.int64) * stride_k + d).to(tl.float32)
        mean = tl.sum(x, axis=0) / DI
        xc = x - mean
        var = tl.sum(xc * xc, axis=0) / DI
        y = xc * tl.rsqrt(var + eps) * tl.load(w_ptr + d).to(tl.float32) + tl.load(b_ptr + d).to(tl.float32)
        y = y.to(tl.bfloat16).to(tl.float32)  # the stock LayerNorm output is BF16
        scale = _pow2_scale(tl.max(tl.abs(y), axis=0))
        vals = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
        blk = slot // BS
        off = slot % BS
        tl.store(cache_ptr + blk * stride_c_blk + off * stride_c_off + d, vals.to(cache_ptr.dtype.element_ty))
        tl.store(scale_ptr + blk * stride_s_blk + off * stride_s_off, scale)


def index_key_insert(k: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, eps: float,
                     index_cache: torch.Tensor, index_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """LayerNorm + FP8 quantize + insert of this step's index keys ``k [T, Di]`` (BF16, unit inner stride).

    index_cache: [NB, BS, Di] float8_e4m3fn (unit inner stride); index_scale: [NB, BS] FP32;
    slot_mapping: [T] (-1 = padding, nothing written).
    """
    T, Di = k.shape
    if T == 0:
        return
    _key_insert_kernel[(T,)](
        k, norm_w, norm_b, slot_mapping, index_cache, index_scale,
        k.stride(0), index_cache.stride(0), index_cache.stride(1), index_scale.stride(0), index_scale.stride(1),
        float(eps), BS=index_cache.shape[1], DI=Di, num_warps=1)


@triton.jit
def _index_logits_kernel(q_ptr, wt_ptr, cache_ptr, scale_ptr, bt_ptr, seq_ptr, slot_ptr, out_ptr,
                         stride_q_t, stride_q_h, stride_w_t, stride_c_blk, stride_c_off, stride_s_blk, stride_s_off,
                         stride_bt, stride_out, w_const, N,
                         Q_LEN: tl.constexpr, QP: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    i = tl.arange(0, QP)  # token of the request
    tok = b * Q_LEN + i
    tok_ok = i < Q_LEN
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1)
    pos = seq - Q_LEN + i  # [QP]
    live = tok_ok & (slot >= 0)
    last = tl.max(tl.where(live, pos, -1), axis=0)  # the last position any token of the request sees
    # Queries of all Q_LEN tokens, quantized per (token, head) once per program: rows r = i * HI + h.
    r = tl.arange(0, QP * HI)
    ri = r // HI
    rh = r % HI
    d = tl.arange(0, DI)
    r_ok = ri < Q_LEN
    rtok = (b * Q_LEN + ri).to(tl.int64)
    q = tl.load(q_ptr + rtok[:, None] * stride_q_t + rh[:, None] * stride_q_h + d[None, :],
                mask=r_ok[:, None], other=0.0).to(tl.float32)
    q_scale = _pow2_scale(tl.max(tl.abs(q), axis=1))  # [QP*HI]
    q8 = tl.minimum(tl.maximum(q / q_scale[:, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float16)
    w = tl.load(wt_ptr + rtok * stride_w_t + rh, mask=r_ok, other=0.0).to(tl.float32)
    w_fold = w * q_scale * w_const  # weights x q scale x Di^-1/2 x Hi^-1/2 (folded on the host)
    # STEPS blocks of BLOCK_N positions per program: first the `seen` ones some token of the request sees (up to
    # `last`; a loop without a branch, so its loads are pipelined), then -inf for the rest (every token padding: all)
    base = tl.program_id(1) * STEPS * BLOCK_N
    seen = tl.minimum((tl.maximum(last + 1 - base, 0) + BLOCK_N - 1) // BLOCK_N, STEPS)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    n = base + tl.arange(0, BLOCK_N)  # positions in the request
    blk = tl.load(bt_row + n // BS, mask=n < seq, other=0).to(tl.int64)
    for j in range(seen):
        n_ok = n < seq
        # the next block's cache blocks, read a block ahead: the key loads below wait on no load of their own step
        blk_next = tl.load(bt_row + (n + BLOCK_N) // BS, mask=n + BLOCK_N < seq, other=0).to(tl.int64)
        off = (n % BS).to(tl.int64)
        k8 = tl.load(cache_ptr + blk[:, None] * stride_c_blk + off[:, None] * stride_c_off + d[None, :],
                     mask=n_ok[:, None], other=0.0)
        k_scale = tl.load(scale_ptr + blk * stride_s_blk + off * stride_s_off, mask=n_ok, other=0.0)
        # [BLOCK_N, QP*HI] FP32, keys the MMA's rows (a wgmma 64 rows tall; 32 heads as rows took mma.sync). FP16
        # operands hold the FP8 values exactly (one conversion a pair; BF16 took three) and keep full FP32
        # accumulation (Hopper's FP8 dots accumulate with ~14 bits, DeepSeek-V3 §3.3).
        dots = dot_fp32_acc(k8.to(tl.float16), tl.trans(q8), F32)
        contrib = tl.maximum(dots, 0.0) * w_fold[None, :]
        logits = tl.sum(tl.reshape(contrib, [BLOCK_N, QP, HI]), axis=2) * k_scale[:, None]  # [BLOCK_N, QP]
        visible = live[None, :] & (n[:, None] <= pos[None, :])
        tl.store(out_ptr + tok.to(tl.int64)[None, :] * stride_out + n[:, None],
                 tl.where(visible, logits, float("-inf")), mask=tok_ok[None, :] & (n < N)[:, None])
        n += BLOCK_N
        blk = blk_next
    for j in range(seen, STEPS):  # no token of the request sees these blocks
        n = base + j * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_out + n[None, :],
                 tl.full([QP, BLOCK_N], float("-inf"), tl.float32), mask=tok_ok[:, None] & (n < N)[None, :])


def index_logits(q_idx: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, index_scale: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, q_len: int,
                 *, block_n: int = 128, steps: int | None = None, num_warps: int | None = None,
                 num_stages: int = 3) -> torch.Tensor:
    """Indexer logits of every step token over its request's cached positions: [T, MB*BS] FP32.

    q_idx: [T, Hi, Di] BF16 (unit inner stride); weights: [T, Hi] (weights_proj output);
    index_cache: [NB, BS, Di] FP8 e4m3; index_scale: [NB, BS] FP32; block_table: [B, MB];
    seq_lens: [B] including this step's tokens; slot_mapping: [T]. Entries a token does not
    see (later positions, padding tokens) are ``-inf``. ``steps`` key blocks a program (default:
    (request, block) pairs // (8 x SMs), between 1 and 16: at 64 tokens x 4K one (22.3 µs; 7, the
    old two-waves rule, lies between 4 and 16: 23.1 and 32.3), at 64 x 32K 15 (16: 125.8 µs, 8:
    125.7, 32: 127.2, 1: 161.4; 256 positions a block: 133.5-152.4; 2026-12-03, after the seen
    blocks' loop lost its branch: 147.6 before; with the keys as wgmma rows over FP16: 109.9, and 394.6 at
    64 x 128K)); ``num_warps`` default: 8 below 16
    tokens, 4 from 16 (measured best at 1 token: 4.7 vs 5.0 µs, and at 64 tokens x 32K: 147 vs
    168 µs; the switch at 16 is not measured; docs/perf.md), and 8 where the query columns
    (``q_len`` x heads, rounded up) exceed 64: 4 warps spill the [128, 128] FP32 dots at q = 4. Three stages: two
    key buffers, one block's keys loading while the last is computed (the block table is read a block ahead, so
    Triton's pipeliner has a stage for the keys; 2 stages gave one buffer: 64 x 32K / 128K 109.8 / 399.1 -> 94.8 /
    359.0 µs, 4 stages 107.4 / 387.8; 2026-12-03).
    """
    T, Hi, Di = q_idx.shape
    qp = max(triton.next_power_of_2(q_len), triton.cdiv(16, Hi))  # tl.dot needs >= 16 query rows
    num_warps = num_warps or (8 if T < 16 or qp * Hi > 64 else 4)
    B, MB = block_table.shape
    BS = index_cache.shape[1]
    N = MB * BS
    out = torch.empty(T, N, dtype=torch.float32, device=q_idx.device)
    if T == 0 or N == 0:
        return out
    blocks = triton.cdiv(N, block_n)
    if steps is None:  # several key blocks a program (queries quantized once) while the grid fills the GPU
        steps = max(1, min(16, B * blocks // (8 * _sm_count(q_idx))))
    steps = max(1, min(steps, blocks))
    grid = (B, triton.cdiv(N, block_n * steps))
    _index_logits_kernel[grid](
        q_idx, weights, index_cache, index_scale, block_table, seq_lens, slot_mapping, out,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), index_cache.stride(0), index_cache.stride(1),
        index_scale.stride(0), index_scale.stride(1), block_table.stride(0), out.stride(0),
        float((Di ** -0.5) * (Hi ** -0.5)), N,
        Q_LEN=int(q_len), QP=qp, HI=Hi, DI=Di, BS=BS, BLOCK_N=block_n, STEPS=steps, F32=_INTERPRET,
        num_warps=num_warps, num_stages=num_stages)
    return out


# Measured (bench_dsa_kernels.py, docs/perf.md): the one-program-a-row kernel beats torch's
# top-k + sort up to 16K positions (11.6 vs 61-73 µs at 4K, 20.1 vs 77-94 at 8K, 38.3 vs 106-118
# at 16K); beyond, the many-programs-a-row kernel (27.5 / 28.6 µs at 1 x 32K / 128K against torch's
# 85.3 / 95.1; 65.4 / 163.9 at 64 x 32K / 128K against 114.8 / 192.5, 2026-12-03): 16K is the switch.
TOPK_TRITON_MAX_N = 16384


def _chunk(tokens: int, n: int, sms: int) -> int:
    """Entries a program of the many-programs top-k: 2048, or 4096 where 2048 would give more than four
    programs an SM (1 x 32K-128K: 2048 measured faster, 64 x 32K-128K: 4096)."""
    return 2048 if tokens * triton.cdiv(n, 2048) <= 4 * sms else 4096


def select_rows(logits: torch.Tensor, topk: int, block_table: torch.Tensor, q_len: int,
                block_size: int) -> torch.Tensor:
    """Each token's top-``topk`` positions (ascending, -1 padded), stored as the latent-cache rows they
    live in: [T, topk] int32 for :func:`sparse_mla_decode_latent` with ``physical=True``.

    Up to ``TOPK_TRITON_MAX_N`` positions the one-launch kernel, longer rows the many-programs kernel;
    both translate to cache rows as they store (free there, and it takes the block-table load out of the
    sparse MLA's loop)."""
    T, N = logits.shape
    rows_of = (block_table, q_len, block_size)
    if N <= TOPK_TRITON_MAX_N:
        return select_topk_triton(logits, topk, rows_of=rows_of)
    return select_topk_chunked(logits, topk, chunk=_chunk(T, N, _sm_count(logits)), num_warps=8, rows_of=rows_of)


@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, bt_ptr, idx_ptr, slot_ptr, o_ptr, m_ptr, l_ptr, ks_ptr,
                       stride_q_t, stride_q_h, stride_kv_blk, stride_kv_off, stride_bt, stride_idx,
                       stride_o_t, stride_o_s, stride_o_h, stride_ml_t, stride_ml_s, stride_ks_blk, stride_ks_off,
                       scale,
                       Q_LEN: tl.constexpr, H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PHYS: tl.constexpr,
                       DIRECT: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    b = t // Q_LEN
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    t64 = t.to(tl.int64)
    slot = tl.load(slot_ptr + t)
    q_rows = q_ptr + t64 * stride_q_t + h.to(tl.int64)[:, None] * stride_q_h
    q_lat = tl.load(q_rows + dl[None, :], mask=h_ok[:, None], other=0.0)  # [BLOCK_H, L] bf16
    q_rope = tl.load(q_rows + L + dr[None, :], mask=h_ok[:, None], other=0.0)  # [BLOCK_H, R]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L], tl.float32)
    for j0 in tl.range(s * CHUNK, (s + 1) * CHUNK, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        pos = tl.load(idx_ptr + t64 * stride_idx + j)
        ok = (pos >= 0) & ((tl.zeros([BLOCK_N], tl.int64) + slot) >= 0)  # tensor mask (interpreter)
        pos_c = tl.maximum(pos, 0)
        if PHYS:  # cache rows (block * BS + offset): no block-table load on the loop's critical path
            blk = (pos_c // BS).to(tl.int64)
        else:
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pos_c // BS, mask=ok, other=0).to(tl.int64)
        rows = kv_ptr + blk * stride_kv_blk + (pos_c % BS).to(tl.int64) * stride_kv_off
        k_lat = tl.load(rows[:, None] + dl[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, L]
        k_rope = tl.load(rows[:, None] + L + dr[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, R]
        if FP8:  # e4m3 rows times their power-of-two scale: exact in BF16
            k_s = tl.load(ks_ptr + blk * stride_ks_blk + (pos_c % BS).to(tl.int64) * stride_ks_off, mask=ok,
                          other=0.0)  # [BLOCK_N] FP32
            k_lat = (k_lat.to(tl.float32) * k_s[:, None]).to(tl.bfloat16)
            k_rope = (k_rope.to(tl.float32) * k_s[:, None]).to(tl.bfloat16)
        # [BLOCK_H, BLOCK_N]
        sc = dot_fp32_acc(q_lat, tl.trans(k_lat), F32) + dot_fp32_acc(q_rope, tl.trans(k_rope), F32)
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_fp32_acc(p.to(tl.bfloat16), k_lat, F32)
        m = m_new
    o_rows = o_ptr + t64 * stride_o_t + s * stride_o_s + h.to(tl.int64)[:, None] * stride_o_h + dl[None, :]
    if DIRECT:  # one split: the normalized BF16 output itself (no partials, no combine launch)
        res = tl.where(l_sum[:, None] > 0, acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)
        tl.store(o_rows, res.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:  # FP32 partials and their softmax max / sum, merged by _combine_kernel
        tl.store(o_rows, acc, mask=h_ok[:, None])
        ml = t64 * stride_ml_t + s * stride_ml_s + h
        tl.store(m_ptr + ml, m, mask=h_ok)
        tl.store(l_ptr + ml, l_sum, mask=h_ok)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, stride_o_t, stride_o_s, stride_o_h, stride_ml_t, stride_ml_s,
                    stride_out_t, stride_out_h, SPLITS: tl.constexpr, SP: tl.constexpr, L: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    sp_ok = sp < SPLITS
    m = tl.load(m_ptr + t * stride_ml_t + sp * stride_ml_s + h, mask=sp_ok, other=float("-inf"))
    l_part = tl.load(l_ptr + t * stride_ml_t + sp * stride_ml_s + h, mask=sp_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    wgt = tl.where(sp_ok & (m > float("-inf")), tl.exp(m - m_safe), 0.0)  # [SP]
    denom = tl.sum(wgt * l_part, axis=0)
    dl = tl.arange(0, L)
    o = tl.load(o_ptr + t * stride_o_t + sp[:, None] * stride_o_s + h * stride_o_h + dl[None, :],
                mask=sp_ok[:, None], other=0.0)
    num = tl.sum(o * wgt[:, None], axis=0)
    res = tl.where(denom > 0, num / tl.where(denom > 0, denom, 1.0), 0.0)  # no selected entry: 0
    tl.store(out_ptr + t * stride_out_t + h * stride_out_h + dl, res.to(out_ptr.dtype.element_ty))


def _splits(T: int, head_tiles: int, topk: int, block_n: int, sms: int) -> int:
    """Splits of the top-k entries: the fewest (a power of two) with which T x head_tiles x splits
    programs fill 90 % of one wave of SMs. Measured at 16 and 64 tokens (docs/perf.md): one wave
    beats two (55 vs 79 µs at 16 tokens, 163 vs 194 at 64): more splits only add partial
    writes, the combine's reads and per-program prologues."""
    max_splits = max(1, topk // block_n)
    s = 1
    while T * head_tiles * s < 0.9 * sms and s * 2 <= max_splits and topk % (s * 2 * block_n) == 0:
        s *= 2
    return s


def physical_rows(topk_pos: torch.Tensor, block_table: torch.Tensor, q_len: int, block_size: int) -> torch.Tensor:
    """Selected positions [T, K] (-1 = none) -> latent-cache rows ``block * block_size + offset``
    (-1 = none), int32, for :func:`sparse_mla_decode_latent` with ``physical=True``: the readable
    torch form (tests, benchmarks) of what :func:`select_topk_triton` stores with ``rows_of``.
    ``T`` must be ``B * q_len`` for the ``B`` rows of ``block_table``."""
    req = torch.arange(topk_pos.shape[0], device=topk_pos.device) // q_len
    pos = topk_pos.clamp_min(0).long()
    blk = block_table[req[:, None], pos // block_size].long()
    return torch.where(topk_pos >= 0, blk * block_size + pos % block_size, -1).to(torch.int32)


def sparse_mla_tile(tokens: int, physical: bool) -> dict:
    """The sparse MLA's default tile for a step of ``tokens`` tokens: heads a program, warps, load stages.

    Measured at 1 and 64 tokens (bench_dsa_kernels.py, docs/perf.md): below 16 tokens 32 heads a program (more
    programs), 4 warps, 2 stages (11.1-11.5 µs vs 12.3-12.6 with 8 warps and 3); from 16, 64 heads (each
    selected row read by fewer programs) and 8 warps, 2 stages over cache rows (195 vs 213 µs), 3 over positions
    (234 vs 254). The switch at 16 tokens was not measured.
    """
    small = tokens < 16
    return dict(block_h=32 if small else 64, num_warps=4 if small else 8,
                num_stages=2 if small or physical else 3)


def sparse_mla_decode_latent(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                             topk_indices: torch.Tensor, slot_mapping: torch.Tensor, q_len: int, kv_lora: int,
                             scale: float, *, block_h: int | None = None, block_n: int = 64,
                             splits: int | None = None, physical: bool = False, num_warps: int | None = None,
                             num_stages: int | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed sparse MLA decode: softmax(query . ctx * scale) @ ctx[:, :kv_lora] per head: [T, H, L] BF16.

    query: [T, H, L+R] BF16 (absorbed q_nope | q_rope; unit inner stride); kv_cache:
    [NB, BS, L+R] BF16 (unit inner stride); block_table: [B, MB]; topk_indices: [T, K] int32
    positions in the request (-1 = none; K a multiple of ``block_n``), or with ``physical``
    cache rows ``block * BS + offset`` (block_table unused); slot_mapping: [T]
    (-1 = padding token: output 0). A token with no selected entry gets 0. ``kv_scale [NB, BS]``
    FP32: the cache is FP8 e4m3, each row times its scale (interpreter-checked only).
    """
    T, H, LR = query.shape
    L, R = kv_lora, LR - kv_lora
    K = topk_indices.shape[1]
    tile = sparse_mla_tile(T, physical)
    block_h = block_h or tile["block_h"]
    num_warps = num_warps or tile["num_warps"]
    num_stages = num_stages or tile["num_stages"]
    out = torch.empty(T, H, L, dtype=query.dtype, device=query.device)
    if T == 0:
        return out
    head_tiles = triton.cdiv(H, block_h)
    n_split = splits or _splits(T, head_tiles, K, block_n, _sm_count(query))
    if K % (n_split * block_n):  # each program's entries must be whole blocks of one row
        raise ValueError(f"top-k {K} is not a multiple of splits {n_split} x block_n {block_n}")
    chunk = K // n_split
    direct = n_split == 1
    if direct:  # the kernel writes the BF16 output itself, through a [T, 1, H, L] view (m, l unused)
        o_part, m_part, l_part = out.unsqueeze(1), out, out
    else:  # [T, splits, H, L] FP32 partials, their [T, splits, H] softmax max and sum
        o_part = torch.empty(T, n_split, H, L, dtype=torch.float32, device=query.device)
        m_part = torch.empty(T, n_split, H, dtype=torch.float32, device=query.device)
        l_part = torch.empty_like(m_part)
    ks = kv_scale if kv_scale is not None else m_part  # unused without FP8
    ks_strides = kv_scale.stride() if kv_scale is not None else (0, 0)
    _sparse_mla_kernel[(T, head_tiles, n_split)](
        query, kv_cache, block_table, topk_indices, slot_mapping, o_part, m_part, l_part, ks,
        query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        topk_indices.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0),
        m_part.stride(1), *ks_strides, float(scale),
        Q_LEN=int(q_len), H=H, L=L, R=R, BS=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, CHUNK=chunk,
        PHYS=bool(physical), DIRECT=direct, F32=_INTERPRET, FP8=kv_scale is not None, num_warps=num_warps,
        num_stages=num_stages)
    if direct:
        return out
    _combine_kernel[(T, H)](
        o_part, m_part, l_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0),
        m_part.stride(1), out.stride(0), out.stride(1), SPLITS=n_split, SP=triton.next_power_of_2(n_split), L=L,
        num_warps=4)
    return out


@triton.jit
def _absorb_kernel(q_ptr, w_ptr, out_ptr, T, stride_q_t, stride_q_h, stride_w_h, stride_w_n, stride_out_t,
                   stride_out_h, NOPE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr,
                   BLOCK_T: tl.constexpr, F32: tl.constexpr):
    c = tl.program_id(0)  # BLOCK_L latent columns of the head (the fastest axis: the programs of a head run together)
    h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    dn = tl.arange(0, NOPE)
    dl = c * BLOCK_L + tl.arange(0, BLOCK_L)
    q_rows = q_ptr + t64[:, None] * stride_q_t + h * stride_q_h
    q_nope = tl.load(q_rows + dn[None, :], mask=t_ok[:, None], other=0.0)  # [BLOCK_T, NOPE]
    w_uk = tl.load(w_ptr + h * stride_w_h + dn[:, None] * stride_w_n + dl[None, :])  # [NOPE, BLOCK_L]
    q_lat = dot_fp32_acc(q_nope, w_uk, F32)  # [BLOCK_T, BLOCK_L] FP32
    out_rows = out_ptr + t64[:, None] * stride_out_t + h * stride_out_h
    tl.store(out_rows + dl[None, :], q_lat.to(out_ptr.dtype.element_ty), mask=t_ok[:, None])
    if c == 0:
        dr = tl.arange(0, R)
        q_rope = tl.load(q_rows + NOPE + dr[None, :], mask=t_ok[:, None], other=0.0)
        tl.store(out_rows + L + dr[None, :], q_rope, mask=t_ok[:, None])


def _block_t(T: int) -> int:
    """Tokens per program of the per-head kernels: all of them up to 64 (each head's weight read once)."""
    return min(64, max(16, triton.next_power_of_2(T)))


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor, *, block_t: int | None = None,
                 block_l: int = 128) -> torch.Tensor:
    """The absorbed query ``[q_nope @ W_UK | q_rope]``, one launch: q [T, H, nope+R] BF16, w_uk [H, nope, L] -> [T, H, L+R].

    FP32 accumulation, the latent part rounded once to BF16 (as the reference's ``absorb_query``).
    ``block_l`` latent columns a program (a power of two dividing L): 4 programs a head at
    L = 512, so that H x 4 programs stream W_UK (measured, docs/perf.md: 5.9 vs 7.1 µs at 1
    token, 8.4 vs 10.8 at 64).
    """
    T, H, NR = q.shape
    nope, L = w_uk.shape[1], w_uk.shape[2]
    out = torch.empty(T, H, L + NR - nope, dtype=q.dtype, device=q.device)
    block_t = block_t or _block_t(T)
    block_l = min(block_l, L)
    if L % block_l:
        raise ValueError(f"block_l {block_l} does not divide the latent width {L}")
    if T:
        _absorb_kernel[(L // block_l, H, triton.cdiv(T, block_t))](
            q, w_uk, out, T, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1),
            NOPE=nope, L=L, R=NR - nope, BLOCK_L=block_l, BLOCK_T=block_t, F32=_INTERPRET,
            num_warps=4 if block_t * block_l <= 16 * 512 else 8)
    return out


@triton.jit
def _latent_insert_kernel(kv_ptr, w_ptr, slot_ptr, cache_ptr, scale_ptr, stride_kv, stride_c_blk, stride_c_off,
                          stride_s_blk, stride_s_off, eps, BS: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                          FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dl = tl.arange(0, L)
        dr = tl.arange(0, R)
        row = kv_ptr + t.to(tl.int64) * stride_kv
        c = tl.load(row + dl).to(tl.float32)
        y = c * tl.rsqrt(tl.sum(c * c, axis=0) / L + eps) * tl.load(w_ptr + dl).to(tl.float32)
        dst = cache_ptr + (slot // BS) * stride_c_blk + (slot % BS) * stride_c_off
        if FP8:  # the BF16 row quantized: e4m3 values and one power-of-two scale (fp8_pow2_quantize)
            yb = y.to(tl.bfloat16).to(tl.float32)
            rope = tl.load(row + L + dr).to(tl.float32)
            s = _pow2_scale(tl.maximum(tl.max(tl.abs(yb), axis=0), tl.max(tl.abs(rope), axis=0)))
            tl.store(dst + dl, tl.minimum(tl.maximum(yb / s, -448.0), 448.0).to(cache_ptr.dtype.element_ty))
            tl.store(dst + L + dr, tl.minimum(tl.maximum(rope / s, -448.0), 448.0).to(cache_ptr.dtype.element_ty))
            tl.store(scale_ptr + (slot // BS) * stride_s_blk + (slot % BS) * stride_s_off, s)
        else:
            tl.store(dst + dl, y.to(cache_ptr.dtype.element_ty))
            tl.store(dst + L + dr, tl.load(row + L + dr))


def latent_insert(kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, kv_scale: torch.Tensor | None = None) -> None:
    """The latent entry ``[RMSNorm(c_kv) | k_rope]`` of each token written into the paged cache, one launch.

    kv_a: [T, L+R] BF16 (unit inner stride); norm_w: [L]; kv_cache: [NB, BS, L+R] BF16;
    slot_mapping: [T] (-1 = padding, nothing written). The norm is FP32, rounded once to BF16.
    ``kv_scale [NB, BS]`` FP32: the cache is FP8 e4m3 and the BF16 row is stored quantized with its
    power-of-two scale (interpreter-checked only).
    """
    T, LR = kv_a.shape
    L = norm_w.shape[0]
    ks = kv_scale if kv_scale is not None else kv_cache  # unused without FP8
    ks_strides = kv_scale.stride() if kv_scale is not None else (0, 0)
    if T:
        _latent_insert_kernel[(T,)](kv_a, norm_w, slot_mapping, kv_cache, ks, kv_a.stride(0), kv_cache.stride(0),
                                    kv_cache.stride(1), *ks_strides, float(eps), BS=kv_cache.shape[1], L=L, R=LR - L,
                                    FP8=kv_scale is not None, num_warps=4)


@triton.jit
def _uv_gate_kernel(o_ptr, w_ptr, g_ptr, out_ptr, T, stride_o_t, stride_o_h, stride_w_h, stride_w_v, stride_g,
                    stride_out, L: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
                    F32: tl.constexpr):
    c = tl.program_id(0)  # BLOCK_V value columns of the head (the fastest axis: a head's o_lat rows shared in L2)
    h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    dl = tl.arange(0, L)
    dv = c * BLOCK_V + tl.arange(0, BLOCK_V)
    o = tl.load(o_ptr + t64[:, None] * stride_o_t + h * stride_o_h + dl[None, :], mask=t_ok[:, None], other=0.0)
    w = tl.load(w_ptr + h * stride_w_h + dv[:, None] * stride_w_v + dl[None, :])  # [BLOCK_V, L]
    y = dot_fp32_acc(o, tl.trans(w), F32).to(tl.bfloat16).to(tl.float32)  # W_UV output, BF16 as stock's
    col = h * V + dv
    gate = tl.load(g_ptr + t64[:, None] * stride_g + col[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    y = y / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t64[:, None] * stride_out + col[None, :], y.to(out_ptr.dtype.element_ty), mask=t_ok[:, None])


def uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor, *, block_t: int | None = None,
            block_v: int | None = None) -> torch.Tensor:
    """W_UV then ``* sigmoid(gate)``, one launch: o_lat [T, H, L] BF16, w_uv [H, v, L], gate [T, H*v] -> [T, H*v] BF16.

    The W_UV product is rounded to BF16 before the gate (as stock's two steps round), the gate
    product in FP32, rounded once. ``block_v`` value columns a program (a power of two dividing
    v); default, measured at v = 128 (docs/perf.md): 32 below 16 tokens (4 programs a head
    stream W_UV: 6.9 vs 7.8 µs at 1 token), all 128 from 16 (each program then re-reads its
    head's o_lat rows per column block: 9.4 vs 14.1 µs at 64 tokens).
    """
    T, H, L = o_lat.shape
    V = w_uv.shape[1]
    out = torch.empty(T, H * V, dtype=o_lat.dtype, device=o_lat.device)
    block_t = block_t or _block_t(T)
    block_v = min(block_v or (32 if T < 16 else V), V)
    if V % block_v:
        raise ValueError(f"block_v {block_v} does not divide the value width {V}")
    if T == 0:
        return out
    _uv_gate_kernel[(V // block_v, H, triton.cdiv(T, block_t))](
        o_lat, w_uv, gate, out, T, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), gate.stride(0),
        out.stride(0), L=L, V=V, BLOCK_V=block_v, BLOCK_T=block_t, F32=_INTERPRET,
        num_warps=4 if block_t * block_v <= 16 * 128 else 8)
    return out


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def dsa_triton_unsupported(kv_cache: torch.Tensor, index_cache: torch.Tensor, *, index_heads: int, index_dim: int,
                           kv_lora: int, nope: int, v_dim: int, topk: int, block_n: int = 64,
                           kv_scale: torch.Tensor | None = None) -> str | None:
    """Why these kernels cannot run a DSA step (None: they can). Shapes and strides only, no sync."""
    if not kv_cache.is_cuda and not _INTERPRET:
        return "not on CUDA"
    R = kv_cache.shape[-1] - kv_lora
    dims = dict(index_heads=index_heads, index_dim=index_dim, kv_lora=kv_lora, rope=R, nope=nope, v=v_dim)
    if not all(_pow2(d) and d >= 16 or name == "index_heads" and _pow2(d) for name, d in dims.items()):
        return f"dims {dims}: not all powers of two >= 16 (index heads: any power of two)"
    if not (_pow2(block_n) and block_n >= 16):
        return f"top-k {topk}: the sparse MLA step min(64, top-k) = {block_n} is not a power of two >= 16"
    if topk % block_n:
        return f"topk {topk} not a multiple of {block_n}"
    if kv_scale is None and (kv_cache.dtype != torch.bfloat16 or kv_cache.stride(-1) != 1):
        return "latent cache not BF16 with unit inner stride"
    if kv_scale is not None and (kv_cache.dtype != torch.float8_e4m3fn or kv_cache.stride(-1) != 1
                                 or kv_scale.dtype != torch.float32 or kv_scale.shape != kv_cache.shape[:2]):
        return "FP8 latent cache not e4m3 with unit inner stride and FP32 [NB, BS] scales"
    if kv_cache.shape[0] * kv_cache.shape[1] >= 2 ** 31:
        return "latent cache has more rows than int32 row indices address"
    if index_cache.shape[1] != kv_cache.shape[1]:
        return f"index cache block size {index_cache.shape[1]} != latent cache block size {kv_cache.shape[1]}"
    if index_cache.dtype != torch.float8_e4m3fn or index_cache.stride(-1) != 1:
        return "index cache not FP8 e4m3 with unit inner stride"
    return None
