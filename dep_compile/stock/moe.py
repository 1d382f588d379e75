"""Stock latent MoE: router | latent down-proj -> routed experts -> latent RMSNorm -> up-proj, + shared expert."""

from __future__ import annotations

import torch
from torch import nn

from .config import K3Config
from .layers import RMSNorm, Router, SiTUMLP


class FusedExperts(nn.Module):
    """The routed experts' weights (vLLM FusedMoE names): w13 [E, 2I, Lat], w2 [E, Lat, I].

    ``num_local`` experts from ``expert_start`` (default: all); ``ep_size`` the EP group they are
    sharded over (default: the experts / ``num_local``; 1 runs these experts alone, with no
    dispatch: ids owned elsewhere add nothing, as one rank's share in a benchmark).
    """

    def __init__(self, config: K3Config, num_local: int | None = None, expert_start: int = 0,
                 ep_size: int | None = None):
        super().__init__()
        E = num_local or config.n_routed_experts
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * config.moe_intermediate, config.moe_latent_size))
        self.w2_weight = nn.Parameter(torch.empty(E, config.moe_latent_size, config.moe_intermediate))
        self.expert_start = expert_start
        self.ep_size = ep_size or config.n_routed_experts // E  # > 1: experts sharded over an EP group
        self.beta, self.beta_lin = config.situ_beta, config.situ_beta_lin

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.kimi_k3.routed_experts(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_start, self.ep_size, self.beta,
            self.beta_lin)


class KimiMoE(nn.Module):
    """K3's latent MoE block; ``shared_intermediate = 0`` builds it without a shared expert."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_start: int = 0,
                 ep_size: int | None = None):
        super().__init__()
        c = config
        self.gate = Router(c)
        self.routed_expert_down_proj = nn.Linear(c.hidden_size, c.moe_latent_size, bias=False)
        self.experts = FusedExperts(c, num_local, expert_start, ep_size)
        self.routed_expert_norm = RMSNorm(c.moe_latent_size, c.rms_eps)
        self.routed_expert_up_proj = nn.Linear(c.moe_latent_size, c.hidden_size, bias=False)
        self.shared_experts = SiTUMLP(c, c.hidden_size, c.shared_intermediate) if c.shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        latent = self.routed_expert_down_proj(x)
        routed = self.experts(latent, topk_weights, topk_ids)
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
