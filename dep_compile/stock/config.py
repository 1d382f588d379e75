"""K3Config: the shapes of a Kimi K3 / K3.1 decoder, with full-size and small presets."""

from __future__ import annotations

import dataclasses
from typing import Literal

LayerKind = Literal["kda", "mla", "dsa"]
# Latent cache formats of MLA / DSA layers: BF16 rows, or FP8 e4m3 rows with one FP32 power-of-two
# scale per token in a side tensor [NB, BS] (docs/fp8_latent_cache.md).
LATENT_CACHE_DTYPES = ("bfloat16", "float8_e4m3fn")
# Routed experts' weight formats: BF16, or MXFP4 as K3 ships them (E2M1 codes two a byte, one E8M0
# scale per 32 inputs; dep_compile/stock/mxfp4.py)
EXPERTS_FORMATS = ("bf16", "mxfp4")
# Dense projections' weight formats (attention, shared expert, latent down / up): BF16, or FP8 e4m3 with a
# scale per 128 x 128 block, activations quantized per 128 inputs (dep_compile/stock/fp8_block.py)
DENSE_FORMATS = ("bf16", "fp8_block")


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Every size the stock decoder needs; the full presets follow docs/design.md §2."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    # Layers (0-based) whose attention is KDA are those with layer+1 in kda_layers (vLLM's
    # 1-based convention); the others are full attention: DSA if in dsa_layers, else MLA.
    kda_layers: tuple[int, ...]
    dsa_layers: tuple[int, ...]
    first_k_dense: int
    dense_intermediate: int
    rms_eps: float
    # KDA
    kda_heads: int
    kda_head_dim: int
    kda_conv_width: int
    kda_f_rank: int  # f_a width (128 at full size)
    kda_lower_bound: float
    # MLA / DSA
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int  # the never-rotated ("NoPE") slice of the latent
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_latent_size: int
    moe_intermediate: int
    shared_intermediate: int  # 2 x 3072 = 6144 at full size
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    scoring_func: str
    # AttnRes
    attn_res_block: int
    # SiTU
    situ_beta: float = 4.0
    situ_beta_lin: float = 25.0
    # The MLA / DSA latent cache [NB, BS, kv_lora + rope]: "bfloat16", or "float8_e4m3fn" with
    # per-token power-of-two scales (LayerCache.kv_scale)
    latent_cache_dtype: str = "bfloat16"
    # The routed experts' weights: "bf16", or "mxfp4" (K3's checkpoint format; the full presets' default)
    experts_format: str = "bf16"
    # The dense projections' weights: "bf16", or "fp8_block" (the derived FP8 checkpoints' format); the router,
    # norms, embedding, lm_head and MLA's kv_b stay BF16
    dense_format: str = "bf16"

    def __post_init__(self):
        if self.latent_cache_dtype not in LATENT_CACHE_DTYPES:
            raise ValueError(f"latent_cache_dtype {self.latent_cache_dtype!r}: valid {LATENT_CACHE_DTYPES}")
        if self.experts_format not in EXPERTS_FORMATS:
            raise ValueError(f"experts_format {self.experts_format!r}: valid {EXPERTS_FORMATS}")
        if self.dense_format not in DENSE_FORMATS:
            raise ValueError(f"dense_format {self.dense_format!r}: valid {DENSE_FORMATS}")

    # ---- derived shapes -------------------------------------------------------------
    def layer_kind(self, layer: int) -> LayerKind:
        """The attention kind of a 0-based layer."""
        if layer + 1 in self.kda_layers:
            return "kda"
        return "dsa" if layer in self.dsa_layers else "mla"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def kda_width(self) -> int:
        return self.kda_heads * self.kda_head_dim

    @property
    def kda_in_segments(self) -> list[int]:
        """Rows of each projection packed in in_proj_qkvgfab: q, k, v, g, f_a, beta."""
        return [self.kda_width] * 4 + [self.kda_f_rank, self.kda_heads]

    @property
    def kda_in_rows(self) -> int:
        return sum(self.kda_in_segments)

    @property
    def kda_conv_dim(self) -> int:
        return 3 * self.kda_width

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def latent_fp8(self) -> bool:
        """Whether the latent cache holds FP8 e4m3 rows with per-token scales."""
        return self.latent_cache_dtype == "float8_e4m3fn"

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache entry: kv_lora + the rope slice (576 at full size)."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def latent_row_bytes(self) -> int:
        """Bytes of one cached latent row: e4m3 values + the token's FP32 scale, or BF16 values."""
        return self.latent_dim + 4 if self.latent_fp8 else 2 * self.latent_dim

    @property
    def mla_gate_width(self) -> int:
        return self.mla_heads * self.v_head_dim

    @property
    def mla_fused_segments(self) -> list[int]:
        """Rows of each projection packed in fused_qkv_a_g_proj: q_a, kv_a, gate."""
        return [self.q_lora_rank, self.latent_dim, self.mla_gate_width]

    @property
    def mla_fused_rows(self) -> int:
        """Rows of fused_qkv_a_g_proj (14400 at full size)."""
        return sum(self.mla_fused_segments)

    @property
    def dsa_packed_rows(self) -> int:
        """Rows of the DEP packed projection q_a | kv_a | gate | wk | weights_proj (14560)."""
        return self.mla_fused_rows + self.index_head_dim + self.index_heads

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    @property
    def attn_res_blocks(self) -> int:
        """Bank slots AttnRes needs: one snapshot each attn_res_block sublayers."""
        return (self.num_sublayers - 1) // self.attn_res_block + 1

    def replace(self, **changes) -> "K3Config":
        return dataclasses.replace(self, **changes)


def _kda_schedule(num_layers: int, last_full: bool = False) -> tuple[int, ...]:
    """1-based KDA layer numbers for the 3:1 KDA:full cycle (every 4th layer is full, and the last one with
    ``last_full``, as in K3's config.json: full attention at 4, 8, ..., 92 and 93)."""
    return tuple(n for n in range(1, num_layers + 1) if n % 4 != 0 and not (last_full and n == num_layers))


def _full_layers(num_layers: int, last_full: bool = False) -> tuple[int, ...]:
    return tuple(l for l in range(num_layers) if l + 1 not in _kda_schedule(num_layers, last_full))


_FULL = dict(
    vocab_size=163840,
    hidden_size=7168,
    num_layers=93,
    first_k_dense=1,
    dense_intermediate=33792,
    rms_eps=1e-5,
    kda_heads=96,
    kda_head_dim=128,
    kda_conv_width=4,
    kda_f_rank=128,
    kda_lower_bound=-5.0,
    mla_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    index_heads=32,
    index_head_dim=128,
    index_topk=2048,
    n_routed_experts=896,
    num_experts_per_tok=16,
    moe_latent_size=3584,
    moe_intermediate=3072,
    shared_intermediate=6144,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    scoring_func="sigmoid",
    attn_res_block=12,
)

# Small presets keep every structural feature (3:1 schedule, dense first layer, AttnRes
# blocks, latent MoE with a shared expert and latent norm, sigmoid top-16 routing) and shrink
# widths: 4 heads of 32, 64 experts (K3: 896) still routed top-16, a top-16 indexer (K3.1:
# top-2048). Keeping top-16 lets dep_moe_supported check the same top-k at every size.
_SMALL = dict(
    vocab_size=512,
    hidden_size=256,
    num_layers=8,
    first_k_dense=1,
    dense_intermediate=384,
    rms_eps=1e-5,
    kda_heads=4,
    kda_head_dim=32,
    kda_conv_width=4,
    kda_f_rank=32,
    kda_lower_bound=-5.0,
    mla_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_dim=32,
    qk_rope_dim=16,
    v_head_dim=32,
    index_heads=4,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=64,
    num_experts_per_tok=16,
    moe_latent_size=128,
    moe_intermediate=64,
    shared_intermediate=128,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    scoring_func="sigmoid",
    attn_res_block=4,
)


def _preset(name: str, base: dict, num_layers: int, full_kind: str) -> K3Config:
    last_full = base is _FULL and num_layers == base["num_layers"]  # K3's own schedule at its own depth: 69 KDA + 24
    full = _full_layers(num_layers, last_full)
    if full_kind == "mla":
        dsa = ()
    elif full_kind == "dsa":
        dsa = full
    else:  # mixed: alternate DSA and MLA among the full-attention layers
        dsa = full[::2]
    return K3Config(name=name, **{**base, "num_layers": num_layers}, kda_layers=_kda_schedule(num_layers, last_full),
                    dsa_layers=dsa, experts_format="mxfp4" if base is _FULL else "bf16")  # K3 ships MXFP4 experts


_SPECS = {
    "k3": (_FULL, "mla"),
    "k31": (_FULL, "dsa"),
    "k3-small": (_SMALL, "mla"),
    "k31-small": (_SMALL, "dsa"),
    "mixed-small": (_SMALL, "mixed"),
}

PRESETS: dict[str, K3Config] = {n: _preset(n, b, b["num_layers"], k) for n, (b, k) in _SPECS.items()}


def preset(name: str, num_layers: int | None = None, **changes) -> K3Config:
    """A named preset (``k3``, ``k31``, ``k3-small``, ``k31-small``, ``mixed-small``).

    ``num_layers`` rebuilds the layer schedule for that depth; other keywords replace fields. The full
    presets' experts are MXFP4, as K3 ships them, the small ones' BF16 (``experts_format`` picks either).
    """
    if name not in _SPECS:
        raise ValueError(f"unknown preset {name!r}; valid: {sorted(_SPECS)}")
    base, kind = _SPECS[name]
    cfg = _preset(name, base, num_layers or base["num_layers"], kind)
    return cfg.replace(**changes) if changes else cfg
