"""Reference routed experts: SiTU MLPs in the MoE latent, weighted by the router."""

from __future__ import annotations

import torch

from ..mxfp4 import Mxfp4Weight
from ..mxfp4_tiles import Mxfp4Tiles
from .common import situ


def routed_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_start: int, beta: float, beta_lin: float,
) -> torch.Tensor:
    """Weighted sum of each token's selected local experts, rounded to BF16: [T, Lat]."""
    return routed_experts_partial(x, w13, w2, topk_weights, topk_ids, expert_start, beta, beta_lin).to(x.dtype)


def routed_experts_partial(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_start: int, beta: float, beta_lin: float,
) -> torch.Tensor:
    """Weighted sum of each token's selected local experts, in FP32.

    x: [T, Lat] BF16; w13: [E_local, 2*I, Lat] (gate | up); w2: [E_local, Lat, I];
    topk_weights: [T, K] FP32; topk_ids: [T, K] global expert ids. Experts
    ``expert_start .. expert_start + E_local - 1`` are local; other ids contribute nothing
    (another rank owns them). Per expert: h = x W13^T (BF16), a = SiTU(h) (BF16), y = a W2^T.
    Returns [T, Lat] FP32.
    """
    E, two_i, _ = w13.shape
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    for e in range(E):
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = (x[tok].float() @ w13[e].float().t()).to(x.dtype)
        a = situ(h[:, : two_i // 2], h[:, two_i // 2 :], beta, beta_lin).to(x.dtype)
        y = a.float() @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out



def routed_experts_mxfp4_partial(
    x: torch.Tensor, w13: Mxfp4Weight | Mxfp4Tiles, w2: Mxfp4Weight | Mxfp4Tiles, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_start: int, beta: float, beta_lin: float,
) -> torch.Tensor:
    """The MXFP4 experts' reference, FP32 [T, Lat]: the weights (checkpoint layout or tiles) dequantized to x's
    dtype (exact: an E2M1 value times a power of two), then :func:`routed_experts_partial`."""
    return routed_experts_partial(x, w13.dequantize(x.dtype), w2.dequantize(x.dtype), topk_weights, topk_ids,
                                  expert_start, beta, beta_lin)
