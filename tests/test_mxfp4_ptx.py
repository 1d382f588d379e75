"""The MXFP4 experts kernels' inline PTX, run on the CPU by a simulator (tests/ptx_sim.py): the checkpoint-layout
dequantizer on code bytes, and the re-packed words' dequantizer on ``tile_mxfp4``'s output, each against the
format's definition (E2M1 value times 2^(s - 127)). The interpreter runs only the kernels' integer twins, so
without this the PTX strings are checked on a GPU alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dep_compile.stock import mxfp4_tiles
from dep_compile.stock.mxfp4 import E2M1, Mxfp4Weight
from ptx_sim import run_ptx

pytest.importorskip("triton")  # the PTX strings live in the Triton module (CI: its interpreter stage)
from dep_compile.ops import experts_triton as et  # noqa: E402


def _ptx(name: str) -> str:
    s = getattr(et, name)
    return getattr(s, "value", s)


def _bf16_bits(values: torch.Tensor) -> np.ndarray:
    """BF16 bit patterns (uint32, one a value) of ``values``."""
    return values.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def _expected(codes: np.ndarray, s: np.ndarray) -> np.ndarray:
    """BF16 bits of E2M1[code] * 2^(s - 127)."""
    return _bf16_bits(torch.tensor(E2M1)[torch.from_numpy(codes.astype(np.int64))]
                      * torch.exp2(torch.from_numpy(s.astype(np.float32)) - 127))


def _lanes(reg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return reg & 0xFFFF, reg >> 16


def test_checkpoint_bytes_dequantizer():
    """_DEQUANT_PTX: four code bytes and the two byte pairs' scales -> each nibble's weight, every code and a
    scale range that reaches BF16 subnormals."""
    rng = np.random.default_rng(0)
    n = 4096
    b = rng.integers(0, 256, size=(n, 4), dtype=np.uint32)
    b[:256, 0] = np.arange(256)  # every byte value
    s = rng.integers(1, 140, size=(n, 2), dtype=np.uint32)
    word = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    scale = [_bf16_bits(torch.exp2(torch.from_numpy(s[:, i].astype(np.float32)) - 127)) * 0x10001 for i in range(2)]
    out = run_ptx(_ptx("_DEQUANT_PTX"), {4: word, 5: scale[0], 6: scale[1]}, 4)
    for reg, (nib, pair) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):  # $0 low 0-1, $1 low 2-3, $2/$3 high
        for lane, got in enumerate(_lanes(out[reg])):
            byte = b[:, 2 * pair + lane]
            assert np.array_equal(got, _expected((byte >> (4 * nib)) & 15, s[:, pair])), (reg, lane)


def _word_mismatches(bn: int, bk: int, seed: int) -> int:
    """Lanes where _WORD_PTX, run on ``tile_mxfp4``'s words and folded scales of a random weight, differs from the
    weight the checkpoint defines (registers R0..R3: row n / n + 8, inputs 16j + 2q (+1) / + 8 (+9))."""
    E, N, K = 2, 2 * bn, 2 * bk
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (E, N, K), generator=g)
    s = torch.randint(100, mxfp4_tiles.SCALE_MAX + 1, (E, N, K // 32), generator=g, dtype=torch.int64)
    w = Mxfp4Weight((codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8), s.to(torch.uint8))
    t = mxfp4_tiles.tile_mxfp4(w, bn, bk)
    words = t.words.numpy().astype(np.int64).astype(np.uint32)  # [E, nt, kt, 2 bn (w, g, q), bk / 16]
    sc = t.scales.numpy().astype(np.uint32) & 0xFFFF  # [E, nt, kt, bn / 2 (w, g), bk / 32]
    e, nt, kt, wi, gi, q, j = np.meshgrid(*[np.arange(d) for d in (E, N // bn, K // bk, bn // 16, 8, 4, bk // 16)],
                                          indexing="ij")
    word = words[e, nt, kt, 32 * wi + 4 * gi + q, j]
    pair = sc[e, nt, kt, 8 * wi + gi, j // 2]
    folded = [((pair >> (8 * h)) & 0xFF) * 0x00800080 for h in (0, 1)]  # BF16 2^(s - 1) in both lanes
    out = run_ptx(_ptx("_WORD_PTX"), {4: word, 5: folded[0], 6: folded[1]}, 4)
    row0, bad = nt * bn + 16 * wi + gi, 0
    for reg in range(4):
        h, half = reg % 2, reg // 2
        for lane, got in enumerate(_lanes(out[reg])):
            n, k = row0 + 8 * h, kt * bk + 16 * j + 8 * half + 2 * q + lane
            bad += int((got != _expected(codes.numpy()[e, n, k], s.numpy()[e, n, k // 32])).sum())
    return bad


@pytest.mark.parametrize("bn, bk", [(64, 128), (16, 32)])
def test_rotated_words_dequantizer(bn, bk):
    """_WORD_PTX on ``tile_mxfp4``'s output gives every weight bit for bit, every code, scales 2^-27 .. 2^1."""
    assert _word_mismatches(bn, bk, seed=1) == 0


def test_rotated_words_check_fails_on_a_wrong_placement(monkeypatch):
    """The check can fail: words placed for another rotation of R2 than the PTX applies."""
    rot = list(mxfp4_tiles.ROTATIONS)
    rot[2] = (rot[2][0], rot[2][1] + 1)
    monkeypatch.setattr(mxfp4_tiles, "ROTATIONS", tuple(rot))
    assert _word_mismatches(16, 32, seed=2) > 0
