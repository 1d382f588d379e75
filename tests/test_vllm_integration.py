"""The vLLM contract (vllm 0.33): our post-grad pass resolves from CompilationConfig, runs inside vLLM's
PostGradPassManager on a post-grad graph of the stock decoder, pickles, deep-copies, and has a stable uuid."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="vllm is not installed")

import torch._inductor.config as inductor_config  # noqa: E402
from vllm.compilation.passes.inductor_pass import InductorPass, pass_context  # noqa: E402
from vllm.config import CompilationConfig  # noqa: E402

import dep_compile  # noqa: E402
import dep_compile_vllm  # noqa: E402
from dep_compile.debug.parity import decisive_routing  # noqa: E402
from dep_compile.integrations.vllm import KimiDepInductorPass, compilation_config, pack_model_weights  # noqa: E402
from dep_compile.stock import build_model, preset  # noqa: E402

from helpers import CUBLAS_ONLY, assert_agrees, compare_steps, kinds_rewritten  # noqa: E402

KEY = "post_grad_custom_post_pass"


def test_import_dep_compile_does_not_import_vllm():
    code = "import sys, dep_compile, dep_compile.passes.manager, dep_compile.stock; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_config_resolves_our_pass():
    frag = compilation_config()
    assert frag["use_inductor_graph_partition"] is True
    cc = CompilationConfig(**json.loads(json.dumps(frag)))  # the --compilation-config JSON route
    p = cc.inductor_compile_config[KEY]
    assert p is dep_compile_vllm.kimi_dep_pass and isinstance(p, InductorPass) and isinstance(p, KimiDepInductorPass)
    assert cc.use_inductor_graph_partition and cc.inductor_compile_config["enable_auto_functionalized_v2"] is True
    cc2 = CompilationConfig(**compilation_config({"front_max": 32}, splitting_ops=[]))  # Python route, options
    p2 = cc2.inductor_compile_config[KEY]
    assert isinstance(p2, KimiDepInductorPass) and p2.options == {"front_max": 32} and cc2.splitting_ops == []
    p3 = CompilationConfig(**compilation_config(dep_compile.options(front_max=32))).inductor_compile_config[KEY]
    assert isinstance(p3, KimiDepInductorPass) and p3.options == {"front_max": 32} and p3.uuid() == p2.uuid()
    assert cc.compute_hash() != cc2.compute_hash()  # vLLM hashes the pass by its uuid()


def test_pickles_and_deep_copies():
    p = KimiDepInductorPass(CUBLAS_ONLY)
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert type(q) is KimiDepInductorPass and q.options == p.options and q.uuid() == p.uuid()
    cc = CompilationConfig(**compilation_config())
    for c in (copy.deepcopy(cc), pickle.loads(pickle.dumps(cc))):
        assert c.inductor_compile_config[KEY].uuid() == p.__class__().uuid()
    with pytest.raises(ValueError, match="unknown option"):
        KimiDepInductorPass({"bogus": 1})


def test_uuid_stable_across_processes_and_tracks_options():
    code = "import dep_compile_vllm; print(dep_compile_vllm.kimi_dep_pass.uuid())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == dep_compile_vllm.kimi_dep_pass.uuid()
    assert KimiDepInductorPass().uuid() == dep_compile_vllm.kimi_dep_pass.uuid()
    assert KimiDepInductorPass({"front_max": 32}).uuid() != KimiDepInductorPass().uuid()
    assert KimiDepInductorPass(CUBLAS_ONLY).uuid() != KimiDepInductorPass().uuid()


def _post_grad_manager(cc: CompilationConfig):
    """vLLM's PostGradPassManager as its backend configures it, with our pass added from the config."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import DeviceConfig, VllmConfig

    vc = VllmConfig(compilation_config=cc, device_config=DeviceConfig(device="cpu"))
    pc = vc.compilation_config.pass_config
    for name, value in list(vars(pc).items()):  # CUDA-only fusions: their passes are not importable on CPU
        if isinstance(value, bool) and name.startswith(("fuse_", "enable_")):
            setattr(pc, name, False)
    pm = PostGradPassManager()
    pm.configure(vc)
    pm.add(cc.inductor_compile_config[KEY])
    try:
        torch.ops._C.rotary_embedding  # fix_functionalization names vllm._C ops; a CPU-only wheel lacks them
    except (AttributeError, RuntimeError):
        pm.fix_functionalization = lambda graph: None
    return vc, pm


def test_post_grad_pass_manager_runs_it_on_the_stock_decoder():
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    cc = CompilationConfig(**compilation_config(CUBLAS_ONLY))
    vc, pm = _post_grad_manager(cc)
    cfg = preset("k31-small", num_layers=4)
    model = decisive_routing(build_model(cfg, seed=1))  # Inductor's glue rounds: no near-tied router (helpers)
    assert pack_model_weights(model) == ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.self_attn",
                                         "model.layers.3.mlp"]
    # Inductor config as vLLM's backend sets it (our fragment turns auto-functionalization v2 back on)
    patches = {k: v for k, v in cc.inductor_compile_config.items() if hasattr(inductor_config, k)}
    assert patches["enable_auto_functionalized_v2"] is True
    patches.update({KEY: pm, "force_disable_caches": True})
    with set_current_vllm_config(vc), pass_context(Range(1, 8)), torch.no_grad(), inductor_config.patch(patches):
        fn = torch.compile(model, fullgraph=True, dynamic=False)
        res = compare_steps(cfg, model, fn, steps=4, batch=3)
    report = res.report
    assert report.graph.startswith("postgrad_")
    # exactly these rows, every one rewritten: KDA 0-2, DSA 3, MoE 1-3 (no stock row, no other kind)
    assert kinds_rewritten(report) == {"kda": [True] * 3, "dsa": [True], "moe": [True] * 3}, report.table()
    assert_agrees(res, "vLLM post-grad pass manager", inductor=True)
