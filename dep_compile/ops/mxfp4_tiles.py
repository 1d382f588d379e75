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
    shape: torch.Size  # the logical [E, N, K]
    block_n: int
    block_k: int


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


def tile_mxfp4(w: Mxfp4Weight, block_n: int, block_k: int) -> Mxfp4Tiles:
    """Re-pack ``w`` (codes and E8M0 scales, ``[E, N, K]``) for the experts kernel's ``block_n`` x ``block_k``
    tiles, one expert at a time (the temporaries stay a few times one expert's codes); raises ValueError where
    ``untileable`` says why."""
    why = untileable(w, block_n, block_k)
    if why:
        raise ValueError(f"tile_mxfp4: {why}")
    E, N, K = w.shape
    nt, kt, wn, jn, groups = N // block_n, K // block_k, block_n // 16, block_k // 16, block_k // GROUP
    words = torch.empty(E, nt, kt, 2 * block_n, jn, dtype=torch.int32, device=w.packed.device)
    scales = torch.empty(E, nt, kt, block_n // 2, groups, dtype=torch.int16, device=w.packed.device)
    for e in range(E):
        p = w.packed[e]
        codes = torch.stack([p & 15, p >> 4], -1).reshape(N, K)  # one code a byte, input order
        # n = t block_n + 16 w + 8 h + g; k = kt block_k + 16 j + 8 half + 2 q + lane
        c = codes.reshape(nt, wn, 2, 8, kt, jn, 2, 4, 2)  # t, w, h, g, kt, j, half, q, lane
        c = c.permute(0, 4, 1, 3, 7, 5, 2, 8, 6).to(torch.int64)  # t, kt, w, g, q, j, h, lane, half
        word = torch.zeros(c.shape[:-3], dtype=torch.int64, device=c.device)
        for h, lane, half in itertools.product(range(2), repeat=3):
            word |= _placed(c[..., h, lane, half], 2 * half + h, lane)
        words[e] = torch.where(word >= 2**31, word - 2**32, word).reshape(nt, kt, 2 * block_n, jn)
        s = (w.scale[e].to(torch.int16) + 126).reshape(nt, wn, 2, 8, kt, groups)  # t, w, h, g, kt, G
        scales[e] = (s[:, :, 0] | (s[:, :, 1] << 8)).permute(0, 3, 1, 2, 4).reshape(nt, kt, block_n // 2, groups)
    return Mxfp4Tiles(words, scales, w.shape, block_n, block_k)


def cached_tiles(w: Mxfp4Weight, block_n: int, block_k: int) -> Mxfp4Tiles | str:
    """``tile_mxfp4(w, ...)`` made once per weight and kept on the tensor that owns its codes (a view's base: it
    lives as long as the parameter, and views made per call find it), remade when the codes or scales change in
    place; or why not (also kept: the scale check reads the device once). Never made inside CUDA-graph capture,
    nor where it would leave less than ``RESERVE_BYTES`` of GPU memory free (the copy doubles the experts' bytes:
    docs/mxfp4.md)."""
    owner = w.packed if w.packed._base is None else w.packed._base
    key = (w.packed.storage_offset(), tuple(w.packed.shape), w.packed.stride(), w.scale.data_ptr(),
           tuple(w.scale.shape), w.scale.stride(), block_n, block_k)
    stamp = (w.packed._version, w.scale._version)
    kept = owner.__dict__.setdefault("_dep_mxfp4_tiles", {})
    hit = kept.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    if w.packed.is_cuda and torch.cuda.is_current_stream_capturing():
        return "no re-packed copy yet, and none can be made inside CUDA-graph capture"
    size = w.packed.nbytes + w.scale.nbytes
    if w.packed.is_cuda and torch.cuda.mem_get_info(w.packed.device)[0] < size + RESERVE_BYTES:
        tiles = f"a re-packed copy ({size / 2**30:.2f} GiB) would leave less than {RESERVE_BYTES >> 30} GiB free"
    else:
        try:
            tiles = tile_mxfp4(w, block_n, block_k)
        except ValueError as e:
            tiles = str(e)
    kept[key] = (stamp, tiles)
    return tiles
