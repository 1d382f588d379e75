"""The SM90 code of the hottest loops keeps the structure their measured speed comes from (benchmarks/sass_mix.py:
compiled on the CPU by Triton's own ptxas; docs/perf.md gives the measurements)."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
    pytest.skip("this Triton ships no CUDA tools", allow_module_level=True)

from benchmarks import sass_mix  # noqa: E402


def _loop_with(kernel: str, opcode: str, listing: str | None = None):
    """The first loop of ``kernel`` (its SASS ``listing`` where the test already compiled it) whose mix holds
    ``opcode``."""
    listing = listing if listing is not None else sass_mix.sass(sass_mix.KERNELS[kernel]())
    mixes = [m for m in sass_mix.loops(listing) if m[opcode]]
    assert mixes, f"{kernel}: no loop issues {opcode}"
    return mixes[0]


@pytest.mark.parametrize("kernel", ["attn_res", "attn_res_part"])
def test_attn_res_loops_prefetch_into_registers_and_reduce_once(kernel):
    """A step loads its next two bank rows straight into registers (4 x 16 bytes a thread, no cp.async through
    shared memory), and a source's two sums cross the warps in one reduction (3 barriers a step, not 6): in the
    point reading its bank and in the bank part computed a point early (the same loop, ``_bank_sources``)."""
    mix = _loop_with(kernel, "SHFL.BFLY")
    assert mix["LDG.E.128"] == 4 and not any(op.startswith("LDGSTS") for op in mix), mix
    assert mix["BAR.SYNC.DEFER_BLOCKING"] <= 3, mix


def test_experts_gemm1_dequantizer_instruction_count():
    """The rotated words: a 128-input step of 128 MXFP4 values a thread (16 words) takes 64 BF16x2 scale FMAs and at
    most 12 logic ops and rotations a word (11 place the codes: stock/mxfp4_tiles.py; the nibble words took 22)."""
    mix = _loop_with("experts_gemm1", "HGMMA.64x32x16.F32.BF16")
    placing = mix["LOP3.LUT"] + mix["SHF.L.W.U32.HI"]
    assert mix["HMUL2.BF16_V2"] == 64 and placing <= 12 * 16, (placing, mix)


@pytest.mark.parametrize("part", [False, True], ids=["bank", "part"])
@pytest.mark.parametrize("ones", [("num_blocks",), ("write_slot",), ("num_blocks", "write_slot")], ids=str)
def test_attn_res_point_compiles_where_the_launch_specializes_ones(part, ones):
    """A launch makes integer arguments equal to 1 compile-time constants: the point kernel compiles with
    ``num_blocks`` and / or ``write_slot`` 1 (the merging point once failed there, on the H200: a condition of two
    constants is a Python bool)."""
    assert sass_mix.attn_res(part, **dict.fromkeys(ones, 1)).asm["cubin"]


def test_kda_state_loop_reduces_across_eight_lanes():
    """The split KDA core's state launch keeps its layout: a program's quarter of the state's rows as four column
    chunks puts a warp over 4 rows x 8 column groups, so a token step's two reductions over k cross 8 lanes (3
    shuffles a row) and the sum of squares for the norm launch once; in 2 warps at 128 registers, without local
    memory (27 shuffles and 548 instructions a step on Triton 3.6). One [Dv, Dk] tile (all 32 lanes along k) takes
    388 shuffles a step in the fused kernel."""
    listing = sass_mix.sass(sass_mix.KERNELS["kda_state"]())
    assert not re.findall(r"\b(?:LDL|STL)\b", listing)
    mix = _loop_with("kda_state", "SHFL.BFLY", listing)
    assert mix["SHFL.BFLY"] <= 32 and sum(mix.values()) <= 600, mix


def test_kda_prep_runs_f_b_as_one_tensor_core_product():
    """The split KDA core's prep launch computes F_B for its 16 token rows of a head as one product: 16 x 128 @
    128 x 128 in 32 HMMA.16816 a warp (4 warps side by side along the head's channels), ``f_b_w`` read once a
    program where the per-token prep read it once a token (its 188 µs a layer at 64 x q = 4: docs/perf.md)."""
    listing = sass_mix.sass(sass_mix.KERNELS["kda_prep"]())
    assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", listing)) == 32


def test_sparse_mla_tile_runs_on_wgmma():
    """At 64 tokens the sparse MLA's tile (64 heads, 8 warps) keeps both products on Hopper's wgmma (layout version 3),
    its P @ V in four 64x256x16 instructions a warpgroup a step. (Its scores' layout puts all 8 warps along the 64
    heads, Triton's choice for a dot feeding a dot, so each warpgroup computes the whole 64 x 64 score tile; Triton
    3.6 holds the loop in 252 registers, 3.9 spills in it: docs/perf.md, the sparse MLA's code.)"""
    compiled = sass_mix.KERNELS["sparse_mla"]()
    layouts = sass_mix.mma_layouts(compiled)
    assert layouts and all("versionMajor = 3" in lay for lay in layouts), layouts
    mix = _loop_with("sparse_mla", "HGMMA.64x256x16.F32.BF16", sass_mix.sass(compiled))
    assert mix["HGMMA.64x256x16.F32.BF16"] == 4, mix
