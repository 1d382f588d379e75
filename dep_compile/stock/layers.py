"""Shared building blocks of the stock decoder: RMSNorm, SiTU MLP, router, AttnRes point."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import K3Config
from .fp8_block import Fp8BlockLinear
from .reference.common import situ as reference_situ


def dense_linear(fmt: str, in_features: int, out_features: int, segments: list[int] | None = None) -> nn.Module:
    """A bias-free projection in the dense format ``fmt`` (``K3Config.dense_format``): ``nn.Linear`` for BF16,
    ``Fp8BlockLinear`` for FP8 blocks (``segments``: the row counts of the projections packed in it)."""
    if fmt == "fp8_block":
        return Fp8BlockLinear(in_features, out_features, segments)
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    """RMSNorm in FP32, output in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def situ(gate_up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    """SiTU of a packed [T, 2I] gate|up projection, FP32 math, output in its dtype: [T, I]."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return reference_situ(g, u, beta, beta_lin).to(gate_up.dtype)


class SiTUMLP(nn.Module):
    """gate_up_proj -> SiTU -> down_proj (the dense MLP, BF16, and the MoE's shared expert, in ``fmt``)."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int, fmt: str = "bf16"):
        super().__init__()
        self.gate_up_proj = dense_linear(fmt, hidden, 2 * intermediate, [intermediate, intermediate])
        self.down_proj = dense_linear(fmt, intermediate, hidden)
        self.beta, self.beta_lin = config.situ_beta, config.situ_beta_lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_up_proj(x), self.beta, self.beta_lin))


def renormalized_topk(scores: torch.Tensor, keyed: torch.Tensor, top_k: int, scale: float):
    """ids = top-k of ``keyed`` [T, E]; weights = the selected ``scores``, renormalized, times ``scale``."""
    topk_ids = torch.topk(keyed, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights * scale, topk_ids


class Router(nn.Module):
    """The MoE gate: FP32 logits, sigmoid (or softmax) scores, top-k, renormalize, scale."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scoring_func = config.scoring_func
        self.scale = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, K] FP32, topk_ids [T, K] int64)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E] FP32
        scores = torch.sigmoid(logits) if self.scoring_func == "sigmoid" else torch.softmax(logits, -1)
        keyed = scores + self.e_score_correction_bias  # the bias steers selection only
        if self.n_group > 1:  # grouped top-k: keep the best topk_group groups (by their top-2 sum)
            grouped = keyed.view(x.shape[0], self.n_group, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            group_idx = group_score.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_score).scatter_(1, group_idx, 1.0)
            keyed = grouped.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).view(x.shape[0], -1)
        return renormalized_topk(scores, keyed, self.top_k, self.scale)


class AttnResPoint(nn.Module):
    """One AttnRes point (ahead of attention or the MLP): its pseudo-query and its schedule."""

    def __init__(self, config: K3Config, sublayer: int):
        super().__init__()
        self.query = nn.Parameter(torch.empty(config.hidden_size))
        block = config.attn_res_block
        self.write_slot = sublayer // block if sublayer % block == 0 else -1
        self.num_blocks = sublayer // block + 1
        self.eps = config.rms_eps

    def forward(self, prefix: torch.Tensor, bank: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return torch.ops.kimi_k3.attn_res(prefix, bank, delta, self.query, self.eps, self.num_blocks, self.write_slot)
