"""Checkpoints in K3's format: ``make-checkpoint`` (BF16, or MXFP4 routed experts written by compressed-tensors),
``load_stock_model`` back, and the clear error a checkpoint that lies gets.

compressed-tensors 0.17 is the authority for the MXFP4 bytes: the file's experts must be its compression of the
BF16 model's, and what we load must dequantize to its decompression of the file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from dep_compile.__main__ import main
from dep_compile.integrations.checkpoint import checkpoint_tensors, config_from_hf, load_stock_model, make_checkpoint
from dep_compile.integrations.quantization import K3_QUANTIZATION_CONFIG, compress_mxfp4
from dep_compile.stock import build_model, preset
from dep_compile.stock.mxfp4 import Mxfp4Weight

from helpers import run_pair

pytest.importorskip("compressed_tensors", reason="the dev extra installs compressed-tensors")
safetensors = pytest.importorskip("safetensors.torch", reason="the dev extra installs safetensors (with transformers)")
from test_mxfp4 import _ct_decompress  # noqa: E402

PRESET = "k31-small"
LAYER = "model.layers.1.mlp.experts"
# K3's text_config.quantization_config as the public config.json dump shows it (docs/mxfp4.md)
K3_JSON = """{"config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": null,
  "output_activations": null, "targets": ["Linear"], "weights": {"actorder": null, "block_structure": null,
  "dynamic": false, "group_size": 32, "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
  "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": true, "type": "float", "zp_dtype": null}}},
  "format": "mxfp4-pack-quantized", "global_compression_ratio": null,
  "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\\\.(gate|up|gate_up|down)_proj.*",
             "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
  "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed"}"""


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """``python -m dep_compile make-checkpoint --preset k31-small --experts mxfp4 DIR``."""
    d = tmp_path_factory.mktemp("mxfp4")
    assert main(["make-checkpoint", "--preset", PRESET, "--experts", "mxfp4", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def bf16_model():
    """The BF16 model make-checkpoint quantizes (seed 0)."""
    return build_model(preset(PRESET), seed=0)


def _digest(d) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_bf16_checkpoint_is_the_bf16_model(tmp_path, bf16_model):
    """--experts bf16 (the small presets' default) writes the BF16 model's tensors and no quantization_config;
    loading gives the model back."""
    make_checkpoint(PRESET, tmp_path / "default")
    make_checkpoint(PRESET, tmp_path / "bf16", experts="bf16")
    assert _digest(tmp_path / "default") == _digest(tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    tensors = safetensors.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    want = checkpoint_tensors(bf16_model.state_dict(), bf16_model.config)
    assert tensors.keys() == want.keys() and all(torch.equal(tensors[k], want[k]) for k in want)
    loaded = load_stock_model(tmp_path / "bf16")
    assert loaded.config.experts_format == "bf16"
    assert all(torch.equal(v, bf16_model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_mxfp4_checkpoint_is_k3s_format(mxfp4_dir, bf16_model):
    """config.json carries K3's quantization_config in text_config only; each expert is w1 / w3 / w2
    ``weight_packed`` [N, K/2] and ``weight_scale`` [N, K/32] uint8, compressed-tensors' compression of the BF16
    model's expert (gate rows, up rows, down), and no expert ``.weight``; everything else the BF16 model's."""
    config = json.loads((mxfp4_dir / "config.json").read_text())
    assert config["text_config"]["quantization_config"] == json.loads(K3_JSON) == K3_QUANTIZATION_CONFIG
    assert "quantization_config" not in config  # K3's raw config.json has it in text_config only
    tensors = safetensors.load_file(str(mxfp4_dir / "model.safetensors"))
    cfg = bf16_model.config
    I, L, E = cfg.moe_intermediate, cfg.moe_latent_size, cfg.n_routed_experts
    experts = {k: t for k, t in tensors.items() if ".experts." in k}
    assert len(experts) == (cfg.num_layers - cfg.first_k_dense) * E * 6
    assert not any(k.endswith(".weight") for k in experts)
    for k, t in experts.items():
        n, k_in = (L, I) if ".w2." in k else (I, L)
        assert t.dtype == torch.uint8 and t.shape == (n, k_in // 2 if k.endswith("packed") else k_in // 32), k
    bf16 = bf16_model.state_dict()
    for layer in (1, cfg.num_layers - 1):
        p = f"model.layers.{layer}.mlp.experts"
        w13, w2 = bf16[f"{p}.w13_weight"], bf16[f"{p}.w2_weight"]
        for e in (0, E // 2 + 3, E - 1):
            for part, w in (("w1", w13[e, :I]), ("w3", w13[e, I:]), ("w2", w2[e])):
                packed, scale = compress_mxfp4(w)
                assert torch.equal(tensors[f"{p}.{e}.{part}.weight_packed"], packed)
                assert torch.equal(tensors[f"{p}.{e}.{part}.weight_scale"], scale)
    dense = checkpoint_tensors({k: v for k, v in bf16.items() if ".experts." not in k}, cfg)
    assert tensors.keys() - experts.keys() == dense.keys() and all(torch.equal(tensors[k], v) for k, v in dense.items())


def test_mxfp4_round_trip_and_rewrite(mxfp4_dir, bf16_model):
    """load_stock_model: each expert dequantizes to compressed-tensors' decompression of the file's tensors
    (near the BF16 weights it quantized), the rest is the BF16 model; compiled by kimi_dep, every MoE becomes
    kimi_dep.moe_mxfp4 and logits and caches equal eager over several steps."""
    model = load_stock_model(mxfp4_dir)
    cfg = model.config
    assert cfg.experts_format == "mxfp4" and cfg.replace(name=PRESET, experts_format="bf16") == bf16_model.config
    tensors = safetensors.load_file(str(mxfp4_dir / "model.safetensors"))
    I = cfg.moe_intermediate
    state, bf16 = model.state_dict(), bf16_model.state_dict()
    for layer in range(cfg.first_k_dense, cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        w13 = Mxfp4Weight(state[f"{p}.w13_weight_packed"], state[f"{p}.w13_weight_scale"]).dequantize()
        w2 = Mxfp4Weight(state[f"{p}.w2_weight_packed"], state[f"{p}.w2_weight_scale"]).dequantize()
        f = {}  # part -> [E, N, K]: compressed-tensors' decompression of the file's tensors, expert by expert
        for part in ("w1", "w3", "w2"):
            packed, scale = (torch.stack([tensors[f"{p}.{e}.{part}.{s}"] for e in range(cfg.n_routed_experts)])
                             for s in ("weight_packed", "weight_scale"))
            f[part] = _ct_decompress(packed.flatten(0, 1), scale.flatten(0, 1)).view(*packed.shape[:2], -1)
        assert torch.equal(w13[:, :I], f["w1"]) and torch.equal(w13[:, I:], f["w3"]) and torch.equal(w2, f["w2"])
        ref = bf16[f"{p}.w13_weight"].float()
        assert 0.02 < (w13.float() - ref).norm() / ref.norm() < 0.2  # 4-bit weights of the BF16 model (~11 %)
    assert all(torch.equal(v, bf16[k]) for k, v in state.items() if ".experts." not in k)
    r = run_pair(cfg, model=model, steps=3, batch=3)
    moe = r.report.rewritten("moe")
    assert len(moe) == cfg.num_layers - cfg.first_k_dense and all(m.op == "kimi_dep.moe_mxfp4" for m in moe), \
        r.report.table()
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def _lie(src, dst, tensors=None, config=None):
    """A copy of checkpoint ``src`` in ``dst`` with its tensors and / or config.json edited."""
    shutil.copytree(src, dst)
    if tensors:
        t = safetensors.load_file(str(src / "model.safetensors"))
        tensors(t)
        safetensors.save_file(t, str(dst / "model.safetensors"))
    if config:
        c = json.loads((src / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _float_scales(t):
    name = f"{LAYER}.3.w2.weight_scale"
    t[name] = torch.exp2(t[name].float() - 127)  # the same scales as float multipliers


def _bf16_experts(t):
    for k in [k for k in t if k.startswith(f"{LAYER}.") and k.endswith("weight_packed")]:
        w = Mxfp4Weight(t.pop(k), t.pop(k.replace("packed", "scale")))
        t[k.replace("weight_packed", "weight")] = w.dequantize()


LIES = {
    "shape": (dict(tensors=lambda t: t.update({f"{LAYER}.0.w1.weight_scale": t[f"{LAYER}.0.w1.weight_scale"][:, :3]
                                                .contiguous()})),
              rf"{LAYER}.0.w1.weight_scale: shape \(64, 3\), expected \(64, 4\)"),
    "missing scale": (dict(tensors=lambda t: t.pop(f"{LAYER}.5.w3.weight_scale")),
                      rf"lacks 1 tensors: {LAYER}.5.w3.weight_scale$"),
    "missing packed": (dict(tensors=lambda t: t.pop(f"{LAYER}.63.w2.weight_packed")),
                       rf"lacks 1 tensors: {LAYER}.63.w2.weight_packed$"),
    "float scales": (dict(tensors=_float_scales),
                     rf"{LAYER}.3.w2.weight_scale is torch.float32; the quantization_config declares E8M0 scales"),
    "bf16 experts, mxfp4 declared": (dict(tensors=_bf16_experts),
                                     rf"{LAYER}.\d+.w\d.weight matches no parameter: the config declares MXFP4"),
    "mxfp4 experts, none declared": (dict(config=lambda c: c["text_config"].pop("quantization_config")),
                                     r"weight_(packed|scale) matches no parameter: the config declares BF16 experts"),
    "format": (dict(config=lambda c: c["text_config"]["quantization_config"].update(format="nvfp4-pack-quantized")),
               r"quantization_config.format is 'nvfp4-pack-quantized'; K3's MXFP4 experts need 'mxfp4-pack-quantized'"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_checkpoint_that_lies_is_refused(mxfp4_dir, tmp_path, lie):
    edits, message = LIES[lie]
    with pytest.raises(ValueError, match=message):
        load_stock_model(_lie(mxfp4_dir, tmp_path / "ckpt", **edits))


def _group(qc):
    return qc["config_groups"]["group_0"]


CONFIG_LIES = {
    "quant_method": (lambda qc: qc.update(quant_method="fp8"), r"quant_method is 'fp8'"),
    "group format": (lambda qc: _group(qc).update(format="int-quantized"), r"group_0.format is 'int-quantized'"),
    "fp8 format, 4 bits": (lambda qc: _group(qc).update(format="float-quantized"),
                           r"group_0.weights.num_bits is 4; FP8 block dense projections need 8"),
    "group_size": (lambda qc: _group(qc)["weights"].update(group_size=16), r"weights.group_size is 16; .* need 32"),
    "num_bits": (lambda qc: _group(qc)["weights"].update(num_bits=8), r"weights.num_bits is 8"),
    "float scales declared": (lambda qc: _group(qc)["weights"].update(scale_dtype="torch.bfloat16"),
                              r"weights.scale_dtype is 'torch.bfloat16'"),
    "W4A4": (lambda qc: _group(qc).update(input_activations={"num_bits": 4, "type": "float", "dynamic": True}),
             r"group_0.input_activations is \{"),
    "not compressed": (lambda qc: qc.update(quantization_status="frozen"), r"quantization_status is 'frozen'"),
    "no groups": (lambda qc: qc.pop("config_groups"), r"no config_groups"),
}


@pytest.mark.parametrize("lie", sorted(CONFIG_LIES))
def test_a_quantization_config_that_is_not_k3s_is_refused(lie):
    from dep_compile.integrations.checkpoint import hf_config

    text = hf_config(preset(PRESET, experts_format="mxfp4"))["text_config"]
    assert config_from_hf(text).experts_format == "mxfp4"
    edit, message = CONFIG_LIES[lie]
    edit(text["quantization_config"])
    with pytest.raises(ValueError, match=message):
        config_from_hf(text)


def test_top_level_quantization_config():
    """A top-level quantization_config (where compressed-tensors' own writer puts it) declares the format too;
    one that contradicts text_config's is refused."""
    from dep_compile.integrations.checkpoint import hf_config

    text = hf_config(preset(PRESET))["text_config"]
    assert config_from_hf(text).experts_format == "bf16"
    assert config_from_hf(text, quantization_config=json.loads(K3_JSON)).experts_format == "mxfp4"
    text["quantization_config"] = json.loads(K3_JSON)
    assert config_from_hf(text, quantization_config=json.loads(K3_JSON)).experts_format == "mxfp4"
    other = json.loads(K3_JSON)
    other["ignore"] = []
    with pytest.raises(ValueError, match="differ"):
        config_from_hf(text, quantization_config=other)


def test_without_compressed_tensors_mxfp4_asks_for_the_extra(tmp_path):
    """Writing MXFP4 without compressed-tensors' undeclared dependency psutil (a fresh process where it cannot be
    imported) fails before writing anything, naming the extra that installs both; BF16 needs neither."""
    script = ("import sys; sys.modules['psutil'] = None; from dep_compile.__main__ import main; "
              "sys.exit(main(['make-checkpoint', '--experts', sys.argv[1], sys.argv[2]]))")

    def run(fmt):
        return subprocess.run([sys.executable, "-c", script, fmt, str(tmp_path / fmt)], capture_output=True, text=True,
                              timeout=300)

    proc = run("mxfp4")
    assert proc.returncode == 2 and not (tmp_path / "mxfp4").exists(), proc.stderr[-2000:]
    assert "(psutil is missing): pip install 'dep-compile[mxfp4]'" in proc.stderr
    assert run("bf16").returncode == 0 and (tmp_path / "bf16" / "model.safetensors").exists()


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_an_ep_rank_loads_only_its_block_of_experts(experts, mxfp4_dir, tmp_path, bf16_model):
    """A model built with EP rank r's block of 2 (``KimiK3Model(ep_rank, ep_size)``) holds half the experts, and
    ``load_checkpoint(experts=block)`` copies exactly those experts' tensors into it (each equal to the full
    model's), skips the other rank's, and still refuses a tensor of an expert the config does not have."""
    from safetensors.torch import load_file

    from dep_compile.integrations.checkpoint import expert_of, load_checkpoint
    from dep_compile.runtime.ep import expert_block
    from dep_compile.stock.model import KimiK3Model

    d = mxfp4_dir if experts == "mxfp4" else make_checkpoint(PRESET, tmp_path / "bf16")
    full = load_stock_model(d).model
    tensors = {n: t for n, t in load_file(str(d / "model.safetensors")).items() if n.startswith("model.")}
    cfg = full.config
    E = cfg.n_routed_experts
    for rank in range(2):
        block = expert_block(E, rank, 2)
        model = KimiK3Model(cfg, ep_rank=rank, ep_size=2)
        params = {f"model.{n}": p for n, p in model.named_parameters()}
        with torch.no_grad():
            read = load_checkpoint(params, cfg, tensors.items(), block)
        assert {expert_of(n) for n in read} - {None} == set(block)
        assert len(read) == len([n for n in tensors if expert_of(n) is None or expert_of(n) in block])
        mods = [m for m in model.modules() if hasattr(m, "expert_start")]
        assert mods and all((m.expert_start, m.num_local, m.ep_size) == (block.start, E // 2, 2) for m in mods)
        for name, p in model.named_parameters():
            want = full.get_parameter(name)
            if ".experts." in name:
                assert p.shape[0] == E // 2 and p.shape[1:] == want.shape[1:], name
                want = want[block.start:block.stop]
            assert torch.equal(p, want), name
        bad = next(n for n in tensors if expert_of(n) == 0).replace(".experts.0.", f".experts.{E}.")
        with pytest.raises(ValueError, match=f"experts.{E}.*matches no parameter"):
            load_checkpoint(params, cfg, [(bad, tensors[bad.replace(f".experts.{E}.", ".experts.0.")])], block)
