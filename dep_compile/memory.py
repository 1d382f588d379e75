"""Bytes per GPU of a K3 / K3.1 decoder served at DEP, computed from its K3Config.

- Non-expert weights: every parameter outside the routed experts, held by every rank (attention runs at TP1):
  embeddings, lm_head, attention, the dense first layer, shared experts, router, latent down / up, norms, AttnRes;
  BF16, or with the projections ``K3Config.dense_format`` covers in FP8 (a byte a weight, an FP32 scale per
  128 x 128 block).
- This rank's experts: 1 / DEP of each MoE layer's routed experts, BF16 or MXFP4 (E2M1 codes and E8M0 scales).
- Caches per request at a context: each KDA layer's conv and FP32 recurrent state, each MLA / DSA layer's latent
  row per token (and per-token scale when FP8), each DSA layer's FP8 index key and scale per token.

Parameter sizes are those of the stock decoder built on the meta device, so nothing is typed in; its AttnRes
parameters are the stock decoder's inference (a few vectors a layer).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dep_compile.stock.config import DENSE_FORMATS, K3Config
from dep_compile.stock.model import FP32_PARAMS, KimiK3ForCausalLM

GB = 10**9
# An H200's memory as CUDA reports it (torch.cuda.mem_get_info total, measured 2026-12-02; nvidia-smi: 143771 MiB;
# sold as "141 GB"). The CUDA context and cuBLAS took 0.77 GB of it; the reserve also covers NCCL buffers,
# activations, CUDA-graph pools and allocator slack.
H200_BYTES = 150_109_880_320
RESERVE_BYTES = 10 * GB


def _dense_bytes(name: str, p: torch.Tensor) -> int:
    """Bytes of a non-expert parameter as served: FP8 codes a byte, FP32 params and block scales 4, else BF16."""
    if p.dtype == torch.float8_e4m3fn:
        return p.numel()
    return p.numel() * (4 if name.rsplit(".", 1)[-1] in (*FP32_PARAMS, "weight_scale") else 2)


# routed experts' format -> bytes per element of its module's parameters (MXFP4: uint8 codes two a byte, and scales)
EXPERT_ELEMENT_BYTES = {"bf16": 2, "mxfp4": 1}


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One rank's bytes: weights every rank holds, its experts, and the caches of one request."""

    dep: int
    experts_format: str
    dense_format: str
    non_expert: int
    experts: int
    cache_per_request: int
    latent_cache: str = "bfloat16"  # the MLA / DSA latent rows' dtype (K3Config.latent_cache_dtype)

    @property
    def weights(self) -> int:
        return self.non_expert + self.experts

    def requests(self, usable: int) -> int:
        """Requests whose caches fit beside the weights in ``usable`` bytes (0 when the weights do not fit)."""
        return max(0, usable - self.weights) // self.cache_per_request


@functools.cache
def weight_bytes(cfg: K3Config, dense: str = "bf16") -> tuple[int, int]:
    """(non-expert bytes, bytes of every MoE layer's routed experts) of ``cfg``'s decoder."""
    if dense not in DENSE_FORMATS:
        raise ValueError(f"dense format {dense!r}: valid {sorted(DENSE_FORMATS)}")
    with torch.device("meta"):
        model = KimiK3ForCausalLM(cfg.replace(dense_format=dense))
    non_expert = experts = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            experts += p.numel() * EXPERT_ELEMENT_BYTES[cfg.experts_format]
        else:
            non_expert += _dense_bytes(name, p)
    return non_expert, experts


def cache_bytes(cfg: K3Config, context: int) -> dict[str, int]:
    """Cache bytes of one request at ``context`` tokens, by kind: ``kda`` (conv + recurrent state), ``latent``
    (MLA / DSA latent rows), ``index`` (DSA index keys and scales); block rounding left out."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    conv = (cfg.kda_conv_width - 1) * cfg.kda_conv_dim * 2  # BF16 taps
    recurrent = cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4  # FP32 [H, D, D]
    return {"kda": kinds.count("kda") * (conv + recurrent),
            "latent": (len(kinds) - kinds.count("kda")) * context * cfg.latent_row_bytes,
            "index": kinds.count("dsa") * context * (cfg.index_head_dim + 4)}  # FP8 key + FP32 scale


def rank_memory(cfg: K3Config, dep: int, context: int, dense: str = "bf16") -> RankMemory:
    """One DEP rank of ``cfg`` (experts in ``cfg.experts_format``) serving requests of ``context`` tokens."""
    if dep < 1 or cfg.n_routed_experts % dep:
        raise ValueError(f"DEP {dep} does not divide the {cfg.n_routed_experts} routed experts")
    non_expert, experts = weight_bytes(cfg, dense)
    per_request = sum(cache_bytes(cfg, context).values())
    return RankMemory(dep, cfg.experts_format, dense, non_expert, experts // dep, per_request, cfg.latent_cache_dtype)


def table(rows: list[RankMemory], usable: int) -> str:
    """A Markdown table of ``rows`` in GB, with how many requests fit in ``usable`` bytes."""
    lines = ["| DEP | experts | dense | non-expert GB | experts GB / rank | weights GB | left GB | requests | "
             "latent cache | cache GB / request |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        left = usable - r.weights
        fits = f"{r.requests(usable)}" if left > 0 else "does not fit"
        lines.append(f"| {r.dep} | {r.experts_format} | {r.dense_format} | {r.non_expert / GB:.1f} | "
                     f"{r.experts / GB:.1f} | {r.weights / GB:.1f} | {left / GB:.1f} | {fits} | {r.latent_cache} | "
                     f"{r.cache_per_request / GB:.3f} |")
    return "\n".join(lines)


def report(cfg: K3Config, deps: list[int], context: int, experts: list[str], dense: list[str], hbm: int,
           reserve: int, latent: tuple[str, ...] = ("bfloat16",)) -> str:
    """The ``memory`` command's text: the model and cache sizes, the table, and which configurations fit
    (``latent``: the latent cache dtypes to tabulate)."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    moe = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    usable = hbm - reserve
    rows = [rank_memory(cfg.replace(experts_format=e, latent_cache_dtype=lat), dep, context, d)
            for dep in deps for e in experts for d in dense for lat in latent]
    fit = [f"DEP{r.dep} {r.experts_format} experts + {r.dense_format} dense"
           + (f" + {r.latent_cache} latent cache" if len(latent) > 1 else "") + f" ({r.requests(usable)} requests)"
           for r in rows if r.requests(usable) > 0]
    caches = [(lat, cache_bytes(cfg.replace(latent_cache_dtype=lat), context)) for lat in latent]
    return "\n".join([
        f"{cfg.name}: {cfg.num_layers} layers ({kinds.count('kda')} KDA, {kinds.count('mla')} MLA, "
        f"{kinds.count('dsa')} DSA), {moe} MoE layers x {cfg.n_routed_experts} routed experts",
        *(f"caches per request at {context} tokens: {c['kda'] / GB:.3f} GB KDA states + {c['latent'] / GB:.3f} "
          f"GB latent ({lat}) + {c['index'] / GB:.3f} GB index keys = {sum(c.values()) / GB:.3f} GB"
          for lat, c in caches),
        f"HBM {hbm / GB:.1f} GB, usable {usable / GB:.1f} GB (reserve {reserve / GB:.1f} GB); GB = 1e9 bytes",
        "", table(rows, usable), "",
        "fits: " + ("; ".join(fit) if fit else "none of these"),
        "MXFP4 experts: kimi_dep's kernels read tiles that the loaders make on CUDA in the checkpoint's own storage"
        " (no more bytes; docs/mxfp4.md). Weights left in the checkpoint's layout get a re-packed copy at their first"
        " call (as many bytes again) while that leaves 4 GiB free, else run 1.6-1.9x slower.",
    ])


__all__ = ["GB", "H200_BYTES", "RESERVE_BYTES", "DENSE_FORMATS", "EXPERT_ELEMENT_BYTES", "RankMemory", "weight_bytes",
           "cache_bytes", "rank_memory", "table", "report"]
