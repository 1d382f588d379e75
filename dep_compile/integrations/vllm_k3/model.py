"""The out-of-tree vLLM model for K3 / K3.1: the ``dep_compile.stock`` decoder behind vLLM's model interface.

Its compiled graph is the stock decoder's (the same ``kimi_k3`` ops on cache tensors and step
metadata), so the kimi_dep passes match it unchanged; ``step.py`` says how vLLM's ragged batch
becomes the stock ops' uniform step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig

from dep_compile.integrations.checkpoint import config_from_hf, load_checkpoint
from dep_compile.integrations.vllm import pack_model_weights
from dep_compile.stock.model import KimiK3Model

from .config import step_sizes
from .reference import fp32_logits
from .step import KimiCacheLayer, StepBuffers


def k3_config(vllm_config: VllmConfig):
    """The stock decoder's K3Config from the checkpoint's ``config.json`` (its ``text_config``, and a top-level
    ``quantization_config``: the experts' format, which the engine hook keeps from vLLM's quantization)."""
    mc = vllm_config.model_config
    return config_from_hf(mc.hf_text_config.to_dict(),
                          quantization_config=getattr(mc.hf_config, "quantization_config", None))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class DepKimiK3Model(KimiK3Model):
    """Embedding, decoder layers, final norm (the stock ``KimiK3Model``), plus the step buffers and
    one KV-cache registration per full-attention layer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        cfg = k3_config(vllm_config)
        super().__init__(cfg)
        B, Q, blocks, bs = step_sizes(vllm_config)
        self.step = StepBuffers(cfg, B, Q, blocks, bs, vllm_config.model_config.max_model_len)
        for i, layer in enumerate(self.layers):
            if layer.kind != "kda":
                layer.self_attn.attn = KimiCacheLayer(f"{prefix}.layers.{i}.self_attn.attn", self.step, cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (vLLM's flat batch) -> final hidden states [T, hidden] BF16."""
        if inputs_embeds is not None:
            raise NotImplementedError("the dep_compile K3 model takes token ids only")
        s = self.step
        h = super().forward(input_ids[s.pad_index], s.meta(), s.layer_caches())  # [B*Q, hidden]
        return h[s.unpad_index[: input_ids.shape[0]]]


class DepKimiK3ForCausalLM(nn.Module):
    """vLLM architecture ``DepKimiK3ForCausalLM``: K3 / K3.1 through ``dep_compile.stock``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config = k3_config(vllm_config)
        self.model = DepKimiK3Model(vllm_config=vllm_config, prefix="model")
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab] computed in FP32 (``fp32_logits``)."""
        return fp32_logits(self.lm_head, hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (unpacked names, experts one by one, BF16 or MXFP4; ``checkpoint.load_checkpoint``,
        which names any tensor that is unknown, misshapen or missing) into the packed parameters, then the DSA
        and MoE row groups packed zero-copy for the kimi_dep ops (before vLLM compiles the model,
        docs/design.md §5.4); returns the parameters written."""
        loaded = load_checkpoint(dict(self.named_parameters()), self.config, weights)
        pack_model_weights(self)
        return loaded


__all__ = ["DepKimiK3ForCausalLM", "DepKimiK3Model"]
