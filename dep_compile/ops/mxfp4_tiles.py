"""MXFP4 experts re-packed once into the order the experts kernel's MMA reads: a thread's codes in one word.

The checkpoint stores an expert weight ``[N, K]`` as ``packed [N, K/2]`` (input 2j in a byte's low nibble) and
``scale [N, K/32]`` (E8M0). Dequantized in registers straight from that layout, a thread of the Hopper MMA needs
two single bytes every 16 inputs of two rows; the compiler moves them into place byte by byte (docs/perf.md,
"Routed experts, MXFP4"). ``tile_mxfp4`` re-packs a copy tile by tile (``block_n`` rows x ``block_k`` inputs,
``block_n / 16`` warps of 16 rows): thread ``(w, g, q)`` (warp, lane / 4, lane % 4) of a tile holds rows
``n = 16 w + g`` and ``n + 8``; for each 16 inputs ``j`` it needs 8 values, four BF16x2 operand registers

    R0: row n,     inputs 16j+2q, +1     R1: row n + 8, inputs 16j+2q, +1
    R2: row n,     inputs 16j+2q+8, +9   R3: row n + 8, inputs 16j+2q+8, +9

(the low lane the even input), and their 32 code bits become one int32 word, placed so that each register is
the word rotated left and masked: ``Ri = rotl(word, a_i) & 0x80008000 | rotl(word, b_i) & 0x01C001C0`` with
``(a_i, b_i) = ROTATIONS[i]``. The masks put a code's sign on the lane's sign bit and its three magnitude bits
on the lowest two exponent bits and the first mantissa bit: the lane then holds the E2M1 value times 2^-126
(a BF16 subnormal for codes 0 and 1). ``ROTATIONS`` is the cheapest such placement (an exhaustive search: 11
shifts and logic ops for the four registers, against 22 from the checkpoint's bytes). Words are stored
``[E, N / block_n, K / block_k, 2 block_n (w, g, q), block_k / 16]``: a thread's words of one tile are
contiguous (16-byte loads).

Scales are stored per thread quad: ``[E, N / block_n, K / block_k, block_n / 2 (w, g), block_k / 32]`` int16,
the low byte for row n and the high byte for row n + 8, each ``s + 126`` (the BF16 exponent of 2^(s - 1)): the
kernel multiplies each register by 2^(s - 1) in one BF16 FMA, exact while s <= 128 (scales up to 2^1; every
real or drawn checkpoint's are far below). Same bytes as the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from ..stock.mxfp4 import GROUP, Mxfp4Weight, group_size

SCALE_MAX = 128  # largest E8M0 code whose 2^(s - 1) is a normal BF16 (the folded scale)
ROTATIONS = ((0, 0), (3, 3), (17, 6), (18, 13))  # (sign, magnitude) left rotations of a word giving R0 .. R3
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


def _placed(code: torch.Tensor, reg: int, lane: int) -> torch.Tensor:
    """The word bits (int64) that give ``code`` (E2M1, 0..15) as ``lane`` of operand register ``reg``."""
    a, b = ROTATIONS[reg]
    bit = lambda v, pos: ((v & 1) << ((pos - a if pos % 16 == 15 else pos - b) % 32))  # noqa: E731
    return (bit(code >> 3, 15 + 16 * lane) | bit(code >> 2, 8 + 16 * lane) | bit(code >> 1, 7 + 16 * lane)
            | bit(code, 6 + 16 * lane))


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
        c = c.permute(0, 4, 1, 3, 7, 5, 2, 8, 6).to(torch.int64)  # t, kt, w, g, q, j, h, lane, half
        word = torch.zeros(c.shape[:-3], dtype=torch.int64, device=c.device)
        for h, lane, half in itertools.product(range(2), repeat=3):
            word |= _placed(c[..., h, lane, half], 2 * half + h, lane)
        out.words[e] = torch.where(word >= 2**31, word - 2**32, word).reshape(nt, kt, 2 * block_n, jn)
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
