"""The dep_compile K3 / K3.1 model for vLLM, registered through the ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (engine core and workers), so the architecture
``DepKimiK3ForCausalLM`` and its engine-settings hook exist wherever the model is built (vLLM
itself reads K3's ``config.json``, ``model_type = "kimi_k3"``). A real K3 / K3.1 checkpoint selects this model with
``hf_overrides={"architectures": ["DepKimiK3ForCausalLM"]}``.
"""

from __future__ import annotations

from dep_compile.integrations.checkpoint import ARCHITECTURE

MODEL_PATH = "dep_compile.integrations.vllm_k3.model:DepKimiK3ForCausalLM"


def register() -> None:
    """Register the architecture and its engine-settings hook (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .config import DepKimiK3EngineConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_PATH)
    MODELS_CONFIG_MAP[ARCHITECTURE] = DepKimiK3EngineConfig


__all__ = ["register", "ARCHITECTURE", "MODEL_PATH"]
