"""The stock FP8 block-scaled linear on CUDA: a Triton activation quantizer, then cuBLAS's blockwise-scaled
FP8 GEMM (``torch._scaled_mm``), or a plain tiled Triton block-FP8 GEMM where cuBLAS has none.

What a user of FP8 block checkpoints runs on Hopper without our kernels:

1. ``quantize_activations``: per row and group of 128 inputs, ``scale = max(amax, 1e-10) / 448`` and
   ``x / scale`` (correctly rounded), saturated at 448, rounded to the nearest e4m3: the reference's
   codes and scales bit for bit (``fp8_block.quantize_activations``), as vLLM's ``per_token_group_quant_fp8``;
2. ``torch._scaled_mm`` with 1 x 128 activation scales (column-major ``[M, K/128]``) and 128 x 128 weight scales
   (a ``[K/128, N/128]`` view of ``weight_scale``): cuBLASLt's blockwise-scaled FP8 GEMM. On the H200 (torch
   2.11, CUDA 13.0) it takes these layouts only, and only for a multiple of 4 rows (``bench_projection_fp8.py``
   prints the probe), so the rows are padded to one. A 128-row block may not span two segments: a packed
   weight is one call per run of segments whose block grids line up (``segment_runs``), the runs' outputs
   concatenated;
3. where ``_scaled_mm`` has no blockwise scaling (checked once per device: ``has_blockwise_mm``), or the
   shapes are not cuBLAS's (K not a multiple of 128, a run not a multiple of 16 rows: the small presets; K = 128,
   KDA's f_b: there cuBLAS's GEMM faulted on the H200, CUBLAS_STATUS_EXECUTION_FAILED, in a full-depth rank), or
   cuBLAS refused a run of that shape and alignment, or computed it wrong (tried once, outside CUDA-graph
   captures, on random codes with distinct power-of-two scales at the run's shapes and alignments, against the
   Triton GEMM: ``_TAKES``; on the H200 it computed a small preset's 256 x 256 run with its 2 x 2 block scales
   wrong),
   ``block_fp8_gemm``: ``[64, 128]`` output tiles, K in steps of 128 (one activation group and one weight
   block), the FP8 products of a step summed by the tensor cores and scaled by both scales, each weight row
   reading its own segment's scale row, in the shape of vLLM's Triton ``w8a8_block_fp8_matmul`` with its
   default untuned tiles.

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .fp8_block import BLOCK, FP8, scale_row_index

_LOG = logging.getLogger(__name__)
_QUANT_GROUPS = 8  # activation groups one quantize program takes
_TILE_M, _TILE_N, _WARPS, _STAGES = 64, 128, 4, 2  # vLLM's default block-FP8 tiles (no tuned config)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K] bf16
    q_ptr,  # [M, K] e4m3 out
    s_ptr,  # [M, G] fp32 out
    K,
    G,
    stride_xm,
    GROUPS: tl.constexpr,  # groups of 128 per program
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # let a programmatic dependent launch (kimi_dep's FP8 GEMM) start now
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] group index
    col = g[:, None] * 128 + tl.arange(0, 128)[None, :]  # [GROUPS, 128]
    mask = col < K
    x = tl.load(x_ptr + row * stride_xm + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * (1.0 / 448.0)  # [GROUPS]
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + row * K + col, q, mask=mask)
    tl.store(s_ptr + row * G + g, scale, mask=g < G)


def quantize_activations(x: torch.Tensor, launch_dependents: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 (unit stride along K) -> (e4m3 codes [M, K], fp32 scales [M, ceil(K/128)]), stock's rule
    (``launch_dependents``: the next kernel is a programmatic dependent launch that waits for these writes)."""
    m, k = x.shape
    groups = -(-k // BLOCK)
    xq = torch.empty(m, k, dtype=FP8, device=x.device)
    xs = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    _quantize_kernel[(m, triton.cdiv(groups, _QUANT_GROUPS))](x, xq, xs, k, groups, x.stride(0),
                                                               GROUPS=_QUANT_GROUPS, LAUNCH_DEPENDENTS=launch_dependents,
                                                               num_warps=4)
    return xq, xs


@triton.jit
def _block_fp8_kernel(
    xq_ptr,  # [M, K] e4m3
    xs_ptr,  # [M, G] fp32
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [R, G] fp32
    srow_ptr,  # [N] int32
    out_ptr,  # [M, N] bf16
    M,
    N,
    K,
    G,
    stride_wn,
    stride_sr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * TILE_M + tl.arange(0, TILE_M)
    offs_n = pid_n * TILE_N + tl.arange(0, TILE_N)
    offs_k = tl.arange(0, 128)
    mmask, nmask = offs_m < M, offs_n < N
    s_rows = s_ptr + tl.load(srow_ptr + offs_n, mask=nmask, other=0).to(tl.int64) * stride_sr
    acc = tl.zeros([TILE_M, TILE_N], dtype=tl.float32)
    for kb in range(0, G):
        k = kb * 128 + offs_k
        kmask = k < K
        a = tl.load(xq_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=nmask[None, :] & kmask[:, None], other=0.0)
        xs = tl.load(xs_ptr + offs_m.to(tl.int64) * G + kb, mask=mmask, other=0.0)
        ws = tl.load(s_rows + kb, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * xs[:, None] * ws[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=mmask[:, None] & nmask[None, :])


def segment_runs(segments: list[int]) -> list[tuple[int, int, int, int]]:
    """(first row, end row, first scale row, end scale row) of each run of segments one blockwise GEMM can take:
    a run ends after a segment that is not a multiple of 128 rows (its last block is partial)."""
    runs, r0, b0, r, b = [], 0, 0, 0, 0
    for i, n in enumerate(segments):
        r, b = r + n, b + -(-n // BLOCK)
        if n % BLOCK or i == len(segments) - 1:
            runs.append((r0, r, b0, b))
            r0, b0 = r, b
    return runs


@functools.lru_cache(maxsize=None)
def has_blockwise_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes 1 x 128 / 128 x 128 block scales on ``device`` (one small call)."""
    a = torch.zeros(16, 128, dtype=FP8, device=device)
    b = torch.zeros(128, 128, dtype=FP8, device=device)
    one = torch.ones(1, 1, dtype=torch.float32, device=device)
    try:
        torch._scaled_mm(a, b.t(), torch.ones(1, 16, device=device).t(), one.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError):
        return False
    return True


# (device, rows, n, k, weight and scale addresses mod 16) -> whether cuBLAS's blockwise FP8 GEMM took a run of that
# shape and computed it right. On the H200 (torch 2.11, CUDA 13) it refused a small preset's run (rows 4, n 48,
# k 256, its scales 8 bytes past a 16-byte boundary) with CUBLAS_STATUS_NOT_SUPPORTED, computed a 256 x 256 run
# (2 x 2 block scales: the small preset's shared gate_up) wrong (max error 36-100 % of the largest output), and takes
# K3's runs (n 576 .. 49152, k 7168, 12288).
_TAKES: dict[tuple, bool] = {}
_PROBE_REL = 2.0 ** -5  # cuBLAS against the Triton GEMM on a probe: summation order and one BF16 rounding apart


def _run_key(xq: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> tuple:
    """The ``_TAKES`` key of one run: [rows, K] codes, its weight rows [n, K] and scale rows [n / 128, K / 128]."""
    return xq.device, xq.shape[0], w.shape[0], xq.shape[1], w.data_ptr() % 16, ws.data_ptr() % 16


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     segments: list[int]) -> torch.Tensor:
    """x [M, K] bf16 @ the FP8 block-scaled weight [N, K]^T -> [M, N] bf16 (the module doc's path)."""
    x = x.contiguous()
    m, k = x.shape
    rows = -(-m // 4) * 4  # cuBLAS's blockwise FP8 GEMM takes a multiple of 4 rows
    runs = [(weight[r0:r1], weight_scale[b0:b1]) for r0, r1, b0, b1 in segment_runs(segments)]
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # no probe inside a capture
    if capturing and not has_blockwise_mm.cache_info().currsize:
        return block_fp8_gemm(x, weight, weight_scale, segments)
    if k % BLOCK or k == BLOCK or any(w.shape[0] % 16 for w, _ in runs) or not has_blockwise_mm(x.device):
        return block_fp8_gemm(x, weight, weight_scale, segments)
    xq, xs = quantize_activations(x if rows == m else F.pad(x, (0, 0, 0, rows - m)))
    keys = [_run_key(xq, w, ws) for w, ws in runs]
    known = [_TAKES.get(key) for key in keys]
    if False in known or (capturing and None in known):
        return block_fp8_gemm(x, weight, weight_scale, segments)
    xs = xs.t().contiguous().t()  # [rows, K/128], column-major
    outs = []
    for (w, ws), key in zip(runs, keys):  # a run cuBLAS has not been seen to take is probed once, outside captures
        if key not in _TAKES:
            _TAKES[key] = _cublas_takes(xq, xs, w, ws)
        if not _TAKES[key]:
            return block_fp8_gemm(x, weight, weight_scale, segments)
        outs.append(torch._scaled_mm(xq, w.t(), xs, ws.t(), out_dtype=torch.bfloat16))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    return out if rows == m else out[:m]


def _random_like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random tensor of ``t``'s shape and dtype at an address as far past a 16-byte boundary as ``t``'s: FP8 codes
    uniform over the finite positive e4m3 values, or FP32 powers of two 2^-4 .. 2^4. Made in place, so a weight-sized
    probe costs its own bytes only."""
    size = t.element_size()
    buf = torch.empty(t.numel() + 16 // size, dtype=t.dtype, device=t.device)
    skip = (t.data_ptr() - buf.data_ptr()) % 16 // size
    out = buf[skip:skip + t.numel()].view(t.shape)
    if t.dtype == FP8:
        out.view(torch.uint8).random_(0, 127, generator=g)  # 0x00 .. 0x7E: 0 .. 448
    else:
        out.random_(-4, 5, generator=g).exp2_()
    return out


def _cublas_takes(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> bool:
    """Whether cuBLAS's blockwise FP8 GEMM takes a run of these shapes and alignments and computes it as the Triton
    GEMM does: probed once on random codes with distinct power-of-two activation and block scales (a misread
    scale layout shows), none of them the caller's (whose values could hide a wrong result: zeros, say)."""
    g = torch.Generator(device=xq.device).manual_seed(0)
    xq_p, xs_p, w_p, ws_p = (_random_like(t.contiguous(), g) for t in (xq, xs, w, ws))
    try:
        got = torch._scaled_mm(xq_p, w_p.t(), xs_p.t().contiguous().t(), ws_p.t(), out_dtype=torch.bfloat16).float()
    except RuntimeError:
        return False
    want = _gemm_quantized(xq_p, xs_p, w_p, ws_p, [w.shape[0]]).float()
    err = float((got - want).abs().max() / want.abs().max())
    if not err <= _PROBE_REL:
        _LOG.warning("cuBLAS's blockwise FP8 GEMM computed a [%d, %d] x [%d, %d]^T run wrong on a probe (max error "
                     "%.3g of the largest output); the Triton block-FP8 GEMM runs that shape", *xq.shape, *w.shape, err)
        return False
    return True


def block_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   segments: list[int]) -> torch.Tensor:
    """The plain Triton path of ``block_fp8_linear``: quantize, then ``_block_fp8_kernel``."""
    return _gemm_quantized(*quantize_activations(x), weight, weight_scale, segments)


def _gemm_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    segments: list[int]) -> torch.Tensor:
    """``_block_fp8_kernel`` on quantized activations (codes [M, K], row-major scales [M, K/128]) -> [M, N] bf16."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    grid = (triton.cdiv(n, _TILE_N), triton.cdiv(m, _TILE_M))
    _block_fp8_kernel[grid](xq, xs, weight, weight_scale, scale_row_index(tuple(segments), xq.device), out, m, n, k,
                            xs.shape[1], weight.stride(0), weight_scale.stride(0), TILE_M=_TILE_M, TILE_N=_TILE_N,
                            num_warps=_WARPS, num_stages=_STAGES)
    return out
