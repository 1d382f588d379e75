"""Triton KDA decode core (SM90): one launch per layer step (or two: the split form, at the end).

One program per (request, head) runs the whole KDA core of that head for all ``q_len`` tokens
of the request, with the head's FP32 recurrent state ``[Dv, Dk]`` (128 x 128 = 64 KiB at full
size) held in registers:

1. depthwise causal conv (width ``W``) + SiLU over the head's q, k and v channels, reading the
   ``W-1`` previous taps from the BF16 conv state and the new tokens from q / k / v; each conv
   output is rounded to BF16 (as the reference's ``.to(x.dtype)``); the new conv state (the
   ``W-1`` taps after ``accepted`` tokens: the last W-1 rows of the committed token's window,
   kept in registers) is written back in place at the end;
2. the F_B gate: ``g_raw = f_a @ f_b_w[h*D:(h+1)*D]^T`` (FP32 accumulation, rounded to BF16
   as the reference's ``F.linear``), then ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw +
   dt_bias))``;
3. L2 norms of q and k (eps 1e-6; q times ``D^-1/2``), ``beta = sigmoid(beta logit)``;
4. the delta rule in FP32: ``S <- S * exp(g)`` along k; ``S <- S + beta (v - S k) k^T``;
   ``o = S q``; the state as of ``accepted`` tokens is stored once (a store predicated on
   ``t + 1 == accepted``), later tokens only produce outputs;
5. the gated RMSNorm of the head's whole ``o`` (eps ``norm_eps``), times ``o_norm_w``, times
   ``sigmoid(g_out)``, stored as BF16.

Rows of the delta rule are independent in ``v``; the gated RMSNorm is not (it needs the head's
whole ``o``), which is why one program owns a whole head. Padding requests
(``state_indices[b] < 0``) load and store no state and write zeros to their outputs.

Tensors (one CUDA device; ``T = B * q_len``; ``H`` heads of ``D``; ``F`` = f_a width):

==================  ==========================  =============================================
name                shape / dtype               notes
==================  ==========================  =============================================
``q, k, v``         ``[T, H*D]`` bf16           before the conv; row stride free, unit inner
``g_out``           ``[T, H*D]`` bf16           output gate logits; row stride free
``f_a``             ``[T, F]`` bf16             row stride free
``f_b_w``           ``[H*D, F]`` bf16           row stride free; or None: then ``f_a`` is the raw
                                               gate ``[T, H*D]`` bf16, F_B applied outside (an FP8
                                               ``f_b_proj``: stock's FP8 linear)
``beta``            ``[T, H]`` bf16/fp32        logits; row stride free
``conv_w``          ``[3*H*D, W]`` any float    any strides
``A_log``           ``[H]`` fp32                contiguous
``dt_bias``         ``[H*D]`` fp32              contiguous
``o_norm_w``        ``[D]`` float               contiguous
``conv_state``      ``[S, W-1, 3*H*D]`` bf16    mutated; slot / tap strides free, unit channel
``rec_state``       ``[S, H, Dv=D, Dk=D]`` fp32 mutated; every stride free (the two inner
                                                ones are compile-time constants)
``state_indices``   ``[B]`` int32/int64         slot per request, -1 = padding
``accepted``        ``[B]`` int32/int64         in 0..q_len: tokens whose state is committed
returns             ``[T, H*D]`` bf16           freshly allocated (the only allocation)
==================  ==========================  =============================================

No host synchronisation and no allocation besides the output: CUDA-graph capturable.
Supported: ``q_len <= MAX_Q_LEN`` (8), power-of-two ``D`` and ``F``, ``W <= 8``
(:func:`kda_decode_unsupported` says why a call is not supported; ``PreparedKda.core`` then
runs the stock KDA core op and logs the reason once).

The split form (``kda_decode_core(split=True)``, where ``tactics.kda_split`` says so) runs steps 1-3 in
``_kda_prep_kernel`` into a workspace it allocates (T x H x 1824 bytes at D = 128; under a CUDA graph in the
graph's pool), a program for a head of ``PREP_ROWS // next_pow2(q_len)`` requests (F_B for all their tokens as one
tensor-core product), then step 4 in ``_kda_state_kernel`` (``STATE_ROW_PARTS`` programs a (request, head), each a
quarter of the state's rows in 2 warps at 128 registers) and step 5 in ``_kda_norm_kernel``, so it takes
``16 <= D <= 128`` and an F_B rank of 16 to 256 (:func:`split_unsupported`).

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dsa_triton import dot_fp32_acc

__all__ = ["kda_decode_core", "kda_decode_unsupported", "split_unsupported", "MAX_Q_LEN"]

MAX_Q_LEN = 8
STATE_ROW_PARTS = 4  # programs a (request, head) in the split form's state launch: a quarter of the state's rows each
STATE_LAUNCH = {"num_warps": 2, "maxnreg": 128}  # the state launch: 64 state values a thread, eight programs an SM
PREP_ROWS = 16  # token rows a program of the split form's prep launch (whole requests; the F_B product's M)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _window(cs_base, stride_cs_w, x_base, stride_x, tok0, p0, ch, ok, W: tl.constexpr, WP: tl.constexpr):
    """Rows ``p0 .. p0+W-1`` of the conv window ``cat(conv_state[0:W-1], x[tok0:])`` for channels
    ``ch``: a ``[WP, len(ch)]`` FP32 tile (rows >= W are 0)."""
    r = tl.arange(0, WP)
    p = p0 + r
    in_state = p < W - 1
    live = (r < W) & ((tl.zeros([WP], tl.int32) + ok.to(tl.int32)) != 0)  # tensor mask (interpreter)
    s_ptr = cs_base + tl.minimum(p, W - 2).to(tl.int64)[:, None] * stride_cs_w + ch[None, :]
    from_state = tl.load(s_ptr, mask=(live & in_state)[:, None], other=0.0)
    xrow = tl.maximum(tok0 + p - (W - 1), 0).to(tl.int64)
    from_x = tl.load(x_base + xrow[:, None] * stride_x + ch[None, :], mask=(live & (p >= W - 1))[:, None],
                     other=0.0)
    return tl.where(in_state[:, None], from_state.to(tl.float32), from_x.to(tl.float32))


@triton.jit
def _conv_silu(win, cw):
    """Conv + SiLU of one ``_window`` tile (``cw`` [WP, len(ch)]), rounded to BF16, as FP32 ``[len(ch)]``."""
    y = tl.sum(win * cw, axis=0)
    y = y / (1.0 + tl.exp(-y))
    return y.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _store_taps(cs_base, stride_cs_w, win, ch, keep, W: tl.constexpr, WP: tl.constexpr):
    """Rows 1 .. W-1 of ``win`` (a ``_window`` tile: the taps after its token) stored as
    conv-state rows 0 .. W-2 of channels ``ch``, where ``keep`` ([len(ch)] bool)."""
    r = tl.arange(0, WP)
    ptrs = cs_base + (r - 1).to(tl.int64)[:, None] * stride_cs_w + ch[None, :]
    tl.store(ptrs, win.to(cs_base.dtype.element_ty), mask=((r >= 1) & (r < W))[:, None] & keep[None, :])


@triton.jit
def _token_conv(cs_base, stride_cs_w, q_ptr, stride_q, k_ptr, stride_k, v_ptr, stride_v, tok0, t, ch, ok, commit,
                taps_q, taps_k, taps_v, cw_q, cw_k, cw_v, HD: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Token ``t``'s conv + SiLU outputs of q, k and v (``_conv_silu`` of its ``_window`` tiles), and the taps
    kept so far with its windows taken where ``commit`` ([D] bool: it is the committed token)."""
    win_q = _window(cs_base, stride_cs_w, q_ptr, stride_q, tok0, t, ch, ok, W, WP)
    win_k = _window(cs_base + HD, stride_cs_w, k_ptr, stride_k, tok0, t, ch, ok, W, WP)
    win_v = _window(cs_base + 2 * HD, stride_cs_w, v_ptr, stride_v, tok0, t, ch, ok, W, WP)
    taps_q = tl.where(commit[None, :], win_q, taps_q)
    taps_k = tl.where(commit[None, :], win_k, taps_k)
    taps_v = tl.where(commit[None, :], win_v, taps_v)
    return _conv_silu(win_q, cw_q), _conv_silu(win_k, cw_k), _conv_silu(win_v, cw_v), taps_q, taps_k, taps_v


@triton.jit
def _store_new_taps(cs_base, stride_cs_w, taps_q, taps_k, taps_v, ch, keep, HD: tl.constexpr, W: tl.constexpr,
                    WP: tl.constexpr):
    """The committed token's taps of q, k and v as the new conv state (``_store_taps``), where ``keep``."""
    _store_taps(cs_base, stride_cs_w, taps_q, ch, keep, W, WP)
    _store_taps(cs_base + HD, stride_cs_w, taps_k, ch, keep, W, WP)
    _store_taps(cs_base + 2 * HD, stride_cs_w, taps_v, ch, keep, W, WP)


@triton.jit
def _gates(fa_ptr, stride_fa, beta_ptr, stride_beta, tok, h, fbw_ptr, stride_fbw, ch, D: tl.constexpr,
           F: tl.constexpr, FB: tl.constexpr, GRAW: tl.constexpr):
    """Token ``tok``'s raw decay gate for channels ``ch`` and head ``h``'s beta: (``f_a[tok] @
    f_b_w[ch]^T`` in FP32, FB columns of ``f_b_w`` at a time (bounded registers), rounded to BF16
    as the reference's ``F.linear``, as FP32 ``[D]``; ``sigmoid(beta[tok, h])``). ``GRAW``: ``fa_ptr``
    holds the raw gate itself ([T, H*D] BF16, F_B applied outside), read as it is."""
    beta = _sigmoid(tl.load(beta_ptr + tok * stride_beta + h).to(tl.float32))
    if GRAW:
        g_raw = tl.load(fa_ptr + tok * stride_fa + ch).to(tl.float32)
    else:
        offs_fb = tl.arange(0, FB)
        g_acc = tl.zeros([D], dtype=tl.float32)
        for f0 in tl.static_range(0, F, FB):
            fa = tl.load(fa_ptr + tok * stride_fa + f0 + offs_fb).to(tl.float32)
            fbw = tl.load(fbw_ptr + ch.to(tl.int64)[:, None] * stride_fbw + (f0 + offs_fb)[None, :])
            g_acc += tl.sum(fbw.to(tl.float32) * fa[None, :], axis=1)
        g_raw = g_acc.to(tl.bfloat16).to(tl.float32)
    return g_raw, beta


@triton.jit
def _head_consts(cw_ptr, stride_cw_c, stride_cw_w, alog_ptr, dtb_ptr, h, ch, offs_w, HD: tl.constexpr,
                 W: tl.constexpr):
    """Head ``h``'s constants: ``exp(A_log[h])``, ``dt_bias`` [D] and the q / k / v conv taps [WP, D], FP32."""
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + ch).to(tl.float32)
    wmask = offs_w[:, None] < W
    cw_q = tl.load(cw_ptr + ch[None, :] * stride_cw_c + offs_w[:, None] * stride_cw_w, mask=wmask, other=0.0)
    cw_k = tl.load(cw_ptr + (HD + ch)[None, :] * stride_cw_c + offs_w[:, None] * stride_cw_w, mask=wmask, other=0.0)
    cw_v = tl.load(cw_ptr + (2 * HD + ch)[None, :] * stride_cw_c + offs_w[:, None] * stride_cw_w, mask=wmask,
                   other=0.0)
    return a, dtb, cw_q.to(tl.float32), cw_k.to(tl.float32), cw_v.to(tl.float32)


@triton.jit
def _norm_scale(x, D: tl.constexpr, Q: tl.constexpr, AXIS: tl.constexpr):
    """The L2 norm's factor of conv outputs over their channel axis ``AXIS`` (eps 1e-6), times ``D^-1/2`` for q."""
    r = tl.rsqrt(tl.sum(x * x, axis=AXIS) + 1e-6)
    if Q:
        r = r * (D ** -0.5)
    return r


@triton.jit
def _gated_norm(o, sum_sq, onw, gate, ok, D: tl.constexpr, norm_eps):
    """The output's gated RMSNorm from its sum of squares over the head's D channels; 0 where ``ok`` is False."""
    return tl.where(ok, o * tl.rsqrt(sum_sq / D + norm_eps) * onw * gate, 0.0)


@triton.jit
def _decay(lower_bound, a, g_raw, dtb):
    """The per-channel state decay ``exp(lower_bound * sigmoid(a * (g_raw + dt_bias)))``."""
    return tl.exp(lower_bound * _sigmoid(a * (g_raw + dtb)))


@triton.jit
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, fa_ptr, beta_ptr,
    fbw_ptr, cw_ptr, alog_ptr, dtb_ptr, onw_ptr,
    cs_ptr, st_ptr, idx_ptr, acc_ptr, out_ptr,
    stride_q, stride_k, stride_v, stride_g, stride_fa, stride_beta,
    stride_fbw, stride_cw_c, stride_cw_w,
    stride_cs_s, stride_cs_w,
    stride_st_s, stride_st_h,
    stride_out,
    lower_bound, norm_eps,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    Q_LEN: tl.constexpr, ST_V: tl.constexpr, ST_K: tl.constexpr, FB: tl.constexpr,
    GRAW: tl.constexpr = False,  # fa_ptr holds the raw gate [T, H*D] (F_B applied outside), fbw_ptr unused
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    HD: tl.constexpr = H * D
    offs = tl.arange(0, D)  # channel of the head: k index (state columns) or v index (rows)
    offs_w = tl.arange(0, WP)

    # Per-head constants (no slot needed: they go out first).
    ch = h * D + offs
    a, dtb, cw_q, cw_k, cw_v = _head_consts(cw_ptr, stride_cw_c, stride_cw_w, alog_ptr, dtb_ptr, h, ch, offs_w, HD, W)

    tok0 = b * Q_LEN
    # Decode: the F_B gate and beta first. Their loads need no state slot, so they are in flight
    # before the slot-dependent chain (slot -> state / conv-state loads) starts; issued after it,
    # they waited for the slot (1.2x slower at 16-64 requests, docs/perf_kda.md).
    if Q_LEN == 1:
        g_first, beta_first = _gates(fa_ptr, stride_fa, beta_ptr, stride_beta, tok0.to(tl.int64), h, fbw_ptr,
                                     stride_fbw, ch, D, F, FB, GRAW)

    slot = tl.load(idx_ptr + b).to(tl.int64)
    acc = tl.load(acc_ptr + b).to(tl.int32)
    ok = slot >= 0
    slot_c = tl.maximum(slot, 0)
    # Per-element masks are built from tensors (Triton's interpreter rejects scalar & tensor masks).
    ok_d = (tl.zeros([D], tl.int64) + slot) >= 0
    commit_d = tl.zeros([D], tl.int32) + acc

    # The recurrent state: the first slot-dependent load, in flight while the conv is computed.
    st_ptrs = st_ptr + slot_c * stride_st_s + h * stride_st_h + offs[:, None] * ST_V + offs[None, :] * ST_K
    st_mask = (offs[:, None] < D) & ok_d[None, :]
    S = tl.load(st_ptrs, mask=st_mask, other=0.0)

    cs_base = cs_ptr + slot_c * stride_cs_s
    # The window of the committed token (t + 1 == accepted) holds the new conv taps (its rows
    # 1 .. W-1); kept in registers and stored after the last token has read the old taps.
    taps_q = tl.zeros([WP, D], tl.float32)
    taps_k = tl.zeros([WP, D], tl.float32)
    taps_v = tl.zeros([WP, D], tl.float32)

    # Verify steps: a loop, not unrolled (unrolled, they spill registers), software-pipelined in
    # two stages: the next token's conv windows, f_a and f_b_w chunks stream into shared memory
    # as asynchronous copies while this token computes (1.2x faster at 16-64 requests x 4
    # tokens; 3 stages were slower). Triton does this only where the row strides are multiples
    # of 16 elements (true of the packed in_proj output); otherwise the loads stay in the loop.
    # Decode runs it once, not pipelined.
    for t in tl.range(Q_LEN, num_stages=2):
        tok = (tok0 + t).to(tl.int64)
        commit = commit_d == t + 1  # [D]: this token's state (and taps) are the committed ones
        qc, kc, vc, taps_q, taps_k, taps_v = _token_conv(cs_base, stride_cs_w, q_ptr, stride_q, k_ptr, stride_k, v_ptr,
                                                         stride_v, tok0, t, ch, ok, commit, taps_q, taps_k, taps_v,
                                                         cw_q, cw_k, cw_v, HD, W, WP)
        qn = qc * _norm_scale(qc, D, True, 0)
        kn = kc * _norm_scale(kc, D, False, 0)

        if Q_LEN == 1:
            g_raw, beta = g_first, beta_first
        else:
            g_raw, beta = _gates(fa_ptr, stride_fa, beta_ptr, stride_beta, tok, h, fbw_ptr, stride_fbw, ch, D, F, FB,
                                 GRAW)
        decay = _decay(lower_bound, a, g_raw, dtb)

        S = S * decay[None, :]
        pred = tl.sum(S * kn[None, :], axis=1)
        u = beta * (vc - pred)
        S = S + u[:, None] * kn[None, :]
        o = tl.sum(S * qn[None, :], axis=1)
        # Commit the state as of `accepted` tokens: exactly one token's store is live. The
        # address is rebuilt from a fresh load of the slot (after a store, so not CSE'd with the
        # first one) so that 64-bit pointers of the whole tile do not stay live in registers.
        # The output gate's loads go before the state store (a load after a store cannot be moved above it).
        gate = _sigmoid(tl.load(g_ptr + tok * stride_g + ch).to(tl.float32))
        onw = tl.load(onw_ptr + offs).to(tl.float32)
        slot_s = tl.maximum(tl.load(idx_ptr + b).to(tl.int64), 0)
        st_out = st_ptr + slot_s * stride_st_s + h * stride_st_h + offs[:, None] * ST_V + offs[None, :] * ST_K
        tl.store(st_out, S, mask=st_mask & commit[None, :])

        y = _gated_norm(o, tl.sum(o * o, axis=0), onw, gate, ok_d, D, norm_eps)
        tl.store(out_ptr + tok * stride_out + ch, y.to(out_ptr.dtype.element_ty))

    # Every conv-state read of this program is done before its taps are overwritten. accepted = 0
    # commits no token: both states stay as they were (as the reference; counts above Q_LEN are
    # outside the contract and leave them too).
    tl.debug_barrier()
    _store_new_taps(cs_base, stride_cs_w, taps_q, taps_k, taps_v, ch, ok_d & (commit_d >= 1) & (commit_d <= Q_LEN),
                    HD, W, WP)


@triton.jit
def _prep_conv(cs_base, stride_cs_w, x_ptr, stride_x, cw_ptr, stride_cw_c, stride_cw_w, tok0, t, ch, live,
               W: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Conv + SiLU of ``R`` rows (each a request's token ``t``, its window read from the request's conv state rows
    ``cs_base`` and tokens ``x[tok0:]``) for channels ``ch``, rounded to BF16, as FP32 ``[R, D]``."""
    y = tl.zeros([R, D], tl.float32)
    for w in tl.static_range(W):
        p = t + w  # [R]: the tap's position in cat(conv_state[0:W-1], x[tok0:])
        in_state = p < W - 1
        s = tl.load(cs_base[:, None] + tl.minimum(p, W - 2).to(tl.int64)[:, None] * stride_cs_w + ch[None, :],
                    mask=(live & in_state)[:, None], other=0.0)
        xrow = tl.maximum(tok0 + p - (W - 1), 0).to(tl.int64)
        x = tl.load(x_ptr + xrow[:, None] * stride_x + ch[None, :], mask=(live & (p >= W - 1))[:, None], other=0.0)
        cw = tl.load(cw_ptr + ch * stride_cw_c + w * stride_cw_w).to(tl.float32)
        y += tl.where(in_state[:, None], s.to(tl.float32), x.to(tl.float32)) * cw[None, :]
    y = y / (1.0 + tl.exp(-y))
    return y.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _prep_taps(cs_ptr, stride_cs_s, stride_cs_w, x_ptr, stride_x, idx_ptr, acc_ptr, b0, ch, B,
               W: tl.constexpr, WP: tl.constexpr, RB: tl.constexpr, Q_LEN: tl.constexpr):
    """The new conv state of requests ``b0 .. b0+RB-1`` for channels ``ch``: each committed token's window rows
    1 .. W-1 (positions ``accepted .. accepted+W-2`` of cat(conv_state, x)), loaded, then stored over the old
    taps once every thread of the program has read them (a request whose ``accepted`` is 0 keeps its taps)."""
    r = tl.arange(0, RB * WP)
    b = b0 + r // WP
    j = r % WP  # the new state's row
    slot = tl.load(idx_ptr + b, mask=b < B, other=-1).to(tl.int64)
    acc = tl.load(acc_ptr + b, mask=b < B, other=0).to(tl.int32)
    keep = (j < W - 1) & (slot >= 0) & (acc >= 1) & (acc <= Q_LEN)
    p = acc + j
    base = cs_ptr + tl.maximum(slot, 0) * stride_cs_s
    s = tl.load(base[:, None] + tl.minimum(p, W - 2).to(tl.int64)[:, None] * stride_cs_w + ch[None, :],
                mask=(keep & (p < W - 1))[:, None], other=0.0)
    xrow = tl.maximum(b.to(tl.int64) * Q_LEN + p - (W - 1), 0)
    x = tl.load(x_ptr + xrow[:, None] * stride_x + ch[None, :], mask=(keep & (p >= W - 1))[:, None], other=0.0)
    taps = tl.where((p < W - 1)[:, None], s, x.to(s.dtype))
    tl.debug_barrier()
    tl.store(base[:, None] + j.to(tl.int64)[:, None] * stride_cs_w + ch[None, :], taps, mask=keep[:, None])


@triton.jit
def _kda_prep_kernel(
    q_ptr, k_ptr, v_ptr, fa_ptr, beta_ptr, fbw_ptr, cw_ptr, alog_ptr, dtb_ptr, cs_ptr, idx_ptr, acc_ptr,
    xs_ptr, dec_ptr, sc_ptr, B,
    stride_q, stride_k, stride_v, stride_fa, stride_beta, stride_fbw, stride_cw_c, stride_cw_w,
    stride_cs_s, stride_cs_w, lower_bound,
    H: tl.constexpr, D: tl.constexpr, F: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, Q_LEN: tl.constexpr,
    QP: tl.constexpr, RB: tl.constexpr, GRAW: tl.constexpr, F32: tl.constexpr,
):
    """The split form's first launch, one program per (``RB`` requests, head): the fused kernel's steps 1-3 for every
    token of them at once (conv + SiLU, norms, the F_B gate as one product of their ``RB x QP`` rows, beta) into
    the workspace, then the new conv taps (the state math is ``_kda_state_kernel``'s)."""
    pid = tl.program_id(0)
    b0 = (pid // H) * RB
    h = pid % H
    HD: tl.constexpr = H * D
    R: tl.constexpr = RB * QP
    offs = tl.arange(0, D)
    ch = h * D + offs
    r = tl.arange(0, R)
    b = b0 + r // QP
    t = r % QP
    valid = (t < Q_LEN) & (b < B)  # [R]: a token of a request (rows past q_len or B pad the tile)
    tok = b.to(tl.int64) * Q_LEN + t
    tok0 = b.to(tl.int64) * Q_LEN
    slot = tl.load(idx_ptr + b, mask=b < B, other=-1).to(tl.int64)
    live = valid & (slot >= 0)
    cs_base = cs_ptr + tl.maximum(slot, 0) * stride_cs_s  # [R] pointers
    qc = _prep_conv(cs_base, stride_cs_w, q_ptr, stride_q, cw_ptr, stride_cw_c, stride_cw_w, tok0, t, ch, live,
                    W, D, R)
    kc = _prep_conv(cs_base + HD, stride_cs_w, k_ptr, stride_k, cw_ptr + HD * stride_cw_c, stride_cw_c, stride_cw_w,
                    tok0, t, ch, live, W, D, R)
    vc = _prep_conv(cs_base + 2 * HD, stride_cs_w, v_ptr, stride_v, cw_ptr + 2 * HD * stride_cw_c, stride_cw_c,
                    stride_cw_w, tok0, t, ch, live, W, D, R)
    if GRAW:
        g_raw = tl.load(fa_ptr + tok[:, None] * stride_fa + ch[None, :], mask=valid[:, None], other=0.0)
    else:  # F_B: [R, F] @ [F, D], FP32 accumulation, rounded to BF16 as the reference's F.linear
        f = tl.arange(0, F)
        fa = tl.load(fa_ptr + tok[:, None] * stride_fa + f[None, :], mask=valid[:, None], other=0.0)
        fbw = tl.load(fbw_ptr + ch.to(tl.int64)[None, :] * stride_fbw + f[:, None])  # [F, D]
        g_raw = dot_fp32_acc(fa, fbw, F32).to(tl.bfloat16)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + ch).to(tl.float32)
    decay = _decay(lower_bound, a, g_raw.to(tl.float32), dtb[None, :])
    beta = _sigmoid(tl.load(beta_ptr + tok * stride_beta + h, mask=valid, other=0.0).to(tl.float32))
    q_scale = _norm_scale(qc, D, True, 1)  # [R]
    k_scale = _norm_scale(kc, D, False, 1)
    th = tok * H + h  # [R]: the workspace rows of (token, head)
    m = valid[:, None]
    xs = xs_ptr + th[:, None] * (3 * D) + offs[None, :]  # q, k, v conv outputs: BF16 values, stored exactly
    tl.store(xs, qc.to(tl.bfloat16), mask=m)
    tl.store(xs + D, kc.to(tl.bfloat16), mask=m)
    tl.store(xs + 2 * D, vc.to(tl.bfloat16), mask=m)
    tl.store(dec_ptr + th[:, None] * D + offs[None, :], decay, mask=m)
    r4 = tl.arange(0, 4)[None, :]  # q's and k's norm factors, beta (a 16-byte row)
    tl.store(sc_ptr + th[:, None] * 4 + r4,
             tl.where(r4 == 0, q_scale[:, None], tl.where(r4 == 1, k_scale[:, None], beta[:, None])),
             mask=m & (r4 < 3))
    # Every conv-state read above is done before a group's taps are overwritten (the barrier in _prep_taps); a
    # group reads and writes only its own channels.
    _prep_taps(cs_ptr, stride_cs_s, stride_cs_w, q_ptr, stride_q, idx_ptr, acc_ptr, b0, ch, B, W, WP, RB, Q_LEN)
    _prep_taps(cs_ptr + HD, stride_cs_s, stride_cs_w, k_ptr, stride_k, idx_ptr, acc_ptr, b0, ch, B, W, WP, RB, Q_LEN)
    _prep_taps(cs_ptr + 2 * HD, stride_cs_s, stride_cs_w, v_ptr, stride_v, idx_ptr, acc_ptr, b0, ch, B, W, WP, RB,
               Q_LEN)


@triton.jit
def _kda_state_kernel(
    xs_ptr, dec_ptr, sc_ptr, st_ptr, idx_ptr, acc_ptr, ow_ptr, ss_ptr, stride_st_s, stride_st_h,
    H: tl.constexpr, D: tl.constexpr, Q_LEN: tl.constexpr, ST_V: tl.constexpr, ST_K: tl.constexpr,
    R: tl.constexpr,
):
    """The split form's second launch, R programs per (request, head), each over D / R of the state's rows: the
    delta rule over the workspace's inputs (the fused kernel's step 4); each token's output before its norm and
    its sum of squares over the program's rows go to ``ow`` / ``ss`` for :func:`_kda_norm_kernel`.

    The delta rule is row-wise (a row's prediction, update and output read only that row and the token's k / q), so
    a head's rows split without exchange: eight such programs fit an SM where two whole heads did, and an SM's state
    loads and token steps overlap across more of them (docs/perf.md, entry "The split KDA state launch over four row
    parts of a head").

    A program's rows are held as four [D / R, D / 4] column chunks. One [Dv, D] tile would put all 32 lanes of a
    warp along k (its contiguous axis), so each of the two reductions a token (over k) would cross 32 lanes for
    every row a thread holds; a chunk spreads a warp over 4 rows x 8 column groups (both Triton 3.6 and 3.9 choose
    that for a 2-D tile), the chunks' products are summed in registers and each reduction crosses 8 lanes once."""
    pid = tl.program_id(0)
    part = pid % R
    b = pid // (H * R)
    h = (pid // R) % H
    C: tl.constexpr = D // 4
    DR: tl.constexpr = D // R
    rows = part * DR + tl.arange(0, DR)  # v: this program's rows of the state
    cols = tl.arange(0, C)  # k within a chunk
    slot = tl.load(idx_ptr + b).to(tl.int64)
    acc = tl.load(acc_ptr + b).to(tl.int32)
    ok_d = (tl.zeros([DR], tl.int64) + slot) >= 0
    live = ok_d[:, None] & (cols[None, :] < C)
    st = st_ptr + tl.maximum(slot, 0) * stride_st_s + h * stride_st_h + rows[:, None] * ST_V + cols[None, :] * ST_K
    S0 = tl.load(st, mask=live, other=0.0)
    S1 = tl.load(st + C * ST_K, mask=live, other=0.0)
    S2 = tl.load(st + 2 * C * ST_K, mask=live, other=0.0)
    S3 = tl.load(st + 3 * C * ST_K, mask=live, other=0.0)
    tok0 = b * Q_LEN
    for t in tl.range(Q_LEN, num_stages=1):
        tok = (tok0 + t).to(tl.int64)
        th = tok * H + h
        xq = xs_ptr + th * (3 * D) + cols  # chunk 0 of q; k at + D, v at + 2D
        dp = dec_ptr + th * D + cols
        q_scale = tl.load(sc_ptr + th * 4)
        k_scale = tl.load(sc_ptr + th * 4 + 1)
        beta = tl.load(sc_ptr + th * 4 + 2)
        vc = tl.load(xs_ptr + th * (3 * D) + 2 * D + rows).to(tl.float32)
        k0 = tl.load(xq + D).to(tl.float32) * k_scale
        k1 = tl.load(xq + D + C).to(tl.float32) * k_scale
        k2 = tl.load(xq + D + 2 * C).to(tl.float32) * k_scale
        k3 = tl.load(xq + D + 3 * C).to(tl.float32) * k_scale
        S0 = S0 * tl.load(dp)[None, :]
        S1 = S1 * tl.load(dp + C)[None, :]
        S2 = S2 * tl.load(dp + 2 * C)[None, :]
        S3 = S3 * tl.load(dp + 3 * C)[None, :]
        pred = tl.sum(S0 * k0[None, :] + S1 * k1[None, :] + S2 * k2[None, :] + S3 * k3[None, :], axis=1)
        u = beta * (vc - pred)
        S0 = S0 + u[:, None] * k0[None, :]
        S1 = S1 + u[:, None] * k1[None, :]
        S2 = S2 + u[:, None] * k2[None, :]
        S3 = S3 + u[:, None] * k3[None, :]
        q0 = tl.load(xq).to(tl.float32) * q_scale
        q1 = tl.load(xq + C).to(tl.float32) * q_scale
        q2 = tl.load(xq + 2 * C).to(tl.float32) * q_scale
        q3 = tl.load(xq + 3 * C).to(tl.float32) * q_scale
        o = tl.sum(S0 * q0[None, :] + S1 * q1[None, :] + S2 * q2[None, :] + S3 * q3[None, :], axis=1)
        # The state as of `accepted` tokens, stored once (see the fused kernel); the address from a fresh slot load.
        commit = live & ((tl.zeros([DR, C], tl.int32) + acc) == t + 1)
        so = (st_ptr + tl.maximum(tl.load(idx_ptr + b).to(tl.int64), 0) * stride_st_s + h * stride_st_h
              + rows[:, None] * ST_V + cols[None, :] * ST_K)
        tl.store(so, S0, mask=commit)
        tl.store(so + C * ST_K, S1, mask=commit)
        tl.store(so + 2 * C * ST_K, S2, mask=commit)
        tl.store(so + 3 * C * ST_K, S3, mask=commit)
        tl.store(ow_ptr + th * D + rows, o)
        tl.store(ss_ptr + th * R + part, tl.sum(o * o, axis=0))


@triton.jit
def _kda_norm_kernel(ow_ptr, ss_ptr, g_ptr, onw_ptr, idx_ptr, out_ptr, stride_g, stride_out, norm_eps,
                     H: tl.constexpr, D: tl.constexpr, Q_LEN: tl.constexpr, R: tl.constexpr):
    """The split form's third launch, one program per (token, head): the gated RMSNorm over the state launch's
    outputs and row parts' sums of squares (the fused kernel's step 5)."""
    pid = tl.program_id(0)
    tok = (pid // H).to(tl.int64)
    h = pid % H
    th = tok * H + h
    rows = tl.arange(0, D)
    o = tl.load(ow_ptr + th * D + rows)
    ss = tl.sum(tl.load(ss_ptr + th * R + tl.arange(0, R)), axis=0)
    gate = _sigmoid(tl.load(g_ptr + tok * stride_g + h * D + rows).to(tl.float32))
    onw = tl.load(onw_ptr + rows).to(tl.float32)
    slot = tl.load(idx_ptr + tok // Q_LEN)
    y = _gated_norm(o, ss, onw, gate, (tl.zeros([D], tl.int32) + slot) >= 0, D, norm_eps)
    tl.store(out_ptr + tok * stride_out + h * D + rows, y.to(out_ptr.dtype.element_ty))


SPLIT_MAX_F_RANK = 256  # the prep launch's whole-F product: 72 KB of shared memory at 256 on SM90 (K3: 128)


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def split_unsupported(head_dim: int, f_rank: int | None) -> str | None:
    """Why the split form cannot run heads of ``head_dim`` with an F_B of rank ``f_rank`` (None: the raw gate, F_B
    applied outside) (None: it can): the state launch holds a quarter of the state's rows in 2 warps at 128
    registers (64 state values a thread at D = 128); the prep launch's F_B is one tensor-core product (each side 16
    or more, the rank at most ``SPLIT_MAX_F_RANK``)."""
    if not 16 <= head_dim <= 128:
        return f"head dim {head_dim} not in 16..128 (the split form: D^2 / 4 state values in 2 warps; an MMA's N)"
    if f_rank is not None and f_rank < 16:
        return f"f rank {f_rank} under 16 (the split form's F_B product: an MMA's K)"
    if f_rank is not None and f_rank > SPLIT_MAX_F_RANK:
        return (f"f rank {f_rank} over {SPLIT_MAX_F_RANK} (the prep launch holds all of f_a and F_B's weight for one "
                "product: 72 KB of shared memory at 256, past an SM's 227 KB at 1024)")
    return None


def kda_decode_unsupported(q, k, v, f_a, f_b_w, beta, g_out, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                           rec_state, state_indices, accepted, q_len: int) -> str | None:
    """Why :func:`kda_decode_core` cannot run this call (None: it can). Shapes/strides only, no sync."""
    if not q.is_cuda and not _INTERPRET:
        return "not on CUDA"
    if not 1 <= q_len <= MAX_Q_LEN:
        return f"q_len {q_len} not in 1..{MAX_Q_LEN} (the state stays in registers across tokens)"
    T, HD = q.shape
    H = beta.shape[-1]
    if H == 0 or HD % H or T % q_len:
        return "inconsistent shapes"
    D = HD // H
    F = f_a.shape[-1] if f_b_w is not None else 1  # f_b_w None: f_a is the raw gate [T, HD]
    W = conv_w.shape[-1]
    if not (_pow2(D) and _pow2(F)):
        return f"head dim {D} / f rank {F} not powers of two"
    if not 2 <= W <= 8:
        return f"conv width {W} unsupported"
    if tuple(rec_state.shape[1:]) != (H, D, D) or rec_state.dtype != torch.float32:
        return "recurrent state not [S, H, D, D] fp32"
    if tuple(conv_state.shape[1:]) != (W - 1, 3 * HD) or conv_state.stride(2) != 1:
        return "conv state not [S, W-1, 3HD] with unit channel stride"
    if f_b_w is not None and (tuple(f_b_w.shape) != (HD, F) or f_b_w.stride(1) != 1):
        return "f_b_w not [HD, F] with unit inner stride"
    if f_b_w is None and tuple(f_a.shape) != (T, HD):
        return "the raw gate (f_a without f_b_w) not [T, HD]"
    for name, t in (("q", q), ("k", k), ("v", v), ("g_out", g_out)):
        if tuple(t.shape) != (T, HD) or t.stride(1) != 1:
            return f"{name} not [T, HD] with unit inner stride"
    if f_a.shape[0] != T or f_a.stride(1) != 1 or beta.shape[0] != T or beta.stride(1) != 1:
        return "f_a / beta not [T, .] with unit inner stride"
    if not (A_log.is_contiguous() and dt_bias.is_contiguous() and o_norm_w.is_contiguous()):
        return "A_log / dt_bias / o_norm_w not contiguous"
    if state_indices.shape[0] * q_len != T or accepted.shape[0] * q_len != T:
        return "state_indices / accepted not [B]"
    if state_indices.stride(0) != 1 or accepted.stride(0) != 1:
        return "state_indices / accepted not contiguous"
    return None


def kda_decode_core(q, k, v, f_a, f_b_w, beta, g_out, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
                    state_indices, accepted, q_len: int, lower_bound: float, norm_eps: float, *,
                    num_warps: int = 4, fb: int = 32, maxnreg: int | None = None,
                    out: torch.Tensor | None = None, split: bool = False) -> torch.Tensor:
    """The KDA core of one decode / verify step (one launch; three with ``split``); mutates both states.

    Arguments in :class:`PreparedKda.core` order (shapes in the module docstring):
    q, k, v [T, H*D] bf16; f_a [T, F] bf16; f_b_w [H*D, F] bf16 (or None: f_a is the raw gate [T, H*D] bf16,
    F_B applied outside); beta [T, H] logits;
    g_out [T, H*D] bf16; conv_w [3*H*D, W]; A_log [H] fp32; dt_bias [H*D] fp32; o_norm_w [D];
    conv_state [S, W-1, 3*H*D] bf16; rec_state [S, H, D, D] fp32 (value-major);
    state_indices [B] (-1 = padding); accepted [B] in 0..q_len. Returns [T, H*D] bf16
    (``out`` if given, else a new tensor; every element written; ``out`` must not overlap the
    inputs: verify steps prefetch the next token's inputs after this token's output is stored).

    Tuning (measured on the H200, docs/perf_kda.md): ``num_warps`` per program (4 is 1.2-1.8x
    faster than 8; the head's 128 x 128 FP32 state is then 128 registers a thread); ``fb``
    columns of ``f_b_w`` per step of the F_B mat-vec, a power of two (32: 1-3 % faster than
    64 at decode, 1-64 requests, on Triton 3.6; verify steps too);
    ``maxnreg`` an optional register cap (more programs per SM, at the price of spills). The output taken
    before the update (``S q + u (k . q)``) was 1.29-1.35x slower at q = 4 (docs/perf_kda.md) and is gone.

    ``split``: three launches instead of one. ``_kda_prep_kernel`` computes every token's conv outputs, norm
    factors, decay and beta into a workspace (``T x H x (3 x D BF16 + 2 x D FP32 + 8 FP32)`` with the state launch's
    outputs, allocated here), a program a head of ``PREP_ROWS`` token rows with F_B as one tensor-core product
    (``f_b_w`` read once a program, not once a token), and writes the conv taps; ``_kda_state_kernel`` runs the
    delta rule from it, four programs a (request, head) over a quarter of the state's rows each, 2 warps at 128
    registers (eight programs an SM, against the fused kernel's two programs of 4 warps at 255), its token loop ~550
    SM90 instructions a warp against the fused loop's ~2600 (``benchmarks/sass_mix.py kda_state``);
    ``_kda_norm_kernel`` then applies the gated RMSNorm from the row parts' sums of squares. Same arithmetic, other
    FP32 summation orders; ``num_warps``, ``fb`` and ``maxnreg`` apply to the fused kernel only (the split form's
    launches have their own). ``split`` needs :func:`split_unsupported` to be None. Built for verify steps, where
    the fused kernel's token loop is ~3.3x the state traffic at 64 x q = 4; ``tactics.KDA_SPLIT_FROM_Q`` picks it
    where the H200 measured it faster (its comment and docs/perf.md give the numbers).
    """
    T, HD = q.shape
    H = beta.shape[-1]
    D = HD // H
    graw = f_b_w is None
    F = 1 if graw else f_a.shape[-1]
    W = conv_w.shape[-1]
    B = T // q_len
    if out is None:
        out = torch.empty(T, HD, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if split:
        why = split_unsupported(D, None if graw else F)
        if why is not None:
            raise ValueError(f"the split KDA core: {why}")
        _kda_split(q, k, v, f_a, f_b_w, beta, g_out, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
                   state_indices, accepted, q_len, lower_bound, norm_eps, out, B=B, H=H, D=D, F=F, W=W)
        return out
    _kda_decode_kernel[(B * H,)](
        q, k, v, g_out, f_a, beta,
        f_a if graw else f_b_w, conv_w, A_log, dt_bias, o_norm_w,
        conv_state, rec_state, state_indices, accepted, out,
        q.stride(0), k.stride(0), v.stride(0), g_out.stride(0), f_a.stride(0), beta.stride(0),
        0 if graw else f_b_w.stride(0), conv_w.stride(0), conv_w.stride(1),
        conv_state.stride(0), conv_state.stride(1),
        rec_state.stride(0), rec_state.stride(1),
        out.stride(0),
        float(lower_bound), float(norm_eps),
        H=H, D=D, F=F, W=W, WP=triton.next_power_of_2(W), Q_LEN=int(q_len),
        ST_V=rec_state.stride(2), ST_K=rec_state.stride(3), FB=min(F, fb), GRAW=graw,
        num_warps=num_warps,
        **({"maxnreg": int(maxnreg)} if maxnreg else {}),
    )
    return out


def prep_requests(q_len: int) -> int:
    """Requests a program of the split form's prep launch: whole requests of ``next_pow2(q_len)`` rows in
    ``PREP_ROWS``."""
    return max(1, PREP_ROWS // triton.next_power_of_2(q_len))


def _kda_split(q, k, v, f_a, f_b_w, beta, g_out, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
               state_indices, accepted, q_len: int, lower_bound: float, norm_eps: float, out: torch.Tensor, *,
               B: int, H: int, D: int, F: int, W: int) -> None:
    """``kda_decode_core(split=True)`` for ``B`` requests (sizes as it derived them): the prep launch into a fresh
    workspace, the state launch, then the norm launch."""
    T = B * q_len
    graw = f_b_w is None
    xs = torch.empty(T, H, 3, D, dtype=torch.bfloat16, device=q.device)  # q, k, v conv outputs
    dec = torch.empty(T, H, D, dtype=torch.float32, device=q.device)  # per-channel decay
    sc = torch.empty(T, H, 4, dtype=torch.float32, device=q.device)  # q / k norm factors, beta, (unused)
    rb = prep_requests(q_len)
    _kda_prep_kernel[(triton.cdiv(B, rb) * H,)](
        q, k, v, f_a, beta, f_a if graw else f_b_w, conv_w, A_log, dt_bias, conv_state, state_indices, accepted,
        xs, dec, sc, B,
        q.stride(0), k.stride(0), v.stride(0), f_a.stride(0), beta.stride(0), 0 if graw else f_b_w.stride(0),
        conv_w.stride(0), conv_w.stride(1), conv_state.stride(0), conv_state.stride(1), float(lower_bound),
        H=H, D=D, F=F, W=W, WP=triton.next_power_of_2(W), Q_LEN=int(q_len), QP=triton.next_power_of_2(q_len), RB=rb,
        GRAW=graw, F32=_INTERPRET, num_warps=4,
    )
    R = STATE_ROW_PARTS
    ow = torch.empty(T, H, D, dtype=torch.float32, device=q.device)  # o before its norm
    ss = torch.empty(T, H, R, dtype=torch.float32, device=q.device)  # o's sum of squares, one a row part
    _kda_state_kernel[(B * H * R,)](
        xs, dec, sc, rec_state, state_indices, accepted, ow, ss, rec_state.stride(0), rec_state.stride(1),
        H=H, D=D, Q_LEN=int(q_len), ST_V=rec_state.stride(2), ST_K=rec_state.stride(3), R=R,
        **STATE_LAUNCH,
    )
    _kda_norm_kernel[(T * H,)](ow, ss, g_out, o_norm_w, state_indices, out, g_out.stride(0), out.stride(0),
                               float(norm_eps), H=H, D=D, Q_LEN=int(q_len), R=R, num_warps=1)
