"""The rewritten MoE layer (EpMoeLayer schedule): packed [shared gate_up | latent down] front, router and
shared expert beside the experts, latent norm, up-projection, add."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock.layers import renormalized_topk, situ
from ..stock.moe import stock_routed_experts
from ..stock.mxfp4_tiles import as_mxfp4
from .dense import dense_linear, dense_weight
from .packing import packed_rows
from .projection import DepProjection
from .registry import lookup, prepared
from .streams import side_stream


@prepared
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
        bf16 = x.dtype == gate_w.dtype == torch.bfloat16  # (FP32 operands would run the Triton dots in TF32)
        if x.is_cuda and bf16 and x.shape[0] <= self.front_max:  # two Triton launches instead of ~15
            from .router_triton import route_sigmoid_topk

            return route_sigmoid_topk(x, gate_w, bias, self.top_k, self.scale)
        if x.is_cuda and bf16:  # BF16 operands, FP32 accumulate and output: no FP32 copy of the weight
            logits = torch.mm(x, gate_w.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x.float(), gate_w.float())
        scores = torch.sigmoid(logits)
        return renormalized_topk(scores, scores + bias, self.top_k, self.scale)

    def front_gemm(self, x: Tensor, front_ws: list[Tensor], front_s: list[Tensor] | None) -> tuple[Tensor, Tensor]:
        """(shared gate_up [T, 2*SI], latent [T, Lat]): one packed GEMM, or stock's two above FRONT_MAX (FP8: stock's
        op on the packed weight, which computes each row as the two would)."""
        if x.shape[0] > self.front_max and front_s is None:
            return F.linear(x, front_ws[0]), F.linear(x, front_ws[1])
        front = packed_rows(front_ws, "MoE front")  # [shared gate_up | latent down] rows
        scale = None if front_s is None else packed_rows(front_s, "MoE front scales")
        return self.front(x, front, scale).split([2 * self.shared_inter, self.latent], -1)

    def experts_tail(self, latent, topk_w, topk_ids, w13, w2, norm_w, up_w) -> Tensor:
        """Routed experts -> latent RMSNorm -> up-projection: [T, hidden] BF16.

        ``w13`` / ``w2``: BF16 tensors, or ``Mxfp4Weight`` / ``Mxfp4Tiles`` codes and scales. On CUDA the experts are
        kimi_dep's Triton kernels (``experts_triton``, MXFP4 dequantized in registers; EP dispatch around
        them when ``ep_size > 1``); elsewhere the stock op (its CPU reference)."""
        if latent.is_cuda:
            from .experts_triton import routed_experts_dep

            routed = routed_experts_dep(latent, w13, w2, topk_w, topk_ids, self.expert_start, self.ep_size,
                                        self.beta, self.beta_lin)
        else:
            routed = stock_routed_experts(latent, w13, w2, topk_w, topk_ids, self.expert_start, self.ep_size,
                                          self.beta, self.beta_lin)
        if routed.is_cuda:  # one Triton launch instead of cast, norm, cast
            from .norm_triton import rms_norm_fused

            routed = rms_norm_fused(routed, norm_w, self.norm_eps)
        else:
            routed = F.rms_norm(routed.float(), (self.latent,), norm_w.float(), self.norm_eps).to(latent.dtype)
        return dense_linear(routed, up_w)

    def forward(self, x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w,
                scales: list[Tensor] = ()) -> Tensor:
        """``scales``: FP8 block-scaled projections' scales, [*front_ws', up, shared down] (empty: BF16 weights)."""
        front_s = list(scales[:2]) or None
        if scales:
            up_w, shared_down_w = dense_weight(up_w, scales[2]), dense_weight(shared_down_w, scales[3])
        if x.is_cuda:
            return self.forward_streams(x, front_ws, front_s, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w)
        gate_up, latent = self.front_gemm(x, front_ws, front_s)
        topk_w, topk_ids = self.route(x, gate_w, bias)
        shared = dense_linear(situ(gate_up, self.beta, self.beta_lin), shared_down_w)
        return self.experts_tail(latent, topk_w, topk_ids, w13, w2, norm_w, up_w) + shared

    def forward_streams(self, x, front_ws, front_s, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w) -> Tensor:
        """The same math with the router and the shared expert on a side stream.

        main: front GEMM ----------> experts -> norm -> up ----> + shared
        side:   router (needs x) --^   shared expert (needs the front) --^
        Events order the streams (graph-capturable: fork from and join to the capturing
        stream); tensors made on the side stream are recorded on main before main reads them.
        """
        from .moe_triton import situ_fused

        main = torch.cuda.current_stream()
        side = side_stream(x.device)
        forked = torch.cuda.Event()
        forked.record(main)
        with torch.cuda.stream(side):
            side.wait_event(forked)
            topk_w, topk_ids = self.route(x, gate_w, bias)
            routed_ready = torch.cuda.Event()
            routed_ready.record(side)
        gate_up, latent = self.front_gemm(x, front_ws, front_s)
        front_ready = torch.cuda.Event()
        front_ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(front_ready)
            shared = dense_linear(situ_fused(gate_up, self.beta, self.beta_lin), shared_down_w)
            shared_ready = torch.cuda.Event()
            shared_ready.record(side)
        main.wait_event(routed_ready)
        for t in (topk_w, topk_ids):
            t.record_stream(main)
        gate_up.record_stream(side)
        tail = self.experts_tail(latent, topk_w, topk_ids, w13, w2, norm_w, up_w)
        main.wait_event(shared_ready)
        shared.record_stream(main)
        return tail + shared


@torch.library.custom_op("kimi_dep::moe", mutates_args=())
def moe(
    x: Tensor, front_ws: list[Tensor], gate_w: Tensor, bias: Tensor, w13: Tensor, w2: Tensor, norm_w: Tensor,
    up_w: Tensor, shared_down_w: Tensor, layer: str, scales: list[Tensor],
) -> Tensor:
    """A whole K3 MoE layer: x [T, hidden] -> [T, hidden].

    front_ws: [shared gate_up [2*SI, hidden], latent down [Lat, hidden]], adjacent views of one
    [2*SI + Lat, hidden] tensor once packed (15872 rows at full size);
    gate_w: [E, hidden]; bias: [E] FP32; w13: [E_local, 2I, Lat]; w2: [E_local, Lat, I];
    norm_w: [Lat]; up_w: [hidden, Lat]; shared_down_w: [hidden, SI].
    FP8 block-scaled projections: front_ws, up_w and shared_down_w are e4m3 codes and ``scales`` their FP32
    block scales [*front_ws, up, shared down] (``stock/fp8_block.py``); empty for BF16. The router stays BF16.
    """
    return lookup(layer).forward(x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w, scales)


@moe.register_fake
def _(x, front_ws, gate_w, bias, w13, w2, norm_w, up_w, shared_down_w, layer, scales):
    return torch.empty_like(x)


@torch.library.custom_op("kimi_dep::moe_mxfp4", mutates_args=())
def moe_mxfp4(
    x: Tensor, front_ws: list[Tensor], gate_w: Tensor, bias: Tensor, w13_packed: Tensor, w13_scale: Tensor,
    w2_packed: Tensor, w2_scale: Tensor, norm_w: Tensor, up_w: Tensor, shared_down_w: Tensor, layer: str,
    scales: list[Tensor],
) -> Tensor:
    """``moe`` on MXFP4 routed experts as K3 ships them (``stock/mxfp4.py``): x [T, hidden] -> [T, hidden].

    w13_packed [E_local, 2I, Lat/2] / w2_packed [E_local, Lat, I/2]: uint8 E2M1 codes, two a byte;
    w13_scale [E_local, 2I, Lat/32] / w2_scale [E_local, Lat, I/32]: uint8 E8M0 scales; or both re-packed into
    tiles at load time (int32 words, int16 scales: ``stock/mxfp4_tiles.py``); the rest as ``moe``.
    """
    return lookup(layer).forward(x, front_ws, gate_w, bias, as_mxfp4("kimi_dep.moe_mxfp4 w13", w13_packed, w13_scale),
                                 as_mxfp4("kimi_dep.moe_mxfp4 w2", w2_packed, w2_scale), norm_w, up_w, shared_down_w,
                                 scales)


@moe_mxfp4.register_fake
def _(x, front_ws, gate_w, bias, w13_packed, w13_scale, w2_packed, w2_scale, norm_w, up_w, shared_down_w, layer,
      scales):
    return torch.empty_like(x)
