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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dep_compile.stock.config import K3Config, preset

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
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "torch_dtype": "bfloat16",
            "text_config": text, "dep_compile_preset": cfg.name}


def config_from_hf(text: dict, name: str = "checkpoint") -> K3Config:
    """The K3Config a checkpoint's ``text_config`` (a dict) describes."""
    missing = [k for k in (*_TEXT, "num_shared_experts", "linear_attn_config", "dsa_layers") if k not in text]
    if missing:
        raise ValueError(f"text_config lacks K3 keys: {', '.join(missing)}")
    la = text["linear_attn_config"]
    fields = {f: text[k] for k, f in _TEXT.items()}
    fields.update({f: la[k] for k, f in _KDA.items()})
    return K3Config(name=name, kda_layers=tuple(la["kda_layers"]), dsa_layers=tuple(l - 1 for l in text["dsa_layers"]),
                    shared_intermediate=text["num_shared_experts"] * text["moe_intermediate_size"], **fields)


def _shards(cfg: K3Config) -> dict[str, list[tuple[str, int | None]]]:
    """Packed parameter (module name) -> its checkpoint parts in row order, with their row counts
    (None: half of the rows)."""
    HD, L = cfg.kda_width, cfg.latent_dim
    return {
        "in_proj_qkvgfab": [("q_proj", HD), ("k_proj", HD), ("v_proj", HD), ("g_proj", HD),
                            ("f_a_proj", cfg.kda_f_rank), ("b_proj", cfg.kda_heads)],
        "conv1d": [("q_conv1d", HD), ("k_conv1d", HD), ("v_conv1d", HD)],
        "fused_qkv_a_g_proj": [("q_a_proj", cfg.q_lora_rank), ("kv_a_proj_with_mqa", L), ("g_proj", cfg.mla_gate_width)],
        "gate_up_proj": [("gate_proj", None), ("up_proj", None)],
    }


def checkpoint_tensors(state_dict: dict[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """The stock model's state dict under checkpoint names (packed parameters and experts split)."""
    shards = _shards(cfg)
    out = {}
    for name, t in state_dict.items():
        parent, module, leaf = ([""] + name.rsplit(".", 2))[-3:]
        if module in shards and leaf == "weight":
            start = 0
            for part, rows in shards[module]:
                rows = rows or t.shape[0] // 2
                out[f"{parent}.{part}.weight"] = t[start:start + rows].contiguous()
                start += rows
        elif module == "experts":
            I = cfg.moe_intermediate
            for e in range(t.shape[0]):
                if leaf == "w13_weight":  # [2I, Lat]: gate rows, then up rows
                    out[f"{parent}.experts.{e}.w1.weight"] = t[e, :I].contiguous()
                    out[f"{parent}.experts.{e}.w3.weight"] = t[e, I:].contiguous()
                else:  # w2_weight [Lat, I]
                    out[f"{parent}.experts.{e}.w2.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def load_target(name: str, cfg: K3Config, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """Where checkpoint tensor ``name`` goes: (parameter name, the view of it to copy into), or None."""
    m = _EXPERT.match(name)
    if m is not None:
        pname = f"{m.group(1)}.{'w2_weight' if m.group(3) == 'w2' else 'w13_weight'}"
        if pname not in params:
            return None
        e, I = int(m.group(2)), cfg.moe_intermediate
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
        sizes = [rows or p.shape[0] // 2 for _, rows in parts]
        i = names.index(part)
        return pname, p[sum(sizes[:i]):sum(sizes[:i + 1])]
    return None


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


def make_checkpoint(preset_name: str, directory: str | Path, seed: int = 0) -> Path:
    """Write ``preset_name``'s stock decoder with random weights (``build_model(cfg, seed)``) to ``directory``."""
    from safetensors.torch import save_file

    from dep_compile.stock import build_model

    cfg = preset(preset_name)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg, seed=seed)
    save_file(checkpoint_tensors(model.state_dict(), cfg), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "do_sample": False}))
    write_tokenizer(d, cfg.vocab_size)
    return d


def load_stock_model(directory: str | Path):
    """The stock decoder with a checkpoint's weights (what vLLM's model must reproduce), on CPU."""
    from safetensors.torch import load_file

    from dep_compile.stock import build_model

    d = Path(directory)
    cfg = config_from_hf(json.loads((d / "config.json").read_text())["text_config"])
    model = build_model(cfg)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, t in load_file(str(d / "model.safetensors")).items():
            target = load_target(name, cfg, params)
            if target is None:
                raise ValueError(f"checkpoint tensor {name} matches no parameter")
            target[1].copy_(t)
            loaded.add(target[0])
    if loaded != set(params):
        raise ValueError(f"parameters not in the checkpoint: {sorted(set(params) - loaded)}")
    return model


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "hf_config", "config_from_hf", "checkpoint_tensors", "load_target",
           "make_checkpoint", "load_stock_model"]
