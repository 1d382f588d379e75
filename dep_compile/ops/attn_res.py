"""The fused AttnRes -> RMSNorm op: one AttnRes point and the layer norm that reads its output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock import ops as stock_ops
from ..stock.reference.attn_res import attn_res_ref
from .fallbacks import log_fallback


@torch.library.custom_op("kimi_dep::attn_res_norm", mutates_args=("prefix", "bank"))
def attn_res_norm(
    prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, norm_weight: Tensor, eps: float, num_blocks: int,
    write_slot: int, norm_eps: float,
) -> Tensor:
    """``RMSNorm(norm_weight, norm_eps)(kimi_k3::attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot))``.

    prefix: [T, D] BF16 and bank: [NB, T, D] BF16, mutated as the stock op mutates them; delta: [T, D];
    query, norm_weight: [D]. Returns the normalized mix [T, D] BF16 (the mix itself is not kept).
    CUDA: one Triton launch (``stock.attn_res_cuda.attn_res_norm_cuda``); a call it cannot take runs
    the stock op and the norm, logged once. CPU: the stock reference, then stock's RMSNorm.
    """
    if prefix.is_cuda:
        from ..stock.attn_res_cuda import attn_res_norm_cuda, unsupported  # noqa: PLC0415 - imports Triton

        why = unsupported(prefix, bank, delta, query, num_blocks, write_slot, norm_weight)
        if why is None:
            return attn_res_norm_cuda(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps)
        log_fallback("AttnRes", why, "the stock AttnRes op and RMSNorm")
        h = stock_ops.attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot)
    else:
        h = attn_res_ref(prefix, bank, delta, query, eps, num_blocks, write_slot)
    # stock's RMSNorm module (dep_compile.stock.layers.RMSNorm), written the same way
    return F.rms_norm(h.float(), (h.shape[-1],), norm_weight.float(), norm_eps).to(h.dtype)


@attn_res_norm.register_fake
def _(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps):
    return torch.empty_like(prefix)
