"""Triton top-k of long rows (SM90): each row's top-``k`` positions, exact, as the reference selects them.

The contract of ``stock.batched_attention.select_topk_positions``: ``want = min(k, visible entries)`` (``-inf``
is not visible), every entry above the ``want``-th largest value and as many of those equal to it as are
needed, taken from the lowest positions; ascending, ``-1`` padded to ``k`` (``-0.0`` ties with ``+0.0``, as torch
compares them). Both kernels find the threshold by radix select on order-preserving keys of the FP32 bits
(``BITS`` bits a pass from the top, a histogram of the entries still matching the prefix), then compact the
selected positions in position order, optionally stored as the latent-cache rows they live in:

* :func:`select_topk_triton`: one program a row, the row held in registers up to 16K entries (re-read in chunks
  beyond): one launch.
* :func:`select_topk_chunked`: many programs a row, ``chunk`` entries each, for rows too long for one program
  (32K-128K): per pass each program adds its chunk's histogram to the row's (atomics; an atomic an entry where
  at most as many entries as bins still match the prefix) and the last to arrive
  picks the digit; then each program counts its chunk's entries above and at the threshold, and each
  compacts its chunk at the offset the earlier chunks' counts give. ``32 / BITS + 2`` launches, a small
  workspace, no host synchronisation (CUDA-graph capturable).

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["select_topk_triton", "select_topk_chunked"]


@triton.jit
def _sort_key(x):
    """Order-preserving uint32 key of an FP32 value (-inf lowest of the non-NaN values; -0.0 and
    +0.0 one key, equal as torch compares them)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    flip = tl.where((b >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return b ^ flip


@triton.jit
def _digit_histogram(key, ok, prefix, pmask, shift, NBINS: tl.constexpr):
    """Histogram [NBINS] of the digit at ``shift`` of the keys that are ``ok`` and match ``prefix``."""
    match = ok & ((key & pmask) == prefix)
    return tl.histogram(((key >> shift) & (NBINS - 1)).to(tl.int32), NBINS, mask=match)


@triton.jit
def _compact_chunk(key, n, ok, thr, need, done, eq_seen, out_row, bt_row, ROWS: tl.constexpr, BS: tl.constexpr):
    """Store the chunk's selected positions (keys above ``thr``, plus equal ones while fewer than
    ``need`` were seen) after the ``done`` already stored; returns the new (done, eq_seen)."""
    eq = ok & (key == thr)
    eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    sel = ok & ((key > thr) | (eq & (eq_rank < need)))
    slot = done + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    if ROWS:  # the latent-cache row of each selected position: block_table[request, n // BS] * BS + n % BS
        blk = tl.load(bt_row + n // BS, mask=sel, other=0).to(tl.int64)
        val = (blk * BS + n % BS).to(tl.int32)
    else:
        val = n.to(tl.int32)
    tl.store(out_row + slot, val, mask=sel)
    return done + tl.sum(sel.to(tl.int32), axis=0), eq_seen + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _topk_kernel(x_ptr, out_ptr, bt_ptr, N, stride_x, stride_out, stride_bt, K: tl.constexpr, KP: tl.constexpr,
                 BLOCK: tl.constexpr, BITS: tl.constexpr, RESIDENT: tl.constexpr, ROWS: tl.constexpr,
                 Q_LEN: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_x
    out_row = out_ptr + t * stride_out
    bt_row = bt_ptr + (t // Q_LEN) * stride_bt
    offs = tl.arange(0, BLOCK)
    ninf = _sort_key(tl.full([BLOCK], float("-inf"), tl.float32))
    # radix select, BITS bits a pass from the top: thr = the want-th largest key, want = min(K,
    # visible entries (> -inf)); `need` of the entries equal to thr are taken (the lowest
    # positions first)
    want = tl.zeros([], tl.int32)
    if RESIDENT:  # the whole row (N <= BLOCK) in registers: read once for every pass
        key_r = _sort_key(tl.load(row + offs, mask=offs < N, other=float("-inf")))  # [BLOCK] uint32
        live_r = (offs < N) & (key_r > ninf)
        want = tl.minimum(tl.sum(live_r.to(tl.int32), axis=0), K)
    NBINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NBINS)
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    need = want
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        if RESIDENT:
            hist = _digit_histogram(key_r, offs < N, prefix, pmask, shift, NBINS)
        else:  # chunks of BLOCK entries, re-read every pass; the visible ones counted in the first
            hist = tl.zeros([NBINS], tl.int32)
            n_vis = tl.zeros([], tl.int32)
            for c0 in range(0, N, BLOCK):
                n = c0 + offs
                key = _sort_key(tl.load(row + n, mask=n < N, other=float("-inf")))
                hist += _digit_histogram(key, n < N, prefix, pmask, shift, NBINS)
                if p == 0:
                    n_vis += tl.sum((key > ninf).to(tl.int32), axis=0)
            if p == 0:
                want = tl.minimum(n_vis, K)
                need = want
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # [NBINS]: matching entries with digit > bin
        d = tl.sum((above >= need).to(tl.int32), axis=0)  # the digit of the want-th largest
        need -= tl.sum(tl.where(bins == d, above, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], NBINS - 1, tl.uint32) << shift)
    # compaction in position order: the output is ascending by construction
    any_ok = (tl.zeros([BLOCK], tl.int32) + want) > 0  # tensor mask (interpreter)
    done = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    if RESIDENT:
        done, eq_seen = _compact_chunk(key_r, offs, live_r & any_ok, prefix, need, done, eq_seen, out_row, bt_row,
                                       ROWS, BS)
    else:
        for c0 in range(0, N, BLOCK):
            n = c0 + offs
            key = _sort_key(tl.load(row + n, mask=n < N, other=float("-inf")))
            done, eq_seen = _compact_chunk(key, n, (n < N) & (key > ninf) & any_ok, prefix, need, done, eq_seen,
                                           out_row, bt_row, ROWS, BS)
    k = tl.arange(0, KP)
    tl.store(out_row + k, tl.full([KP], -1, tl.int32), mask=(k >= done) & (k < K))


def select_topk_triton(logits: torch.Tensor, topk: int, *, block: int | None = None, num_warps: int | None = None,
                       bits: int = 4, rows_of: tuple[torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """:func:`select_topk_positions` in one launch (one program per row): radix select, then the
    selected positions compacted in position order (ascending; ties at the threshold taken from
    the lowest positions). logits: [T, N] FP32 (unit inner stride) -> [T, topk] int32.

    ``rows_of = (block_table, q_len, block_size)``: store each selection's latent-cache row
    (:func:`physical_rows`) instead of its position. ``bits``: radix digit width (1, 2, 4 or 8:
    32 / bits passes over the row, then one to compact). ``block``: entries a chunk; a row of at
    most ``block`` entries is read once and held in registers for every pass, a longer one is
    re-read in chunks every pass. Defaults measured (bench_dsa_kernels.py, docs/perf.md): 4-bit
    digits; the whole row up to 16K entries (8 warps up to 4K, 16 above): 11.6 µs at 4K, 20.1 at
    8K, 38.3 at 16K (re-read in 4K chunks: 15.6, 28.5, 53.7); longer rows spill a resident row
    (92-103 µs at 32K, 16-32 warps) and take 4K chunks, 8 warps (104-113 µs)."""
    if bits not in (1, 2, 4, 8):  # the passes must resolve all 32 key bits
        raise ValueError(f"radix digit width {bits} is not 1, 2, 4 or 8")
    T, N = logits.shape
    out = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    bt, q_len, bs = rows_of if rows_of is not None else (out, 1, 1)
    block = min(block or (16384 if N <= 16384 else 4096), triton.next_power_of_2(max(N, 16)))
    num_warps = num_warps or (16 if block > 4096 else 8)
    if T:
        _topk_kernel[(T,)](logits, out, bt, N, logits.stride(0), out.stride(0), bt.stride(0), K=topk,
                           KP=triton.next_power_of_2(topk), BLOCK=block, BITS=bits, RESIDENT=N <= block,
                           ROWS=rows_of is not None, Q_LEN=int(q_len), BS=int(bs), num_warps=num_warps)
    return out


@triton.jit
def _chunk_keys(row, c, N, CHUNK: tl.constexpr):
    """Chunk ``c`` of a row: (positions [CHUNK], keys, in range, visible: in range and above -inf)."""
    n = c * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    key = _sort_key(tl.load(row + n, mask=ok, other=float("-inf")))
    return n, key, ok, ok & (key > _sort_key(tl.full([CHUNK], float("-inf"), tl.float32)))


@triton.jit
def _chunk_pass_kernel(x_ptr, hist_ptr, arrived_ptr, st_ptr, N, stride_x, K, C, P: tl.constexpr,
                       CHUNK: tl.constexpr, BITS: tl.constexpr):
    """Radix pass ``P`` over chunk (program 1) of row (program 0): the chunk's histogram of the digit at
    ``32 - BITS (P + 1)`` among the entries matching the row's prefix, added to the row's; the last chunk to
    arrive picks the digit of the ``need``-th largest, extends the prefix and zeroes the histogram and the
    arrival count for the next pass. Row state ``st`` [T, 3] int32: prefix (key bits), need, want."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    NBINS: tl.constexpr = 1 << BITS
    SHIFT: tl.constexpr = 32 - BITS * (P + 1)
    bins = tl.arange(0, NBINS)
    n, key, ok, vis = _chunk_keys(x_ptr + t * stride_x, c, N, CHUNK)
    st = st_ptr + t * 3
    if P == 0:
        prefix = tl.zeros([], tl.uint32)
        pmask = tl.zeros([], tl.uint32)
        tl.atomic_add(st + 2, tl.sum(vis.to(tl.int32), axis=0))  # visible entries of the row
    else:
        prefix = tl.load(st).to(tl.uint32, bitcast=True)
        pmask = tl.full([], 0xFFFFFFFF, tl.uint32) << (SHIFT + BITS)
    hrow = hist_ptr + t * NBINS + bins
    match = ok & ((key & pmask) == prefix)
    if tl.sum(match.to(tl.int32), axis=0) <= NBINS:  # few still match (after pass 0, most chunks): an atomic each
        digit = ((key >> SHIFT) & (NBINS - 1)).to(tl.int32)
        tl.atomic_add(hist_ptr + t * NBINS + digit, tl.full([CHUNK], 1, tl.int32), mask=match)
    else:  # the chunk's histogram, an atomic a non-empty bin (never more atomics than the branch above)
        hist = _digit_histogram(key, ok, prefix, pmask, SHIFT, NBINS)
        tl.atomic_add(hrow, hist, mask=hist != 0)
    tl.debug_barrier()  # every thread's histogram atomics before the program's arrival (Triton 3.6 adds none itself)
    if tl.atomic_add(arrived_ptr + t, 1) == C - 1:  # acq_rel: every chunk's histogram is in
        hist = tl.atomic_xchg(hrow, tl.zeros([NBINS], tl.int32))  # read, and zeroed for the next pass
        if P == 0:
            need = tl.minimum(tl.atomic_add(st + 2, 0), K)
            tl.store(st + 2, need)  # want
        else:
            need = tl.load(st + 1)
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # [NBINS]: matching entries with digit > bin
        d = tl.sum((above >= need).to(tl.int32), axis=0)  # the digit of the need-th largest
        tl.store(st + 1, need - tl.sum(tl.where(bins == d, above, 0), axis=0))
        tl.store(st, (prefix | (d.to(tl.uint32) << SHIFT)).to(tl.int32, bitcast=True))
        tl.store(arrived_ptr + t, 0)


@triton.jit
def _chunk_count_kernel(x_ptr, st_ptr, counts_ptr, N, stride_x, C, CHUNK: tl.constexpr):
    """Visible entries of the chunk above the row's threshold and equal to it: ``counts`` [T, C, 2]."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n, key, ok, live = _chunk_keys(x_ptr + t * stride_x, c, N, CHUNK)
    thr = tl.load(st_ptr + t * 3).to(tl.uint32, bitcast=True)
    out = counts_ptr + (t * C + c) * 2
    tl.store(out, tl.sum((live & (key > thr)).to(tl.int32), axis=0))
    tl.store(out + 1, tl.sum((live & (key == thr)).to(tl.int32), axis=0))


@triton.jit
def _chunk_compact_kernel(x_ptr, st_ptr, counts_ptr, out_ptr, bt_ptr, N, stride_x, stride_out, stride_bt, C,
                          K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr, CHUNK: tl.constexpr,
                          ROWS: tl.constexpr, Q_LEN: tl.constexpr, BS: tl.constexpr):
    """The chunk's selected positions (or cache rows), stored after those of the chunks before it: they took
    every entry above the threshold and the first ``need`` equal ones, in position order. The last chunk pads
    the row's tail with -1."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n, key, ok, vis = _chunk_keys(x_ptr + t * stride_x, c, N, CHUNK)
    thr = tl.load(st_ptr + t * 3).to(tl.uint32, bitcast=True)
    need = tl.load(st_ptr + t * 3 + 1)
    want = tl.load(st_ptr + t * 3 + 2)
    prev = tl.arange(0, CP)
    before = counts_ptr + (t * C + prev) * 2
    gt = tl.sum(tl.load(before, mask=prev < c, other=0), axis=0)
    eq = tl.sum(tl.load(before + 1, mask=prev < c, other=0), axis=0)
    live = vis & ((tl.zeros([CHUNK], tl.int32) + want) > 0)  # tensor mask (interpreter)
    out_row = out_ptr + t * stride_out
    _compact_chunk(key, n, live, thr, need, gt + tl.minimum(eq, need), eq, out_row, bt_ptr + (t // Q_LEN) * stride_bt,
                   ROWS, BS)
    if c == C - 1:
        k = tl.arange(0, KP)
        tl.store(out_row + k, tl.full([KP], -1, tl.int32), mask=(k >= want) & (k < K))


def select_topk_chunked(logits: torch.Tensor, topk: int, *, chunk: int = 4096, bits: int = 8,
                        num_warps: int | None = None, rows_of: tuple[torch.Tensor, int, int] | None = None
                        ) -> torch.Tensor:
    """:func:`select_topk_triton`'s result with ``chunk`` entries a program (a power of two): ``32 / bits`` radix
    passes (``bits`` 4 or 8), a count and a compaction launch. logits: [T, N] FP32 (unit inner stride) ->
    [T, topk] int32; ``rows_of = (block_table, q_len, block_size)`` stores latent-cache rows. ``select_rows``
    takes it above 16K positions (timed by ``bench_dsa_kernels.py --kernels topk``)."""
    if bits not in (4, 8):  # the passes must resolve all 32 key bits; fewer bins cost more passes
        raise ValueError(f"radix digit width {bits} is not 4 or 8")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk {chunk} is not a power of two >= 16")
    T, N = logits.shape
    out = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    if T == 0:
        return out
    bt, q_len, bs = rows_of if rows_of is not None else (out, 1, 1)
    C = triton.cdiv(N, chunk)
    num_warps = num_warps or (8 if chunk >= 4096 else 4)
    dev = logits.device
    hist = torch.zeros(T, 1 << bits, dtype=torch.int32, device=dev)  # zeroed again by each pass's last chunk
    arrived = torch.zeros(T, dtype=torch.int32, device=dev)
    st = torch.zeros(T, 3, dtype=torch.int32, device=dev)  # prefix, need, want
    counts = torch.empty(T, C, 2, dtype=torch.int32, device=dev)
    grid = (T, C)  # rows on axis 0 (no 65535 cap)
    for p in range(32 // bits):
        _chunk_pass_kernel[grid](logits, hist, arrived, st, N, logits.stride(0), topk, C, P=p, CHUNK=chunk, BITS=bits,
                                 num_warps=num_warps)
    _chunk_count_kernel[grid](logits, st, counts, N, logits.stride(0), C, CHUNK=chunk, num_warps=num_warps)
    _chunk_compact_kernel[grid](logits, st, counts, out, bt, N, logits.stride(0), out.stride(0), bt.stride(0), C,
                                K=topk, KP=triton.next_power_of_2(topk), CP=triton.next_power_of_2(C), CHUNK=chunk,
                                ROWS=rows_of is not None, Q_LEN=int(q_len), BS=int(bs), num_warps=num_warps)
    return out
