"""The engine settings the dep_compile K3 model needs, applied by vLLM's per-architecture config hook."""

from __future__ import annotations

import logging
import math

from dep_compile.integrations.quantization import weight_formats

log = logging.getLogger("dep_compile.vllm_k3")


def step_sizes(vllm_config) -> tuple[int, int, int]:
    """(blocks, block size, decode q) of the model's caches and step groups; decode q = 1 + the speculative
    tokens (vLLM's uniform decode query length)."""
    cache, spec = vllm_config.cache_config, vllm_config.speculative_config
    blocks = cache.num_gpu_blocks_override
    if blocks is None:
        raise ValueError("the dep_compile K3 model needs cache_config.num_gpu_blocks_override (its hook sets it)")
    return blocks, cache.block_size, 1 + (spec.num_speculative_tokens if spec is not None else 0)


def ep_size(parallel_config, num_experts: int) -> int:
    """The EP size the routed experts are sharded over (1: not sharded), for a parallel layout the model serves:
    DEP, attention at TP1 on every rank and the experts split over the DP ranks (``--data-parallel-size N
    --enable-expert-parallel``). ValueError naming the setting for any other layout."""
    pc = parallel_config
    how = "serve DEP as --tensor-parallel-size 1 --data-parallel-size N --enable-expert-parallel"
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
                 "decode_context_parallel_size"):
        if getattr(pc, name, 1) > 1:  # (a vLLM without the setting has it at 1)
            raise ValueError(f"the dep_compile K3 model runs attention at TP1 on every rank, with no model split "
                             f"(DEP); got {name} = {getattr(pc, name)}: {how}")
    dp = pc.data_parallel_size
    if not pc.enable_expert_parallel:
        if dp > 1:
            raise ValueError(f"data_parallel_size = {dp} without enable_expert_parallel: vLLM would split every "
                             f"expert by tensor parallelism over the {dp} ranks, which the kimi_dep MoE op does not "
                             f"do; {how}")
        return 1
    if num_experts % dp:
        raise ValueError(f"EP size {dp} (data_parallel_size with enable_expert_parallel) does not divide the "
                         f"config's {num_experts} routed experts: each EP rank owns an equal block of them")
    return dp


def cuda_graphs_off(compilation_config) -> None:
    """Turn vLLM's CUDA graphs off for this model (its default on a GPU captures them), or raise where they were
    asked for explicitly.

    The forward runs the compiled decoder once per step group, on group tensors the builder makes afresh each step
    (``layout.py``); a captured step would replay the capture's groups and addresses, not the step's: wrong tokens,
    silently. Until the builder writes into persistent buffers (docs/vllm.md, "On a GPU"), the model runs without
    them. The hook runs before vLLM applies its optimization level's default, which leaves a set mode alone.
    """
    from vllm.config.compilation import CUDAGraphMode  # noqa: PLC0415 - only where vLLM calls the hook

    mode = compilation_config.cudagraph_mode
    if mode is None:
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        log.info("dep_compile K3: CUDA graphs off (cudagraph_mode NONE): the model's step groups are new tensors "
                 "each step, which a graph replay would not read")
    elif mode != CUDAGraphMode.NONE:
        raise ValueError(f"the dep_compile K3 model cannot run in CUDA graphs yet (its step groups are new tensors "
                         f"each step, which a replay would not read); got cudagraph_mode = {mode.name}: leave it "
                         f"unset or set it to NONE")


class DepKimiK3EngineConfig:
    """vLLM's per-architecture hook (``MODELS_CONFIG_MAP``): the engine settings the model relies on.

    The scheduler's budgets stay vLLM's: the model splits each step into uniform groups itself
    (``layout.py``).
    - Prefix caching is off: a request's first block id names its KDA state slot.
    - ``num_gpu_blocks_override`` fixes the block pool, so the model can allocate its caches
      at construction (the CPU worker compiles before vLLM allocates its KV pool).
    - A checkpoint's ``quantization_config`` (K3's MXFP4 experts, FP8 block-scaled dense projections) is
      checked, then hidden from vLLM's quantization: the model reads it from ``text_config`` and builds its
      own MXFP4 experts and FP8 linears, so vLLM must not make a quant method (compressed-tensors) that the
      model's own modules would ignore.
    - The parallel layout is checked (``ep_size``) before any worker starts.
    - CUDA graphs are off (``cuda_graphs_off``).
    """

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        ep_size(vllm_config.parallel_config, vllm_config.model_config.hf_text_config.num_experts)
        cuda_graphs_off(vllm_config.compilation_config)
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        cache.enable_prefix_caching = False
        if cache.num_gpu_blocks_override is None:
            per_request = math.ceil(vllm_config.model_config.max_model_len / cache.block_size)
            cache.num_gpu_blocks_override = sched.max_num_seqs * per_request + 1  # + vLLM's null block 0

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        """Runs before vLLM resolves the quantization method from ``model_arch_config.quantization_config``."""
        arch = model_config.model_arch_config
        if arch.quantization_config is None:
            return
        if model_config.quantization is not None:
            raise ValueError(f"the dep_compile K3 model reads the checkpoint's quantized weights itself: leave vLLM's "
                             f"quantization unset (got {model_config.quantization!r})")
        experts, dense = weight_formats(arch.quantization_config)  # ValueError for anything but MXFP4 / FP8 blocks
        log.info("dep_compile K3: %s routed experts, %s dense projections, read by the model itself (vLLM's "
                 "quantization stays off)", experts, dense)
        arch.quantization_config = None


__all__ = ["DepKimiK3EngineConfig", "cuda_graphs_off", "ep_size", "step_sizes"]
