"""The stock MXFP4 routed experts on CUDA: the touched experts dequantized to BF16, then the grouped GEMMs.

What a user without a fused W4A16 MoE kernel runs (FlashInfer's SM90 MXFP4 MoE is JIT-built with nvcc
at first use and is not on the GPU machine; docs/mxfp4.md): one Triton launch writes each touched
local expert's BF16 weights (exact: an E2M1 value times a power of two) into a scratch tensor, reading
its codes and scales once; untouched experts are skipped, no host sync. Experts re-packed into tiles
(``mxfp4_tiles.py``) are read too, each value gathered from its tile word and scale. Then
``grouped_experts.routed_experts_grouped`` on them. Uniform MXFP4 only (uint8 E8M0 scales, 32 inputs a
scale); other scale formats dequantize with the reference's torch code.

The module imports Triton at import time: import it only where CUDA and Triton exist.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .grouped_experts import routed_experts_grouped
from .mxfp4 import GROUP, Mxfp4Weight, group_size
from .mxfp4_tiles import Mxfp4Tiles, code_bits


@triton.jit
def e2m1_bf16(c):
    """BF16 values of E2M1 codes (int32, 0..15): sign bit 3 over magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    Codes 2..7 hold exponent e = code >> 1 (bias 126 here) and mantissa bit code & 1; 0 and 1 are 0 and 0.5."""
    em = c & 7
    mag = tl.where(em < 2, em * 0x3F00, (em + 252) << 6)
    return (mag | ((c & 8) << 12)).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_bf16(s):
    """BF16 2^(s - 127) of E8M0 codes (int32): the exponent field, or the subnormal 2^-127 for s = 0."""
    return tl.where(s == 0, 0x40, s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_kernel(p_ptr, s_ptr, touched_ptr, out_ptr, N, stride_pe, stride_pn, stride_se, stride_sn,
                    stride_oe, stride_on, KH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr):
    """out[e, rows, :] = the BF16 weights of expert e's rows (codes [BLOCK_N, BLOCK_KH] and their scales a
    step), for experts ``touched`` marks; the others are left as they are."""
    e = tl.program_id(1)
    if tl.load(touched_ptr + e) != 0:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        e64 = e.to(tl.int64)
        for kh in range(0, KH, BLOCK_KH):
            ch = kh + tl.arange(0, BLOCK_KH)
            cg = kh // 16 + tl.arange(0, BLOCK_KH // 16)
            p = tl.load(p_ptr + e64 * stride_pe + rows[:, None] * stride_pn + ch[None, :],
                        mask=rmask[:, None] & (ch < KH)[None, :], other=0).to(tl.int32)
            s = tl.load(s_ptr + e64 * stride_se + rows[:, None] * stride_sn + cg[None, :],
                        mask=rmask[:, None] & (cg < KH // 16)[None, :], other=0).to(tl.int32)
            w = tl.join(e2m1_bf16(p & 15), e2m1_bf16(p >> 4)).reshape(BLOCK_N, 2 * BLOCK_KH).to(tl.float32)
            w = w.reshape(BLOCK_N, BLOCK_KH // 16, 32) * e8m0_bf16(s).to(tl.float32)[:, :, None]
            k = 2 * kh + tl.arange(0, 2 * BLOCK_KH)
            tl.store(out_ptr + e64 * stride_oe + rows[:, None] * stride_on + k[None, :],
                     w.reshape(BLOCK_N, 2 * BLOCK_KH).to(tl.bfloat16), mask=rmask[:, None] & (k < 2 * KH)[None, :])


@triton.jit
def _dequant_tiles_kernel(w_ptr, s_ptr, bits_ptr, touched_ptr, out_ptr, N, K, stride_we, stride_wt, stride_wk,
                          stride_wr, stride_se, stride_st, stride_sk, stride_sr, stride_oe, stride_on,
                          BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, rows, inputs] = the BF16 weights of a [BLOCK_N, BLOCK_K] block of expert e, each gathered from its
    BN x BK tile's word and scale, for experts ``touched`` marks; the others are left as they are."""
    e = tl.program_id(2)
    if tl.load(touched_ptr + e) != 0:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, 1]
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
        mask = (n < N) & (k < K)
        t, r, kt, c = n // BN, n % BN, k // BK, k % BK  # tile and row in it; tile and input in it
        warp, h, g = r // 16, r % 16 // 8, r % 8  # r = 16 warp + 8 h + g
        j, half, q, lane = c // 16, c % 16 // 8, c % 8 // 2, c % 2  # c = 16 j + 8 half + 2 q + lane
        e64 = e.to(tl.int64)
        word = tl.load(w_ptr + e64 * stride_we + t * stride_wt + kt * stride_wk + (32 * warp + 4 * g + q) * stride_wr
                       + j, mask=mask, other=0)
        pair = tl.load(s_ptr + e64 * stride_se + t * stride_st + kt * stride_sk + (8 * warp + g) * stride_sr + c // 32,
                       mask=mask, other=0).to(tl.int32)
        s = ((pair >> (8 * h)) & 255) - 126  # E8M0 code: byte s + 126 of row n (low) or n + 8 (high)
        at = bits_ptr + ((2 * half + h) * 2 + lane) * 4  # the word bits of its code's bits 3..0 (register 2 half + h)
        code = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
        for i in tl.static_range(4):
            code |= ((word >> tl.load(at + i)) & 1) << (3 - i)
        v = e2m1_bf16(code).to(tl.float32) * e8m0_bf16(s).to(tl.float32)
        tl.store(out_ptr + e64 * stride_oe + n * stride_on + k, v.to(tl.bfloat16), mask=mask)


@functools.cache
def _on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``values`` on ``device``, copied once (later calls, CUDA-graph captures included, copy nothing)."""
    return torch.tensor(values, dtype=torch.int32, device=device)


def touched_experts(topk_ids: torch.Tensor, expert_start: int, num_local: int) -> torch.Tensor:
    """int32 [num_local]: 1 for each local expert some token picked (no host sync)."""
    local = topk_ids.long().flatten() - expert_start
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    return torch.zeros(num_local + 1, dtype=torch.int32, device=topk_ids.device).index_fill_(0, key, 1)[:num_local]


def dequantize_touched(w: Mxfp4Weight | Mxfp4Tiles, touched: torch.Tensor) -> torch.Tensor:
    """BF16 [E, N, K] of MXFP4 ``w`` (the checkpoint's layout or tiles): the touched experts' weights (rows of the
    others are not written)."""
    if isinstance(w, Mxfp4Tiles):
        return _dequantize_tiles_touched(w, touched)
    E, N, K = w.shape
    if w.scale.dtype != torch.uint8 or group_size(w.packed, w.scale) != GROUP:
        return w.dequantize()  # another scale format: the reference's torch code, on the device
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=w.packed.device)
    block_n, block_kh = 32, min(128, triton.next_power_of_2(K // 2))
    _dequant_kernel[(triton.cdiv(N, block_n), E)](
        w.packed, w.scale, touched, out, N, w.packed.stride(0), w.packed.stride(1), w.scale.stride(0),
        w.scale.stride(1), out.stride(0), out.stride(1), KH=K // 2, BLOCK_N=block_n, BLOCK_KH=block_kh, num_warps=4)
    return out


def _dequantize_tiles_touched(w: Mxfp4Tiles, touched: torch.Tensor) -> torch.Tensor:
    """``dequantize_touched`` of tiles."""
    E, N, K = w.shape
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=w.words.device)
    # int32 [4 registers, 2 lanes, code bits 3..0]: the word bit holding each (from code_bits: follows ROTATIONS)
    bits = _on_device(tuple(b for reg in range(4) for lane in range(2) for b in code_bits(reg, lane)), out.device)
    block_n, block_k = 32, min(128, triton.next_power_of_2(K))
    _dequant_tiles_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k), E)](
        w.words, w.scales, bits, touched, out, N, K, *w.words.stride()[:4], *w.scales.stride()[:4], out.stride(0),
        out.stride(1), BN=w.block_n, BK=w.block_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def routed_experts_mxfp4_grouped(x: torch.Tensor, w13: Mxfp4Weight | Mxfp4Tiles, w2: Mxfp4Weight | Mxfp4Tiles,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int, beta: float,
                                 beta_lin: float) -> torch.Tensor:
    """``routed_experts_grouped`` on the touched experts' dequantized weights: FP32 [T, Lat]."""
    touched = touched_experts(topk_ids, expert_start, w13.shape[0])
    return routed_experts_grouped(x, dequantize_touched(w13, touched), dequantize_touched(w2, touched), topk_weights,
                                  topk_ids, expert_start, beta, beta_lin)
