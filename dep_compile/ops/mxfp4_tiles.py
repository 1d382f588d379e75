"""kimi_dep's re-packed copy of checkpoint-layout MXFP4 experts (``stock/mxfp4_tiles.py`` gives the tiles), made
once per weight and kept on it: for weights the loader left in the checkpoint's layout."""

from __future__ import annotations

import weakref

import torch

from ..stock.mxfp4 import Mxfp4Weight
from ..stock.mxfp4_tiles import Mxfp4Tiles, tile_mxfp4

RESERVE_BYTES = 4 << 30  # GPU memory a re-packed copy must leave free (the step's activations, caches, graphs)


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if it is no view)."""
    return t if t._base is None else t._base


def cached_tiles(w: Mxfp4Weight, block_n: int, block_k: int, spare: int = 0) -> Mxfp4Tiles | str:
    """``tile_mxfp4(w, ...)``, made once and kept on the tensor that owns the codes (a view's base: it lives as long
    as the parameter, and views made per call find it); or why not.

    Re-packed again, into the same buffers (graphs captured on them then read the new weights once an eager call
    has run), when the codes or scales change: in place (the version counter), or swapped (``param.data = ...``,
    another scale tensor). Writes through ``.data`` bypass the version counter and are not seen. Never made inside
    CUDA-graph capture, nor where it would leave less than ``RESERVE_BYTES`` + ``spare`` bytes of GPU memory free
    (the copy doubles the experts' bytes: docs/mxfp4.md). A cache miss reads the device (the scale check): the
    first call on a weight syncs and allocates."""
    slot = (w.packed.storage_offset(), tuple(w.packed.shape), w.packed.stride(), block_n, block_k)
    source = (w.packed.data_ptr(), w.scale.data_ptr(), tuple(w.scale.shape), w.scale.stride(), w.packed._version,
              w.scale._version)
    kept = _owner(w.packed).__dict__.setdefault("_dep_mxfp4_tiles", {})
    hit = kept.get(slot)
    if hit is not None and hit[0] == source and hit[1]() is _owner(w.scale):
        return hit[2]
    if w.packed.is_cuda and torch.cuda.is_current_stream_capturing():
        return "no re-packed copy yet, and none can be made inside CUDA-graph capture"
    reuse = hit[2] if hit is not None and isinstance(hit[2], Mxfp4Tiles) else None
    size = w.packed.nbytes + w.scale.nbytes
    if reuse is None and w.packed.is_cuda and torch.cuda.mem_get_info(w.packed.device)[0] < size + RESERVE_BYTES + spare:
        return f"a re-packed copy ({size / 2**30:.2f} GiB) would leave less than {RESERVE_BYTES >> 30} GiB free"
    try:
        tiles = tile_mxfp4(w, block_n, block_k, out=reuse)
    except ValueError as e:
        tiles = str(e)
    kept[slot] = (source, weakref.ref(_owner(w.scale)), tiles)
    return tiles
