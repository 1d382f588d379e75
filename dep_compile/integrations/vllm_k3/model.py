"""The out-of-tree vLLM model for K3 / K3.1: the ``dep_compile.stock`` decoder behind vLLM's model interface.

Its compiled graph is the stock decoder's (the same ``kimi_k3`` ops on cache tensors and step
metadata), so the kimi_dep passes match it unchanged. ``layout.py`` says how vLLM's ragged batch
becomes uniform groups of n requests x q tokens; the forward here (not compiled) runs the compiled
decoder once per group. The decoder's inputs are [n, q] with both sizes dynamic, traced once: one
graph serves decode (q = 1), verify and prefill groups, and the kimi_dep ops pick their path per call
from q (prefill-shaped groups run the stock cores inside them). Under vLLM's expert parallelism (DEP) each
rank builds and loads only its block of the routed experts, the MoE op dispatches over vLLM's EP group, and
every rank's decoder calls are aligned with the others' (``dp.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available

from dep_compile.integrations.checkpoint import config_from_hf, expert_of, load_checkpoint
from dep_compile.integrations.vllm import pack_model_weights
from dep_compile.runtime import ep
from dep_compile.stock.cache import StepMeta
from dep_compile.stock.model import KimiK3Model
from dep_compile.stock.moe import tile_experts_

from .config import step_sizes
from .dp import align_calls, join_ep
from .layout import StepGroup, dummy_group
from .reference import fp32_logits
from .step import KimiCacheLayer, StepCaches

log = logging.getLogger("vllm.dep_compile")


def k3_config(vllm_config: VllmConfig):
    """The stock decoder's K3Config from the checkpoint's ``config.json`` (its ``text_config``, and a top-level
    ``quantization_config``: the experts' format, which the engine hook keeps from vLLM's quantization)."""
    mc = vllm_config.model_config
    return config_from_hf(mc.hf_text_config.to_dict(),
                          quantization_config=getattr(mc.hf_config, "quantization_config", None))


@support_torch_compile(dynamic_arg_dims={"input_ids": [0, 1], "slot_mapping": [0, 1], "block_table": 0,
                                         "seq_lens": 0, "state_indices": 0, "accepted": 0})
class DepKimiK3Model(KimiK3Model):
    """Embedding, decoder layers, final norm (the stock ``KimiK3Model``) on one uniform group, plus the
    caches and one KV-cache registration per full-attention layer; under vLLM's expert parallelism, only this
    EP rank's block of the routed experts (``dp.join_ep``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        cfg = k3_config(vllm_config)
        placement = join_ep(vllm_config, cfg)  # (a Module's attributes can be set only after its __init__)
        super().__init__(cfg, ep_rank=placement.rank, ep_size=placement.size)
        self.ep = placement
        blocks, bs, decode_q = step_sizes(vllm_config)
        self.step = StepCaches(cfg, blocks, bs, vllm_config.model_config.max_model_len, decode_q)
        self.attn_names = []  # the full-attention layers' names: their metadata holds the step's groups
        for i, layer in enumerate(self.layers):
            if layer.kind != "kda":
                self.attn_names.append(f"{prefix}.layers.{i}.self_attn.attn")
                layer.self_attn.attn = KimiCacheLayer(self.attn_names[-1], self.step, cfg)

    def forward(self, input_ids: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, state_indices: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """One group: input_ids / slot_mapping [n, q], block_table [n, W], the rest [n] -> hidden [n*q, hidden]."""
        meta = StepMeta(input_ids.shape[1], slot_mapping.reshape(-1), block_table, seq_lens, state_indices, accepted)
        return super().forward(input_ids.reshape(-1), meta, self.step.layer_caches())

    def groups(self, num_tokens: int, device) -> list[StepGroup]:
        """This step's groups (the builder's), or a dummy group for vLLM's dummy and profile runs (no metadata)."""
        md = get_forward_context().attn_metadata if is_forward_context_available() else None
        if not md:
            return [dummy_group(num_tokens, self.step.width, device)]
        if not isinstance(md, dict):
            raise NotImplementedError("the dep_compile K3 model does not support micro-batching (ubatch metadata)")
        return md[self.attn_names[0]].groups

    def calls(self, num_tokens: int, device) -> list[tuple[StepGroup, contextlib.AbstractContextManager]]:
        """This step's decoder calls, each with the context to run it in: under EP, aligned with the other EP
        ranks' calls (``dp.align_calls``), the experts padded to the call's agreed rows."""
        groups = self.groups(num_tokens, device)
        if self.ep.cpu_group is None:
            return [(g, contextlib.nullcontext()) for g in groups]
        return [(g, ep.padded_rows(rows)) for g, rows in align_calls(groups, self.ep.cpu_group, self.step.width,
                                                                      device)]


class DepKimiK3ForCausalLM(nn.Module):
    """vLLM architecture ``DepKimiK3ForCausalLM``: K3 / K3.1 through ``dep_compile.stock``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config = k3_config(vllm_config)
        self.model = DepKimiK3Model(vllm_config=vllm_config, prefix="model")
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.groups_run = Counter()  # (kind, n, q) -> groups run: what the engine's steps were (tests, docs)
        self.experts_read: set[int] = set()  # the routed experts whose checkpoint tensors load_weights copied

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (vLLM's flat batch) -> final hidden states [T, hidden] BF16: the compiled decoder once
        per group of the step, and under EP once per padding call (positions are implied by the groups' sequence
        lengths)."""
        if inputs_embeds is not None:
            raise NotImplementedError("the dep_compile K3 model takes token ids only")
        T = input_ids.shape[0]  # vLLM may pad it past the step's tokens (DP with CUDA graphs): those rows are unused
        out = None
        for g, context in self.model.calls(T, input_ids.device):
            n, q = g.shape
            self.groups_run[g.kind, n, q] += 1
            with context:
                h = self.model(input_ids[g.tokens].view(n, q), g.slot_mapping, g.block_table, g.seq_lens,
                               g.state_indices, g.accepted)  # [n*q, hidden]
            if g.whole and h.shape[0] == T:
                out = h
            elif g.dest.numel():
                out = h.new_empty(T, h.shape[-1]) if out is None else out
                out[g.dest] = h[g.rows]
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab] computed in FP32 (``fp32_logits``)."""
        return fp32_logits(self.lm_head, hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (unpacked names, experts one by one, BF16 or MXFP4; ``checkpoint.load_checkpoint``,
        which names any tensor that is unknown, misshapen or missing) into the packed parameters; on CUDA, MXFP4
        experts re-packed in place into the tiles kimi_dep's kernels read (``stock.tile_experts_``); then the DSA
        and MoE row groups packed zero-copy for the kimi_dep ops (before vLLM compiles the model,
        docs/design.md §5.4); returns the parameters written."""
        placement = self.model.ep
        read = load_checkpoint(dict(self.named_parameters()), self.config, weights, placement.experts)
        self.experts_read = {e for e in map(expert_of, read) if e is not None}
        if placement.size > 1 and self.experts_read:
            log.info("dep_compile K3: EP rank %d of %d read routed experts %d-%d of %d from the checkpoint",
                     placement.rank, placement.size, min(self.experts_read), max(self.experts_read),
                     self.config.n_routed_experts)
        if self.lm_head.weight.is_cuda:  # kimi_dep's MXFP4 kernels read tiles: re-packed in place, no copy
            tile_experts_(self)
        pack_model_weights(self)
        return set(read.values())


__all__ = ["DepKimiK3ForCausalLM", "DepKimiK3Model"]
