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
from dep_compile.ops.packing import packed_view  # noqa: E402
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


def test_pack_model_weights_packs_fp8_codes_and_scales():
    """FP8 block-scaled projections: each DSA a-projection group and MoE front packs its codes and, apart, its
    block scales as zero-copy row views (what the kimi_dep ops read without concatenating), values unchanged."""
    model = build_model(preset("k31-small", num_layers=4, dense_format="fp8_block"), seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_model_weights(model) == ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.self_attn",
                                         "model.layers.3.mlp"]
    a, idx = model.model.layers[3].self_attn, model.model.layers[3].self_attn.indexer
    groups = [[a.fused_qkv_a_g_proj, idx.wk, idx.weights_proj]] + [
        [layer.mlp.shared_experts.gate_up_proj, layer.mlp.routed_expert_down_proj] for layer in model.model.layers[1:]]
    for g in groups:
        assert g[0].weight.dtype == torch.float8_e4m3fn
        assert packed_view([lin.weight for lin in g]) is not None
        assert packed_view([lin.weight_scale for lin in g]) is not None
    after = model.state_dict()
    assert all(torch.equal(v.view(torch.uint8), after[k].view(torch.uint8)) if v.dtype == torch.float8_e4m3fn
               else torch.equal(v, after[k]) for k, v in before.items())


def test_k3_model_turns_cuda_graphs_off_or_refuses_them():
    """vLLM's default captures a GPU engine's steps in CUDA graphs, which would replay the K3 model's capture-time
    step groups: its engine hook sets cudagraph_mode NONE where unset (before vLLM's default, which leaves a set
    mode alone) and refuses an explicit mode that captures graphs, naming it."""
    from vllm.config.compilation import CUDAGraphMode

    from dep_compile.integrations.vllm_k3.config import cuda_graphs_off

    cc = CompilationConfig()
    assert cc.cudagraph_mode is None  # what the hook sees: vLLM fills its default in after the hook
    cuda_graphs_off(cc)
    assert cc.cudagraph_mode == CUDAGraphMode.NONE
    cuda_graphs_off(cc)  # asked for NONE: kept
    assert cc.cudagraph_mode == CUDAGraphMode.NONE
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY):
        with pytest.raises(ValueError, match=f"cudagraph_mode = {mode.name}"):
            cuda_graphs_off(CompilationConfig(cudagraph_mode=mode))


def test_step_groups_decode_unpadded_prefill_bounded():
    """vLLM's ragged step as uniform groups (``vllm_k3.layout``): decode requests together at q = 1 with no padding,
    prefill chunks largest first with padding below their tokens; every token lands once, at its cache slot
    and position (token i of a request with c tokens at seq - c + i), with accepted = c and the request's KDA slot
    its first block."""
    from dep_compile.integrations.vllm_k3.layout import build_groups, dummy_group, group_requests

    assert group_requests([1, 1, 1], 1) == [[0, 1, 2]]
    assert group_requests([3, 12, 7, 1], 1) == [[3], [1, 2], [0]]
    assert group_requests([2, 1, 9], 2) == [[0, 1], [2]]  # verify-sized (<= 1 + spec tokens) join the decodes
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(1, 40, (9,), generator=g).tolist()
        groups = group_requests(counts, 1)
        assert sorted(i for grp in groups for i in grp) == list(range(9))
        assert all(len(grp) * max(counts[i] for i in grp) < 2 * sum(counts[i] for i in grp)
                   for grp in groups if max(counts[i] for i in grp) > 1)

    counts, seq, width = [1, 5, 1, 3], [9, 5, 17, 12], 4
    qsl = torch.tensor([0, 1, 6, 7, 10])
    table = torch.arange(4 * 6, dtype=torch.int32).view(4, 6) + 1  # [n, 6]: wider than the graph's 4
    slots = torch.arange(100, 110)  # [T]
    groups = build_groups(qsl, torch.tensor(seq, dtype=torch.int32), table, slots, width, decode_q=1)
    assert [(grp.kind, grp.shape) for grp in groups] == [("decode", (2, 1)), ("prefill", (2, 5))]
    assert not any(grp.whole for grp in groups)
    seen = []
    for grp in groups:
        n, q = grp.shape
        assert grp.block_table.shape == (n, width) and torch.equal(grp.state_indices, grp.block_table[:, 0])
        assert torch.equal(grp.tokens.view(n, q).flatten()[grp.rows], grp.dest)
        for r in range(n):
            req = next(i for i in range(4) if table[i, 0] == grp.block_table[r, 0])
            c = counts[req]
            assert grp.accepted[r] == c and torch.equal(grp.block_table[r], table[req, :width])
            assert int(grp.seq_lens[r]) - q == seq[req] - c  # slot i sits at seq - c + i
            assert grp.slot_mapping[r, :c].tolist() == slots[qsl[req]: qsl[req] + c].tolist()
            assert (grp.slot_mapping[r, c:] == -1).all()
        seen += grp.dest.tolist()
    assert sorted(seen) == list(range(10))

    decode = build_groups(torch.arange(5), torch.tensor([3, 4, 5, 6], dtype=torch.int32), table, slots, width, 1)
    assert len(decode) == 1 and decode[0].whole and decode[0].shape == (4, 1)
    assert torch.equal(decode[0].tokens, torch.arange(4))
    with pytest.raises(ValueError, match="at least one token"):
        build_groups(torch.tensor([0, 2, 2]), torch.tensor([2, 2]), table, slots, width, 1)
    dummy = dummy_group(4096, width, "cpu")  # vLLM's profile run: the trace's example, n and q both >= 2
    assert dummy.shape == (2, 2048) and dummy.whole and (dummy.slot_mapping == -1).all()
    assert (dummy.state_indices == -1).all()
    small = dummy_group(1, width, "cpu")
    assert small.shape == (2, 2) and not small.whole and small.dest.tolist() == [0]


def test_engine_log_names_step_kinds_and_warns_once_for_stock_attention():
    """The pass's log in the engine: which steps the graph serves (from its q_len), and for a graph whose DSA / KDA
    layers stay stock (a static prefill-shaped q) one warning naming each with its reason and what to set."""
    import logging

    from dep_compile.stock.cache import KimiCache, RequestBatch

    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg, seed=1)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.dep_compile")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as vLLM's logging config has it in an engine
    try:
        for q in (1, 12):
            torch._dynamo.reset()
            cache = KimiCache.allocate(cfg, num_slots=3, num_blocks=16, block_size=4, seed=2)
            meta = RequestBatch(cache, 2).step(q)
            with inductor_config.patch({KEY: KimiDepInductorPass(CUBLAS_ONLY), "force_disable_caches": True,
                                        "enable_auto_functionalized_v2": True}), torch.no_grad():
                torch.compile(model, fullgraph=True, dynamic=False)(torch.zeros(2 * q, dtype=torch.int64), meta, cache)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(infos) == 2 and "(steps served: steps of q = 1 only)" in infos[0], infos
    assert "(steps served: steps of q = 12 only (prefill-shaped: DSA/KDA stay stock))" in infos[1], infos
    assert len(warnings) == 1 and "4 DSA/KDA layer(s)" in warnings[0], warnings  # q = 1: none; q = 12: one
    for i in range(4):
        assert f"model.layers.{i}.self_attn" in warnings[0]
    assert warnings[0].count("trace steps as [n, q] with q dynamic") == 4, warnings[0]
