"""The near-miss catalogue: one layer of a stock decoder, written another way.

Each :class:`Variant` swaps ONE module of a built stock decoder (``layers[L].self_attn``,
``layers[L].mlp``, ``layers[L].mlp.gate`` or ``layers[L].mlp.shared_experts``) for a subclass
whose ``forward`` is written differently. The new module keeps the stock parameter names and
loads the old module's state dict (FP32 parameters stay FP32: A_log, dt_bias,
e_score_correction_bias; the rest BF16), frozen, in eval mode, on the old module's device.

``expect``:

* ``"either"``: the variant changes what the layer computes (or is a legal change the fused op
  can carry, like an eps). The compiler must leave it stock (report row not rewritten, with the
  failed check as its reason) or rewrite it and still match eager exactly.
* ``"rewrite"``: a pure re-spelling of the stock math (its eager output is bit-identical to the
  stock layer's); the pass is being taught to canonicalize it, so it must be rewritten and exact.
* ``"stock-only"`` (not used so far): must stay stock.

``neutral``: an ``"either"`` variant whose eager output may equal stock's (a re-spelling that a
pass could get wrong, or a change no short run can observe); the suite does not require its
output to differ from stock.

``core``: one variant per item of the suite's brief (62 of them), the three product orders the walkers read,
the five MXFP4-experts variants and the five FP8-dense ones (75 in all); tests/test_near_miss.py runs
these by default, to stay under 90 s on 2 CPU cores, and every variant with ``NEAR_MISS_ALL=1``;
the property test draws from the whole catalogue.

Module slots compose: a ``"mlp"`` variant keeps the MoE's current ``gate`` and
``shared_experts`` modules (which ``"gate"`` / ``"shared"`` variants replace), so one layer can
carry one variant per slot (the property test does that).

``experts_format``: a variant of models with that routed-experts format only (``"mxfp4"``: K3's own); the
near-miss test builds its model in it, the property test applies it where the drawn config has it.
``dense_format``: the dense projections' format of the models a variant applies to, ``"bf16"`` unless it
is one of the FP8 block-scaled variants (``"fp8_block"``): most variants spell BF16 projections.

The kind-wide keyword spellings (every call with keyword arguments) live here as well
(``KwDSA``, ``KwKDA``, ``KwRouter``, ``KwMoE``, ``KwShared``, ``KwExperts``), for
tests/test_keyword_spellings.py and the ``*_all_kwargs`` variants.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dep_compile.stock.attention import KimiDeltaAttention, KimiDSAAttention
from dep_compile.stock.fp8_block import FP8_MAX, Fp8BlockLinear, dequantize
from dep_compile.stock.layers import Router, SiTUMLP
from dep_compile.stock.moe import FusedExperts, KimiMoE, Mxfp4Experts

BF16 = torch.bfloat16
K3 = torch.ops.kimi_k3

# ---------------------------------------------------------------------------------------------
# swapping one module


def adopt(new: nn.Module, old: nn.Module, strict: bool = True) -> nn.Module:
    """``new`` takes ``old``'s parameters: same names, dtypes (FP32 ones stay FP32), device and values."""
    ref = dict(old.named_parameters())
    for name, p in new.named_parameters():
        if name in ref:
            p.data = torch.empty_like(ref[name])
    new.load_state_dict(old.state_dict(), strict=strict)
    return new.eval().requires_grad_(False)


SLOTS = ("attn", "mlp", "gate", "shared")


def slot_parent(model, layer: int, slot: str) -> tuple[nn.Module, str]:
    block = model.model.layers[layer]
    return {"attn": (block, "self_attn"), "mlp": (block, "mlp"), "gate": (block.mlp, "gate"),
            "shared": (block.mlp, "shared_experts")}[slot]


def _plain(cls):
    def build(cfg, old):
        return adopt(cls(cfg), old)
    return build


def _dsa(cls):
    def build(cfg, old):
        return adopt(cls(cfg, old.indexer.merged), old)
    return build


def _shared(cls):
    def build(cfg, old):
        return adopt(cls(cfg, cfg.hidden_size, cfg.shared_intermediate, cfg.dense_format), old)
    return build


def _moe(cls):
    def build(cfg, old):
        new = adopt(cls(cfg), old)
        new.gate, new.shared_experts = old.gate, old.shared_experts  # keep the other slots' variants
        return new
    return build


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "dsa" | "kda" | "moe" | "router"
    expect: str  # "either" | "rewrite" | "stock-only"
    slot: str  # "attn" | "mlp" | "gate" | "shared"
    build: Callable = dataclasses.field(repr=False)  # (cfg, old module) -> new module
    neutral: bool = False  # an "either" whose eager output may equal stock's
    run: dict = dataclasses.field(default_factory=dict)  # compare_steps overrides (e.g. a batch it needs)
    note: str = ""
    core: bool = True  # in the default (fast) CPU run of tests/test_near_miss.py; see CORE below
    experts_format: str | None = None  # a variant of that experts format's models only ("mxfp4"); None: any
    dense_format: str = "bf16"  # the dense format of the models it applies to (most spell the BF16 projections)

    def config(self, cfg):
        """``cfg`` in the experts and dense formats the variant needs."""
        if self.experts_format:
            cfg = cfg.replace(experts_format=self.experts_format)
        return cfg.replace(dense_format=self.dense_format)

    @property
    def row_kind(self) -> str:
        """The report row's kind: the router is part of its MoE."""
        return "moe" if self.kind == "router" else self.kind

    def layers(self, cfg) -> list[int]:
        """The layers this variant can apply to in ``cfg``."""
        n = cfg.num_layers
        if self.experts_format not in (None, cfg.experts_format) or self.dense_format != cfg.dense_format:
            return []
        if self.kind == "dsa":
            return [i for i in range(n) if cfg.layer_kind(i) == "dsa"]
        if self.kind == "kda":
            return [i for i in range(n) if cfg.layer_kind(i) == "kda"]
        return [i for i in range(n) if cfg.is_moe(i)]

    def default_layer(self, cfg) -> int:
        """DSA: the first DSA layer (3 in k31-small at 4 layers); KDA, MoE, router: layer 1."""
        ls = self.layers(cfg)
        return ls[0] if self.kind == "dsa" else (1 if 1 in ls else ls[0])

    def apply(self, model, cfg, layer: int | None = None) -> int:
        """Swap the module in ``model`` (in place); returns the layer it changed."""
        layer = self.default_layer(cfg) if layer is None else layer
        assert layer in self.layers(cfg), (self.name, layer)
        parent, attr = slot_parent(model, layer, self.slot)
        setattr(parent, attr, self.build(cfg, getattr(parent, attr)))
        return layer


CATALOGUE: list[Variant] = []


def variant(name, kind, expect, slot, build, **kw) -> Variant:
    assert expect in ("either", "rewrite", "stock-only") and slot in SLOTS and kind in ("dsa", "kda", "moe", "router")
    assert all(v.name != name for v in CATALOGUE), name
    v = Variant(name, kind, expect, slot, build, **kw)
    CATALOGUE.append(v)
    return v


# ---------------------------------------------------------------------------------------------
# Router: hook points over the stock math (the base class computes exactly Router.forward)


class HookRouter(Router):
    def logits(self, x):
        return F.linear(x.float(), self.weight.float())

    def scores(self, logits):
        return torch.sigmoid(logits)

    def keyed(self, scores):
        return scores + self.e_score_correction_bias

    def select(self, keyed):
        return torch.topk(keyed, self.top_k, dim=-1).indices

    def weights(self, scores, keyed, ids):
        return scores.gather(1, ids)

    def renorm(self, w):
        return w / w.sum(dim=-1, keepdim=True)

    def scale_w(self, w):
        return w * self.scale

    def forward(self, x):
        scores = self.scores(self.logits(x))
        keyed = self.keyed(scores)
        ids = self.select(keyed)
        w = self.renorm(self.weights(scores, keyed, ids))
        return self.scale_w(w), ids


def _router(name, expect, **methods):
    """A variant that overrides some of HookRouter's hooks."""
    kw = {k: methods.pop(k) for k in ("neutral", "run", "note") if k in methods}
    cls = type("Router_" + name, (HookRouter,), methods)
    return variant(name, "router", expect, "gate", _plain(cls), **kw)


# -- meaning changes
_router("router_topk_smallest", "either",
        select=lambda self, keyed: torch.topk(keyed, self.top_k, dim=-1, largest=False).indices)
# top-k over the tokens (dim 0) of the [T, E] keyed scores: ids [16, E] (a batch of 16 rows runs it)
_router("router_topk_dim0", "either", run={"batch": 16},
        select=lambda self, keyed: torch.topk(keyed, self.top_k, dim=0).indices)
_router("router_renorm_dim0", "either",
        renorm=lambda self, w: w / w.sum(dim=0, keepdim=True))
_router("router_renorm_total_sum", "either",
        renorm=lambda self, w: w / w.sum())
_router("router_weights_bf16", "either",
        scale_w=lambda self, w: (w * self.scale).to(torch.bfloat16))
_router("router_weights_fp16", "either",
        scale_w=lambda self, w: (w * self.scale).half())
_router("router_weights_bf16_before_scale", "either",
        renorm=lambda self, w: (w / w.sum(dim=-1, keepdim=True)).bfloat16())
_router("router_softmax_by_hand", "either",
        scores=lambda self, logits: torch.exp(logits) / torch.exp(logits).sum(dim=-1, keepdim=True))
_router("router_tanh_scores", "either",
        scores=lambda self, logits: 0.5 * (torch.tanh(logits) + 1.0))
_router("router_bias_added_to_weights", "either",
        weights=lambda self, scores, keyed, ids: scores.gather(1, ids) + self.e_score_correction_bias[ids])
_router("router_gather_keyed", "either",
        weights=lambda self, scores, keyed, ids: keyed.gather(1, ids))
_router("router_bias_scaled", "either",
        keyed=lambda self, scores: scores + 2.0 * self.e_score_correction_bias)
_router("router_no_bias", "either",
        keyed=lambda self, scores: scores + 0.0)
_router("router_scale_twice", "either",
        scale_w=lambda self, w: w * self.scale * self.scale)
_router("router_scale_extra_2", "either",
        scale_w=lambda self, w: (w * 2.0) * self.scale)
_router("router_scale_folded_constant", "either", note="a different constant than config: carried or refused",
        scale_w=lambda self, w: w * (self.scale * 2.0))
_router("router_logits_bf16", "either",
        logits=lambda self, x: F.linear(x, self.weight).float())
_router("router_logits_bf16_sigmoid", "either", note="sigmoid in BF16, FP32 only after",
        scores=lambda self, logits: torch.sigmoid(logits.bfloat16()).float())
_router("router_sorted_false", "either", neutral=True,
        note="experts are order-invariant; the renorm sum order may move",
        select=lambda self, keyed: torch.topk(keyed, self.top_k, dim=-1, sorted=False).indices)
_router("router_topk_dim0_transposed", "either", neutral=True, note="top-k over dim 0 of keyed^T: the same ids",
        select=lambda self, keyed: torch.topk(keyed.t(), self.top_k, dim=0).indices.t())
_router("router_renorm_unsqueeze", "either", neutral=True,
        renorm=lambda self, w: w / w.sum(dim=-1).unsqueeze(-1))

# -- re-spellings


class KwRouter(HookRouter):
    """Every call with keywords."""

    def forward(self, x):
        logits = F.linear(input=x.float(), weight=self.weight.float())
        scores = torch.sigmoid(input=logits)
        keyed = torch.add(input=scores, other=self.e_score_correction_bias)
        ids = torch.topk(input=keyed, k=self.top_k, dim=-1).indices
        w = torch.gather(input=scores, dim=1, index=ids)
        w = torch.div(input=w, other=torch.sum(input=w, dim=-1, keepdim=True))
        return torch.mul(input=w, other=self.scale), ids


variant("router_all_kwargs", "router", "rewrite", "gate", _plain(KwRouter))
_router("router_topk_kwargs", "rewrite",
        select=lambda self, keyed: torch.topk(input=keyed, k=self.top_k, dim=-1).indices)
_router("router_sigmoid_kwargs", "rewrite",
        scores=lambda self, logits: torch.sigmoid(input=logits))
_router("router_gather_kwargs", "rewrite",
        weights=lambda self, scores, keyed, ids: torch.gather(input=scores, dim=1, index=ids))
_router("router_linear_kwargs", "rewrite",
        logits=lambda self, x: F.linear(input=x.float(), weight=self.weight.float()))
_router("router_methods", "rewrite",
        scores=lambda self, logits: logits.sigmoid(),
        select=lambda self, keyed: keyed.topk(self.top_k, dim=-1).indices)
_router("router_torch_div", "rewrite",
        renorm=lambda self, w: torch.div(w, w.sum(dim=-1, keepdim=True)))
_router("router_torch_sum", "rewrite",
        renorm=lambda self, w: w / torch.sum(w, dim=-1, keepdim=True))
_router("router_topk_explicit_defaults", "rewrite",
        select=lambda self, keyed: torch.topk(keyed, self.top_k, dim=-1, largest=True, sorted=True).indices)
_router("router_matmul_logits", "rewrite",
        logits=lambda self, x: x.float() @ self.weight.float().t())
_router("router_scale_first", "rewrite",
        scale_w=lambda self, w: self.scale * w)


# ---------------------------------------------------------------------------------------------
# MoE: the routed path / latent norm / combine (KimiMoE subclasses), the shared expert (SiTUMLP)


class HookMoE(KimiMoE):
    def down(self, x):
        return self.routed_expert_down_proj(x)

    def experts_call(self, latent, w, ids):
        return self.experts(latent, w, ids)

    def routed_path(self, routed):
        return routed

    def latent_norm(self, routed):
        return self.routed_expert_norm(routed)

    def up(self, n):
        return self.routed_expert_up_proj(n)

    def combine(self, up, shared):
        return up + shared

    def forward(self, x):
        w, ids = self.gate(x)
        routed = self.routed_path(self.experts_call(self.down(x), w, ids))
        return self.combine(self.up(self.latent_norm(routed)), self.shared_experts(x))


def _hook_variant(name, expect, kind, hook, make, slot, setup=None, **methods):
    """A variant overriding ``methods`` of hook class ``hook`` (built by ``make``), then ``setup``."""
    kw = {k: methods.pop(k) for k in ("neutral", "run", "note", "experts_format") if k in methods}
    build = make(type(f"{kind.upper()}_{name}", (hook,), methods))
    if setup is not None:
        base = build

        def build(cfg, old, base=base):
            new = base(cfg, old)
            setup(new, cfg)
            return new
    return variant(name, kind, expect, slot, build, **kw)


def _moe_variant(name, expect, setup=None, **methods):
    return _hook_variant(name, expect, "moe", HookMoE, _moe, "mlp", setup, **methods)


def _rms_by_hand(r, w, eps):
    xf = r.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(r.dtype)


def _set_norm_eps(new, cfg):
    new.routed_expert_norm.eps = 1e-2


# -- meaning changes
_moe_variant("moe_routed_scaled", "either", routed_path=lambda self, r: r * 2)
_moe_variant("moe_routed_shifted", "either", routed_path=lambda self, r: r + 0.25)
_moe_variant("moe_latent_norm_eps", "either", setup=_set_norm_eps, note="a legal carried parameter")
_moe_variant("moe_latent_norm_no_weight", "either",
             latent_norm=lambda self, r: F.rms_norm(r.float(), (r.shape[-1],), None,
                                                    self.routed_expert_norm.eps).to(r.dtype))
_moe_variant("moe_latent_norm_bf16", "either", neutral=True, note="RMSNorm of BF16 input (CPU computes it in FP32)",
             latent_norm=lambda self, r: F.rms_norm(r, (r.shape[-1],), self.routed_expert_norm.weight,
                                                    self.routed_expert_norm.eps))
_moe_variant("moe_up_scaled", "either", up=lambda self, n: self.routed_expert_up_proj(n) * 0.5)
_moe_variant("moe_sub_shared", "either", combine=lambda self, up, shared: up - shared)
_moe_variant("moe_add_alpha", "either", combine=lambda self, up, shared: torch.add(up, shared, alpha=2))
_moe_variant("moe_shared_scaled_in_add", "either", combine=lambda self, up, shared: up + shared * 0.5)
_moe_variant("moe_latent_scaled", "either", note="latent = down(x) * 1.5",
             down=lambda self, x: self.routed_expert_down_proj(x) * 1.5)

# -- re-spellings
_moe_variant("moe_norm_by_hand", "rewrite",
             latent_norm=lambda self, r: _rms_by_hand(r, self.routed_expert_norm.weight, self.routed_expert_norm.eps))
_moe_variant("moe_norm_kwargs", "rewrite",
             latent_norm=lambda self, r: F.rms_norm(input=r.float(), normalized_shape=(r.shape[-1],),
                                                    weight=self.routed_expert_norm.weight.float(),
                                                    eps=self.routed_expert_norm.eps).to(r.dtype))
_moe_variant("moe_linear_kwargs", "rewrite",
             down=lambda self, x: F.linear(input=x, weight=self.routed_expert_down_proj.weight),
             up=lambda self, n: F.linear(input=n, weight=self.routed_expert_up_proj.weight))
_moe_variant("moe_torch_add", "rewrite", combine=lambda self, up, shared: torch.add(up, shared))
_moe_variant("moe_shared_first", "rewrite", combine=lambda self, up, shared: shared + up)
_moe_variant("moe_matmul_projections", "rewrite",
             down=lambda self, x: x @ self.routed_expert_down_proj.weight.t(),
             up=lambda self, n: n @ self.routed_expert_up_proj.weight.t())
def _experts_op_kwargs(e, latent, w, ids):
    """The experts module ``e``'s stock op (BF16 or MXFP4), every argument by keyword."""
    common = dict(topk_weights=w, topk_ids=ids, expert_start=e.expert_start, ep_size=e.ep_size, beta=e.beta,
                  beta_lin=e.beta_lin)
    if isinstance(e, Mxfp4Experts):
        return K3.routed_experts_mxfp4(x=latent, w13_packed=e.w13_weight_packed, w13_scale=e.w13_weight_scale,
                                       w2_packed=e.w2_weight_packed, w2_scale=e.w2_weight_scale, **common)
    return K3.routed_experts(x=latent, w13=e.w13_weight, w2=e.w2_weight, **common)


_moe_variant("moe_experts_op_kwargs", "rewrite", note="the routed-experts op with keywords",
             experts_call=lambda self, latent, w, ids: _experts_op_kwargs(self.experts, latent, w, ids))


# -- MXFP4 experts (K3's format): what the kimi_dep kernels cannot read is refused
def _mxfp4_call(self, latent, w, ids, w13=None, w2=None):
    e = self.experts
    w13 = w13 or (e.w13_weight_packed, e.w13_weight_scale)
    w2 = w2 or (e.w2_weight_packed, e.w2_weight_scale)
    return K3.routed_experts_mxfp4(latent, *w13, *w2, w, ids, e.expert_start, e.ep_size, e.beta, e.beta_lin)


def _float_scales(new, cfg):
    """The same weights with float scales 2^(s - 127) for E8M0 codes s (the stock op reads either)."""
    for name in ("w13_weight_scale", "w2_weight_scale"):
        p = getattr(new.experts, name)
        p.data = torch.exp2(p.data.float() - 127)


def _scales_per_16(new, cfg):
    """The same weights with each scale written twice: one per 16 inputs."""
    for name in ("w13_weight_scale", "w2_weight_scale"):
        p = getattr(new.experts, name)
        p.data = p.data.repeat_interleave(2, -1)


_moe_variant("mxfp4_float_scale", "either", setup=_float_scales, neutral=True, experts_format="mxfp4",
             note="FP32 scales, the same values: not E8M0")
_moe_variant("mxfp4_group_16", "either", setup=_scales_per_16, neutral=True, experts_format="mxfp4",
             note="one scale per 16 inputs, the same values: not MXFP4's 32")
_moe_variant("mxfp4_nibbles_swapped", "either", experts_format="mxfp4", note="w13 codes with their nibbles swapped",
             experts_call=lambda self, latent, w, ids: _mxfp4_call(
                 self, latent, w, ids, w13=((self.experts.w13_weight_packed << 4) | (self.experts.w13_weight_packed >> 4),
                                            self.experts.w13_weight_scale)))
_moe_variant("mxfp4_scale_of_another_expert", "either", experts_format="mxfp4",
             note="w2 scales rolled by one expert",
             experts_call=lambda self, latent, w, ids: _mxfp4_call(
                 self, latent, w, ids, w2=(self.experts.w2_weight_packed, self.experts.w2_weight_scale.roll(1, 0))))
_moe_variant("mxfp4_experts_op_kwargs", "rewrite", experts_format="mxfp4", note="the MXFP4 experts op with keywords",
             experts_call=lambda self, latent, w, ids: _experts_op_kwargs(self.experts, latent, w, ids))


class HookShared(SiTUMLP):
    """SiTUMLP.forward with the SiTU written out (FP32 math, the stock op order)."""

    def gate_up(self, x):
        return self.gate_up_proj(x)

    def halves(self, gu):
        return gu.float().chunk(2, dim=-1)

    def act(self, g, u):
        b, bl = self.beta, self.beta_lin
        return b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))

    def down(self, a):
        return self.down_proj(a)

    def forward(self, x):
        gu = self.gate_up(x)
        g, u = self.halves(gu)
        return self.down(self.act(g, u).to(gu.dtype))


def _shared_variant(name, expect, **methods):
    kw = {k: methods.pop(k) for k in ("neutral", "run", "note", "dense_format") if k in methods}
    cls = type("Shared_" + name, (HookShared,), methods)
    return variant(name, "moe", expect, "shared", _shared(cls), **kw)


def _situ(g, u, b, bl, *, sig=None):
    return b * torch.tanh(g / b) * (torch.sigmoid(g) if sig is None else sig) * (bl * torch.tanh(u / bl))


# -- meaning changes
_shared_variant("shared_halves_swapped", "either",
                halves=lambda self, gu: gu.float().chunk(2, dim=-1)[::-1])
_shared_variant("shared_beta_plus_1", "either",
                act=lambda self, g, u: _situ(g, u, self.beta + 1.0, self.beta_lin))
_shared_variant("shared_beta_mixed", "either", note="beta in the factor, beta+1 in the divisor",
                act=lambda self, g, u: self.beta * torch.tanh(g / (self.beta + 1.0)) * torch.sigmoid(g)
                * (self.beta_lin * torch.tanh(u / self.beta_lin)))
_shared_variant("shared_beta_lin_changed", "either",
                act=lambda self, g, u: _situ(g, u, self.beta, self.beta_lin * 0.2))
_shared_variant("shared_beta_lin_mixed", "either",
                act=lambda self, g, u: self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
                * (self.beta_lin * torch.tanh(u / (self.beta_lin * 0.2))))
_shared_variant("shared_gate_tanh_dropped", "either",
                act=lambda self, g, u: self.beta * (g / self.beta) * torch.sigmoid(g)
                * (self.beta_lin * torch.tanh(u / self.beta_lin)))
_shared_variant("shared_up_tanh_dropped", "either",
                act=lambda self, g, u: self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
                * (self.beta_lin * (u / self.beta_lin)))
_shared_variant("shared_silu_for_sigmoid", "either",
                act=lambda self, g, u: _situ(g, u, self.beta, self.beta_lin, sig=F.silu(g)))
_shared_variant("shared_sigmoid_of_up", "either",
                act=lambda self, g, u: _situ(g, u, self.beta, self.beta_lin, sig=torch.sigmoid(u)))
_shared_variant("shared_extra_scale", "either",
                act=lambda self, g, u: _situ(g, u, self.beta, self.beta_lin) * 1.5)
_shared_variant("shared_act_bf16", "either", note="SiTU computed in BF16",
                halves=lambda self, gu: gu.chunk(2, dim=-1))
_shared_variant("shared_down_scaled", "either",
                down=lambda self, a: self.down_proj(a) * 1.5)

# -- re-spellings
_shared_variant("shared_split_halves", "rewrite",
                halves=lambda self, gu: gu.float().split([gu.shape[-1] // 2, gu.shape[-1] // 2], dim=-1))
_shared_variant("shared_split_int", "rewrite",
                halves=lambda self, gu: gu.float().split(gu.shape[-1] // 2, dim=-1))
_shared_variant("shared_torch_chunk", "rewrite",
                halves=lambda self, gu: torch.chunk(gu.float(), 2, dim=-1))
_shared_variant("shared_matmul", "rewrite",
                gate_up=lambda self, x: x @ self.gate_up_proj.weight.t(),
                down=lambda self, a: a @ self.down_proj.weight.t())
_shared_variant("shared_linear_kwargs", "rewrite",
                gate_up=lambda self, x: F.linear(input=x, weight=self.gate_up_proj.weight),
                down=lambda self, a: F.linear(input=a, weight=self.down_proj.weight))
_shared_variant("shared_act_factors_commuted", "rewrite", note="every product's factors in the other order",
                act=lambda self, g, u: (torch.tanh(u / self.beta_lin) * self.beta_lin)
                * (torch.sigmoid(g) * (torch.tanh(g / self.beta) * self.beta)))
_shared_variant("shared_act_reassociated", "either", neutral=True,
                note="the same factors, multiplied in another order (it may round alike)",
                act=lambda self, g, u: self.beta * torch.tanh(g / self.beta)
                * (torch.sigmoid(g) * (self.beta_lin * torch.tanh(u / self.beta_lin))))
_shared_variant("shared_act_torch_fns", "rewrite",
                act=lambda self, g, u: torch.mul(torch.mul(torch.mul(self.beta, torch.tanh(torch.div(g, self.beta))),
                                                           torch.sigmoid(g)),
                                                 torch.mul(self.beta_lin, torch.tanh(torch.div(u, self.beta_lin)))))


# -- FP8 block-scaled dense weights (the shared expert's down_proj of an FP8 model)

def _fp8_down(self, a, scale):
    d = self.down_proj
    return K3.fp8_block_linear(a, d.weight, scale, d.segments)


def _per_tensor_w8a8(self, a):
    """W8A8 with one activation scale for the whole tensor (not per 128 inputs), the weight dequantized."""
    d = self.down_proj
    s = a.float().abs().amax().clamp_min(1e-10) / FP8_MAX
    aq = (a.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return ((aq.float() @ dequantize(d.weight, d.weight_scale, d.segments).t()) * s).to(a.dtype)


class Fp8ScalesTransposed(nn.Module):
    """An FP8 block linear that stores its block scales transposed and reads them through ``.t()``."""

    def __init__(self, old: Fp8BlockLinear):
        super().__init__()
        self.weight, self.segments = old.weight, old.segments
        self.weight_scale_t = nn.Parameter(old.weight_scale.data.t().contiguous(), requires_grad=False)

    def forward(self, a):
        return K3.fp8_block_linear(a, self.weight, self.weight_scale_t.t(), self.segments)


def _shared_replacing_down(make):
    """A shared-expert variant whose down_proj module is ``make(old down_proj)``."""
    def build(cfg, old):
        new = adopt(HookShared(cfg, cfg.hidden_size, cfg.shared_intermediate, cfg.dense_format), old)
        new.down_proj = make(new.down_proj)
        return new
    return build


def _bf16_linear(old: Fp8BlockLinear) -> nn.Linear:
    lin = nn.Linear(old.in_features, old.out_features, bias=False, device=old.weight.device)
    lin.weight = nn.Parameter(dequantize(old.weight, old.weight_scale, old.segments).to(BF16), requires_grad=False)
    return lin


_shared_variant("fp8_scale_of_another_block_row", "either", dense_format="fp8_block",
                note="down_proj's block scales rolled by one block row",
                down=lambda self, a: _fp8_down(self, a, self.down_proj.weight_scale.roll(1, 0)))
_shared_variant("fp8_per_tensor_activation", "either", dense_format="fp8_block",
                note="down_proj as W8A8 with one activation scale per tensor", down=_per_tensor_w8a8)
variant("fp8_scales_transposed", "moe", "either", "shared", _shared_replacing_down(Fp8ScalesTransposed),
        neutral=True, dense_format="fp8_block", note="down_proj's scales stored transposed, read through .t()")
variant("fp8_mixed_formats", "moe", "either", "shared", _shared_replacing_down(_bf16_linear), neutral=True,
        dense_format="fp8_block", note="down_proj in BF16 (its FP8 weight dequantized), the rest FP8")
_shared_variant("fp8_linear_kwargs", "rewrite", dense_format="fp8_block", note="the FP8 linear with keywords",
                down=lambda self, a: K3.fp8_block_linear(x=a, weight=self.down_proj.weight,
                                                         weight_scale=self.down_proj.weight_scale,
                                                         segments=self.down_proj.segments))


class KwExperts(FusedExperts):
    def forward(self, x, topk_weights, topk_ids):
        return _experts_op_kwargs(self, x, topk_weights, topk_ids)


class KwMxfp4Experts(Mxfp4Experts):
    def forward(self, x, topk_weights, topk_ids):
        return _experts_op_kwargs(self, x, topk_weights, topk_ids)


class KwMoE(HookMoE):
    """Every call with keywords (the experts op too, through KwExperts)."""

    def forward(self, x):
        w, ids = self.gate(x)
        latent = F.linear(input=x, weight=self.routed_expert_down_proj.weight)
        routed = self.experts(latent, w, ids)
        n = F.rms_norm(input=routed.float(), normalized_shape=(routed.shape[-1],),
                       weight=self.routed_expert_norm.weight.float(), eps=self.routed_expert_norm.eps)
        up = F.linear(input=n.to(dtype=routed.dtype), weight=self.routed_expert_up_proj.weight)
        return torch.add(input=up, other=self.shared_experts(x))


def _kw_moe(cfg, old):
    new = _moe(KwMoE)(cfg, old)
    new.experts = adopt((KwMxfp4Experts if cfg.experts_format == "mxfp4" else KwExperts)(cfg), old.experts)
    return new


class KwShared(HookShared):
    def forward(self, x):
        gu = F.linear(input=x, weight=self.gate_up_proj.weight)
        g, u = torch.split(tensor=gu.float(), split_size_or_sections=gu.shape[-1] // 2, dim=-1)
        b, bl = self.beta, self.beta_lin
        a = b * torch.tanh(input=g / b) * torch.sigmoid(input=g) * (bl * torch.tanh(input=u / bl))
        return F.linear(input=a.to(dtype=gu.dtype), weight=self.down_proj.weight)


variant("moe_all_kwargs", "moe", "rewrite", "mlp", _kw_moe)
variant("shared_all_kwargs", "moe", "rewrite", "shared", _shared(KwShared))


# ---------------------------------------------------------------------------------------------
# DSA: hook points over KimiDSAAttention.forward (project + indexer + sparse MLA + finish)


class HookDSA(KimiDSAAttention):
    def fused(self, x):
        return self.fused_qkv_a_g_proj(x)

    def split3(self, f):
        return f.split([self.q_lora, self.kv_lora + self.rope, self.gate_width], dim=-1)

    def norm_q_a(self, q_a):
        return self.q_a_layernorm(q_a)

    def q_heads(self, q_a_n, T):
        return self.q_b_proj(q_a_n).view(T, self.heads, self.nope + self.rope)

    def split_kv(self, kv_a):
        return kv_a.split([self.kv_lora, self.rope], dim=-1)

    def norm_c_kv(self, c_kv):
        return self.kv_a_layernorm(c_kv)

    def latent_of(self, c_n, k_rope):
        return torch.cat([c_n, k_rope], dim=-1)

    def index_query(self, q_a, q_a_n, T):
        idx = self.indexer
        return idx.wq_b(q_a_n).view(T, idx.heads, idx.head_dim)

    def index_keys(self, x):
        idx = self.indexer
        k = idx.wk(x)
        return F.layer_norm(k.float(), (idx.head_dim,), idx.k_norm.weight.float(), idx.k_norm.bias.float(),
                            idx.k_norm.eps).to(x.dtype)

    def index_weights(self, x):
        return self.indexer.weights_proj(x)

    def gate_out(self, o, gate):
        return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)

    def out(self, y):
        return self.o_proj(y)

    def gate_of(self, x, gate):
        return gate

    def forward(self, x, meta, cache):
        T = x.shape[0]
        q_a, kv_a, gate = self.split3(self.fused(x))
        q_a_n = self.norm_q_a(q_a)
        q = self.q_heads(q_a_n, T)
        c_kv, k_rope = self.split_kv(kv_a)
        latent = self.latent_of(self.norm_c_kv(c_kv), k_rope)
        idx = self.indexer
        topk = K3.dsa_indexer(self.index_query(q_a, q_a_n, T), self.index_weights(x), self.index_keys(x),
                              cache.index_cache, cache.index_scale, meta.slot_mapping, meta.block_table,
                              meta.seq_lens, meta.q_len, idx.topk)
        o = K3.sparse_mla_decode(q, latent, self.kv_b_proj.weight, cache.kv_cache, meta.slot_mapping,
                                 meta.block_table, topk, meta.q_len, self.scale, self.nope)
        return self.out(self.gate_out(o, self.gate_of(x, gate)))


def _dsa_variant(name, expect, setup=None, **methods):
    return _hook_variant(name, expect, "dsa", HookDSA, _dsa, "attn", setup, **methods)


def _eps(path, value):
    def setup(new, cfg):
        mod = new
        for p in path.split("."):
            mod = getattr(mod, p)
        mod.eps = value
    return setup


# -- meaning changes
_dsa_variant("dsa_gate_times_1_01", "either",
             gate_out=lambda self, o, gate: (o.float() * torch.sigmoid(gate.float()) * 1.01).to(o.dtype))
_dsa_variant("dsa_gated_bf16_times_1_01", "either",
             out=lambda self, y: self.o_proj(y * 1.01))
_dsa_variant("dsa_gate_plus_0", "either", neutral=True,
             gate_out=lambda self, o, gate: (o.float() * torch.sigmoid(gate.float()) + 0.0).to(o.dtype))
_dsa_variant("dsa_gate_fp16_round_trip", "either", note="FP32 -> FP16 -> BF16 double rounding",
             gate_out=lambda self, o, gate: (o.float() * torch.sigmoid(gate.float())).half().bfloat16())
_dsa_variant("dsa_gate_relu", "either",
             gate_out=lambda self, o, gate: torch.relu(o.float() * torch.sigmoid(gate.float())).to(o.dtype))
_dsa_variant("dsa_gate_tanh", "either",
             gate_out=lambda self, o, gate: (o.float() * torch.tanh(gate.float())).to(o.dtype))
_dsa_variant("dsa_gate_silu", "either",
             gate_out=lambda self, o, gate: (o.float() * F.silu(gate.float())).to(o.dtype))
_dsa_variant("dsa_gate_product_bf16", "either",
             gate_out=lambda self, o, gate: o * torch.sigmoid(gate))
_dsa_variant("dsa_gate_sigmoid_bf16", "either", note="sigmoid of the BF16 gate, product in FP32",
             gate_out=lambda self, o, gate: (o.float() * torch.sigmoid(gate).float()).to(o.dtype))
_dsa_variant("dsa_q_a_norm_eps", "either", setup=_eps("q_a_layernorm", 1e-1), note="a legal carried parameter")
_dsa_variant("dsa_kv_a_norm_eps", "either", setup=_eps("kv_a_layernorm", 1e-1), note="a legal carried parameter")
_dsa_variant("dsa_kv_a_layernorm", "either", note="kv_a RMSNorm replaced by LayerNorm (no bias)",
             norm_c_kv=lambda self, c: F.layer_norm(c.float(), (c.shape[-1],), self.kv_a_layernorm.weight.float(),
                                                    None, self.kv_a_layernorm.eps).to(c.dtype))
_dsa_variant("dsa_latent_cat_swapped", "either",
             latent_of=lambda self, c_n, k_rope: torch.cat([k_rope, c_n], dim=-1))
_dsa_variant("dsa_k_norm_eps", "either", setup=_eps("indexer.k_norm", 0.5), note="a legal carried parameter")
_dsa_variant("dsa_q_heads_dims_swapped", "either",
             q_heads=lambda self, q_a_n, T: self.q_b_proj(q_a_n).view(T, self.nope + self.rope, self.heads)
             .transpose(1, 2))
_dsa_variant("dsa_index_query_bit_view", "either", note="view(float16) reinterprets the BF16 bits: not plumbing",
             index_query=lambda self, q_a, q_a_n, T: self.indexer.wq_b(q_a_n).view(
                 T, self.indexer.heads, self.indexer.head_dim).view(torch.float16))
_dsa_variant("dsa_index_query_unnormed", "either",
             index_query=lambda self, q_a, q_a_n, T: self.indexer.wq_b(q_a).view(T, self.indexer.heads,
                                                                                 self.indexer.head_dim))
_dsa_variant("dsa_index_weights_times_2", "either", neutral=True, note="order-preserving: the same top-k",
             index_weights=lambda self, x: self.indexer.weights_proj(x) * 2)
_dsa_variant("dsa_index_weights_negated", "either",
             index_weights=lambda self, x: -self.indexer.weights_proj(x))
_dsa_variant("dsa_index_keys_unnormed", "either",
             index_keys=lambda self, x: self.indexer.wk(x))
_dsa_variant("dsa_gate_from_q_a", "either", note="the gate is the fused projection's first gate_width columns",
             gate_of=lambda self, x, gate: self.fused_qkv_a_g_proj(x)[..., :gate.shape[-1]])
_dsa_variant("dsa_k_rope_scaled", "either",
             latent_of=lambda self, c_n, k_rope: torch.cat([c_n, k_rope * 2], dim=-1))


# -- re-spellings
def _slices3(self, f):
    a, b = self.q_lora, self.q_lora + self.kv_lora + self.rope
    return f[..., :a], f[..., a:b], f[..., b:]


_dsa_variant("dsa_gate_commuted", "rewrite",
             gate_out=lambda self, o, gate: (torch.sigmoid(gate.float()) * o.float()).to(o.dtype))
_dsa_variant("dsa_slices", "rewrite", split3=_slices3,
             split_kv=lambda self, kv_a: (kv_a[..., :self.kv_lora], kv_a[..., self.kv_lora:]))
_dsa_variant("dsa_split_kwargs", "rewrite",
             split3=lambda self, f: torch.split(tensor=f, split_size_or_sections=[
                 self.q_lora, self.kv_lora + self.rope, self.gate_width], dim=-1),
             split_kv=lambda self, kv_a: torch.split(tensor=kv_a, split_size_or_sections=[self.kv_lora, self.rope],
                                                     dim=-1))
_dsa_variant("dsa_layer_norm_kwargs", "rewrite",
             index_keys=lambda self, x: F.layer_norm(
                 input=self.indexer.wk(x).float(), normalized_shape=(self.indexer.head_dim,),
                 weight=self.indexer.k_norm.weight.float(), bias=self.indexer.k_norm.bias.float(),
                 eps=self.indexer.k_norm.eps).to(x.dtype))
_dsa_variant("dsa_cat_kwargs", "rewrite",
             latent_of=lambda self, c_n, k_rope: torch.cat(tensors=[c_n, k_rope], dim=-1))
_dsa_variant("dsa_rms_norm_kwargs", "rewrite",
             norm_q_a=lambda self, q_a: F.rms_norm(input=q_a.float(), normalized_shape=(q_a.shape[-1],),
                                                   weight=self.q_a_layernorm.weight.float(),
                                                   eps=self.q_a_layernorm.eps).to(q_a.dtype),
             norm_c_kv=lambda self, c: F.rms_norm(input=c.float(), normalized_shape=(c.shape[-1],),
                                                  weight=self.kv_a_layernorm.weight.float(),
                                                  eps=self.kv_a_layernorm.eps).to(c.dtype))
_dsa_variant("dsa_rms_norm_by_hand", "rewrite",
             norm_q_a=lambda self, q_a: _rms_by_hand(q_a, self.q_a_layernorm.weight, self.q_a_layernorm.eps),
             norm_c_kv=lambda self, c: _rms_by_hand(c, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps))
_dsa_variant("dsa_gate_sigmoid_method", "rewrite",
             gate_out=lambda self, o, gate: (o.float() * gate.float().sigmoid()).to(o.dtype))
_dsa_variant("dsa_gate_torch_mul", "rewrite",
             gate_out=lambda self, o, gate: torch.mul(torch.sigmoid(gate.float()), o.float()).to(o.dtype))
_dsa_variant("dsa_reshape_heads", "rewrite",
             q_heads=lambda self, q_a_n, T: self.q_b_proj(q_a_n).reshape(T, self.heads, self.nope + self.rope))
_dsa_variant("dsa_matmul_projections", "rewrite",
             fused=lambda self, x: x @ self.fused_qkv_a_g_proj.weight.t(),
             out=lambda self, y: y @ self.o_proj.weight.t())


class SeparateGateDSA(HookDSA):
    """The output gate from its own ``gate_proj`` (same input x); the fused projection is q_a | kv_a only."""

    def split3(self, f):
        q_a, kv_a = f.split([self.q_lora, self.kv_lora + self.rope], dim=-1)
        return q_a, kv_a, None

    def gate_of(self, x, gate):
        return self.gate_proj(x)


def _separate_gate(cfg, old):
    new = _dsa(SeparateGateDSA)(cfg, old)
    w = new.fused_qkv_a_g_proj.weight.data
    rows = new.q_lora + new.kv_lora + new.rope
    new.fused_qkv_a_g_proj.weight = nn.Parameter(w[:rows].clone(), requires_grad=False)
    new.gate_proj = nn.Linear(w.shape[1], w.shape[0] - rows, bias=False, device=w.device, dtype=w.dtype)
    new.gate_proj.weight = nn.Parameter(w[rows:].clone(), requires_grad=False)
    return new


variant("dsa_separate_gate_proj", "dsa", "rewrite", "attn", _separate_gate)


class KwDSA(HookDSA):
    """Every call with keywords, the kimi_k3 ops too."""

    def forward(self, x, meta, cache):
        T = x.shape[0]
        idx = self.indexer
        f = F.linear(input=x, weight=self.fused_qkv_a_g_proj.weight)
        q_a, kv_a, gate = torch.split(tensor=f, split_size_or_sections=[
            self.q_lora, self.kv_lora + self.rope, self.gate_width], dim=-1)
        q_a_n = F.rms_norm(input=q_a.float(), normalized_shape=(self.q_lora,), weight=self.q_a_layernorm.weight.float(),
                           eps=self.q_a_layernorm.eps).to(dtype=x.dtype)
        q = F.linear(input=q_a_n, weight=self.q_b_proj.weight).view(T, self.heads, self.nope + self.rope)
        c_kv, k_rope = torch.split(tensor=kv_a, split_size_or_sections=[self.kv_lora, self.rope], dim=-1)
        c_n = F.rms_norm(input=c_kv.float(), normalized_shape=(self.kv_lora,),
                         weight=self.kv_a_layernorm.weight.float(), eps=self.kv_a_layernorm.eps).to(dtype=x.dtype)
        latent = torch.cat(tensors=[c_n, k_rope], dim=-1)
        q_idx = F.linear(input=q_a_n, weight=idx.wq_b.weight).view(T, idx.heads, idx.head_dim)
        k = F.layer_norm(input=F.linear(input=x, weight=idx.wk.weight).float(), normalized_shape=(idx.head_dim,),
                         weight=idx.k_norm.weight.float(), bias=idx.k_norm.bias.float(),
                         eps=idx.k_norm.eps).to(dtype=x.dtype)
        w = F.linear(input=x, weight=idx.weights_proj.weight)
        topk = K3.dsa_indexer(q_idx=q_idx, weights=w, k=k, index_cache=cache.index_cache,
                              index_scale=cache.index_scale, slot_mapping=meta.slot_mapping,
                              block_table=meta.block_table, seq_lens=meta.seq_lens, q_len=meta.q_len, topk=idx.topk)
        o = K3.sparse_mla_decode(q=q, latent=latent, kv_b_weight=self.kv_b_proj.weight, kv_cache=cache.kv_cache,
                                 slot_mapping=meta.slot_mapping, block_table=meta.block_table, topk_indices=topk,
                                 q_len=meta.q_len, scale=self.scale, nope=self.nope)
        y = torch.mul(input=o.float(), other=torch.sigmoid(input=gate.float())).to(dtype=o.dtype)
        return F.linear(input=y, weight=self.o_proj.weight)


variant("dsa_all_kwargs", "dsa", "rewrite", "attn", _dsa(KwDSA))


# ---------------------------------------------------------------------------------------------
# KDA: hook points over KimiDeltaAttention.forward


class HookKDA(KimiDeltaAttention):
    def in_proj(self, x):
        return self.in_proj_qkvgfab(x)

    def parts(self, y):
        HD = self.heads * self.head_dim
        return y.split([HD, HD, HD, HD, self.f_rank, self.heads], dim=-1)

    def g_raw(self, y, f_a):
        return self.f_b_proj(f_a)

    def core_inputs(self, q, k, v, g, beta):
        return q, k, v, g, beta

    def out(self, o):
        return self.o_proj(o)

    def forward(self, x, meta, cache):
        y = self.in_proj(x)
        q, k, v, g, f_a, beta = self.parts(y)
        g_raw = self.g_raw(y, f_a)
        q, k, v, g, beta = self.core_inputs(q, k, v, g, beta)
        o = K3.kda_core(q, k, v, g_raw, beta, g, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias,
                        self.o_norm.weight, cache.conv_state, cache.recurrent_state, meta.state_indices,
                        meta.accepted, meta.q_len, self.lower_bound, self.o_norm.eps)
        return self.out(o)


def _kda_variant(name, expect, **methods):
    kw = {k: methods.pop(k) for k in ("neutral", "run", "note") if k in methods}
    cls = type("KDA_" + name, (HookKDA,), methods)
    return variant(name, "kda", expect, "attn", _plain(cls), **kw)


def _misaligned_f_a(self, y, f_a):
    """f_b_proj reads part 4 of a second split whose part 4 is the last f_rank columns of g."""
    HD, F_ = self.heads * self.head_dim, self.f_rank
    parts = y.split([HD, HD, HD, HD - F_, F_, F_ + self.heads], dim=-1)
    return self.f_b_proj(parts[4])


def _beta_before_f_a(self, y):
    HD = self.heads * self.head_dim
    q, k, v, g, beta, f_a = y.split([HD, HD, HD, HD, self.heads, self.f_rank], dim=-1)
    return q, k, v, g, f_a, beta


# -- meaning changes
_kda_variant("kda_q_k_swapped", "either", core_inputs=lambda self, q, k, v, g, beta: (k, q, v, g, beta))
_kda_variant("kda_v_g_swapped", "either", core_inputs=lambda self, q, k, v, g, beta: (q, k, g, v, beta))
_kda_variant("kda_beta_part_wrong", "either", parts=_beta_before_f_a, note="split [.., beta, f_a]: wrong columns")
_kda_variant("kda_g_raw_times_2", "either", g_raw=lambda self, y, f_a: self.f_b_proj(f_a) * 2)
_kda_variant("kda_o_proj_input_scaled", "either", out=lambda self, o: self.o_proj(o * 0.5))
_kda_variant("kda_q_scaled", "either", core_inputs=lambda self, q, k, v, g, beta: (q * 2, k, v, g, beta))
_kda_variant("kda_beta_negated", "either", core_inputs=lambda self, q, k, v, g, beta: (q, k, v, g, -beta))
_kda_variant("kda_f_b_misaligned_split", "either", g_raw=_misaligned_f_a)
_kda_variant("kda_out_scaled", "either", out=lambda self, o: self.o_proj(o) * 0.5)

# -- re-spellings


def _kda_slices(self, y):
    HD, F_ = self.heads * self.head_dim, self.f_rank
    return (y[..., :HD], y[..., HD:2 * HD], y[..., 2 * HD:3 * HD], y[..., 3 * HD:4 * HD],
            y[..., 4 * HD:4 * HD + F_], y[..., 4 * HD + F_:])


_kda_variant("kda_slices", "rewrite", parts=_kda_slices)
_kda_variant("kda_linear_kwargs", "rewrite",
             in_proj=lambda self, x: F.linear(input=x, weight=self.in_proj_qkvgfab.weight),
             g_raw=lambda self, y, f_a: F.linear(input=f_a, weight=self.f_b_proj.weight),
             out=lambda self, o: F.linear(input=o, weight=self.o_proj.weight))
_kda_variant("kda_einsum_in_proj", "rewrite",
             in_proj=lambda self, x: torch.einsum("tk,nk->tn", x, self.in_proj_qkvgfab.weight))
_kda_variant("kda_matmul_T", "rewrite",
             in_proj=lambda self, x: x @ self.in_proj_qkvgfab.weight.T,
             out=lambda self, o: o @ self.o_proj.weight.T)
_kda_variant("kda_split_kwargs", "rewrite",
             parts=lambda self, y: torch.split(tensor=y, split_size_or_sections=[
                 self.heads * self.head_dim] * 4 + [self.f_rank, self.heads], dim=-1))
_kda_variant("kda_split_tuple_sizes", "rewrite",
             parts=lambda self, y: y.split((self.heads * self.head_dim,) * 4 + (self.f_rank, self.heads), -1))


class KwKDA(HookKDA):
    """Every call with keywords, the kimi_k3 op too."""

    def forward(self, x, meta, cache):
        HD = self.heads * self.head_dim
        y = F.linear(input=x, weight=self.in_proj_qkvgfab.weight)
        q, k, v, g, f_a, beta = torch.split(tensor=y, split_size_or_sections=[HD, HD, HD, HD, self.f_rank, self.heads],
                                            dim=-1)
        g_raw = F.linear(input=f_a, weight=self.f_b_proj.weight)
        o = K3.kda_core(q=q, k=k, v=v, g_raw=g_raw, beta=beta, g_out=g, conv_weight=self.conv1d.weight.squeeze(1),
                        A_log=self.A_log, dt_bias=self.dt_bias, o_norm_weight=self.o_norm.weight,
                        conv_state=cache.conv_state, recurrent_state=cache.recurrent_state,
                        state_indices=meta.state_indices, accepted=meta.accepted, q_len=meta.q_len,
                        lower_bound=self.lower_bound, norm_eps=self.o_norm.eps)
        return F.linear(input=o, weight=self.o_proj.weight)


variant("kda_all_kwargs", "kda", "rewrite", "attn", _plain(KwKDA))


def _kda_core_kwargs(self, x, meta, cache):
    y = self.in_proj(x)
    q, k, v, g, f_a, beta = self.parts(y)
    o = K3.kda_core(q=q, k=k, v=v, g_raw=self.f_b_proj(f_a), beta=beta, g_out=g,
                    conv_weight=self.conv1d.weight.squeeze(1), A_log=self.A_log, dt_bias=self.dt_bias,
                    o_norm_weight=self.o_norm.weight, conv_state=cache.conv_state,
                    recurrent_state=cache.recurrent_state, state_indices=meta.state_indices, accepted=meta.accepted,
                    q_len=meta.q_len, lower_bound=self.lower_bound, norm_eps=self.o_norm.eps)
    return self.out(o)


_kda_variant("kda_core_kwargs", "rewrite", forward=_kda_core_kwargs)


# ---------------------------------------------------------------------------------------------

# The core set: every item the suite's brief names, one variant each; tests/test_near_miss.py runs it by
# default (under 90 s on 2 cores) and the whole catalogue with NEAR_MISS_ALL=1; the property test draws from
# the whole catalogue (every variant appears in some case).
CORE_NAMES = frozenset("""
router_topk_smallest router_topk_dim0 router_renorm_dim0 router_weights_bf16 router_softmax_by_hand
router_bias_added_to_weights router_gather_keyed router_scale_extra_2 router_logits_bf16 router_sorted_false
router_all_kwargs router_methods router_torch_div router_torch_sum shared_halves_swapped shared_beta_plus_1
shared_beta_mixed shared_beta_lin_changed shared_gate_tanh_dropped shared_silu_for_sigmoid
shared_sigmoid_of_up shared_extra_scale shared_act_bf16 moe_routed_scaled moe_latent_norm_eps
moe_latent_norm_no_weight moe_up_scaled moe_sub_shared moe_norm_by_hand shared_split_halves moe_linear_kwargs
shared_linear_kwargs shared_matmul moe_torch_add dsa_gate_times_1_01 dsa_gate_plus_0 dsa_gate_fp16_round_trip
dsa_gate_relu dsa_gate_tanh dsa_gate_product_bf16 dsa_q_a_norm_eps dsa_kv_a_layernorm
dsa_latent_cat_swapped dsa_k_norm_eps dsa_q_heads_dims_swapped dsa_index_query_unnormed dsa_index_query_bit_view
dsa_index_weights_times_2 dsa_slices dsa_layer_norm_kwargs dsa_cat_kwargs dsa_separate_gate_proj
dsa_rms_norm_kwargs kda_q_k_swapped kda_beta_part_wrong kda_g_raw_times_2 kda_o_proj_input_scaled kda_q_scaled
kda_f_b_misaligned_split kda_slices kda_linear_kwargs kda_einsum_in_proj kda_matmul_T
shared_act_factors_commuted shared_act_reassociated dsa_gate_commuted
mxfp4_float_scale mxfp4_group_16 mxfp4_nibbles_swapped mxfp4_scale_of_another_expert mxfp4_experts_op_kwargs
fp8_scale_of_another_block_row fp8_per_tensor_activation fp8_scales_transposed fp8_mixed_formats fp8_linear_kwargs
""".split())
CATALOGUE[:] = [dataclasses.replace(v, core=v.name in CORE_NAMES) for v in CATALOGUE]
CORE = [v for v in CATALOGUE if v.core]
BY_NAME = {v.name: v for v in CATALOGUE}
EITHER = [v for v in CATALOGUE if v.expect == "either"]
REWRITE = [v for v in CATALOGUE if v.expect == "rewrite"]

# the kind-wide keyword spellings, one per slot
KEYWORD_SPELLINGS = {"attn_kda": BY_NAME["kda_all_kwargs"], "attn_dsa": BY_NAME["dsa_all_kwargs"],
                     "gate": BY_NAME["router_all_kwargs"], "mlp": BY_NAME["moe_all_kwargs"],
                     "shared": BY_NAME["shared_all_kwargs"]}

assert len(CATALOGUE) >= 45 and len(CORE) >= 45 and CORE_NAMES <= set(BY_NAME)


# ---------------------------------------------------------------------------------------------
# running a model eagerly on the steps tests/helpers.compare_steps runs (same caches, requests, ids)

BASE_RUN = dict(steps=3, batch=2, q=1, start_len=24)  # start_len > index_topk: the indexer really selects


def eager_outputs(cfg, model, *, steps=3, batch=2, q=1, start_len=24, block_size=4, seed=2, accepted=None,
                  device="cpu"):
    """Eager logits of every step and the final cache snapshot, from compare_steps' caches and inputs."""
    from dep_compile.stock import KimiCache, RequestBatch

    cache = KimiCache.allocate(cfg, num_slots=2 * batch + 1, num_blocks=8 * batch + 8, block_size=block_size,
                               seed=seed, device=device)
    req = RequestBatch(cache, batch, start_len=start_len, seed=batch, device=device)
    g = torch.Generator().manual_seed(3)
    logits = []
    with torch.no_grad():
        for i in range(steps):
            meta = req.step(q, None if accepted is None else accepted(i, batch))
            ids = torch.randint(0, cfg.vocab_size, (batch * q,), generator=g).to(device)
            logits.append(model.step(ids, meta, cache))
    return logits, cache.snapshot()


def same_outputs(a, b) -> bool:
    """Bit-identical logits and caches (FP8 compared as bytes)."""
    (la, ca), (lb, cb) = a, b

    def bits(x, y):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
            x.detach().cpu().contiguous().view(torch.uint8), y.detach().cpu().contiguous().view(torch.uint8))

    return all(bits(x, y) for x, y in zip(la, lb)) and ca.keys() == cb.keys() and all(bits(ca[k], cb[k]) for k in ca)


# ---------------------------------------------------------------------------------------------
# compiling and checking the report


def crash_message(e: BaseException) -> str:
    """The backend's exception (BackendCompilerFailed wraps it) and the innermost frames where it was raised."""
    inner = getattr(e, "inner_exception", None) or e
    lines = [ln for ln in str(inner).strip().splitlines() if ln.strip()] or [""]
    frames = traceback.extract_tb(inner.__traceback__)[-3:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(inner).__name__}: {lines[0][:400]} (at {where})"


def compile_and_compare(name, cfg, model, run):
    """run_pair in pattern-only mode with cuBLAS tactics; an exception escaping torch.compile is a crash
    (reported in one line with its innermost frames: Dynamo's chained tracebacks are long to render)."""
    try:
        from helpers import run_pair

        return run_pair(cfg, model=model, **run)
    except Exception as e:  # noqa: BLE001 - any escape is the failure being tested for
        msg = f"crash: {name}: {crash_message(e)}"
    raise AssertionError(msg)


def check_report(name: str, expects: dict, r, exact: bool = True) -> None:
    """``expects``: {(layer, kind) row the variants changed: "either" | "rewrite" | "stock-only"}.

    Each changed row: stock with a failed check as its reason, or rewritten (not if "stock-only"); rewritten
    if "rewrite". The run is exact (``exact``): every rewritten layer computes what stock does. Every other
    DSA / KDA / MoE row is rewritten (a variant affects its own layer only).
    """
    rows = {(m.layer, m.kind): m for m in r.report.layers}
    table = r.report.table()
    for key in expects:
        assert key in rows, f"no report row for layer {key[0]} {key[1]} ({name})\n{table}"
    errs = f"logits_err={r.logits_err} cache_err={r.cache_err} {({k: e for k, e in r.cache_errs.items() if e})}"
    is_exact = r.logits_err == 0.0 and r.cache_err == 0.0
    rewritten = [key for key in sorted(expects) if rows[key].rewritten]
    if exact and not is_exact and rewritten:
        ops = ", ".join(rows[k].op for k in rewritten)
        raise AssertionError(f"silent wrong: {name}: rewritten {rewritten} ({ops}) but not exact: {errs}\n{table}")
    for key in sorted(expects):
        row = rows[key]
        if row.rewritten:
            assert expects[key] != "stock-only", f"rewritten although stock-only: {name} {key}\n{table}"
        else:
            assert row.reason.strip() and not row.reason.startswith("policy:"), \
                f"no reason: {name} {key} left stock without a failed check: {row.reason!r}\n{table}"
    if exact:
        assert is_exact, f"stock but not exact: {name}: {errs}\n{table}"
    for key in sorted(expects):
        assert expects[key] != "rewrite" or rows[key].rewritten, \
            f"refused although expect rewrite: {name} {key}: {rows[key].reason} [node {rows[key].node}]\n{table}"
    others = [m for k, m in rows.items() if k not in expects and m.kind != "mla" and not m.rewritten]
    assert not others, f"other layer: {name}: " + "; ".join(
        f"layer {m.layer} {m.kind} stock: {m.reason}" for m in others) + f"\n{table}"
