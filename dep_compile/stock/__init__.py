"""The stock Kimi K3 / K3.1 decoder that ``kimi_dep`` traces and rewrites."""

from .cache import KimiCache, LayerCache, RequestBatch, StepError, StepMeta, check_step
from .config import PRESETS, K3Config, preset
from .model import KimiK3ForCausalLM, build_model, init_weights
from .moe import tile_experts_

__all__ = [
    "K3Config", "PRESETS", "preset", "KimiCache", "LayerCache", "RequestBatch", "StepMeta", "StepError",
    "check_step", "KimiK3ForCausalLM", "build_model", "init_weights", "tile_experts_",
]
