"""Per-step metadata for the dep_compile K3 model: persistent buffers filled by a vLLM metadata builder.

The stock ``kimi_k3`` ops take cache tensors and a uniform step (B requests x q tokens, with
``slot_mapping``, ``block_table``, ``seq_lens``, ``state_indices``, ``accepted``). vLLM hands the
model a flat, ragged batch. The builder below (vLLM calls it before every forward, for the KV
cache group of the full-attention layers) lays that batch out as ``B`` requests x ``Q`` tokens,
padded, and writes the layout and the metadata into tensors the model owns; the compiled graph
reads those tensors, so it holds the same ``kimi_k3`` ops on the same kinds of inputs as the
stock decoder, and the passes match it unchanged. The builder copies tensors only (host-side
numbers come from vLLM's CPU copies): no host sync.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from dep_compile.stock.cache import KimiCache, LayerCache, StepMeta
from dep_compile.stock.config import K3Config


class StepBuffers(nn.Module):
    """The caches and the step layout the compiled graph reads (buffers, so Dynamo sees module tensors).

    Layout: ``B`` request rows of ``Q`` token slots each (N = B*Q); a request's c real tokens sit at
    the start of its row, the rest is padding (cache slot -1; its outputs are dropped).
    """

    def __init__(self, config: K3Config, requests: int, q: int, num_blocks: int, block_size: int,
                 max_model_len: int, device=None):
        super().__init__()
        self.B, self.Q, self.block_size, self.num_blocks = requests, q, block_size, num_blocks
        N = requests * q
        width = -(-max_model_len // block_size)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.register_buffer("pad_index", torch.zeros(N, **i64), persistent=False)  # [N] -> vLLM token
        self.register_buffer("unpad_index", torch.zeros(N, **i64), persistent=False)  # vLLM token -> [N]
        self.register_buffer("slot_mapping", torch.full((N,), -1, **i64), persistent=False)
        self.register_buffer("block_table", torch.zeros(requests, width, **i32), persistent=False)
        self.register_buffer("seq_lens", torch.full((requests,), q, **i32), persistent=False)
        self.register_buffer("state_indices", torch.full((requests,), -1, **i32), persistent=False)
        self.register_buffer("accepted", torch.ones(requests, **i32), persistent=False)
        # Caches: KDA states in slots (a request's slot = its first block id), latent / index keys
        # paged with vLLM's block ids; zeros (a new request's KDA state is zeroed by the builder).
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

    def meta(self) -> StepMeta:
        """This step's metadata (a uniform step of Q tokens a request)."""
        return StepMeta(self.Q, self.slot_mapping, self.block_table, self.seq_lens, self.state_indices, self.accepted)

    def kda_states(self) -> list[torch.Tensor]:
        return [getattr(self, f"l{i}_{n}") for i, names in enumerate(self.cache_names) for n in names
                if n in ("conv_state", "recurrent_state")]

    @torch.no_grad()
    def fill(self, cm: CommonAttentionMetadata) -> None:
        """Lay vLLM's batch out as B x Q and write this step's metadata (no host sync)."""
        n, B, Q = cm.num_reqs, self.B, self.Q
        qsl = cm.query_start_loc_cpu[: n + 1].long()
        counts = qsl[1:] - qsl[:-1]  # [n] tokens per request (CPU)
        T = int(qsl[-1])
        if n > B or (n and int(counts.max()) > Q):
            raise ValueError(f"dep_compile K3: a step of {n} requests with up to {int(counts.max())} tokens each does "
                             f"not fit the {B} x {Q} layout (max_num_seqs x max_num_batched_tokens)")
        dev = self.slot_mapping.device
        req = torch.repeat_interleave(torch.arange(n), counts)
        dst = req * Q + (torch.arange(T) - qsl[req])  # padded position of each vLLM token
        pad = torch.zeros(B * Q, dtype=torch.int64)
        pad[dst] = torch.arange(T)
        self.pad_index.copy_(pad)
        self.unpad_index.zero_()
        self.unpad_index[:T].copy_(dst)
        dst_d, counts_d = dst.to(dev), counts.to(dev, torch.int32)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[dst_d] = cm.slot_mapping[:T].long()
        seq = cm.seq_lens[:n].to(torch.int32)
        self.seq_lens.fill_(Q)
        self.seq_lens[:n] = seq - counts_d + Q  # token i of a request sits at position seq - count + i
        bt = cm.block_table_tensor[:n]
        w = min(bt.shape[1], self.block_table.shape[1])
        self.block_table.zero_()
        self.block_table[:n, :w] = bt[:, :w].to(torch.int32)
        self.state_indices.fill_(-1)
        self.state_indices[:n] = bt[:, 0].to(torch.int32)
        self.accepted.fill_(1)
        self.accepted[:n] = counts_d
        # A request's first step (nothing computed yet) starts from a zero KDA state.
        kept = seq != counts_d  # [n] False: the request's first step
        slots = bt[:, 0].long()
        for state in self.kda_states():
            state[slots] = state[slots] * kept.view((-1,) + (1,) * (state.dim() - 1))


@dataclasses.dataclass
class KimiStepMetadata:
    """What the forward context holds for these layers: the step is in the model's buffers."""

    num_reqs: int
    num_actual_tokens: int


class KimiStepBuilder(AttentionMetadataBuilder[KimiStepMetadata]):
    """Fills the model's :class:`StepBuffers` from vLLM's common metadata before each step."""

    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, KimiCacheLayer, layer_names)
        self.step = next(iter(layers.values())).step_ref[0]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KimiStepMetadata:
        self.step.fill(common_attn_metadata)
        return KimiStepMetadata(common_attn_metadata.num_reqs, common_attn_metadata.num_actual_tokens)


class KimiStepBackend(AttentionBackend):
    """The "backend" of the full-attention layers: the kimi_k3 ops compute, the builder lays out."""

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
    tensors the ops write are the model's (``StepBuffers``), addressed by those block ids.
    """

    def __init__(self, prefix: str, step: StepBuffers, config: K3Config):
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


__all__ = ["StepBuffers", "KimiCacheLayer", "KimiStepBackend", "KimiStepBuilder", "KimiStepMetadata"]
