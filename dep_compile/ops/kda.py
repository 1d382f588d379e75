"""The rewritten KDA layer: packed in_proj (DepProjection) -> PreparedKda core (F_B inside) -> o_proj."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock import ops as stock_ops
from .fallbacks import log_fallback
from .projection import DepProjection
from .registry import lookup, prepared


@prepared
@dataclasses.dataclass
class PreparedKda:
    """Sizes and projections of one KDA layer, prepared once at compile time."""

    heads: int
    head_dim: int
    f_rank: int
    lower_bound: float
    norm_eps: float
    in_proj: DepProjection
    o_proj: DepProjection

    def core(self, q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
             state_indices, accepted, q_len: int) -> Tensor:
        """The KDA core with the F_B gate computed inside it: [T, H*D] BF16.

        CUDA: the one-launch Triton decode core (conv, F_B gate, norms, delta rule, gated RMSNorm).
        A call it does not support (q_len > 8, odd shapes or strides; decided from metadata, no
        sync) runs the stock op instead (on CUDA its graph-capturable kernels), after F_B as a
        linear, and the reason is logged once per process; states the stock CUDA op cannot
        address in place either (not [S, H, D, D] FP32 with contiguous slots, or a conv state
        without unit channel stride) raise its ValueError. CPU: the stock op's reference.
        """
        if q.is_cuda:
            from .kda_triton import kda_decode_core, kda_decode_unsupported

            why = kda_decode_unsupported(q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                                         rec_state, state_indices, accepted, q_len)
            if why is None:
                return kda_decode_core(q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                                       rec_state, state_indices, accepted, q_len, self.lower_bound, self.norm_eps)
            log_fallback("KDA", why, "the stock KDA core op")
        g_raw = F.linear(f_a, f_b_w)  # f_a [T, F] -> raw decay gate [T, H*D], BF16 as stock's f_b_proj
        return stock_ops.kda_core(q, k, v, g_raw, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
                                  state_indices, accepted, q_len, self.lower_bound, self.norm_eps)

    def forward(self, x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state, rec_state,
                state_indices, accepted, q_len: int) -> Tensor:
        HD = self.heads * self.head_dim
        q, k, v, g, f_a, beta = self.in_proj(x, in_proj_w).split([HD, HD, HD, HD, self.f_rank, self.heads], -1)
        o = self.core(q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
                      state_indices, accepted, q_len)
        return self.o_proj(o, o_proj_w)


@torch.library.custom_op("kimi_dep::kda_attention", mutates_args=("conv_state", "recurrent_state"))
def kda_attention(
    x: Tensor, in_proj_w: Tensor, f_b_w: Tensor, conv_w: Tensor, A_log: Tensor, dt_bias: Tensor,
    o_norm_w: Tensor, o_proj_w: Tensor, conv_state: Tensor, recurrent_state: Tensor,
    state_indices: Tensor, accepted: Tensor, q_len: int, layer: str,
) -> Tensor:
    """A whole KDA attention layer at TP1: x [T, hidden] -> [T, hidden]; mutates both states.

    in_proj_w: [4HD + F + H, hidden]; f_b_w: [HD, F]; conv_w: [3HD, W]; o_proj_w: [hidden, HD];
    the rest as ``kimi_k3::kda_core``.
    """
    return lookup(layer).forward(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state,
                                 recurrent_state, state_indices, accepted, q_len)


@kda_attention.register_fake
def _(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state, recurrent_state,
      state_indices, accepted, q_len, layer):
    return x.new_empty(x.shape[0], o_proj_w.shape[0])
