"""The stock CUDA path's dequantizer on MXFP4 tiles (``stock/mxfp4_cuda.py``) against the readable reference.

Tiles from ``tile_mxfp4`` of seeded random MXFP4 experts, some experts not touched: each touched expert bit-equal
to ``Mxfp4Tiles.dequantize`` (untile, then the torch reference) and to the checkpoint layout's Triton kernel; the
grouped-GEMM experts on tiles bit-equal to them on the checkpoint's layout; mutants of the bit table (lanes or
rows swapped) are caught. Small sizes: runs in Triton's CPU interpreter (``TRITON_TEST_DEVICE=cpu
TRITON_INTERPRET=1``) and on CUDA; a CUDA-graph capture on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.stock import mxfp4_tiles
from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4
from dep_compile.stock.mxfp4_tiles import code_bits, tile_mxfp4

from triton_device import TRITON_DEV as _DEV, device_test, use_triton

BETA, BETA_LIN = 4.0, 25.0
# E, N, K, block_n, block_k: the load-time tiles, small ones, blocks of the kernel ragged on N and K, a 48 x 96 tile
SHAPES = [(3, 128, 256, 64, 128), (2, 64, 128, 16, 32), (2, 96, 192, 32, 64), (2, 96, 96, 48, 96)]


def _mc():
    use_triton()
    from dep_compile.stock import mxfp4_cuda  # noqa: PLC0415 - CUDA / interpreter only

    return mxfp4_cuda


def _weight(E, N, K, seed):
    """Seeded random MXFP4 experts [E, N, K] on the test device, with the extreme scales the tiles keep in expert 0's
    first groups: E8M0 128 (2^1), and 0 (2^-127, a BF16 subnormal) on CUDA or 1 (2^-126: subnormal products) in the
    interpreter, whose BF16 -> FP32 conversion of subnormals is wrong (the checkpoint layout's kernel misses too)."""
    w = Mxfp4Weight(*random_mxfp4((E, N, K), torch.Generator(device=_DEV).manual_seed(seed), K ** -0.5))
    w.scale[0, :, 0], w.scale[0, : N // 2, 1] = 0 if _DEV == "cuda" else 1, 128
    return w


def _touched(E):
    """int32 [E]: every expert but the last touched (at least one of each)."""
    return (torch.arange(E, device=_DEV) < E - 1).to(torch.int32)


def _assert_equal_on_touched(got, ref, touched):
    """BF16 ``got`` and ``ref`` [E, N, K] bit-equal on each expert ``touched`` marks."""
    for e in range(len(touched)):
        if touched[e]:
            assert torch.equal(got[e].view(torch.int16), ref[e].view(torch.int16)), e


@device_test
@pytest.mark.parametrize("E, N, K, bn, bk", SHAPES)
def test_tiles_dequantize_exactly_on_touched_experts(E, N, K, bn, bk):
    """Bit-equal to the tiles' reference and to the checkpoint layout's kernel on every touched expert."""
    mc = _mc()
    w = _weight(E, N, K, seed=N + K + bn)
    tiles, touched = tile_mxfp4(w, bn, bk), _touched(E)
    got = mc.dequantize_touched(tiles, touched)
    assert got.dtype == torch.bfloat16 and got.shape == (E, N, K)
    _assert_equal_on_touched(got, tiles.dequantize(), touched)
    _assert_equal_on_touched(got, mc.dequantize_touched(w, touched), touched)


@device_test
def test_tiles_strided_expert_views():
    """Every other expert of a larger stack (strided on the expert axis): the same values as contiguous tiles."""
    mc = _mc()
    w = _weight(4, 64, 128, seed=5)
    tiles = tile_mxfp4(w, 32, 64)
    view = mxfp4_tiles.Mxfp4Tiles(tiles.words[1::2], tiles.scales[1::2])
    touched = torch.ones(2, dtype=torch.int32, device=_DEV)
    _assert_equal_on_touched(mc.dequantize_touched(view, touched), w.dequantize()[1::2], touched)


def _grouped_mm_or_skip():
    """Skip where ``torch._grouped_mm`` does not run on the test device."""
    a = torch.ones(2, 16, dtype=torch.bfloat16, device=_DEV)
    try:
        torch._grouped_mm(a, torch.ones(1, 16, 16, dtype=torch.bfloat16, device=_DEV),
                          offs=torch.tensor([2], dtype=torch.int32, device=_DEV))
    except (AttributeError, NotImplementedError, RuntimeError) as err:
        pytest.skip(f"no grouped GEMMs on {_DEV}: {err}")


@device_test
@pytest.mark.parametrize("start", [0, 3])
def test_grouped_experts_on_tiles_equal_the_checkpoint_layout(start):
    """routed_experts_mxfp4_grouped on tiles (another tile size for w13 and w2) bit-equal to it on the checkpoint's
    layout: 6 tokens top-2 over 6 local experts of 12 ids (``expert_start`` 0 or 3: other ranks' ids, and
    experts nobody picked)."""
    mc = _mc()
    _grouped_mm_or_skip()
    E, T, K, lat, inter = 6, 6, 2, 128, 64
    g = torch.Generator().manual_seed(7 + start)
    x = torch.randn(T, lat, generator=g).to(torch.bfloat16).to(_DEV)
    w13, w2 = _weight(E, 2 * inter, lat, seed=8), _weight(E, lat, inter, seed=9)
    ids = torch.stack([torch.randperm(12, generator=g)[:K] for _ in range(T)]).to(_DEV)
    tw = (torch.rand(T, K, generator=g) + 0.1).to(_DEV)
    ref = mc.routed_experts_mxfp4_grouped(x, w13, w2, tw, ids, start, BETA, BETA_LIN)
    got = mc.routed_experts_mxfp4_grouped(x, tile_mxfp4(w13, 32, 64), tile_mxfp4(w2, 64, 32), tw, ids, start, BETA,
                                          BETA_LIN)
    assert float(ref.abs().max()) > 0.1, "the case routes no real work to local experts"
    assert torch.equal(got, ref)


@device_test
@pytest.mark.parametrize("mutant", ["lanes", "rows"])
def test_check_catches_a_wrong_bit_table(mutant, monkeypatch):
    """The check can fail: the kernel fed the bits of the other lane (inputs 2i and 2i + 1 swapped) or of the other
    register of the pair (rows n and n + 8) misses the reference."""
    mc = _mc()
    w = _weight(2, 64, 128, seed=11)
    tiles, touched = tile_mxfp4(w, 32, 64), _touched(2)
    swap = {"lanes": lambda reg, lane: code_bits(reg, 1 - lane), "rows": lambda reg, lane: code_bits(reg ^ 1, lane)}
    monkeypatch.setattr(mc, "code_bits", swap[mutant])
    got = mc.dequantize_touched(tiles, touched)
    assert not torch.equal(got[0].view(torch.int16), w.dequantize()[0].view(torch.int16))


@device_test
def test_kernel_follows_the_rotations(monkeypatch):
    """Tiles made with other rotations (every code bit one word bit lower: other words) dequantize to the same
    weights: the bit table is built from ``code_bits``, not fixed in the kernel."""
    mc = _mc()
    w = _weight(2, 64, 128, seed=12)
    touched, words = _touched(2), tile_mxfp4(w, 32, 64).words
    monkeypatch.setattr(mxfp4_tiles, "ROTATIONS", tuple(((a + 1) % 32, (b + 1) % 32) for a, b in mxfp4_tiles.ROTATIONS))
    tiles = tile_mxfp4(w, 32, 64)
    assert not torch.equal(tiles.words, words)
    _assert_equal_on_touched(mc.dequantize_touched(tiles, touched), w.dequantize(), touched)


@pytest.mark.cuda
def test_capture_in_cuda_graph():
    """Captured once, replayed on new tiles and another touched set: equals an eager call (no host sync inside)."""
    mc = _mc()
    w, fresh = _weight(3, 128, 256, seed=13), _weight(3, 128, 256, seed=14)
    tiles, touched = tile_mxfp4(w, 64, 128), _touched(3)
    mc.dequantize_touched(tiles, touched)  # compiles the kernel and copies the bit table: before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mc.dequantize_touched(tiles, touched)
    tile_mxfp4(fresh, 64, 128, out=tiles)
    touched.copy_(torch.tensor([0, 1, 1], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_equal_on_touched(captured, fresh.dequantize(), touched)
