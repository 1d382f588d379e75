"""The stock ``kimi_k3`` custom ops: opaque to Dynamo where vLLM's kernels are.

Each op declares exactly what it mutates, has a fake kernel, and runs the readable reference
in ``dep_compile.stock.reference`` on CPU. On CUDA the MLA / DSA ops run vectorized,
graph-capturable versions (``batched_attention``), the KDA core ``kda_cuda.kda_core_cuda``
(Triton conv, fla-core's fused recurrent KDA where it imports, Triton gated norm) and the
routed experts grouped GEMMs, and AttnRes one Triton launch (``attn_res_cuda``).

An FP8 latent cache (``K3Config.latent_cache_dtype``) has its own ops, ``mla_decode_fp8`` and
``sparse_mla_decode_fp8``: the BF16 ops' arguments plus ``kv_scale [NB, BS]`` FP32 (mutated), so the
BF16 ops' schemas and graphs stay as they are. MXFP4 routed experts (``K3Config.experts_format``) have
``routed_experts_mxfp4``, whose weights are the packed codes and scales as K3's checkpoint holds them.
FP8 block-scaled dense projections (``K3Config.dense_format``) call ``fp8_block_linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .batched_attention import dsa_indexer_batched, mla_decode_batched, sparse_mla_decode_batched
from .reference.attn_res import attn_res_ref
from .reference.dsa import dsa_indexer_ref, sparse_mla_decode_ref
from .reference.kda import kda_core_ref
from .reference.mla import mla_decode_ref
from .grouped_experts import routed_experts_grouped
from .fp8_block import check_weight, fp8_block_linear as fp8_block_linear_ref
from .mxfp4_tiles import as_mxfp4
from .reference.moe import routed_experts_mxfp4_partial, routed_experts_partial


@torch.library.custom_op("kimi_k3::kda_core", mutates_args=("conv_state", "recurrent_state"))
def kda_core(
    q: Tensor, k: Tensor, v: Tensor, g_raw: Tensor, beta: Tensor, g_out: Tensor,
    conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor, o_norm_weight: Tensor,
    conv_state: Tensor, recurrent_state: Tensor, state_indices: Tensor, accepted: Tensor,
    q_len: int, lower_bound: float, norm_eps: float,
) -> Tensor:
    """KDA core: conv -> gate -> delta rule -> gated RMSNorm; [T, H*D] (see kda_core_ref)."""
    if q.is_cuda:  # kda_cuda imports Triton: imported only for CUDA tensors
        from .kda_cuda import kda_core_cuda as fn  # noqa: PLC0415
    else:
        fn = kda_core_ref
    return fn(q, k, v, g_raw, beta, g_out, conv_weight, A_log, dt_bias, o_norm_weight,
              conv_state, recurrent_state, state_indices, accepted, q_len, lower_bound, norm_eps)


@kda_core.register_fake
def _(q, k, v, g_raw, beta, g_out, conv_weight, A_log, dt_bias, o_norm_weight, conv_state,
      recurrent_state, state_indices, accepted, q_len, lower_bound, norm_eps):
    return torch.empty_like(q)


def _attention_out(q: Tensor, kv_b_weight: Tensor, nope: int) -> Tensor:
    """The fake output of an MLA-family op: [T, H*v] in q's dtype (v from ``kv_b_weight [H*(nope+v), L]``)."""
    heads = q.shape[1]
    return q.new_empty(q.shape[0], heads * (kv_b_weight.shape[0] // heads - nope))


@torch.library.custom_op("kimi_k3::mla_decode", mutates_args=("kv_cache",))
def mla_decode(
    q: Tensor, latent: Tensor, kv_b_weight: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
    block_table: Tensor, seq_lens: Tensor, q_len: int, scale: float, nope: int,
) -> Tensor:
    """Latent cache insert + absorbed MLA decode + W_UV; [T, H*v] (see mla_decode_ref)."""
    fn = mla_decode_batched if q.is_cuda else mla_decode_ref
    return fn(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, seq_lens, q_len, scale, nope)


@mla_decode.register_fake
def _(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, seq_lens, q_len, scale, nope):
    return _attention_out(q, kv_b_weight, nope)


@torch.library.custom_op("kimi_k3::mla_decode_fp8", mutates_args=("kv_cache", "kv_scale"))
def mla_decode_fp8(
    q: Tensor, latent: Tensor, kv_b_weight: Tensor, kv_cache: Tensor, kv_scale: Tensor, slot_mapping: Tensor,
    block_table: Tensor, seq_lens: Tensor, q_len: int, scale: float, nope: int,
) -> Tensor:
    """``mla_decode`` on an FP8 e4m3 latent cache with per-token power-of-two scales ``kv_scale [NB, BS]``."""
    fn = mla_decode_batched if q.is_cuda else mla_decode_ref
    return fn(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, seq_lens, q_len, scale, nope,
              kv_scale=kv_scale)


@mla_decode_fp8.register_fake
def _(q, latent, kv_b_weight, kv_cache, kv_scale, slot_mapping, block_table, seq_lens, q_len, scale, nope):
    return _attention_out(q, kv_b_weight, nope)


@torch.library.custom_op("kimi_k3::dsa_indexer", mutates_args=("index_cache", "index_scale"))
def dsa_indexer(
    q_idx: Tensor, weights: Tensor, k: Tensor, index_cache: Tensor, index_scale: Tensor,
    slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, q_len: int, topk: int,
) -> Tensor:
    """FP8 index-key insert + ReLU-weighted logits + top-k; [T, topk] int32 (see dsa_indexer_ref)."""
    fn = dsa_indexer_batched if q_idx.is_cuda else dsa_indexer_ref
    return fn(q_idx, weights, k, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len, topk)


@dsa_indexer.register_fake
def _(q_idx, weights, k, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len, topk):
    return q_idx.new_empty(q_idx.shape[0], topk, dtype=torch.int32)


@torch.library.custom_op("kimi_k3::sparse_mla_decode", mutates_args=("kv_cache",))
def sparse_mla_decode(
    q: Tensor, latent: Tensor, kv_b_weight: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
    block_table: Tensor, topk_indices: Tensor, q_len: int, scale: float, nope: int,
) -> Tensor:
    """Latent cache insert + absorbed MLA over the selected tokens; [T, H*v]."""
    fn = sparse_mla_decode_batched if q.is_cuda else sparse_mla_decode_ref
    return fn(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, topk_indices, q_len, scale, nope)


@sparse_mla_decode.register_fake
def _(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, topk_indices, q_len, scale, nope):
    return _attention_out(q, kv_b_weight, nope)


@torch.library.custom_op("kimi_k3::sparse_mla_decode_fp8", mutates_args=("kv_cache", "kv_scale"))
def sparse_mla_decode_fp8(
    q: Tensor, latent: Tensor, kv_b_weight: Tensor, kv_cache: Tensor, kv_scale: Tensor, slot_mapping: Tensor,
    block_table: Tensor, topk_indices: Tensor, q_len: int, scale: float, nope: int,
) -> Tensor:
    """``sparse_mla_decode`` on an FP8 e4m3 latent cache with per-token power-of-two scales ``kv_scale [NB, BS]``."""
    fn = sparse_mla_decode_batched if q.is_cuda else sparse_mla_decode_ref
    return fn(q, latent, kv_b_weight, kv_cache, slot_mapping, block_table, topk_indices, q_len, scale, nope,
              kv_scale=kv_scale)


@sparse_mla_decode_fp8.register_fake
def _(q, latent, kv_b_weight, kv_cache, kv_scale, slot_mapping, block_table, topk_indices, q_len, scale, nope):
    return _attention_out(q, kv_b_weight, nope)


def _experts(x, w13, w2, topk_weights, topk_ids, expert_start: int, ep_size: int, local_fn) -> Tensor:
    """[T, Lat] in x's dtype: ``local_fn(x, w13, w2, weights, ids, expert_start) -> FP32`` on this rank's
    experts, through the EP group's dispatch and combine when ``ep_size`` > 1."""
    if ep_size > 1:
        from ..runtime.ep import dispatch_combine

        return dispatch_combine(x, w13, w2, topk_weights, topk_ids, expert_start, ep_size, local_fn)
    return local_fn(x, w13, w2, topk_weights, topk_ids, expert_start).to(x.dtype)


@torch.library.custom_op("kimi_k3::routed_experts", mutates_args=())
def routed_experts(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
    expert_start: int, ep_size: int, beta: float, beta_lin: float,
) -> Tensor:
    """The MoE's experts(latent, topk_weights, topk_ids): [T, Lat] (see routed_experts_ref).

    With ``ep_size`` > 1 this rank holds experts ``expert_start ..`` of E, and the call
    dispatches to and combines from the EP group (``dep_compile.runtime.ep``).
    """
    # CUDA: two grouped GEMMs (the fair stock baseline); CPU: the readable reference
    local_fn = routed_experts_grouped if x.is_cuda else routed_experts_partial
    return _experts(x, w13, w2, topk_weights, topk_ids, expert_start, ep_size,
                    lambda *a: local_fn(*a, beta, beta_lin))


@routed_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids, expert_start, ep_size, beta, beta_lin):
    return x.new_empty(x.shape[0], w2.shape[1])


@torch.library.custom_op("kimi_k3::routed_experts_mxfp4", mutates_args=())
def routed_experts_mxfp4(
    x: Tensor, w13_packed: Tensor, w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, topk_weights: Tensor,
    topk_ids: Tensor, expert_start: int, ep_size: int, beta: float, beta_lin: float,
) -> Tensor:
    """``routed_experts`` on the experts as K3 ships them: [T, Lat].

    w13_packed [E, 2I, Lat/2] / w2_packed [E, Lat, I/2]: uint8, two E2M1 codes a byte (low nibble first);
    w13_scale [E, 2I, Lat/g] / w2_scale [E, Lat, I/g]: uint8 E8M0 (2^(s-127)) or float scales, one per g
    inputs (MXFP4: g = 32; ``stock/mxfp4.py``); or both re-packed into tiles at load time (int32 words, int16
    scales: ``stock/mxfp4_tiles.py``). The weights dequantize exactly to BF16; the rest is ``routed_experts`` on
    them. CPU: the reference on the dequantized weights; CUDA: the touched experts dequantized to BF16 by a Triton
    kernel, then the grouped GEMMs.
    """
    w13, w2 = as_mxfp4("routed_experts_mxfp4 w13", w13_packed, w13_scale), as_mxfp4(
        "routed_experts_mxfp4 w2", w2_packed, w2_scale)
    if x.is_cuda:  # mxfp4_cuda imports Triton: imported only for CUDA tensors
        from .mxfp4_cuda import routed_experts_mxfp4_grouped as local_fn  # noqa: PLC0415
    else:
        local_fn = routed_experts_mxfp4_partial
    return _experts(x, w13, w2, topk_weights, topk_ids, expert_start, ep_size,
                    lambda *a: local_fn(*a, beta, beta_lin))


@routed_experts_mxfp4.register_fake
def _(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, expert_start, ep_size, beta, beta_lin):
    return x.new_empty(x.shape[0], as_mxfp4("routed_experts_mxfp4 w2", w2_packed, w2_scale).shape[1])


@torch.library.custom_op("kimi_k3::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, segments: list[int]) -> Tensor:
    """x [T, K] BF16 @ an FP8 block-scaled weight^T -> [T, N] BF16 (W8A8: activations quantized per 128 inputs).

    weight [N, K] float8_e4m3fn; weight_scale FP32, one per 128 x 128 block of each row segment (``segments``:
    the row counts of the projections packed in it, in order). CPU: the reference (``stock/fp8_block.py``);
    CUDA: a Triton quantizer and a plain tiled block-FP8 GEMM (``stock/fp8_block_cuda.py``).
    """
    check_weight("fp8_block_linear", weight, weight_scale, segments)
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_block_linear: x {tuple(x.shape)} {x.dtype} is not [T, {weight.shape[1]}] bfloat16")
    if x.is_cuda:  # fp8_block_cuda imports Triton: imported only for CUDA tensors
        from .fp8_block_cuda import block_fp8_linear  # noqa: PLC0415

        return block_fp8_linear(x, weight, weight_scale, segments)
    return fp8_block_linear_ref(x, weight, weight_scale, segments)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale, segments):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)


@torch.library.custom_op("kimi_k3::attn_res", mutates_args=("prefix", "bank"))
def attn_res(
    prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int
) -> Tensor:
    """AttnRes ahead of a sublayer: prefix += delta, optional bank write, softmax mix; [T, D].

    CUDA: one Triton launch (``attn_res_cuda``); a call it cannot take (odd shapes or strides,
    decided from metadata) runs the reference, logged once per reason.
    """
    if prefix.is_cuda:  # attn_res_cuda imports Triton: imported only for CUDA tensors
        from .attn_res_cuda import attn_res_cuda, unsupported  # noqa: PLC0415

        why = unsupported(prefix, bank, delta, query, num_blocks, write_slot)
        if why is None:
            return attn_res_cuda(prefix, bank, delta, query, eps, num_blocks, write_slot)
        _log_once(f"kimi_k3::attn_res: Triton kernel not used ({why}); running the PyTorch reference")
    return attn_res_ref(prefix, bank, delta, query, eps, num_blocks, write_slot)


@attn_res.register_fake
def _(prefix, bank, delta, query, eps, num_blocks, write_slot):
    return torch.empty_like(prefix)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger("dep_compile").warning("%s", message)
