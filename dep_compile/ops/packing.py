"""Zero-copy weight packing: row-stacked parameters become views of one packed tensor.

A packed projection reads ``[W_0; W_1; ...]`` as one [sum rows, K] matrix. The parameters
stay the module's own (``param.data`` is swapped for a row slice of the packed tensor), so
there is one copy of the weights, and in-place updates reach the packed GEMM. The ops take
the parameters themselves and view them as one matrix when they are adjacent.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger("dep_compile")
_warned: set[tuple] = set()
_quiet = False  # set by unpacked_ok()


def packed_view(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """If ``ws`` are consecutive row slices of one storage, the [sum rows, K] view over them."""
    first = ws[0]
    if first.dim() != 2:
        return None
    offset = first.storage_offset()
    for w in ws:
        if (w.dim() != 2 or w.shape[1] != first.shape[1] or not w.is_contiguous() or w.dtype != first.dtype
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.storage_offset() != offset):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in ws)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())


@contextlib.contextmanager
def unpacked_ok():
    """Inside: unpacked weights are expected (a compile-time probe runs before packing), so not logged."""
    global _quiet
    _quiet, saved = True, _quiet
    try:
        yield
    finally:
        _quiet = saved


def packed_rows(ws: list[torch.Tensor], what: str) -> torch.Tensor:
    """The packed matrix of ``ws``: a zero-copy view when packed, else a concatenation (logged once)."""
    if len(ws) == 1:
        return ws[0]
    view = packed_view(ws)
    if view is not None:
        return view
    key = (what, tuple(w.shape for w in ws))
    if key not in _warned and not _quiet:
        _warned.add(key)
        log.warning("kimi_dep: %s weights are not packed; concatenating them every call "
                    "(pack them once with dep_compile.ops.packing.pack_params)", what)
    return torch.cat(ws, 0)


def pack_params(params: list[torch.Tensor]) -> torch.Tensor:
    """Make ``params`` row slices of one new packed tensor (a no-op if they already are)."""
    view = packed_view(params)
    if view is not None:
        return view
    packed = torch.cat([p.detach() for p in params], 0)
    r0 = 0
    for p in params:
        p.data = packed[r0 : r0 + p.shape[0]]
        r0 += p.shape[0]
    return packed
