"""MXFP4 experts re-packed once into the order the experts kernel's MMA reads: a thread's codes in one word.

The checkpoint stores an expert weight ``[N, K]`` as ``packed [N, K/2]`` (input 2j in a byte's low nibble) and
``scale [N, K/32]`` (E8M0). Dequantized in registers straight from that layout, a thread of the Hopper MMA needs
two single bytes every 16 inputs of two rows; the compiler moves them into place byte by byte (docs/perf.md,
"Routed experts, MXFP4"). ``tile_mxfp4`` re-packs a copy tile by tile (``block_n`` rows x ``block_k`` inputs,
``block_n / 16`` warps of 16 rows): thread ``(w, g, q)`` (warp, lane / 4, lane % 4) of a tile holds rows
``n = 16 w + g`` and ``n + 8``; for each 16 inputs ``j`` it needs the 8 values at inputs ``16 j + 2 q + {0, 1}``
and ``+ 8``, which become one int32 word:

    byte 0: row n,     input 16j+2q   (low nibble) and 16j+2q+8 (high nibble)
    byte 1: row n,     input 16j+2q+1 and 16j+2q+9
    byte 2: row n + 8, input 16j+2q   and 16j+2q+8
    byte 3: row n + 8, input 16j+2q+1 and 16j+2q+9

so the word's low nibbles are the BF16 pairs of the MMA's first two operand registers, its high nibbles those
of the last two. Words are stored ``[E, N / block_n, K / block_k, 2 block_n (w, g, q), block_k / 16]``: a
thread's words of one tile are contiguous (16-byte loads).

Scales are stored per thread quad: ``[E, N / block_n, K / block_k, block_n / 2 (w, g), block_k / 32]`` int16,
the low byte for row n and the high byte for row n + 8, each ``s + 126`` (the BF16 exponent of 2^(s - 1)): the
kernel multiplies the code's bits placed as ``value x 2^-126`` by 2^(s - 1) in one BF16 FMA, exact while
s <= 128 (scales up to 2^1; every real or drawn checkpoint's are far below). Same bytes as the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..stock.mxfp4 import GROUP, Mxfp4Weight, group_size

SCALE_MAX = 128  # largest E8M0 code whose 2^(s - 1) is a normal BF16 (the folded scale)
RESERVE_BYTES = 4 << 30  # GPU memory a re-packed copy must leave free (the step's activations, caches, graphs)


@dataclasses.dataclass(frozen=True)
class Mxfp4Tiles:
    """An MXFP4 experts weight ``[E, N, K]`` re-packed by ``tile_mxfp4`` for ``block_n`` x ``block_k`` tiles."""

    words: torch.Tensor  # int32 [E, N / block_n, K / block_k, 2 block_n, block_k / 16]
    scales: torch.Tensor  # int16 [E, N / block_n, K / block_k, block_n / 2, block_k / 32]


def untileable(w: Mxfp4Weight, block_n: int, block_k: int) -> str | None:
    """Why ``w`` cannot be re-packed into ``block_n`` x ``block_k`` tiles (None when it can)."""
    E, N, K = w.shape
    if w.packed.dtype != torch.uint8 or w.scale.dtype != torch.uint8 or group_size(w.packed, w.scale) != GROUP:
        return "not uint8 codes with E8M0 scales per 32 inputs"
    if block_n % 16 or block_k % 32 or N % block_n or K % block_k:
        return f"[{N}, {K}] does not tile into {block_n} x {block_k} (rows a multiple of 16, inputs of 32)"
    if int(w.scale.max()) > SCALE_MAX:
        return f"a scale above 2^{SCALE_MAX - 127} (the folded scale 2^(s - 1) would not be a normal BF16)"
    return None


def tile_mxfp4(w: Mxfp4Weight, block_n: int, block_k: int, out: Mxfp4Tiles | None = None) -> Mxfp4Tiles:
    """Re-pack ``w`` (codes and E8M0 scales, ``[E, N, K]``) for the experts kernel's ``block_n`` x ``block_k``
    tiles, one expert at a time (the temporaries stay a few times one expert's codes), into ``out`` if given (its
    buffers keep their addresses); raises ValueError where ``untileable`` says why."""
    why = untileable(w, block_n, block_k)
    if why:
        raise ValueError(f"tile_mxfp4: {why}")
    E, N, K = w.shape
    nt, kt, wn, jn, groups = N // block_n, K // block_k, block_n // 16, block_k // 16, block_k // GROUP
    shapes = ((E, nt, kt, 2 * block_n, jn), (E, nt, kt, block_n // 2, groups))  # words, scales
    if out is None:
        out = Mxfp4Tiles(torch.empty(shapes[0], dtype=torch.int32, device=w.packed.device),
                         torch.empty(shapes[1], dtype=torch.int16, device=w.packed.device))
    elif (tuple(out.words.shape), tuple(out.scales.shape)) != shapes:
        raise ValueError(f"tile_mxfp4: out holds words {tuple(out.words.shape)}, scales {tuple(out.scales.shape)}; "
                         f"{shapes} needed")
    for e in range(E):
        p = w.packed[e]
        codes = torch.stack([p & 15, p >> 4], -1).reshape(N, K)  # one code a byte, input order
        # n = t block_n + 16 w + 8 h + g; k = kt block_k + 16 j + 8 half + 2 q + lane
        c = codes.reshape(nt, wn, 2, 8, kt, jn, 2, 4, 2)  # t, w, h, g, kt, j, half, q, lane
        c = c.permute(0, 4, 1, 3, 7, 5, 2, 8, 6)  # t, kt, w, g, q, j, h, lane, half
        byte = (c[..., 0] | (c[..., 1] << 4)).reshape(nt, kt, 2 * block_n, jn, 4)  # bytes (h, lane) of a word
        out.words[e] = byte.contiguous().view(torch.int32).squeeze(-1)  # little-endian: byte 0 lowest
        s = (w.scale[e].to(torch.int16) + 126).reshape(nt, wn, 2, 8, kt, groups)  # t, w, h, g, kt, G
        out.scales[e] = (s[:, :, 0] | (s[:, :, 1] << 8)).permute(0, 3, 1, 2, 4).reshape(nt, kt, block_n // 2, groups)
    return out


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
