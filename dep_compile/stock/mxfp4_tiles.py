"""MXFP4 experts re-packed into the order kimi_dep's experts kernel's MMA reads: a thread's codes in one word.

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

Two ways to hold them: re-packed in place when the weights are loaded (``tile_in_place``, what the loaders do on
CUDA: the codes' and scales' own storage then holds the tiles, and the stock op reads them through
``untile_mxfp4``), or as a copy beside the checkpoint's layout (``ops/mxfp4_tiles.py``), which doubles the
experts' bytes.
"""

from __future__ import annotations

import itertools
import traceback
from typing import NamedTuple

import torch
from torch import Tensor

from .mxfp4 import GROUP, Mxfp4Weight, check_mxfp4, group_size, random_e8m0

SCALE_MAX = 128  # largest E8M0 code whose 2^(s - 1) is a normal BF16 (the folded scale)
SCALE_OFFSET = 126  # a tile's scale byte is s + 126: the BF16 exponent of 2^(s - 1)
ROTATIONS = ((0, 0), (3, 3), (17, 6), (18, 13))  # (sign, magnitude) left rotations of a word giving R0 .. R3
LOAD_TILE = (64, 128)  # (block_n, block_k) of the tiles made at load time: the default MXFP4 tactic's
_ORDER = (0, 4, 1, 3, 7, 5, 2, 8, 6)  # (t, w, h, g, kt, j, half, q, lane) -> (t, kt, w, g, q, j, h, lane, half)


class Mxfp4Tiles(NamedTuple):
    """An MXFP4 experts weight ``[E, N, K]`` re-packed by ``tile_mxfp4`` for ``block_n`` x ``block_k`` tiles."""

    words: Tensor  # int32 [E, N / block_n, K / block_k, 2 block_n, block_k / 16]
    scales: Tensor  # int16 [E, N / block_n, K / block_k, block_n / 2, block_k / 32]

    @property
    def block_n(self) -> int:
        """Rows of a tile."""
        return self.words.shape[-2] // 2

    @property
    def block_k(self) -> int:
        """Inputs of a tile."""
        return self.words.shape[-1] * 16

    @property
    def shape(self) -> torch.Size:
        """The logical shape ``[E, N, K]``."""
        E, nt, kt = self.words.shape[:3]
        return torch.Size((E, nt * self.block_n, kt * self.block_k))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weight ``[E, N, K]`` in ``dtype`` (exact in BF16)."""
        return untile_mxfp4(self).dequantize(dtype)


def check_tiles(what: str, words: Tensor, scales: Tensor) -> None:
    """ValueError naming ``what`` unless ``words`` / ``scales`` are int32 / int16 tiles of one weight."""
    if words.dtype != torch.int32 or scales.dtype != torch.int16 or words.dim() != 5 or scales.dim() != 5:
        raise ValueError(f"{what}: MXFP4 tiles are int32 words and int16 scales, 5-D; got {words.dtype} "
                         f"{tuple(words.shape)} / {scales.dtype} {tuple(scales.shape)}")
    two_bn, jn = words.shape[3:]
    if (tuple(scales.shape) != (*words.shape[:3], two_bn // 4, jn // 2) or two_bn % 32 or jn % 2
            or not (words.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"{what}: tile scales {tuple(scales.shape)} do not fit words {tuple(words.shape)} "
                         "(contiguous [E, N tiles, K tiles, 2 block_n, block_k / 16] / [..., block_n / 2, "
                         "block_k / 32], block_n a multiple of 16, block_k of 32)")


def as_mxfp4(what: str, packed: Tensor, scale: Tensor) -> Mxfp4Weight | Mxfp4Tiles:
    """The MXFP4 weight that ``packed`` / ``scale`` hold: the checkpoint's layout (uint8 codes) or tiles (int32
    words, ``tile_in_place``); ValueError naming ``what`` for anything else."""
    if packed.dtype == torch.int32:
        check_tiles(what, packed, scale)
        return Mxfp4Tiles(packed, scale)
    check_mxfp4(what, packed, scale)
    return Mxfp4Weight(packed, scale)


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


def code_bits(reg: int, lane: int) -> tuple[int, int, int, int]:
    """The word bits holding a code's bits 3 (sign), 2, 1, 0 as ``lane`` of operand register ``reg``: those the
    rotations and masks move to the lane's bits 15, 8, 7, 6."""
    a, b = ROTATIONS[reg]
    return ((15 + 16 * lane - a) % 32, (8 + 16 * lane - b) % 32, (7 + 16 * lane - b) % 32, (6 + 16 * lane - b) % 32)


def _placed(code: Tensor, reg: int, lane: int) -> Tensor:
    """The word bits (int64) that give ``code`` (E2M1, 0..15) as ``lane`` of operand register ``reg``."""
    return sum(((code >> (3 - i)) & 1) << pos for i, pos in enumerate(code_bits(reg, lane)))


def _code(word: Tensor, reg: int, lane: int) -> Tensor:
    """The E2M1 code (int64, 0..15) that ``word`` (int64, 0 .. 2^32 - 1) gives as ``lane`` of register ``reg``."""
    return sum(((word >> pos) & 1) << (3 - i) for i, pos in enumerate(code_bits(reg, lane)))


def _tile_expert(w: Mxfp4Weight, e: int, block_n: int, block_k: int) -> tuple[Tensor, Tensor]:
    """Expert ``e`` of ``w`` as tiles: (int32 words, int16 scales) of ``Mxfp4Tiles``' shapes less the expert dim."""
    _, N, K = w.shape
    nt, kt, wn, jn, groups = N // block_n, K // block_k, block_n // 16, block_k // 16, block_k // GROUP
    p = w.packed[e]
    codes = torch.stack([p & 15, p >> 4], -1).reshape(N, K)  # one code a byte, input order
    # n = t block_n + 16 w + 8 h + g; k = kt block_k + 16 j + 8 half + 2 q + lane
    c = codes.reshape(nt, wn, 2, 8, kt, jn, 2, 4, 2)  # t, w, h, g, kt, j, half, q, lane
    c = c.permute(_ORDER).to(torch.int64)  # t, kt, w, g, q, j, h, lane, half
    word = torch.zeros(c.shape[:-3], dtype=torch.int64, device=c.device)
    for h, lane, half in itertools.product(range(2), repeat=3):
        word |= _placed(c[..., h, lane, half], 2 * half + h, lane)
    words = torch.where(word >= 2**31, word - 2**32, word).reshape(nt, kt, 2 * block_n, jn).to(torch.int32)
    s = (w.scale[e].to(torch.int16) + SCALE_OFFSET).reshape(nt, wn, 2, 8, kt, groups)  # t, w, h, g, kt, G
    return words, (s[:, :, 0] | (s[:, :, 1] << 8)).permute(0, 3, 1, 2, 4).reshape(nt, kt, block_n // 2, groups)


def _tile_shapes(shape: tuple[int, int, int], block_n: int, block_k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``Mxfp4Tiles``' (words, scales) shapes for a weight ``[E, N, K]`` in ``block_n`` x ``block_k`` tiles."""
    E, N, K = shape
    lead = (E, N // block_n, K // block_k)
    return (*lead, 2 * block_n, block_k // 16), (*lead, block_n // 2, block_k // GROUP)


def tile_mxfp4(w: Mxfp4Weight, block_n: int, block_k: int, out: Mxfp4Tiles | None = None) -> Mxfp4Tiles:
    """Re-pack ``w`` (codes and E8M0 scales, ``[E, N, K]``) for the experts kernel's ``block_n`` x ``block_k``
    tiles, one expert at a time (the temporaries stay a few times one expert's codes), into ``out`` if given (its
    buffers keep their addresses); raises ValueError where ``untileable`` says why."""
    why = untileable(w, block_n, block_k)
    if why:
        raise ValueError(f"tile_mxfp4: {why}")
    shapes = _tile_shapes(w.shape, block_n, block_k)
    if out is None:
        out = Mxfp4Tiles(torch.empty(shapes[0], dtype=torch.int32, device=w.packed.device),
                         torch.empty(shapes[1], dtype=torch.int16, device=w.packed.device))
    elif (tuple(out.words.shape), tuple(out.scales.shape)) != shapes:
        raise ValueError(f"tile_mxfp4: out holds words {tuple(out.words.shape)}, scales {tuple(out.scales.shape)}; "
                         f"{shapes} needed")
    for e in range(w.shape[0]):
        out.words[e], out.scales[e] = _tile_expert(w, e, block_n, block_k)
    return out


def _untile_expert(t: Mxfp4Tiles, e: int) -> tuple[Tensor, Tensor]:
    """Expert ``e`` of ``t`` in the checkpoint's layout: (uint8 codes [N, K/2], uint8 E8M0 scales [N, K/32])."""
    _, N, K = t.shape
    nt, kt, wn, jn, groups = N // t.block_n, K // t.block_k, t.block_n // 16, t.block_k // 16, t.block_k // GROUP
    back = tuple(_ORDER.index(d) for d in range(len(_ORDER)))
    word = t.words[e].reshape(nt, kt, wn, 8, 4, jn).to(torch.int64) & 0xFFFFFFFF  # t, kt, w, g, q, j
    c = torch.stack([torch.stack([torch.stack([_code(word, 2 * half + h, lane).to(torch.uint8) for half in range(2)], -1)
                                  for lane in range(2)], -2) for h in range(2)], -3)  # ..., h, lane, half (uint8: small)
    codes = c.permute(back).reshape(N, K)
    v = t.scales[e].reshape(nt, kt, wn, 8, groups).to(torch.int32) & 0xFFFF  # t, kt, w, g, G
    s = torch.stack([v & 255, v >> 8], 3).permute(0, 2, 3, 4, 1, 5)  # t, w, h, g, kt, G
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8), (s.reshape(N, K // GROUP) - SCALE_OFFSET).to(torch.uint8)


def untile_mxfp4(t: Mxfp4Tiles) -> Mxfp4Weight:
    """The checkpoint's layout (uint8 codes and E8M0 scales, ``[E, N, K]``) of tiles: ``tile_mxfp4``'s inverse,
    one expert at a time."""
    check_tiles("untile_mxfp4", t.words, t.scales)
    E, N, K = t.shape
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8, device=t.words.device)
    scale = torch.empty(E, N, K // GROUP, dtype=torch.uint8, device=t.words.device)
    for e in range(E):
        packed[e], scale[e] = _untile_expert(t, e)
    return Mxfp4Weight(packed, scale)


def in_place_why(w: Mxfp4Weight, block_n: int, block_k: int) -> str | None:
    """Why ``w`` cannot be re-packed into tiles in its own storage (None when it can): ``untileable``'s reasons,
    or storage that cannot be viewed as words (not contiguous, misaligned in memory or in its storage)."""
    why = untileable(w, block_n, block_k)
    if why is None and not (w.packed.is_contiguous() and w.scale.is_contiguous()):
        why = "codes or scales not contiguous"
    if why is None and any(v % size for t, size in ((w.packed, 4), (w.scale, 2))
                           for v in (t.data_ptr(), t.storage_offset())):  # address: word loads; offset: view(dtype)
        why = "codes or scales not aligned to their words (address or offset in their storage)"
    return why


class MixedLayoutError(RuntimeError):
    """A re-pack in place failed and could not be undone: some experts of the weight hold tiles, the rest the
    checkpoint's layout (the error says which); the weight must be loaded again."""


def _rewrite(what: str, E: int, make, dst: tuple[Tensor, Tensor], undo, back: tuple[Tensor, Tensor]) -> None:
    """Expert by expert, ``dst[0][e], dst[1][e] = make(e)``: all or nothing. ``make`` reads slot e and returns new
    tensors; slot e's old bytes are copied (``back[i][e]``, one expert) before it is written, and one assignment
    records each step (an interrupt between two bytecodes cannot split the record). On any failure, an interrupt
    included: the slot being written is put back from its copy and the experts before it with ``back[0][e],
    back[1][e] = undo(e)``, once the failed step's temporaries are freed, and the failure is re-raised; a failure
    while putting back raises ``MixedLayoutError``."""
    state = (0, None)  # (experts rewritten, the old bytes of the slot being written, or None)
    try:
        for e in range(E):
            new = make(e)
            state = (e, (back[0][e].clone(), back[1][e].clone()))
            dst[0][e], dst[1][e] = new
            state = (e + 1, None)
        return
    except BaseException as err:
        failure = err
    traceback.clear_frames(failure.__traceback__)  # the failed step's temporaries (its locals) go first
    done, old = state
    moved = list(range(done)) + ([done] if old is not None else [])  # rewritten, or half written
    try:
        if old is not None:
            back[0][done].copy_(old[0])
            back[1][done].copy_(old[1])
            moved.pop()
        while moved:
            back[0][moved[0]], back[1][moved[0]] = undo(moved[0])
            moved.pop(0)
    except BaseException as err:
        raise MixedLayoutError(f"{what}: failed at expert {done}, then putting the experts back failed ({err!r}): "
                               f"experts {moved} are rewritten, the others not; load the weight again") from err
    raise failure


def tile_in_place(w: Mxfp4Weight, block_n: int = LOAD_TILE[0], block_k: int = LOAD_TILE[1]) -> Mxfp4Tiles:
    """Re-pack ``w`` into tiles in its own storage (the same bytes, one expert at a time: nothing of the size of
    the weight is allocated); ``w``'s codes and scales read as tiles afterwards. ValueError where ``in_place_why``
    says why; a failure midway (out of memory) leaves ``w`` as it was (``_rewrite``)."""
    why = in_place_why(w, block_n, block_k)
    if why:
        raise ValueError(f"tile_in_place: {why}")
    words, scales = _tile_shapes(w.shape, block_n, block_k)
    t = Mxfp4Tiles(w.packed.reshape(-1).view(torch.int32).view(words), w.scale.reshape(-1).view(torch.int16).view(scales))
    _rewrite("tile_in_place", w.shape[0], lambda e: _tile_expert(w, e, block_n, block_k), t, lambda e: _untile_expert(t, e),
             (w.packed, w.scale))
    return t


def untile_in_place(t: Mxfp4Tiles) -> Mxfp4Weight:
    """``tile_in_place``'s inverse: the checkpoint's layout in the tiles' own storage, all or nothing."""
    check_tiles("untile_in_place", t.words, t.scales)
    E, N, K = t.shape
    w = Mxfp4Weight(t.words.reshape(-1).view(torch.uint8).view(E, N, K // 2),
                    t.scales.reshape(-1).view(torch.uint8).view(E, N, K // GROUP))
    _rewrite("untile_in_place", E, lambda e: _untile_expert(t, e), (w.packed, w.scale),
             lambda e: _tile_expert(w, e, t.block_n, t.block_k), t)
    return w


def scale_range_why(t: Mxfp4Tiles) -> str | None:
    """Why the tiles' scale bytes are not what ``tile_mxfp4`` writes (each ``s + 126`` with ``s <= SCALE_MAX``;
    the readers disagree on any other byte), None when they are; reads every scale (a device sync)."""
    b = t.scales.view(torch.uint8)  # both bytes of every pair
    lo, hi = int(b.min()), int(b.max())
    if lo < SCALE_OFFSET or hi > SCALE_OFFSET + SCALE_MAX:
        return (f"tile scale bytes {lo}..{hi} outside {SCALE_OFFSET}..{SCALE_OFFSET + SCALE_MAX} "
                f"(E8M0 0..{SCALE_MAX} plus {SCALE_OFFSET})")
    return None


def random_tiles(shape: tuple[int, int, int], block_n: int, block_k: int, generator: torch.Generator,
                 std: float) -> Mxfp4Tiles:
    """Random tiles of a weight ``[E, N, K]``, on ``generator``'s device, drawn as they are stored: any word is
    eight uniform codes, each scale byte ``random_e8m0``'s plus 126 (what ``random_mxfp4`` then ``tile_mxfp4``
    draws, without the re-pack)."""
    words, scales = _tile_shapes(shape, block_n, block_k)
    words = torch.randint(0, 256, (*words, 4), generator=generator, dtype=torch.uint8,
                          device=generator.device).view(torch.int32).squeeze(-1)
    pairs = random_e8m0((*scales, 2), generator, std).to(torch.int16) + SCALE_OFFSET
    return Mxfp4Tiles(words, pairs[..., 0] | (pairs[..., 1] << 8))


__all__ = ["SCALE_MAX", "SCALE_OFFSET", "ROTATIONS", "LOAD_TILE", "Mxfp4Tiles", "check_tiles", "as_mxfp4", "untileable", "code_bits",
           "tile_mxfp4", "untile_mxfp4", "in_place_why", "MixedLayoutError", "tile_in_place", "untile_in_place",
           "scale_range_why", "random_tiles"]
