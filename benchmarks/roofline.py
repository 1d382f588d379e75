"""The roofline floor of a decode or verify step: per kernel group, max(bytes / 4.33 TB/s, FLOPs / peak), summed.

The bytes floor alone understates verify steps: at 64 requests x q = 4 (256 tokens) a DSA layer's projections and
its sparse attention are compute-bound (issue #29). Groups and their FLOPs (multiply-adds count two):

* ``weights``: every matrix weight outside the routed experts times each token (2 T x numel); the embedding
  gathers rows (no FLOPs). FP8 block-scaled weights run on the FP8 tensor cores, the rest on the BF16 ones.
* ``experts``: each routed row through its expert's three matrices (2 rows x 3 x I x Lat), BF16 tensor cores
  (MXFP4 weights are dequantized to BF16 in registers).
* ``kda_states``: the per-token recurrence on each head's [D, D] FP32 state: ~8 D^2 a head (decay, k^T S,
  the rank-one update, q^T S), FP32 CUDA cores.
* ``dsa_mla``: the indexer's logits (2 T x context x index heads x index dim) and the attention over the
  selected (DSA: min(context, top-k); MLA: the whole context) latent rows, QK over the latent (kv_lora + rope)
  and PV over kv_lora: 2 T x heads x rows x (latent + kv_lora), BF16 tensor cores.
"""

from __future__ import annotations

import torch

from common import HBM_PRACTICAL_BPS

# FLOP/s. BF16: an 8192^3 BF16 matmul on random data measured 769-798 TFLOP/s on the H200. FP8: twice BF16, the
# tensor cores' rate ratio (not measured here). FP32: CUDA cores, 132 SMs x 128 lanes x 2 x 1.98 GHz (spec).
PEAK_FLOPS = {"bf16": 790e12, "fp8": 2 * 790e12, "fp32": 132 * 128 * 2 * 1.98e9}
KDA_FLOPS_PER_D2 = 8  # per token, head and D^2 of the recurrent state


def weight_flop_seconds(model: torch.nn.Module, tokens: int) -> float:
    """Seconds of tensor-core work of the non-expert matrix weights over ``tokens`` tokens at ``PEAK_FLOPS``."""
    seconds = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or ".experts." in name or name.endswith("embed_tokens.weight"):
            continue
        peak = PEAK_FLOPS["fp8" if p.dtype == torch.float8_e4m3fn else "bf16"]
        seconds += 2 * tokens * p.numel() / peak
    return seconds


def expert_flops(cfg, routed_rows: int) -> float:
    """FLOPs of ``routed_rows`` (token, local expert) pairs through w13 [2I, Lat] and w2 [Lat, I]."""
    return 2 * routed_rows * 3 * cfg.moe_intermediate * cfg.moe_latent_size


def attention_flops(cfg, kind: str, rows: int, q: int, context: int | None = None) -> float:
    """FLOPs of one attention layer's core (not its projections) for ``rows`` requests of ``q`` tokens."""
    tokens = rows * q
    if kind == "kda":
        return tokens * cfg.kda_heads * cfg.kda_head_dim ** 2 * KDA_FLOPS_PER_D2
    attended = min(context, cfg.index_topk) if kind == "dsa" else context
    core = 2 * tokens * cfg.mla_heads * attended * (cfg.latent_dim + cfg.kv_lora_rank)
    index = 2 * tokens * context * cfg.index_heads * cfg.index_head_dim if kind == "dsa" else 0
    return core + index


def attention_flop_seconds(cfg, kind: str, rows: int, q: int, context: int | None = None) -> float:
    """``attention_flops`` at its units' peak: FP32 CUDA cores for KDA, BF16 tensor cores for DSA / MLA."""
    return attention_flops(cfg, kind, rows, q, context) / PEAK_FLOPS["fp32" if kind == "kda" else "bf16"]


def local_ids(experts, ids: torch.Tensor) -> torch.Tensor:
    """The routed ids [T, K] that land on ``experts`` (an experts module's local range), as local ids (flat)."""
    local = ids - experts.expert_start
    return local[(local >= 0) & (local < experts.num_local)]


def step_roofline(model: torch.nn.Module, rows: int, q: int, context: int, routing: list[torch.Tensor],
                  nbytes: dict) -> dict:
    """The decoder step's ``roofline``: ``nbytes`` the step's bytes by group (``bench_decoder.floor_bytes``),
    ``routing`` each MoE layer's expert ids [T, K] (the local ones are routed rows)."""
    cfg = model.config
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    routed = sum(local_ids(experts, ids).numel() for experts, ids in zip(moe, routing[:len(moe)]))
    kinds = [layer.kind for layer in model.model.layers]
    return roofline({
        "weights": (nbytes["weights"], weight_flop_seconds(model, rows * q)),
        "experts": (nbytes["experts"], expert_flops(cfg, routed) / PEAK_FLOPS["bf16"]),
        "kda_states": (nbytes["kda_states"], kinds.count("kda") * attention_flop_seconds(cfg, "kda", rows, q)),
        "dsa_mla": (nbytes["dsa_mla"], sum(attention_flop_seconds(cfg, k, rows, q, context)
                                           for k in kinds if k in ("dsa", "mla"))),
    })


def layer_roofline(block: torch.nn.Module, cfg, kind: str, rows: int, q: int, context: int | None,
                   core_bytes: int) -> dict:
    """One attention layer's ``roofline``: its projections (``weights``) and its core (``core``: ``core_bytes``,
    the caches and states it moves, and ``attention_flops``)."""
    wbytes = sum(p.numel() * p.element_size() for p in block.parameters())
    return roofline({"weights": (wbytes, weight_flop_seconds(block, rows * q)),
                     "core": (core_bytes, attention_flop_seconds(cfg, kind, rows, q, context))})


def roofline(groups: dict[str, tuple[float, float]]) -> dict:
    """``groups``: name -> (bytes, FLOP seconds). Per group µs of both terms and their max; ``roofline_us`` the
    sum of the maxima, ``bytes_us`` / ``flops_us`` the sums of each term."""
    per = {g: {"bytes_us": b / HBM_PRACTICAL_BPS * 1e6, "flops_us": s * 1e6} for g, (b, s) in groups.items()}
    for v in per.values():
        v["floor_us"] = max(v["bytes_us"], v["flops_us"])
    return {"groups": per, "roofline_us": sum(v["floor_us"] for v in per.values()),
            "bytes_us": sum(v["bytes_us"] for v in per.values()), "flops_us": sum(v["flops_us"] for v in per.values())}
