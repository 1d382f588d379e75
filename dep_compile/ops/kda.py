"""The rewritten KDA layer: packed in_proj (DepProjection) -> PreparedKda core (F_B inside) -> o_proj."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import tactics
from ..stock import ops as stock_ops
from .dense import Fp8Weight, dense_linear, dense_weight
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

        CUDA: the one-launch Triton decode core (conv, F_B gate, norms, delta rule, gated RMSNorm), or its
        split form where ``tactics.kda_split`` says so and the head fits it (else the one launch, the reason logged
        once).
        A call it does not support (q_len > 8, odd shapes or strides; decided from metadata, no
        sync) runs the stock op instead (on CUDA its graph-capturable kernels), after F_B as a
        linear, and the reason is logged once per process; states the stock CUDA op cannot
        address in place either (not [S, H, D, D] FP32 with contiguous slots, or a conv state
        without unit channel stride) raise its ValueError. CPU: the stock op's reference. An FP8
        block-scaled ``f_b_w`` (``Fp8Weight``): F_B runs first as stock's FP8 linear, and the core reads the raw
        gate it made.
        """
        if isinstance(f_b_w, Fp8Weight):  # F_B as stock's FP8 linear; the core reads the raw gate
            f_a, f_b_w = dense_linear(f_a, f_b_w), None
        if q.is_cuda:
            from .kda_triton import kda_decode_core, kda_decode_unsupported, split_unsupported

            why = kda_decode_unsupported(q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                                         rec_state, state_indices, accepted, q_len)
            if why is None:
                f_rank = None if f_b_w is None else self.f_rank
                split = tactics.kda_split(q_len)
                why_split = split_unsupported(self.head_dim, f_rank) if split else None
                if why_split:
                    log_fallback("KDA", f"the split form: {why_split}", "the one-launch Triton KDA core")
                    split = False
                return kda_decode_core(q, k, v, f_a, f_b_w, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                                       rec_state, state_indices, accepted, q_len, self.lower_bound, self.norm_eps,
                                       split=split)
            log_fallback("KDA", why, "the stock KDA core op")
        g_raw = f_a if f_b_w is None else dense_linear(f_a, f_b_w)  # [T, H*D] BF16, as stock's f_b_proj
        return stock_ops.kda_core(q, k, v, g_raw, beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state, rec_state,
                                  state_indices, accepted, q_len, self.lower_bound, self.norm_eps)

    def forward(self, x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state, rec_state,
                state_indices, accepted, q_len: int, scales: list[Tensor] = ()) -> Tensor:
        """``scales``: FP8 block-scaled projections' scales, [in_proj, f_b_proj, o_proj] (empty: BF16 weights)."""
        s = list(scales) or [None] * 3
        HD = self.heads * self.head_dim
        q, k, v, g, f_a, beta = self.in_proj(x, in_proj_w, s[0]).split([HD, HD, HD, HD, self.f_rank, self.heads], -1)
        o = self.core(q, k, v, f_a, dense_weight(f_b_w, s[1]), beta, g, conv_w, A_log, dt_bias, o_norm_w, conv_state,
                      rec_state, state_indices, accepted, q_len)
        return self.o_proj(o, o_proj_w, s[2])


@torch.library.custom_op("kimi_dep::kda_attention", mutates_args=("conv_state", "recurrent_state"))
def kda_attention(
    x: Tensor, in_proj_w: Tensor, f_b_w: Tensor, conv_w: Tensor, A_log: Tensor, dt_bias: Tensor,
    o_norm_w: Tensor, o_proj_w: Tensor, conv_state: Tensor, recurrent_state: Tensor,
    state_indices: Tensor, accepted: Tensor, q_len: int, layer: str, scales: list[Tensor],
) -> Tensor:
    """A whole KDA attention layer at TP1: x [T, hidden] -> [T, hidden]; mutates both states.

    in_proj_w: [4HD + F + H, hidden]; f_b_w: [HD, F]; conv_w: [3HD, W]; o_proj_w: [hidden, HD];
    the rest as ``kimi_k3::kda_core``. FP8 block-scaled projections: the three weights are e4m3 codes and
    ``scales`` their FP32 block scales [in_proj, f_b_proj, o_proj] (``stock/fp8_block.py``); empty for BF16.
    """
    return lookup(layer).forward(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state,
                                 recurrent_state, state_indices, accepted, q_len, scales)


@kda_attention.register_fake
def _(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state, recurrent_state,
      state_indices, accepted, q_len, layer, scales):
    return x.new_empty(x.shape[0], o_proj_w.shape[0])
