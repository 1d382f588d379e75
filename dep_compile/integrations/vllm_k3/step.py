"""Per-step metadata for the dep_compile K3 model: a vLLM metadata builder that plans each step.

The stock ``kimi_k3`` ops take cache tensors and a uniform step (B requests x q tokens, with
``slot_mapping``, ``block_table``, ``seq_lens``, ``state_indices``, ``accepted``). vLLM hands the
model a flat, ragged batch. The builder below (vLLM calls it before every forward, for the KV cache
group of the full-attention layers) splits that batch into uniform groups (``layout.py``) and
returns them as the layers' metadata; the model's forward (not compiled) runs its compiled decoder
once per group, on the group's tensors. The caches are the model's own buffers (``StepCaches``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from dep_compile.stock.cache import KimiCache, LayerCache
from dep_compile.stock.config import K3Config

from .layout import StepGroup, build_groups


class StepCaches(nn.Module):
    """The decoder's caches as module buffers (so Dynamo sees module tensors): KDA states in slots (a
    request's slot is its first block id), latent / index keys paged with vLLM's block ids; zeros."""

    def __init__(self, config: K3Config, num_blocks: int, block_size: int, max_model_len: int, decode_q: int,
                 device=None):
        super().__init__()
        self.num_blocks, self.block_size, self.decode_q = num_blocks, block_size, decode_q
        self.width = -(-max_model_len // block_size)  # block-table width of every step
        cache = KimiCache.allocate(config, num_slots=num_blocks, num_blocks=num_blocks, block_size=block_size,
                                   device=device or "cpu", seed=None)
        self.cache_names = [list(lc.tensors()) for lc in cache.layers]  # per layer: its LayerCache fields
        for i, lc in enumerate(cache.layers):
            for name, t in lc.tensors().items():
                self.register_buffer(f"l{i}_{name}", t.zero_(), persistent=False)

    def layer_caches(self) -> KimiCache:
        """The caches as the stock decoder takes them."""
        layers = [LayerCache(**{n: getattr(self, f"l{i}_{n}") for n in names})
                  for i, names in enumerate(self.cache_names)]
        return KimiCache(layers, self.num_blocks, self.num_blocks, self.block_size)

    def kda_states(self) -> list[torch.Tensor]:
        return [getattr(self, f"l{i}_{n}") for i, names in enumerate(self.cache_names) for n in names
                if n in ("conv_state", "recurrent_state")]

    @torch.no_grad()
    def plan(self, cm: CommonAttentionMetadata) -> list[StepGroup]:
        """This step's groups (``layout.build_groups``); a request's first step starts from a zero KDA state."""
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n + 1]
        bt, seq = cm.block_table_tensor[:n], cm.seq_lens[:n]
        groups = build_groups(qsl, seq, bt, cm.slot_mapping, self.width, self.decode_q)
        counts = (qsl[1:] - qsl[:-1]).to(seq.device)
        kept = seq != counts  # [n] False: the request's first step (nothing computed yet)
        slots = bt[:, 0].long()
        for state in self.kda_states():
            state[slots] = state[slots] * kept.view((-1,) + (1,) * (state.dim() - 1))
        return groups


@dataclasses.dataclass
class KimiStepMetadata:
    """What the forward context holds for these layers: the step's uniform groups."""

    groups: list[StepGroup]
    num_actual_tokens: int


class KimiStepBuilder(AttentionMetadataBuilder[KimiStepMetadata]):
    """Plans each step (:meth:`StepCaches.plan`) from vLLM's common metadata, before its forward."""

    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, KimiCacheLayer, layer_names)
        self.step = next(iter(layers.values())).step_ref[0]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KimiStepMetadata:
        return KimiStepMetadata(self.step.plan(common_attn_metadata), common_attn_metadata.num_actual_tokens)


class KimiStepBackend(AttentionBackend):
    """The "backend" of the full-attention layers: the kimi_k3 ops compute, the builder plans the step."""

    supported_dtypes = [torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "DEP_KIMI_K3"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the kimi_k3 ops in the model's graph compute attention; there is no impl")

    @staticmethod
    def get_builder_cls():
        return KimiStepBuilder


class KimiCacheLayer(nn.Module, AttentionLayerBase):
    """One full-attention layer as vLLM's KV cache manager sees it: its paged latent (+ index key) entry.

    vLLM allocates and frees its blocks and gives each step's slot mapping and block table; the
    tensors the ops write are the model's (``StepCaches``), addressed by those block ids.
    """

    def __init__(self, prefix: str, step: StepCaches, config: K3Config):
        super().__init__()
        self.step_ref = [step]  # a list: not a submodule of this layer
        self.kv_cache = torch.tensor([])
        bytes_per_token = 2 * config.latent_dim + (config.index_head_dim + 4 if config.dsa_layers else 0)
        self.head_size = bytes_per_token
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=self.head_size, dtype=torch.uint8)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KimiStepBackend

    def forward(self):  # never called: the kimi_k3 ops are in the decoder's graph
        raise RuntimeError("KimiCacheLayer is a KV cache registration only")


__all__ = ["StepCaches", "KimiCacheLayer", "KimiStepBackend", "KimiStepBuilder", "KimiStepMetadata"]
