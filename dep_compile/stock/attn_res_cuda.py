"""Stock AttnRes on CUDA: one Triton launch per point, a program per row with the whole row in registers.

Same numerics as ``reference.attn_res.attn_res_ref``: ``prefix += delta`` in FP32, rounded once to
the prefix dtype and stored in place; the optional bank write; per source (the bank's first
``num_blocks`` snapshots, then the prefix) an FP32 logit ``RMSNorm(source) . query``; a softmax over
the sources; the FP32 weighted sum of the un-normalized sources, rounded once. Only the FP32
summation order differs: the logit is ``rsqrt(mean(x^2) + eps) * sum(x * query)``, and the softmax is
taken online (a running max and sum), so every source is read once (bank rows UNROLL per load).

``attn_res_norm_cuda`` (the kimi_dep fused op) adds the RMSNorm that follows an AttnRes point in the
same launch: the mix is rounded to BF16 as stock's would be, then normalized in FP32, times the
norm weight, rounded once; the mix itself is not written. It can take the point's bank part ready-made:
``attn_res_bank_part_cuda`` sums the bank slots the point does not write (their mix, max and sum, FP32)
any time after their last write, e.g. on a side stream beside the sublayer before the point (ops/attn_res.py);
the point then reads its prefix and that one row, and merges them (the same online softmax, one step).

Imports Triton at import time: import it only where CUDA (or Triton's CPU interpreter) runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference.attn_res import PART_EXTRA, empty_bank_part  # noqa: F401  (PART_EXTRA: the part's layout, re-exported)

MAX_D = 16384  # the whole row stays in registers: [MAX_D] FP32 per live tensor (K3: 7168)
# Bank rows per load; the next load is issued into registers before a step's reductions. Measured on the H200
# (docs/perf.md, 2026-12-04): 9-15 % faster than a 3-stage cp.async pipeline through shared memory at 4-16 bank
# rows; 4 rows a load, or two loads ahead, measured slower (4 rows two loads ahead 5x: past the registers).
# benchmarks/bench_attn_res.py times the variants.
UNROLL = 2


@triton.jit
def _add_pairs(a, b, c, d):
    """Combine of two sums reduced together: (a + c, b + d)."""
    return a + c, b + d


@triton.jit
def _bank_rows(bank_ptr, src, num_blocks, write_slot, t, stride_bs, stride_bt, d, ok):
    """Bank slots ``src`` [UNROLL] of row ``t`` as stored [UNROLL, BLOCK_D]: 0 past num_blocks and at the slot
    just written."""
    keep = (src < num_blocks) & (src != write_slot)
    return tl.load(bank_ptr + src[:, None] * stride_bs + t * stride_bt + d[None, :], mask=keep[:, None] & ok[None, :],
                   other=0.0)


@triton.jit
def _bank_sources(bank_ptr, t, stride_bs, stride_bt, d, ok, q, eps, num_blocks, write_slot, pf, m, l, acc,
                  D: tl.constexpr, UNROLL: tl.constexpr, FRESH: tl.constexpr):
    """The online softmax (running max ``m``, sum ``l``, mix ``acc`` [BLOCK_D]) carried over row ``t``'s first
    ``num_blocks`` bank slots, UNROLL a load, the next load issued before a step's reductions (2 UNROLL rows in
    flight). The slot just written (``write_slot``) is the prefix ``pf`` with FRESH, else left out."""
    j = tl.arange(0, UNROLL)
    nxt = _bank_rows(bank_ptr, j, num_blocks, write_slot, t, stride_bs, stride_bt, d, ok)
    for s0 in tl.range(0, num_blocks, UNROLL, num_stages=1):  # no cp.async: the next load is issued by hand
        src = s0 + j  # [UNROLL] bank slots
        if FRESH:  # just overwritten by this row's prefix: taken from registers
            live = src < num_blocks
            x = tl.where((src == write_slot)[:, None], pf[None, :], nxt.to(tl.float32))  # [UNROLL, BLOCK_D]
        else:
            live = (src < num_blocks) & (src != write_slot)
            x = nxt.to(tl.float32)
        nxt = _bank_rows(bank_ptr, src + UNROLL, num_blocks, write_slot, t, stride_bs, stride_bt, d, ok)
        xq, xx = tl.reduce((x * q[None, :], x * x), 1, _add_pairs)  # [UNROLL] each
        logit = tl.where(live, xq * tl.rsqrt(xx / D + eps), float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, axis=0))
        if FRESH:  # the prefix opened the softmax: m_new is finite
            m_ref = m_new
        else:  # no source yet: keep the sums at 0 instead of exp(-inf - -inf)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep, w = tl.exp(m - m_ref), tl.exp(logit - m_ref)  # w: [UNROLL], 0 for slots left out
        acc = acc * keep + tl.sum(w[:, None] * x, axis=0)
        l = l * keep + tl.sum(w, axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def _attn_res_kernel(prefix_ptr, bank_ptr, delta_ptr, query_ptr, norm_w_ptr, part_ptr, out_ptr,
                     stride_p, stride_bs, stride_bt, stride_dl, stride_pt, stride_o, num_blocks, write_slot, eps,
                     norm_eps, D: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr, NORM: tl.constexpr,
                     PART: tl.constexpr):
    """Row ``t``: prefix[t] += delta[t]; bank[write_slot, t] = prefix[t]; out[t] = the softmax mix
    (or, with NORM, its RMSNorm times norm_w). prefix/out [T, D], bank [NB, T, D], unit inner strides.
    With PART, the bank's slots other than write_slot come as one source already summed (``_attn_res_part_kernel``'s
    row of ``part`` [T, D + PART_EXTRA] FP32: their mix, max and sum), and no bank row is read."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    q = tl.load(query_ptr + d, mask=ok, other=0.0).to(tl.float32)
    old = tl.load(prefix_ptr + t * stride_p + d, mask=ok, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + t * stride_dl + d, mask=ok, other=0.0).to(tl.float32)
    p = (old + delta).to(prefix_ptr.dtype.element_ty)  # [BLOCK_D], rounded once as the reference
    tl.store(prefix_ptr + t * stride_p + d, p, mask=ok)
    if write_slot >= 0:
        tl.store(bank_ptr + write_slot * stride_bs + t * stride_bt + d, p, mask=ok)
    pf = p.to(tl.float32)
    # the prefix (the last source) opens the online softmax: running max m, sum l, mix acc
    pq, pp = tl.reduce((pf * q, pf * pf), 0, _add_pairs)  # one cross-warp reduction for both sums
    m = pq * tl.rsqrt(pp / D + eps)
    if PART:
        # the slot just written is the prefix again (same logit): counted twice, exactly
        # (a tensor even where the launch specialized write_slot and num_blocks to 1: a Python bool has no .to)
        twice = tl.full([], 1.0, tl.float32) * ((write_slot >= 0) & (write_slot < num_blocks))
        l = m * 0.0 + 1.0 + twice
        acc = pf * (1.0 + twice)
        row = part_ptr + t * stride_pt
        m_bank, l_bank = tl.load(row + D), tl.load(row + D + 1)  # m_bank = -inf: no bank source
        m_new = tl.maximum(m, m_bank)
        keep, w = tl.exp(m - m_new), tl.exp(m_bank - m_new)
        acc = acc * keep + w * tl.load(row + d, mask=ok, other=0.0)
        l = l * keep + w * l_bank
    else:
        l = m * 0.0 + 1.0
        m, l, acc = _bank_sources(bank_ptr, t, stride_bs, stride_bt, d, ok, q, eps, num_blocks, write_slot, pf, m, l,
                                  pf, D, UNROLL, True)
    h = (acc / l).to(out_ptr.dtype.element_ty)
    if NORM:
        hf = h.to(tl.float32)
        nw = tl.load(norm_w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        y = hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / D + norm_eps) * nw
        tl.store(out_ptr + t * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + t * stride_o + d, h, mask=ok)


@triton.jit
def _attn_res_part_kernel(bank_ptr, query_ptr, part_ptr, stride_bs, stride_bt, stride_pt, num_blocks, write_slot,
                          eps, D: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    """Row ``t`` of an AttnRes point's bank part, computed before the point: the online softmax over the bank's
    first ``num_blocks`` slots but ``write_slot`` (the one the point itself writes), stored as part[t] = (mix
    [D], max, sum) in FP32; max -inf and sum 0 where no slot is a source."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    q = tl.load(query_ptr + d, mask=ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    m, l, acc = _bank_sources(bank_ptr, t, stride_bs, stride_bt, d, ok, q, eps, num_blocks, write_slot, acc, m, l,
                              acc, D, UNROLL, False)
    row = part_ptr + t * stride_pt
    tl.store(row + d, acc, mask=ok)
    tl.store(row + D, m)
    tl.store(row + D + 1, l)


def unsupported(prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, num_blocks: int, write_slot: int,
                norm_weight: Tensor | None = None) -> str | None:
    """Why the kernel cannot run this call (None: it can); decided from metadata only (no sync)."""
    if prefix.dim() != 2 or delta.shape != prefix.shape or bank.dim() != 3 or bank.shape[1:] != prefix.shape:
        return f"shapes prefix {tuple(prefix.shape)}, bank {tuple(bank.shape)}, delta {tuple(delta.shape)}"
    D = prefix.shape[1]
    if query.shape != (D,) or (norm_weight is not None and norm_weight.shape != (D,)):
        return f"query {tuple(query.shape)} / norm weight is not [{D}]"
    if D > MAX_D:
        return f"hidden {D} > {MAX_D}"
    if not prefix.dtype.is_floating_point or bank.dtype != prefix.dtype:
        return f"prefix {prefix.dtype} / bank {bank.dtype}"
    if bank.numel() >= 2 ** 31:
        return "bank of 2^31 elements or more (32-bit offsets)"
    if not 0 <= num_blocks <= bank.shape[0] or not -1 <= write_slot < bank.shape[0]:
        return f"num_blocks {num_blocks} / write_slot {write_slot} outside a bank of {bank.shape[0]}"
    rest = (query, norm_weight) if norm_weight is not None else (query,)
    if any(x.stride(-1) != 1 for x in (prefix, bank, delta, *rest) if x.numel() > 1):
        return "a tensor without unit inner stride"
    return None


def launch_shape(D: int) -> tuple[int, int]:
    """(BLOCK_D, num_warps) of a launch at hidden size ``D``: the whole row, 512 values a warp, at most 16 warps."""
    BLOCK_D = triton.next_power_of_2(D)
    return BLOCK_D, max(1, min(16, BLOCK_D // 512))


def _launch(prefix, bank, delta, query, norm_weight, out, eps, num_blocks, write_slot, norm_eps, unroll, part=None):
    T, D = prefix.shape
    if T == 0:
        return out
    BLOCK_D, num_warps = launch_shape(D)
    _attn_res_kernel[(T,)](
        prefix, bank, delta, query, norm_weight if norm_weight is not None else query,
        part if part is not None else query, out,
        prefix.stride(0), bank.stride(0), bank.stride(1), delta.stride(0), part.stride(0) if part is not None else 0,
        out.stride(0), int(num_blocks), int(write_slot), float(eps), float(norm_eps),
        D=D, BLOCK_D=BLOCK_D, UNROLL=unroll, NORM=norm_weight is not None, PART=part is not None,
        num_warps=num_warps)
    return out


def attn_res_cuda(prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, eps: float, num_blocks: int,
                  write_slot: int, unroll: int = UNROLL) -> Tensor:
    """``attn_res_ref`` in one launch: mutates ``prefix [T, D]`` and ``bank [NB, T, D]``; returns [T, D].
    ``unroll`` (bank rows per load, a power of two): tuning, compared by the benchmark."""
    out = torch.empty_like(prefix)
    return _launch(prefix, bank, delta, query, None, out, eps, num_blocks, write_slot, 0.0, unroll)


def attn_res_norm_cuda(prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, norm_weight: Tensor,
                       eps: float, num_blocks: int, write_slot: int, norm_eps: float, unroll: int = UNROLL,
                       part: Tensor | None = None) -> Tensor:
    """AttnRes then RMSNorm(norm_weight, norm_eps) of its BF16-rounded mix, in one launch: [T, D]. ``part``: the
    point's bank part (:func:`attn_res_bank_part_cuda` of the same bank, query, eps, num_blocks and write_slot,
    computed after the bank's last write): then no bank row is read."""
    out = torch.empty_like(prefix)
    return _launch(prefix, bank, delta, query, norm_weight, out, eps, num_blocks, write_slot, norm_eps, unroll, part)


def part_unsupported(bank: Tensor, query: Tensor, num_blocks: int, write_slot: int) -> str | None:
    """Why :func:`attn_res_bank_part_cuda` cannot run this call (None: it can)."""
    if bank.dim() != 3 or bank.shape[0] == 0:
        return f"bank {tuple(bank.shape)} is not [NB >= 1, T, D]"
    return unsupported(bank[0], bank, bank[0], query, num_blocks, write_slot)


def attn_res_bank_part_cuda(bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int,
                            unroll: int = UNROLL, out: Tensor | None = None) -> Tensor:
    """The bank part of an AttnRes point (``reference.attn_res.bank_part_ref``): [T, D + PART_EXTRA] FP32, each row
    the softmax mix of the bank's first ``num_blocks`` slots but ``write_slot``, then its max and sum. Reads only
    bank slots the point does not write, so it runs any time after their last write. ``out``: where to write it."""
    _, T, D = bank.shape
    part = empty_bank_part(bank) if out is None else out
    if T == 0:
        return part
    BLOCK_D, num_warps = launch_shape(D)
    # named attn_res_*: bench_decoder's profile gives it to the AttnRes family by name
    _attn_res_part_kernel[(T,)](bank, query, part, bank.stride(0), bank.stride(1), part.stride(0), int(num_blocks),
                                int(write_slot), float(eps), D=D, BLOCK_D=BLOCK_D, UNROLL=unroll, num_warps=num_warps)
    return part
