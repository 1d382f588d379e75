"""The stock Kimi K3 / K3.1 decoder, written to be traced whole by torch.compile."""

from __future__ import annotations

import torch
from torch import nn

from ..runtime.ep import expert_block
from . import ops  # noqa: F401  (registers the kimi_k3 ops)
from .attention import KimiDeltaAttention, KimiDSAAttention, KimiMLAAttention
from .cache import KimiCache, StepMeta, check_step
from .config import K3Config
from .layers import AttnResPoint, RMSNorm, SiTUMLP
from .moe import KimiMoE
from .fp8_block import FP8, random_fp8_block
from .mxfp4 import random_mxfp4


class KimiDecoderLayer(nn.Module):
    """AttnRes -> input norm -> attention -> AttnRes -> post-attention norm -> MLP or MoE (its routed experts
    EP rank ``ep_rank``'s block of ``ep_size``)."""

    def __init__(self, config: K3Config, layer: int, merged_indexer: bool = False, ep_rank: int = 0,
                 ep_size: int = 1):
        super().__init__()
        self.kind = config.layer_kind(layer)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(config)
        elif self.kind == "dsa":
            self.self_attn = KimiDSAAttention(config, merged_indexer)
        else:
            self.self_attn = KimiMLAAttention(config)
        if config.is_moe(layer):
            block = expert_block(config.n_routed_experts, ep_rank, ep_size)
            self.mlp = KimiMoE(config, len(block), block.start, ep_size)
        else:
            self.mlp = SiTUMLP(config, config.hidden_size, config.dense_intermediate)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.attn_res = AttnResPoint(config, 2 * layer)
        self.mlp_res = AttnResPoint(config, 2 * layer + 1)

    def forward(self, prefix, bank, delta, meta: StepMeta, cache):
        h = self.attn_res(prefix, bank, delta)
        delta = self.self_attn(self.input_layernorm(h), meta, cache)
        h = self.mlp_res(prefix, bank, delta)
        return self.mlp(self.post_attention_layernorm(h))


class KimiK3Model(nn.Module):
    """Embedding, the decoder layers, the final norm (vLLM's ``model.*`` names); built with only EP rank
    ``ep_rank``'s block of the routed experts when ``ep_size`` > 1."""

    def __init__(self, config: K3Config, merged_indexer: bool = False, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i, merged_indexer, ep_rank, ep_size)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, input_ids: torch.Tensor, meta: StepMeta, cache: KimiCache) -> torch.Tensor:
        c = self.config
        T = input_ids.shape[0]
        delta = self.embed_tokens(input_ids)
        prefix = torch.zeros_like(delta)  # the running residual
        bank = delta.new_empty(c.attn_res_blocks, T, c.hidden_size)  # AttnRes block snapshots
        for layer, layer_cache in zip(self.layers, cache.layers):
            delta = layer(prefix, bank, delta, meta, layer_cache)
        return self.norm((prefix.float() + delta.float()).to(delta.dtype))


class KimiK3ForCausalLM(nn.Module):
    """The stock decoder: ``forward(input_ids [T], meta, cache) -> logits [T, vocab]`` (FP32).

    ``T = B * meta.q_len``: decode steps have q_len = 1, uniform verify steps q_len > 1.
    """

    def __init__(self, config: K3Config, merged_indexer: bool = False):
        super().__init__()
        self.config = config
        self.model = KimiK3Model(config, merged_indexer)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, meta: StepMeta, cache: KimiCache) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, meta, cache)).float()

    def step(self, input_ids: torch.Tensor, meta: StepMeta, cache: KimiCache, fn=None) -> torch.Tensor:
        """Check the step's inputs (before any cache is touched), then run ``fn`` (default: self)."""
        check_step(self.config, input_ids, meta, cache)
        return (self if fn is None else fn)(input_ids, meta, cache)

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor, batch, cache: KimiCache) -> torch.Tensor:
        """Eager prefill: each request's ``L`` prompt tokens (prompts [B, L]) as one step of
        q_len = L, every token accepted; leaves the caches as L single-token decode steps would.
        Returns the logits of the last prompt token of each request [B, vocab]."""
        B, L = prompts.shape
        meta = batch.step(q_len=L)
        logits = self.step(prompts.reshape(-1), meta, cache)
        return logits.view(B, L, -1)[:, -1]


FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")  # parameter leaves the decoder keeps in FP32


def init_weights(model: nn.Module, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Random weights at scales that keep activations O(1); BF16 except A_log, dt_bias, the router bias,
    MXFP4 experts' codes and scales (uint8: random codes, scales for the same RMS as BF16 experts), and FP8
    block-scaled projections (random e4m3 codes and block scales, the same RMS)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("_weight_packed"):  # with its sibling "_weight_scale"
                if p.dtype != torch.uint8:
                    raise ValueError(f"init_weights: {name} is {p.dtype}: the MXFP4 experts are tiled (tile_); draw "
                                     "weights before tiling")
                packed, scale = random_mxfp4((*p.shape[:-1], 2 * p.shape[-1]), g, (2 * p.shape[-1]) ** -0.5)
                p.data, params[name.replace("_packed", "_scale")].data = packed, scale
                continue
            if p.dtype == torch.uint8 or leaf == "weight_scale":  # a scale, drawn with its codes
                continue
            if p.dtype == FP8:  # an Fp8BlockLinear's weight, with its sibling weight_scale
                module = model.get_submodule(name.rsplit(".", 1)[0])
                codes, scale = random_fp8_block(*p.shape, module.segments, g, p.shape[1] ** -0.5)
                p.data, module.weight_scale.data = codes, scale
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or ".k_norm." in name:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g) if leaf == "weight" else 0.1 * torch.randn(p.shape, generator=g)
            elif leaf == "A_log":
                val = torch.log(torch.empty(p.shape).uniform_(1, 16, generator=g))
            elif leaf == "dt_bias":
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif leaf == "e_score_correction_bias":
                val = 0.05 * torch.randn(p.shape, generator=g)
            elif leaf == "query":
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                val = torch.randn(p.shape, generator=g) * fan_in ** -0.5
            else:
                val = torch.randn(p.shape, generator=g)
            p.data = val.to(torch.float32 if leaf in FP32_PARAMS else dtype)
    return model


def build_model(config: K3Config, seed: int = 0, device="cpu", merged_indexer: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> KimiK3ForCausalLM:
    """A stock decoder with random weights on ``device``, in eval mode, parameters frozen."""
    model = init_weights(KimiK3ForCausalLM(config, merged_indexer), seed, dtype).to(device).eval()
    return model.requires_grad_(False)  # an inference decoder, as in vLLM
