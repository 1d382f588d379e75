"""Split-K skinny GEMM for FP8 block-scaled decode projections (Triton, SM90): W8A8 as stock computes it.

``out[M, N] = x[M, K] @ W[N, K]^T`` where ``W`` is e4m3 codes with one FP32 scale per 128 x 128 block of
each row segment (``stock/fp8_block.py``) and ``x`` is BF16. Two launches:

1. stock's own quantizer (``stock/fp8_block_cuda.py``) turns ``x`` into e4m3 codes and per-group scales,
   the reference's bit for bit;
2. the GEMM streams the weight once: the FP8 products of one 128-input block are summed by the tensor cores
   (``tl.dot``, FP32 out) and scaled in the loop's epilogue by the activation group's and the weight
   block's scales, in block order.

Quantizing inside the GEMM instead (each program its own x tiles) measured 2-4x slower on the H200 at
1-64 rows: the correctly rounded division of every x tile, repeated by every row tile, bounds the loop.
The rest is the BF16 kernel's schedule (``splitk_triton``): operands swapped (``acc[block_n, block_m]``),
the ``split_k`` slices of one row tile summed in slice order by the last program to arrive.

Tensors (one CUDA device): ``x [M, K]`` bf16, unit stride along K; ``xq [M, K]`` e4m3 and ``xs [M, ceil(K/128)]``
fp32, its codes and scales; ``w [N, K]`` float8_e4m3fn (may be a row slice of a packed weight); ``scale [R, ceil(K/128)]`` fp32; ``scale_row [N]`` int32, each weight row's
scale row (``fp8_block.scale_rows``); ``out [M, N]`` bf16; ``workspace`` as ``splitk_triton``'s (``split_k
> 1``). ``tactic.block_k`` must be 128 (one activation group and one weight block per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dep_compile.stock.fp8_block_cuda import quantize_activations
from dep_compile.tactics import SplitK

from .splitk_triton import splitk_block_m, splitk_grid, splitk_workspace_numel

__all__ = ["fp8_splitk_linear", "fp8_splitk_check"]

GROUP = 128  # activation group = weight block edge = block_k
_SMEM_BYTES = 225 * 1024


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
    EVEN_K: tl.constexpr,  # K % 128 == 0
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

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_ptrs = xq_ptr + rm[:, None] * K + (k_start + offs_k)[None, :]
    xs_ptrs = xs_ptr + rm * G + k_start // 128
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_start + offs_k)[None, :]
    xmask = offs_m[:, None] < M
    for k in tl.range(k_start, k_end, 128):
        if EVEN_K:
            xq = tl.load(x_ptrs, mask=xmask, other=0.0)
            wt = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            kmask = (k + offs_k) < K
            xq = tl.load(x_ptrs, mask=xmask & kmask[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
        xs = tl.load(xs_ptrs, mask=offs_m < M, other=0.0)  # [BLOCK_M]
        ws = tl.load(s_rows + k // 128)  # [BLOCK_N]
        blk = tl.dot(wt, tl.trans(xq))  # [BLOCK_N, BLOCK_M] FP32: one block's FP8 products
        acc += blk * xs[None, :] * ws[:, None]
        x_ptrs += 128
        xs_ptrs += 1
        w_ptrs += 128

    out_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn = M.to(tl.int64) * N
        p_ptrs = part_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(p_ptrs + pid_k * mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before thread 0 releases the arrival
        n_tiles = tl.num_programs(0) // SPLIT_K
        cnt = cnt_ptr + pid_m * n_tiles + pid_n
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sum
                total += tl.load(p_ptrs + s * mn, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def fp8_splitk_check(x, w, scale, scale_row, out, tactic: SplitK) -> None:
    """A ValueError unless the operands are as the module doc says."""
    if tactic.block_k != GROUP:
        raise ValueError(f"fp8_splitk_linear: block_k must be {GROUP} (one scale block a step), got {tactic.block_k}")
    m, k = x.shape
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_splitk_linear: x bf16, w float8_e4m3fn, scale float32 expected, got {x.dtype}, "
                         f"{w.dtype}, {scale.dtype}")
    if w.shape[1] != k or tuple(out.shape) != (m, n) or scale.shape[1] != -(-k // GROUP) or scale_row.shape != (n,):
        raise ValueError(f"fp8_splitk_linear: shapes x{tuple(x.shape)} w{tuple(w.shape)} scale{tuple(scale.shape)} "
                         f"scale_row{tuple(scale_row.shape)} out{tuple(out.shape)} do not match")
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("fp8_splitk_linear: x, w, scale and out need unit stride along their last dim")


def fp8_splitk_linear(x, w, scale, scale_row, out, tactic: SplitK, workspace=None):
    """``out = x @ dequant(w)^T`` as the module doc computes it; returns ``out`` (``workspace``: as
    ``splitk_linear``'s, for ``tactic.split_k > 1``; without one a zeroed buffer is made per call)."""
    fp8_splitk_check(x, w, scale, scale_row, out, tactic)
    m, k = x.shape
    n = w.shape[0]
    split_k = tactic.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, GROUP), split_k) * GROUP
    if split_k > 1:
        need = splitk_workspace_numel(m, n, tactic)
        if workspace is None:
            workspace = torch.zeros(need, dtype=torch.float32, device=x.device)
        if workspace.dtype != torch.float32 or not workspace.is_contiguous() or workspace.numel() < need:
            raise ValueError(f"fp8_splitk_linear: workspace must be contiguous fp32 with >= {need} elements")
        grid = splitk_grid(m, n, tactic)
        n_cnt = (grid[0] // split_k) * grid[1]
        parts, counters = workspace, workspace.view(torch.int32)[workspace.numel() - n_cnt:]
    else:
        parts = counters = out  # unused
    xq, xs = quantize_activations(x)
    bm = splitk_block_m(m)
    per_stage = (tactic.block_n + bm) * GROUP  # bytes: the FP8 weight and activation tiles
    stages = max(1, min(tactic.num_stages, _SMEM_BYTES // per_stage))
    _fp8_splitk_kernel[splitk_grid(m, n, tactic)](
        xq, xs, w, scale, scale_row, out, parts, counters, m, n, k, xs.shape[1], w.stride(0), scale.stride(0),
        out.stride(0), k_per_split, BLOCK_M=bm, BLOCK_N=tactic.block_n, SPLIT_K=split_k,
        EVEN_K=(k % GROUP == 0), num_warps=tactic.num_warps, num_stages=stages,
    )
    return out
