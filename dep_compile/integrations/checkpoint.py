"""A tiny K3 / K3.1 checkpoint that vLLM loads offline: safetensors, an HF ``config.json``, a ``tokenizer.json``.

Format (read off vLLM 0.32's K3 config class and K3 weight loader; K3.1's is not public):

- ``config.json``: ``model_type = "kimi_k3"`` with the decoder in ``text_config`` (vLLM's
  ``KimiLinearConfig`` keys: ``linear_attn_config`` with 1-based ``kda_layers`` /
  ``full_attn_layers``, ``use_full_rank_gate``, ``gate_lower_bound``; MLA, latent-MoE, SiTU and
  AttnRes keys). K3.1's indexer keys follow DeepSeek V3.2 (``index_n_heads``, ``index_head_dim``,
  ``index_topk``) plus ``dsa_layers`` (1-based): inferred, like its DSA layer.
- Tensors under the checkpoint's unpacked names, which vLLM's loader stacks: KDA ``q/k/v/g/f_a/b_proj``
  and ``q/k/v_conv1d``; MLA ``q_a_proj``, ``kv_a_proj_with_mqa``, ``g_proj``; ``gate_proj`` /
  ``up_proj``; routed experts one by one as ``experts.<e>.w1`` (gate), ``w3`` (up), ``w2`` (down).
  Every other name is the stock decoder's (its AttnRes parameters are the stock decoder's own inference).
- MXFP4 routed experts as K3 ships them: ``experts.<e>.w1.weight_packed`` (uint8 [N, K/2]) and
  ``.weight_scale`` (uint8 [N, K/32]) instead of ``.weight``, declared by ``text_config.quantization_config``
  (``quantization.K3_QUANTIZATION_CONFIG``; docs/mxfp4.md).
- FP8 block dense projections (``K3Config.dense_format``, the derived FP8 checkpoints): each unpacked part's
  ``.weight`` float8_e4m3fn and ``.weight_scale`` FP32, one per 128 x 128 block of that part (DeepSeek's
  ``.weight_scale_inv`` is read as the same tensor), declared by an FP8_BLOCK group of the ``quantization_config``
  (``quantization.FP8_BLOCK_GROUP``). A packed parameter's scales stack its parts' block rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from dep_compile.integrations.quantization import (compress_fp8_block, compress_mxfp4, quantization_config,
                                                   weight_formats)
from dep_compile.stock.config import K3Config, preset
from dep_compile.stock.fp8_block import FP8, blocks

ARCHITECTURE = "DepKimiK3ForCausalLM"  # the dep_compile model's name in vLLM's registry
MODEL_TYPE = "kimi_k3"
EOS_ID = 1

# text_config key -> K3Config field
_TEXT = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "first_k_dense_replace": "first_k_dense", "intermediate_size": "dense_intermediate", "rms_norm_eps": "rms_eps",
    "num_attention_heads": "mla_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_dim", "qk_rope_head_dim": "qk_rope_dim", "v_head_dim": "v_head_dim",
    "index_n_heads": "index_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
    "routed_expert_hidden_size": "moe_latent_size", "moe_intermediate_size": "moe_intermediate",
    "routed_scaling_factor": "routed_scaling_factor", "num_expert_group": "n_group", "topk_group": "topk_group",
    "moe_router_activation_func": "scoring_func", "attn_res_block_size": "attn_res_block",
    "activation_situ_beta": "situ_beta", "activation_situ_linear_beta": "situ_beta_lin",
}
# linear_attn_config key -> K3Config field
_KDA = {"num_heads": "kda_heads", "head_dim": "kda_head_dim", "short_conv_kernel_size": "kda_conv_width",
        "f_rank": "kda_f_rank", "gate_lower_bound": "kda_lower_bound"}


def hf_config(cfg: K3Config) -> dict:
    """``config.json`` for ``cfg`` (the shared expert as ``num_shared_experts`` x ``moe_intermediate_size``)."""
    if cfg.shared_intermediate % cfg.moe_intermediate:
        raise ValueError("shared_intermediate must be a multiple of moe_intermediate")
    text = {k: getattr(cfg, f) for k, f in _TEXT.items()}
    text.update(model_type="kimi_linear", num_shared_experts=cfg.shared_intermediate // cfg.moe_intermediate,
                moe_renormalize=True, use_grouped_topk=cfg.n_group > 1, topk_method="noaux_tc",
                mla_use_nope=True, mla_use_output_gate=True, latent_moe_use_norm=True,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=0,
                max_position_embeddings=4096, dsa_layers=[l + 1 for l in cfg.dsa_layers])
    text["linear_attn_config"] = {k: getattr(cfg, f) for k, f in _KDA.items()}
    text["linear_attn_config"].update(
        use_full_rank_gate=True, kda_layers=list(cfg.kda_layers),
        full_attn_layers=[l + 1 for l in range(cfg.num_layers) if l + 1 not in cfg.kda_layers])
    qc = quantization_config(cfg.experts_format, cfg.dense_format)
    if qc is not None:
        text["quantization_config"] = qc
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "torch_dtype": "bfloat16",
            "text_config": text, "dep_compile_preset": cfg.name}


def config_from_hf(text: dict, name: str = "checkpoint", quantization_config: dict | None = None) -> K3Config:
    """The K3Config a checkpoint's ``text_config`` (a dict) describes, its experts' and dense projections' formats
    read off the ``quantization_config`` in ``text_config`` (as K3 ships it) or the top-level one passed here."""
    qc = text.get("quantization_config")
    if qc is not None and quantization_config is not None and qc != quantization_config:
        raise ValueError("text_config.quantization_config and the top-level quantization_config differ")
    missing = [k for k in (*_TEXT, "num_shared_experts", "linear_attn_config", "dsa_layers") if k not in text]
    if missing:
        raise ValueError(f"text_config lacks K3 keys: {', '.join(missing)}")
    la = text["linear_attn_config"]
    fields = {f: text[k] for k, f in _TEXT.items()}
    fields.update({f: la[k] for k, f in _KDA.items()})
    experts, dense = weight_formats(qc if qc is not None else quantization_config)
    return K3Config(name=name, kda_layers=tuple(la["kda_layers"]), dsa_layers=tuple(l - 1 for l in text["dsa_layers"]),
                    shared_intermediate=text["num_shared_experts"] * text["moe_intermediate_size"],
                    experts_format=experts, dense_format=dense, **fields)


def _part_sizes(parts: list[tuple[str, int | None]], leaf: str, rows: int) -> list[int]:
    """Rows of each part of a packed ``leaf`` tensor of ``rows`` rows: a weight's rows (None: half), or an FP8
    ``weight_scale``'s block rows (each part has its own 128-row blocks)."""
    if leaf == "weight_scale":
        return [blocks(n) if n else rows // 2 for _, n in parts]
    return [n or rows // 2 for _, n in parts]


def _shards(cfg: K3Config) -> dict[str, list[tuple[str, int | None]]]:
    """Packed parameter (module name) -> its checkpoint parts in row order, with their row counts
    (None: half of the rows)."""
    HD = cfg.kda_width
    return {
        "in_proj_qkvgfab": list(zip(("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
                                    cfg.kda_in_segments)),
        "conv1d": [("q_conv1d", HD), ("k_conv1d", HD), ("v_conv1d", HD)],
        "fused_qkv_a_g_proj": list(zip(("q_a_proj", "kv_a_proj_with_mqa", "g_proj"), cfg.mla_fused_segments)),
        "gate_up_proj": [("gate_proj", None), ("up_proj", None)],
    }


def checkpoint_tensors(state_dict: dict[str, torch.Tensor], cfg: K3Config,
                       expert_start: int = 0) -> dict[str, torch.Tensor]:
    """The stock model's state dict under checkpoint names (packed parameters and experts split); its experts
    are experts ``expert_start ..`` of the checkpoint (an EP rank's block)."""
    shards = _shards(cfg)
    out = {}
    for name, t in state_dict.items():
        parent, module, leaf = ([""] + name.rsplit(".", 2))[-3:]
        if module in shards and leaf in ("weight", "weight_scale"):
            start = 0
            for (part, _), rows in zip(shards[module], _part_sizes(shards[module], leaf, t.shape[0])):
                out[f"{parent}.{part}.{leaf}"] = t[start:start + rows].contiguous()
                start += rows
        elif module == "experts":
            if leaf.endswith(("_weight_packed", "_weight_scale")) and t.dtype != torch.uint8:  # tiles' int32 / int16
                raise ValueError(f"checkpoint_tensors: {name} is {t.dtype}: the MXFP4 experts are tiled "
                                 "(dep_compile.stock.mxfp4_tiles.untile_mxfp4 gives the checkpoint's layout back)")
            I = cfg.moe_intermediate
            stack, _, suffix = leaf.partition("_")  # w13_weight_packed -> w13, weight_packed
            for e in range(t.shape[0]):
                g = expert_start + e  # the expert's id in the checkpoint
                if stack == "w13":  # [2I, ...]: gate rows, then up rows
                    out[f"{parent}.experts.{g}.w1.{suffix}"] = t[e, :I].contiguous()
                    out[f"{parent}.experts.{g}.w3.{suffix}"] = t[e, I:].contiguous()
                else:  # w2 [Lat, ...]
                    out[f"{parent}.experts.{g}.w2.{suffix}"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.(weight|weight_packed|weight_scale)$")


def expert_of(name: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to (``...experts.<e>.w1.weight``: e), or None."""
    m = _EXPERT.match(name)
    return None if m is None else int(m.group(2))


def load_target(name: str, cfg: K3Config, params: dict[str, torch.Tensor],
                expert_start: int = 0) -> tuple[str, torch.Tensor] | None:
    """Where checkpoint tensor ``name`` goes: (parameter name, the view of it to copy into), or None; the
    params' experts are experts ``expert_start ..`` of the checkpoint."""
    m = _EXPERT.match(name)
    if m is not None:
        pname = f"{m.group(1)}.{'w2' if m.group(3) == 'w2' else 'w13'}_{m.group(4)}"
        if pname not in params:
            return None
        e, I = int(m.group(2)) - expert_start, cfg.moe_intermediate
        dst = params[pname][e]
        return pname, {"w1": dst[:I], "w3": dst[I:], "w2": dst}[m.group(3)]
    if name in params:
        return name, params[name]
    if name.count(".") < 2:
        return None
    parent, part, leaf = name.rsplit(".", 2)
    for module, parts in _shards(cfg).items():
        pname = f"{parent}.{module}.{leaf}"
        names = [p for p, _ in parts]
        if part not in names or pname not in params:
            continue
        p = params[pname]
        sizes = _part_sizes(parts, leaf, p.shape[0])
        i = names.index(part)
        return pname, p[sum(sizes[:i]):sum(sizes[:i + 1])]
    return None


def _unknown(name: str, cfg: K3Config) -> str:
    """Why checkpoint tensor ``name`` matches no parameter, with the experts' declared format where it is one."""
    m = _EXPERT.match(name)
    if m is None:
        return f"checkpoint tensor {name} matches no parameter"
    declared = ("MXFP4 experts (weight_packed / weight_scale): the quantization_config says so"
                if cfg.experts_format == "mxfp4" else "BF16 experts (weight): there is no quantization_config")
    return f"checkpoint tensor {name} matches no parameter: the config declares {declared}"


def _check_dtype(name: str, t: torch.Tensor, want: torch.dtype) -> None:
    if want == FP8 and t.dtype != FP8:
        raise ValueError(f"checkpoint tensor {name} is {t.dtype}; the quantization_config declares FP8 block "
                         "dense projections (float8_e4m3fn)")
    if want == torch.float32 and name.endswith(".weight_scale") and t.dtype != torch.float32:
        raise ValueError(f"checkpoint tensor {name} is {t.dtype}; FP8 block scales are float32")
    if want == torch.uint8 and t.dtype != torch.uint8:
        what = "E8M0 scales" if name.endswith("weight_scale") else "E2M1 codes, two a byte"
        raise ValueError(f"checkpoint tensor {name} is {t.dtype}; the quantization_config declares {what} (uint8)")
    if want.is_floating_point and not t.is_floating_point():
        raise ValueError(f"checkpoint tensor {name} is {t.dtype}, not a floating-point weight")


def _elsewhere(name: str, cfg: K3Config, experts: range, expected: dict) -> bool:
    """Whether ``name`` is a routed expert's tensor, in the declared format, of an expert outside ``experts``."""
    m = _EXPERT.match(name)
    if m is None or int(m.group(2)) in experts or int(m.group(2)) >= cfg.n_routed_experts:
        return False
    return f"{m.group(1)}.{experts.start}.{m.group(3)}.{m.group(4)}" in expected


def load_checkpoint(params: dict[str, torch.Tensor], cfg: K3Config, tensors: Iterable[tuple[str, torch.Tensor]],
                    experts: range | None = None) -> dict[str, str]:
    """Copy checkpoint tensors into ``params`` (a model's named parameters); returns {checkpoint tensor: the
    parameter it was copied into}.

    ``experts``: the routed experts ``params`` hold (an EP rank's block; default all of them): the other
    experts' tensors are skipped, not copied. ValueError naming the tensor for one that matches no parameter,
    has another shape, or another kind of dtype (uint8 codes and scales, floating-point weights), and for
    every tensor of ``params`` the checkpoint lacks.
    """
    experts = range(cfg.n_routed_experts) if experts is None else experts
    meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()}
    expected = {n: (t.shape, t.dtype) for n, t in checkpoint_tensors(meta, cfg, experts.start).items()}
    read = {}
    for name, t in tensors:
        if name.endswith(".weight_scale_inv") and cfg.dense_format == "fp8_block":  # DeepSeek's name for it
            name = name.removesuffix("_inv")
        if name not in expected:
            if _elsewhere(name, cfg, experts, expected):
                continue
            raise ValueError(_unknown(name, cfg))
        shape, dtype = expected[name]
        if t.shape != shape:
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        _check_dtype(name, t, dtype)
        pname, dst = load_target(name, cfg, params, experts.start)
        dst.copy_(t)
        read[name] = pname
    missing = [n for n in expected if n not in read]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors: {', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''}")
    return read


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level ``tokenizer.json`` (+ ``tokenizer_config.json``): ``<unk>``, ``</s>``, then ``w2`` ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": EOS_ID, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>",
        "pad_token": "<unk>", "model_max_length": 4096}, indent=1))


def quantize_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with each BF16 ``experts.w13_weight`` / ``w2_weight`` replaced by compressed-tensors' MXFP4
    (``w13_weight_packed`` and ``w13_weight_scale``, ...)."""
    out = {}
    for name, t in state_dict.items():
        if name.endswith(("experts.w13_weight", "experts.w2_weight")):
            out[f"{name}_packed"], out[f"{name}_scale"] = compress_mxfp4(t)
        else:
            out[name] = t
    return out


def quantize_dense(tensors: dict[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """Checkpoint ``tensors`` (BF16 dense parts) with each part ``cfg``'s FP8 model holds in FP8 replaced by
    compressed-tensors' FP8_BLOCK of it (``.weight`` float8_e4m3fn, ``.weight_scale``), part by part."""
    from dep_compile.stock.model import KimiK3ForCausalLM

    with torch.device("meta"):
        fp8 = KimiK3ForCausalLM(cfg).state_dict()
    out = dict(tensors)
    for name, t in checkpoint_tensors(fp8, cfg).items():
        if name.endswith(".weight_scale") and t.dtype == torch.float32:  # FP8 blocks (MXFP4 scales are uint8)
            weight = name.removesuffix("_scale")
            out[weight], out[name] = compress_fp8_block(tensors[weight])
    return out


def make_checkpoint(preset_name: str, directory: str | Path, seed: int = 0, experts: str | None = None,
                    dense: str | None = None) -> Path:
    """Write ``preset_name``'s stock decoder with random BF16 weights (``build_model(cfg, seed)``) to ``directory``;
    ``experts="mxfp4"`` stores its routed experts as K3 does (compressed-tensors' MXFP4 of those BF16 weights;
    default: the preset's ``experts_format``), ``dense="fp8_block"`` its dense projections as the derived FP8
    checkpoints do (compressed-tensors' FP8_BLOCK of each BF16 part)."""
    from safetensors.torch import save_file

    from dep_compile.stock import build_model

    cfg = preset(preset_name, **({"experts_format": experts} if experts else {}),
                 **({"dense_format": dense} if dense else {}))
    bf16 = cfg.replace(experts_format="bf16", dense_format="bf16")
    state = build_model(bf16, seed=seed).state_dict()
    if cfg.experts_format == "mxfp4":
        state = quantize_experts(state)
    tensors = checkpoint_tensors(state, bf16)
    if cfg.dense_format == "fp8_block":
        tensors = quantize_dense(tensors, cfg)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "do_sample": False}))
    write_tokenizer(d, cfg.vocab_size)
    return d


def load_stock_model(directory: str | Path, experts_layout: str = "checkpoint"):
    """The stock decoder with a checkpoint's weights (what vLLM's model must reproduce), on CPU.

    ``experts_layout="tiles"``: MXFP4 experts re-packed in place into the tiles kimi_dep's kernels read
    (``stock.tile_experts_``, what the vLLM model does on CUDA; a layer that cannot be tiled keeps the
    checkpoint's layout, logged)."""
    from safetensors.torch import load_file

    from dep_compile.stock import build_model, tile_experts_

    if experts_layout not in ("checkpoint", "tiles"):
        raise ValueError(f"experts_layout {experts_layout!r}: 'checkpoint' or 'tiles'")

    d = Path(directory)
    config = json.loads((d / "config.json").read_text())
    cfg = config_from_hf(config["text_config"], quantization_config=config.get("quantization_config"))
    model = build_model(cfg)
    with torch.no_grad():
        load_checkpoint(dict(model.named_parameters()), cfg, load_file(str(d / "model.safetensors")).items())
    if experts_layout == "tiles":
        tile_experts_(model)
    return model


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "hf_config", "config_from_hf", "checkpoint_tensors", "expert_of",
           "load_target", "load_checkpoint", "quantize_experts", "quantize_dense", "make_checkpoint", "load_stock_model"]
