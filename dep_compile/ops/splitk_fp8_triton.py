"""Split-K skinny GEMM for FP8 block-scaled decode projections (Triton, SM90): W8A8 as stock computes it.

``out[M, N] = x[M, K] @ W[N, K]^T`` where ``W`` is e4m3 codes with one FP32 scale per 128 x 128 block of
each row segment (``stock/fp8_block.py``) and ``x`` is BF16. Two launches:

1. stock's own quantizer (``stock/fp8_block_cuda.py``) turns ``x`` into e4m3 codes and per-group scales,
   the reference's bit for bit;
2. the GEMM streams the weight once: the FP8 products of one 128-input block are summed by the tensor cores
   (``tl.dot``, FP32 out) and scaled in the loop's epilogue by the activation group's and the weight
   block's scales, in block order.

The GEMM is a programmatic dependent launch (PDL): the quantizer lets it start at once and its programs wait
(``griddepcontrol.wait``) before reading the codes, so its launch and prologue overlap the quantizer: 0.6-0.8 µs a
call on the H200 (2026-12-04, every shape and row count; prefetching weight rows into L2 before the wait measured
1-6 µs slower). The kernels before the quantizer are complete when it starts, so nothing else is read early.

Quantizing inside the GEMM instead (each program its own x tiles) measured 2-4x slower on the H200 at
1-64 rows: the correctly rounded division of every x tile, repeated by every row tile, bounds the loop.
The rest is the BF16 kernel's schedule (``splitk_triton``): operands swapped (``acc[block_n, block_m]``),
the ``split_k`` slices of one row tile summed in slice order by the last program to arrive.

Tensors (one CUDA device): ``x [M, K]`` bf16, unit stride along K; ``xq [M, K]`` e4m3 and ``xs [M, ceil(K/128)]``
fp32, its codes and scales; ``w [N, K]`` float8_e4m3fn (may be a row slice of a packed weight); ``scale [R, ceil(K/128)]`` fp32; ``scale_row [N]`` int32, each weight row's
scale row (``fp8_block.scale_rows``); ``out [M, N]`` bf16; ``workspace`` as ``splitk_triton``'s (``split_k
> 1``). ``tactic.block_k`` is 128, 256 or 512: one, two or four activation groups and weight blocks a loop step,
summed in block order (the same arithmetic at every block_k).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dep_compile.stock.fp8_block import BLOCK
from dep_compile.stock.fp8_block_cuda import quantize_activations
from dep_compile.tactics import SplitK

from .splitk_triton import gdc_wait, splitk_block_m, splitk_buffers, splitk_grid, splitk_k_per_split, splitk_store

__all__ = ["fp8_splitk_linear"]

_SMEM_BYTES = 225 * 1024
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
STEP_K = (128, 256, 512)  # the block_k a tactic may take: 1, 2 or 4 scale blocks a loop step


@triton.jit(do_not_specialize=["M"])
def _fp8_splitk_kernel(
    xq_ptr,  # [M, K] e4m3 activation codes
    xs_ptr,  # [M, G] fp32 activation scales
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [R, G] fp32 weight block scales
    srow_ptr,  # [N] int32 scale row of each weight row
    out_ptr,  # [M, N] bf16
    part_ptr,  # [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1)
    cnt_ptr,  # [m_tiles * n_tiles] int32 arrival counters (SPLIT_K > 1)
    M,
    N,
    K,
    G,
    stride_wn,
    stride_sr,
    stride_om,
    K_PER_SPLIT,  # multiple of 128
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STEP_BLOCKS: tl.constexpr,  # 128-input blocks a loop step takes (block_k / 128)
    EVEN_K: tl.constexpr,  # K % block_k == 0
    USE_PDL: tl.constexpr,  # a programmatic dependent launch after the quantizer
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    if SPLIT_K > 1:
        pid_n = pid // SPLIT_K
        pid_k = pid % SPLIT_K
    else:
        pid_n = pid
        pid_k = 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped rows: the ragged tile re-reads valid rows
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    s_rows = s_ptr + tl.load(srow_ptr + rn).to(tl.int64) * stride_sr  # [BLOCK_N] this tile's scale rows

    if USE_PDL:
        gdc_wait()  # launched while the quantizer runs: its codes and scales are ready past this point

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_ptrs = xq_ptr + rm[:, None] * K + (k_start + offs_k)[None, :]
    xs_ptrs = xs_ptr + rm * G + k_start // 128
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_start + offs_k)[None, :]
    xmask = offs_m[:, None] < M
    for k in tl.range(k_start, k_end, 128 * STEP_BLOCKS):
        for j in tl.static_range(STEP_BLOCKS):  # the step's 128-input blocks, in block order
            kj = k + j * 128
            if EVEN_K:
                xq = tl.load(x_ptrs + j * 128, mask=xmask, other=0.0)
                wt = tl.load(w_ptrs + j * 128, eviction_policy="evict_first")
                xs = tl.load(xs_ptrs + j, mask=offs_m < M, other=0.0)  # [BLOCK_M]
                ws = tl.load(s_rows + kj // 128)  # [BLOCK_N]
            else:
                kmask = (kj + offs_k) < K
                xq = tl.load(x_ptrs + j * 128, mask=xmask & kmask[None, :], other=0.0)
                wt = tl.load(w_ptrs + j * 128, mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
                xs = tl.load(xs_ptrs + j, mask=(offs_m < M) & ((offs_m * 0 + kj) < K), other=0.0)
                ws = tl.load(s_rows + kj // 128, mask=(offs_n * 0 + kj) < K, other=0.0)
            blk = tl.dot(wt, tl.trans(xq))  # [BLOCK_N, BLOCK_M] FP32: one block's FP8 products
            acc += blk * xs[None, :] * ws[:, None]
        x_ptrs += 128 * STEP_BLOCKS
        xs_ptrs += STEP_BLOCKS
        w_ptrs += 128 * STEP_BLOCKS

    splitk_store(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_m, pid_n, pid_k,
                 BLOCK_M, BLOCK_N, SPLIT_K, False)


def _check(x, w, scale, scale_row, out, tactic: SplitK) -> None:
    """A ValueError unless the operands are as the module doc says."""
    if tactic.block_k not in STEP_K:
        raise ValueError(f"fp8_splitk_linear: block_k must be one of {STEP_K} (whole scale blocks a step), "
                         f"got {tactic.block_k}")
    m, k = x.shape
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_splitk_linear: x bf16, w float8_e4m3fn, scale float32 expected, got {x.dtype}, "
                         f"{w.dtype}, {scale.dtype}")
    if w.shape[1] != k or tuple(out.shape) != (m, n) or scale.shape[1] != -(-k // BLOCK) or scale_row.shape != (n,):
        raise ValueError(f"fp8_splitk_linear: shapes x{tuple(x.shape)} w{tuple(w.shape)} scale{tuple(scale.shape)} "
                         f"scale_row{tuple(scale_row.shape)} out{tuple(out.shape)} do not match")
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("fp8_splitk_linear: x, w, scale and out need unit stride along their last dim")


def fp8_splitk_linear(x, w, scale, scale_row, out, tactic: SplitK, workspace=None, *, pdl: bool = True):
    """``out = x @ dequant(w)^T`` as the module doc computes it; returns ``out`` (``workspace``: as
    ``splitk_linear``'s, for ``tactic.split_k > 1``; without one a zeroed buffer is made per call). ``pdl``: launch
    the GEMM as a programmatic dependent of the quantizer (module doc; never under Triton's interpreter)."""
    _check(x, w, scale, scale_row, out, tactic)
    m, k = x.shape
    n = w.shape[0]
    pdl = pdl and not _INTERPRET
    parts, counters = splitk_buffers(workspace, m, n, tactic, out, "fp8_splitk_linear")
    xq, xs = quantize_activations(x, launch_dependents=pdl)
    bm = splitk_block_m(m)
    per_stage = (tactic.block_n + bm) * tactic.block_k  # bytes: the FP8 weight and activation tiles
    stages = max(1, min(tactic.num_stages, _SMEM_BYTES // per_stage))
    _fp8_splitk_kernel[splitk_grid(m, n, tactic)](
        xq, xs, w, scale, scale_row, out, parts, counters, m, n, k, xs.shape[1], w.stride(0), scale.stride(0),
        out.stride(0), splitk_k_per_split(k, tactic), BLOCK_M=bm, BLOCK_N=tactic.block_n, SPLIT_K=tactic.split_k,
        STEP_BLOCKS=tactic.block_k // BLOCK, EVEN_K=(k % tactic.block_k == 0), USE_PDL=pdl,
        num_warps=tactic.num_warps, num_stages=stages, launch_pdl=pdl,
    )
    return out
