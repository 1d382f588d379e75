"""The rewritten MoE layer (EpMoeLayer schedule): packed [shared gate_up | latent down] front, router and
shared expert beside the experts, latent norm, up-projection, add."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock.layers import situ
from .packing import packed_rows
from .projection import DepProjection
from .registry import lookup


@dataclasses.dataclass
class EpMoeLayer:
    """Sizes, routing constants and the front projection of one K3 MoE layer."""

    shared_inter: int  # SiTU width of the shared expert (gate_up has 2x this many rows)
    latent: int
    top_k: int
    scale: float
    beta: float
    beta_lin: float
    norm_eps: float
    expert_start: int
    ep_size: int  # > 1: the experts call dispatches over the EP group (dep_compile.runtime.ep)
    front_max: int
    front: DepProjection

    def route(self, x: Tensor, gate_w: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        """Sigmoid top-k: FP32 logits, bias for selection only, renormalized, scaled."""
        scores = torch.sigmoid(F.linear(x.float(), gate_w.float()))
        ids = torch.topk(scores + bias, self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * self.scale, ids

    def forward(self, x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w) -> Tensor:
        gu_w, down_w = front_ws
        if x.shape[0] > self.front_max:  # the stock path: two plain GEMMs
            gate_up, latent = F.linear(x, gu_w), F.linear(x, down_w)
        else:
            front = packed_rows(front_ws, "MoE front")  # [shared gate_up | latent down] rows
            gate_up, latent = self.front(x, front).split([2 * self.shared_inter, self.latent], -1)
        topk_w, topk_ids = self.route(x, gate_w, bias)
        shared = F.linear(situ(gate_up, self.beta, self.beta_lin), shared_down_w)
        routed = torch.ops.kimi_k3.routed_experts(latent, w13, w2, topk_w, topk_ids, self.expert_start,
                                                  self.ep_size, self.beta, self.beta_lin)
        routed = F.rms_norm(routed.float(), (self.latent,), norm_w.float(), self.norm_eps).to(x.dtype)
        return F.linear(routed, up_w) + shared


@torch.library.custom_op("kimi_dep::moe", mutates_args=())
def moe(
    x: Tensor, front_ws: list[Tensor], gate_w: Tensor, bias: Tensor, w13: Tensor, w2: Tensor, norm_w: Tensor,
    up_w: Tensor, shared_down_w: Tensor, layer: str,
) -> Tensor:
    """A whole K3 MoE layer: x [T, hidden] -> [T, hidden].

    front_ws: [shared gate_up [2*SI, hidden], latent down [Lat, hidden]], adjacent views of one
    [2*SI + Lat, hidden] tensor once packed (15872 rows at full size);
    gate_w: [E, hidden]; bias: [E] FP32; w13: [E_local, 2I, Lat]; w2: [E_local, Lat, I];
    norm_w: [Lat]; up_w: [hidden, Lat]; shared_down_w: [hidden, SI].
    """
    return lookup(layer).forward(x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w)


@moe.register_fake
def _(x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w, layer):
    return torch.empty_like(x)
