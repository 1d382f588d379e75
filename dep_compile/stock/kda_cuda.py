"""The stock KDA core on CUDA: a Triton conv step, fla-core's fused recurrent KDA, a Triton gated RMSNorm.

:func:`kda_core_cuda` has the signature and the semantics of ``reference.kda.kda_core_ref``
(conv over q, k, v with the taps committed after ``accepted`` tokens, decay gate, L2 norms,
delta rule on the FP32 state committed after ``accepted`` tokens, gated RMSNorm; padding
requests, state index -1, touch no state and output 0), with no host sync, no
data-dependent shape and a fixed launch sequence, so it can be captured in a CUDA graph. It
is the fair stock baseline that the rewritten KDA core is measured against.

1. **Conv** (:func:`conv_step`, one Triton program per (request, channel block)): depthwise
   causal conv + SiLU of q, k and v in FP32, each output rounded to BF16 as the reference
   rounds it; the ``W-1`` taps after ``accepted`` tokens written back into the (strided,
   pooled) conv state. The same program lays the step out for the recurrence: q, k, v
   (after the conv), g_raw and beta rows in the *plain* layout (row ``b*q_len + t``, padding
   rows 0) and/or the *packed* layout (the ``accepted`` tokens of the live requests, back to
   back), the packed layout's ``cu_seqlens`` and a ``[B, q_len]`` table of state slots.
2. **Recurrence**, with fla-core where it imports (lazily; the project does not require it):

   * *commit pass*: ``fused_recurrent_kda_fwd`` over the packed layout, in place on the
     state pool (gate with lower bound, L2 norms, q scale ``D^-1/2``, beta sigmoid, all in
     the kernel; value-major FP32 state). Padding requests are zero-length sequences, which
     the kernel skips before it reads their slot; a live request runs exactly its
     ``accepted`` tokens, so the last state it stores into its slot is the committed one.
     For a decode step (``q_len`` = 1) this pass is the whole recurrence and gives the output.
   * *verify steps* (``q_len`` > 1) also need the outputs of the tokens after ``accepted``,
     which the commit pass does not run, and fla cannot stop committing part-way through a
     sequence. So the requests' states are first gathered into a scratch tensor
     (``index_select``, before the commit pass) and an *output pass* runs all ``q_len``
     tokens from it in fla's plain batched mode, which reads the initial state and stores
     none: every output comes from this pass, the committed state from the commit pass.
     State traffic per request: gather read + write, output pass read, commit pass
     read + write (2.5x a decode step's), whatever ``q_len``.

   Without fla: :func:`recurrence_torch`, the delta rule batched over requests in torch (one
   step per token, the committed state kept by a ``where`` on ``accepted``), from states
   gathered with ``index_select``; the committed states go back through a Triton scatter
   that skips padding slots. Exact to the contract, slower.
3. **Gated RMSNorm** (one Triton program per (token, head)): RMSNorm of the FP32 output over
   the head (eps ``norm_eps``) times ``o_norm_weight`` times ``sigmoid(g_out)``, rounded to
   BF16; it reads a decode step's outputs from their packed rows and writes 0 for padding.

A decode step is three launches (conv, fla, norm), a verify step five (+ the gather, + the
output pass). The layouts cost a copy of the step's activations (a few tens of KiB per token
at full size), small next to the 6 MiB state read and written per request.

Facts of fla-core 0.6.0 relied on (``fla/ops/kda/fused_recurrent.py``, line numbers):

* ``fused_recurrent_kda_fwd`` (236; the public ``fused_recurrent_kda``, 338, exposes neither
  state indices nor in-place states; ``@dispatch('kda')``, 235, keeps this Triton kernel on
  CUDA, the registered KDA backends being TileLang for a backward kernel and Ascend) takes ``q, k, g [1, T, H, K]`` (g raw), ``v [1, T, H, V]``,
  ``beta [1, T, H]`` logits (one per head since ``beta.ndim != v.ndim``, 323), contiguous
  (pointers are built from ``bos * H + i_h``, 105-114); ``A_log [H]``; ``dt_bias [H*K]``
  (read at ``i_hv * K + o_k``, 166); ``scale`` defaults to ``K^-1/2`` (260); ``out`` of
  ``v``'s shape in any dtype (FP32 here: no rounding before the norm, as in the reference).
* in the kernel: gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (162-170), L2
  norm ``x / sqrt(sum x^2 + 1e-6)`` (156-158), ``sigmoid(beta)`` (189-190), FP32 state;
  ``state_v_first`` is our value-major ``[V, K]`` state (140-141, 213-214).
* with ``ssm_state_indices`` (continuous batching) the initial state is read from slot
  ``indices[n, 0]`` at ``initial_state + slot * initial_state.stride(0)`` (128-139; with
  ``num_accepted_tokens`` from ``indices[n, accepted[n] - 1]``), and the state after *every*
  token ``t`` is stored to slot ``indices[n * indices.stride(0) + t]`` (202-217: the token
  stride is ignored, so a 2-D table must be contiguous, and 1-D indices are right only for
  one-token sequences). ``num_accepted_tokens`` picks where the *previous* step's state is
  read from (vLLM's one slot per draft token); nothing commits the state after ``accepted``
  tokens of the current step into one slot, hence the commit pass over exactly those tokens.
* negative indices are not checked anywhere: slot -1 would be read and written at
  ``pool - stride(0)``. A zero-length sequence returns before anything is read (99-100):
  padding requests are made zero-length, which is why the packed layout exists.
* without indices and with ``inplace_final_state=False, output_final_state=False`` the
  initial state of sequence ``n`` is ``initial_state[n]`` of a contiguous ``[N, H, V, K]``
  tensor and no state is stored (145-149, 226-232): the verify output pass.

Layouts accepted: q, k, v, g_raw, g_out ``[T, H*D]`` and beta ``[T, H]`` with any row stride
(column slices of one packed projection); ``conv_state [S, W-1, 3*H*D]`` BF16 with unit
channel stride; ``recurrent_state [S, H, D, D]`` FP32 with each slot contiguous (slot stride
free). Live requests have distinct slots, as in the reference's contract.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .paged_insert import insert_rows_triton
from .reference.common import l2_normalize
from .reference.kda import decay_gate

__all__ = ["ConvOut", "conv_step", "gated_rms_norm", "kda_core_cuda", "recurrence_backend", "recurrence_torch",
           "scatter_states"]

_FLA = None  # fla's fused_recurrent_kda_fwd once resolved; False where fla does not import
_FLA_ERROR = ""


def _fla_fwd():
    """fla-core's ``fused_recurrent_kda_fwd``, or None where fla does not import (resolved once)."""
    global _FLA, _FLA_ERROR
    if _FLA is None:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: PLC0415

            _FLA = fused_recurrent_kda_fwd
        except Exception as e:  # noqa: BLE001 - any import failure means "fla not present"
            _FLA, _FLA_ERROR = False, repr(e)
    return _FLA or None


def recurrence_backend() -> str:
    """Which recurrence :func:`kda_core_cuda` runs here: "fla" or "torch (why not fla)"."""
    return "fla" if _fla_fwd() is not None else f"torch ({_FLA_ERROR or 'fla disabled'})"


# ---------------------------------------------------------------------------------------------
# 1. conv step + layouts


@triton.jit
def _taps(cs, stride_cs_w, x_ptr, stride_x, tok0, p0, ch, cmask, slot,
          W: tl.constexpr, WP: tl.constexpr, N: tl.constexpr):
    """Rows ``p0 .. p0+N-1`` of ``cat(conv taps, new tokens)`` for channels ``ch``: FP32 [WP, BC], others 0."""
    r = tl.arange(0, WP)
    p = p0 + r
    in_state = p < W - 1
    ok = (r < N) & ((tl.zeros([WP], tl.int64) + slot) >= 0)  # tensor masks only (interpreter)
    st = tl.load(cs + tl.minimum(p, W - 2).to(tl.int64)[:, None] * stride_cs_w + ch[None, :],
                 mask=(ok & in_state)[:, None] & cmask[None, :], other=0.0)
    row = (tok0 + tl.maximum(p - (W - 1), 0)).to(tl.int64)
    x = tl.load(x_ptr + row[:, None] * stride_x + ch[None, :], mask=(ok & (p >= W - 1))[:, None] & cmask[None, :],
                other=0.0)
    return tl.where(in_state[:, None], st.to(tl.float32), x.to(tl.float32))


@triton.jit
def _emit(plain_ptr, packed_ptr, plane, row, prow, keep, ch, cmask, y, T, HD: tl.constexpr,
          PLAIN: tl.constexpr, PACKED: tl.constexpr):
    """Store a row ``y`` of ``plane`` (q, k, v, g) at plain row ``row`` and, if ``keep``, packed row ``prow``."""
    if PLAIN:
        tl.store(plain_ptr + (plane * T + row).to(tl.int64) * HD + ch, y, mask=cmask)
    if PACKED:
        tl.store(packed_ptr + (plane * T + prow).to(tl.int64) * HD + ch, y, mask=cmask & keep)


@triton.jit
def _conv_one(x_ptr, stride_x, cs, stride_cs_w, cw_ptr, stride_cw_c, stride_cw_w, plain_ptr, packed_ptr,
              plane, tok0, acc, n_prev, n_mine, ch, cmask, slot, T,
              HD: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, Q_LEN: tl.constexpr,
              PLAIN: tl.constexpr, PACKED: tl.constexpr):
    """Conv + SiLU of one of q, k, v (``plane``) for channels ``ch``: emit the outputs, commit the taps."""
    r = tl.arange(0, WP)
    cs = cs + plane * HD  # this plane's channels of the [W-1, 3*H*D] taps
    wch = (plane * HD + ch).to(tl.int64)
    w = tl.load(cw_ptr + wch[None, :] * stride_cw_c + r[:, None] * stride_cw_w,
                mask=(r < W)[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [WP, BC]
    for t in tl.static_range(Q_LEN):
        y = tl.sum(_taps(cs, stride_cs_w, x_ptr, stride_x, tok0, t, ch, cmask, slot, W, WP, W) * w, axis=0)
        y = (y / (1.0 + tl.exp(-y))).to(tl.bfloat16)  # padding: all taps 0, so y = 0
        keep = (tl.zeros_like(ch) + t) < n_mine
        _emit(plain_ptr, packed_ptr, plane, tok0 + t, n_prev + t, keep, ch, cmask, y, T, HD, PLAIN, PACKED)
    taps = _taps(cs, stride_cs_w, x_ptr, stride_x, tok0, acc, ch, cmask, slot, W, WP, W - 1)
    tl.debug_barrier()  # every read of the taps (any thread) is done before they are overwritten
    live = (tl.zeros([WP], tl.int64) + slot) >= 0
    tl.store(cs + r.to(tl.int64)[:, None] * stride_cs_w + ch[None, :], taps.to(cs.dtype.element_ty),
             mask=((r < W - 1) & live)[:, None] & cmask[None, :])


@triton.jit
def _conv_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cw_ptr, cs_ptr, idx_ptr, acc_ptr,
    plain_ptr, plain_beta_ptr, packed_ptr, packed_beta_ptr, cu_ptr, slots_ptr,
    stride_q, stride_k, stride_v, stride_g, stride_beta, stride_cw_c, stride_cw_w, stride_cs_s, stride_cs_w,
    B, T,
    H: tl.constexpr, HP: tl.constexpr, HD: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    Q_LEN: tl.constexpr, QP: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr,
    PLAIN: tl.constexpr, PACKED: tl.constexpr,
):
    """Program (request b, channel block cb): conv of q, k, v, g_raw copy; block 0 also beta, cu, slots."""
    b = tl.program_id(0)
    cb = tl.program_id(1)
    ch = cb * BC + tl.arange(0, BC)
    cmask = ch < HD
    slot = tl.load(idx_ptr + b).to(tl.int64)
    acc = tl.load(acc_ptr + b).to(tl.int32)
    # packed rows: the accepted tokens of live requests before b, then b's own (0 for padding)
    j = tl.arange(0, BP)
    before = j < b
    j_slot = tl.load(idx_ptr + j, mask=before, other=-1)
    j_acc = tl.load(acc_ptr + j, mask=before, other=0).to(tl.int32)
    n_prev = tl.sum(tl.where(j_slot >= 0, j_acc, 0), axis=0)
    n_mine = tl.where(slot >= 0, acc, 0)
    tok0 = b * Q_LEN
    cs = cs_ptr + tl.maximum(slot, 0) * stride_cs_s
    _conv_one(q_ptr, stride_q, cs, stride_cs_w, cw_ptr, stride_cw_c, stride_cw_w, plain_ptr, packed_ptr,
              0, tok0, acc, n_prev, n_mine, ch, cmask, slot, T, HD, W, WP, Q_LEN, PLAIN, PACKED)
    _conv_one(k_ptr, stride_k, cs, stride_cs_w, cw_ptr, stride_cw_c, stride_cw_w, plain_ptr, packed_ptr,
              1, tok0, acc, n_prev, n_mine, ch, cmask, slot, T, HD, W, WP, Q_LEN, PLAIN, PACKED)
    _conv_one(v_ptr, stride_v, cs, stride_cs_w, cw_ptr, stride_cw_c, stride_cw_w, plain_ptr, packed_ptr,
              2, tok0, acc, n_prev, n_mine, ch, cmask, slot, T, HD, W, WP, Q_LEN, PLAIN, PACKED)
    live_c = (tl.zeros_like(ch) + slot) >= 0
    for t in tl.static_range(Q_LEN):  # g_raw rows, copied
        g = tl.load(g_ptr + (tok0 + t).to(tl.int64) * stride_g + ch, mask=cmask & live_c, other=0.0)
        keep = (tl.zeros_like(ch) + t) < n_mine
        _emit(plain_ptr, packed_ptr, 3, tok0 + t, n_prev + t, keep, ch, cmask, g, T, HD, PLAIN, PACKED)
    if cb == 0:  # per-request metadata and beta rows
        e = tl.arange(0, 2)
        last = (tl.zeros([2], tl.int32) + b) == B - 1
        tl.store(cu_ptr + b + e, n_prev + e * n_mine, mask=(e == 0) | last)  # cu[b] (and cu[B])
        tq = tl.arange(0, QP)
        slot_q = tl.zeros([QP], tl.int64) + tl.maximum(slot, 0)
        tl.store(slots_ptr + b * Q_LEN + tq, slot_q.to(tl.int32), mask=tq < Q_LEN)
        hh = tl.arange(0, HP)
        live_h = (tl.zeros([HP], tl.int64) + slot) >= 0
        for t in tl.static_range(Q_LEN):
            bt = tl.load(beta_ptr + (tok0 + t).to(tl.int64) * stride_beta + hh, mask=(hh < H) & live_h, other=0.0)
            if PLAIN:
                tl.store(plain_beta_ptr + (tok0 + t) * H + hh, bt, mask=hh < H)
            if PACKED:
                keep_h = (tl.zeros([HP], tl.int32) + t) < n_mine
                tl.store(packed_beta_ptr + (n_prev + t) * H + hh, bt, mask=(hh < H) & keep_h)


class ConvOut(NamedTuple):
    """What :func:`conv_step` lays out (a layout not asked for is None).

    plain: [4, T, H*D] bf16 planes q, k, v (after the conv), g_raw, row ``b*q_len + t``, padding 0;
    plain_beta: [T, H]; packed, packed_beta: the same for the accepted tokens of live requests,
    back to back (rows past ``cu[B]`` unwritten); cu: [B+1] int32 packed start of each
    request; slots: [B, q_len] int32 the request's state slot (padding: 0) repeated, fla's index
    table (padding requests have no packed tokens, so fla never reads theirs).
    """

    plain: torch.Tensor | None
    plain_beta: torch.Tensor | None
    packed: torch.Tensor | None
    packed_beta: torch.Tensor | None
    cu: torch.Tensor
    slots: torch.Tensor


def conv_step(q, k, v, g_raw, beta, conv_weight, conv_state, state_indices, accepted, q_len: int, *,
              plain: bool = True, packed: bool = False, block: int = 256, num_warps: int = 4) -> ConvOut:
    """Causal conv step of q, k, v (mutates ``conv_state``) and the recurrence's input layouts.

    q, k, v, g_raw: [T, H*D] bf16 (unit inner stride); beta: [T, H]; conv_weight: [3*H*D, W];
    conv_state: [S, W-1, 3*H*D] bf16 (unit channel stride); state_indices, accepted: [B].
    """
    T, HD = q.shape
    H = beta.shape[1]
    W = conv_weight.shape[1]
    B = T // q_len
    dev = q.device
    empty = lambda *s, dtype=q.dtype: torch.empty(*s, dtype=dtype, device=dev)  # noqa: E731
    out = ConvOut(
        plain=empty(4, T, HD) if plain else None, plain_beta=empty(T, H, dtype=beta.dtype) if plain else None,
        packed=empty(4, T, HD) if packed else None, packed_beta=empty(T, H, dtype=beta.dtype) if packed else None,
        cu=empty(B + 1, dtype=torch.int32), slots=empty(B, q_len, dtype=torch.int32),
    )
    bc = min(block, triton.next_power_of_2(HD))
    _conv_kernel[(B, triton.cdiv(HD, bc))](
        q, k, v, g_raw, beta, conv_weight, conv_state, state_indices, accepted,
        out.plain, out.plain_beta, out.packed, out.packed_beta, out.cu, out.slots,
        q.stride(0), k.stride(0), v.stride(0), g_raw.stride(0), beta.stride(0),
        conv_weight.stride(0), conv_weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        B, T,
        H=H, HP=triton.next_power_of_2(H), HD=HD, W=W, WP=triton.next_power_of_2(W),
        Q_LEN=q_len, QP=triton.next_power_of_2(q_len), BC=bc, BP=triton.next_power_of_2(B),
        PLAIN=plain, PACKED=packed, num_warps=num_warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# 2. recurrence


def _fla_call(fla, planes, beta, A_log, dt_bias, state, lower_bound, out, **kw):
    """One fla fused recurrent KDA launch over ``planes`` [4, N, L, H, D] (q, k, v, g) into ``out`` (FP32)."""
    fla(q=planes[0], k=planes[1], v=planes[2], g=planes[3], beta=beta, A_log=A_log, dt_bias=dt_bias,
        initial_state=state, state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, out=out, **kw)


def _recurrence_fla(fla, c: ConvOut, A_log, dt_bias, rec_state, q_len, H, D, lower_bound):
    """fla commit pass (+ output pass for verify); returns (o FP32 [T, H*D], whether its rows are packed)."""
    B = c.slots.shape[0]
    T = B * q_len
    f32 = dict(dtype=torch.float32, device=rec_state.device)
    if q_len > 1:  # verify: outputs from all q_len tokens on a scratch copy of the states
        scratch = rec_state.index_select(0, c.slots[:, 0])  # [B, H, D, D] FP32
        o = torch.empty(B, q_len, H, D, **f32)
        _fla_call(fla, c.plain.view(4, B, q_len, H, D), c.plain_beta.view(B, q_len, H), A_log, dt_bias, scratch,
                  lower_bound, o, inplace_final_state=False, output_final_state=False)
    o_commit = torch.empty(1, T, H, D, **f32)
    _fla_call(fla, c.packed.view(4, 1, T, H, D), c.packed_beta.view(1, T, H), A_log, dt_bias, rec_state,
              lower_bound, o_commit, inplace_final_state=True, cu_seqlens=c.cu, ssm_state_indices=c.slots)
    return (o, False) if q_len > 1 else (o_commit, True)


def recurrence_torch(q, k, v, g, beta, A_log, dt_bias, state, accepted, lower_bound: float):
    """The delta rule of B requests at once in torch (FP32), the state committed after ``accepted`` tokens.

    q, k, v, g: [B, L, H, D] (q, k, v after the conv; g raw); beta: [B, L, H] logits;
    state: [B, H, Dv, Dk] FP32 (not mutated); accepted: [B]. Returns (o [B, L, H, Dv] FP32,
    the committed states [B, H, Dv, Dk]).
    """
    qn = l2_normalize(q) * q.shape[-1] ** -0.5
    kn = l2_normalize(k)
    decay = torch.exp(decay_gate(g, A_log, dt_bias, lower_bound))  # [B, L, H, Dk]
    b = torch.sigmoid(beta.float())
    S = committed = state.float()
    outs = []
    for t in range(q.shape[1]):
        S = S * decay[:, t].unsqueeze(2)
        pred = torch.einsum("bhvk,bhk->bhv", S, kn[:, t])
        S = S + b[:, t, :, None, None] * torch.einsum("bhv,bhk->bhvk", v[:, t].float() - pred, kn[:, t])
        outs.append(torch.einsum("bhvk,bhk->bhv", S, qn[:, t]))
        committed = torch.where((accepted == t + 1).view(-1, 1, 1, 1), S, committed)
    return torch.stack(outs, 1), committed


def scatter_states(rec_state, states, state_indices, block: int = 4096):
    """``rec_state[state_indices[b]] = states[b]`` for every b with a slot >= 0 (padding skipped, no sync).

    rec_state: [S, H, Dv, Dk] with each slot contiguous, written as a paged cache of one-row blocks.
    """
    insert_rows_triton(rec_state.flatten(1).unsqueeze(1), state_indices, states.reshape(states.shape[0], -1),
                       block=block)


def _recurrence_torch_step(c: ConvOut, A_log, dt_bias, rec_state, state_indices, accepted, q_len, H, D,
                           lower_bound):
    """Torch recurrence on gathered states, committed states scattered back; returns (o FP32 [T, H*D], False)."""
    B = c.slots.shape[0]
    planes = c.plain.view(4, B, q_len, H, D)
    S0 = rec_state.index_select(0, c.slots[:, 0])  # [B, H, D, D] FP32
    o, committed = recurrence_torch(planes[0], planes[1], planes[2], planes[3], c.plain_beta.view(B, q_len, H),
                                    A_log, dt_bias, S0, accepted, lower_bound)
    scatter_states(rec_state, committed, state_indices)
    return o, False


# ---------------------------------------------------------------------------------------------
# 3. gated RMSNorm


@triton.jit
def _gated_norm_kernel(o_ptr, g_ptr, w_ptr, idx_ptr, cu_ptr, out_ptr, stride_g, stride_out, eps,
                       H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, Q_LEN: tl.constexpr,
                       PACKED: tl.constexpr):
    """Program (token row, head): gated RMSNorm of the head's D outputs, 0 for a padding request."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    b = row // Q_LEN
    offs = tl.arange(0, DP)
    dmask = offs < D
    live = (tl.zeros([DP], tl.int64) + tl.load(idx_ptr + b)) >= 0
    if PACKED:
        src = tl.load(cu_ptr + b) + row % Q_LEN
    else:
        src = row
    o = tl.load(o_ptr + src.to(tl.int64) * (H * D) + h * D + offs, mask=dmask & live, other=0.0)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row.to(tl.int64) * stride_g + h * D + offs, mask=dmask, other=0.0).to(tl.float32)
    y = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps) * w * (1.0 / (1.0 + tl.exp(-g)))
    y = tl.where(live, y, 0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + h * D + offs, y.to(out_ptr.dtype.element_ty), mask=dmask)


def gated_rms_norm(o, packed: bool, g_out, o_norm_weight, state_indices, cu, q_len: int, norm_eps: float, out):
    """``out`` [T, H*D] bf16 = RMSNorm(o) * w * sigmoid(g_out), 0 on padding rows; o FP32 rows plain or packed."""
    T, HD = out.shape
    D = o_norm_weight.shape[0]
    _gated_norm_kernel[(T, HD // D)](o, g_out, o_norm_weight, state_indices, cu, out, g_out.stride(0),
                                     out.stride(0), float(norm_eps), H=HD // D, D=D,
                                     DP=triton.next_power_of_2(D), Q_LEN=q_len, PACKED=packed)
    return out


# ---------------------------------------------------------------------------------------------
# the core


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its inner stride is 1 (any row stride), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_states(conv_state, recurrent_state, H, D, HD, W):
    """Raise ValueError for state layouts the kernels cannot address in place (metadata only, no sync)."""
    if tuple(conv_state.shape[1:]) != (W - 1, 3 * HD) or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} / strides {conv_state.stride()}: "
                         f"need [S, {W - 1}, {3 * HD}] with unit channel stride")
    if (tuple(recurrent_state.shape[1:]) != (H, D, D) or recurrent_state.dtype != torch.float32
            or recurrent_state.stride()[1:] != (D * D, D, 1)):
        raise ValueError(f"recurrent_state {tuple(recurrent_state.shape)} {recurrent_state.dtype}: "
                         f"need [S, {H}, {D}, {D}] FP32 with each slot contiguous")


def kda_core_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta: torch.Tensor,
    g_out: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    state_indices: torch.Tensor, accepted: torch.Tensor, q_len: int, lower_bound: float, norm_eps: float,
) -> torch.Tensor:
    """The KDA core of a decode or uniform verify step (as ``kda_core_ref``); mutates both states.

    q, k, v, g_raw, g_out: [T, H*D] BF16 (q, k, v before the conv); beta: [T, H] logits;
    conv_weight: [3*H*D, W]; A_log: [H]; dt_bias: [H*D]; o_norm_weight: [D];
    conv_state: [S, W-1, 3*H*D] BF16; recurrent_state: [S, H, D, D] FP32 (value-major);
    state_indices: [B] (-1 = padding); accepted: [B] in 1..q_len. Returns [T, H*D] BF16.
    """
    T, HD = q.shape
    H = beta.shape[1]
    D = HD // H
    out = torch.empty(T, HD, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    _check_states(conv_state, recurrent_state, H, D, HD, conv_weight.shape[1])
    state_indices, accepted = state_indices.contiguous(), accepted.contiguous()
    A_log, dt_bias, o_norm_weight = A_log.contiguous(), dt_bias.contiguous(), o_norm_weight.contiguous()
    fla = _fla_fwd()
    c = conv_step(_rows(q), _rows(k), _rows(v), _rows(g_raw), _rows(beta), conv_weight, conv_state, state_indices,
                  accepted, q_len, plain=fla is None or q_len > 1, packed=fla is not None)
    if fla is not None:
        o, packed = _recurrence_fla(fla, c, A_log, dt_bias, recurrent_state, q_len, H, D, lower_bound)
    else:
        o, packed = _recurrence_torch_step(c, A_log, dt_bias, recurrent_state, state_indices, accepted, q_len, H, D,
                                           lower_bound)
    return gated_rms_norm(o, packed, _rows(g_out), o_norm_weight, state_indices, c.cu, q_len, norm_eps, out)
