"""Paged cache insert without a host sync: Triton programs per (token, run of a row) on CUDA, the reference elsewhere.

``insert_rows_paged(cache, slot_mapping, rows)`` writes ``rows [T, W]`` into ``cache [NB, BS, W]``
at flat slots ``slot_mapping [T]`` (``slot // BS`` = block, ``slot % BS`` = offset; -1 = skip),
exactly as ``reference.mla.insert_rows``. Every stride of the cache and the rows is free
(caches are strided views into pools). Rows are converted to the cache's dtype by torch first
(as the reference), so the kernel copies bits: BF16, FP8 e4m3 and FP32 caches alike (the FP32
``[NB, BS]`` index scales through an unsqueezed ``[NB, BS, 1]`` view).
"""

from __future__ import annotations

import torch

from .reference.mla import insert_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference does the work
    triton = None

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # element size -> same-size integer dtype

if triton is not None:

    @triton.jit
    def _insert_rows_kernel(cache, slots, rows, BS, W, s_cb, s_co, s_cw, s_rt, s_rw, BLOCK_W: tl.constexpr):
        """Program (t, j) copies elements ``j*BLOCK_W ..`` of row t into the cache at slots[t]; a
        negative slot stores nothing."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        w = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = w < tl.where(slot >= 0, W, 0)  # nothing for padding tokens
        row = tl.load(rows + t * s_rt + w * s_rw, mask=mask)
        s = tl.maximum(slot, 0)
        tl.store(cache + (s // BS) * s_cb + (s % BS) * s_co + w * s_cw, row, mask=mask)


def insert_rows_triton(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, *,
                       block: int = 4096) -> None:
    """The Triton insert (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); ``block``
    elements of a row per program."""
    T, W = rows.shape
    if T == 0:
        return
    bits = _BITS[cache.element_size()]
    dst = cache.view(bits)  # [NB, BS, W], same strides
    src = rows.to(cache.dtype).view(bits)  # [T, W]
    bw = min(block, triton.next_power_of_2(W))
    _insert_rows_kernel[(T, triton.cdiv(W, bw))](dst, slot_mapping, src, cache.shape[1], W, *dst.stride(),
                                                 *src.stride(), BLOCK_W=bw)


def insert_rows_paged(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [T, W]`` into a paged ``cache [NB, BS, W]`` at flat slots (-1 = skip), no host sync on CUDA."""
    if cache.is_cuda and triton is not None:
        insert_rows_triton(cache, slot_mapping, rows)
    else:
        insert_rows(cache, slot_mapping, rows)
