"""Coverage: every DSA, KDA and MoE subgraph is rewritten, every MLA layer is left untouched."""

from __future__ import annotations

import pytest
import torch

from dep_compile.stock import KimiCache, RequestBatch, build_model, preset



def _graph_ops(cfg, options=None):
    """Compile one decode step in pattern-only mode; return (report, the rewritten graph's op names)."""
    graphs = []

    def capture(gm, example_inputs):
        from dep_compile.backend import kimi_dep

        fn = kimi_dep(gm, example_inputs, options={"inductor": False, **(options or {})})
        graphs.append(gm)
        return fn

    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    meta = RequestBatch(cache, 2, start_len=5).step(1)
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(torch.randint(0, cfg.vocab_size, (2,)), meta, cache)
    import dep_compile

    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    return dep_compile.last_report(), ops


@pytest.mark.parametrize("name", ["k3-small", "k31-small", "mixed-small"])
def test_every_dsa_kda_moe_rewritten_mla_untouched(name):
    cfg = preset(name)
    report, ops = _graph_ops(cfg)
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert len(report.rewritten("kda")) == kinds.count("kda")
    assert len(report.rewritten("dsa")) == kinds.count("dsa")
    assert len(report.rewritten("moe")) == n_moe
    assert report.rewritten("mla") == []
    assert len(report.stock("mla")) == kinds.count("mla")
    assert all(m.reason.startswith("policy:") for m in report.stock())
    # the graph: no stock KDA / DSA / experts op left, every MLA decode still there
    assert not any("kimi_k3.kda_core" in o or "kimi_k3.dsa_indexer" in o or "sparse_mla" in o for o in ops)
    assert not any("routed_experts" in o for o in ops)
    assert sum("kimi_k3.mla_decode" in o for o in ops) == kinds.count("mla")
    assert sum("kimi_dep.kda_attention" in o for o in ops) == kinds.count("kda")
    assert sum("kimi_dep.dsa_attention" in o for o in ops) == kinds.count("dsa")
    assert sum("kimi_dep.moe" in o for o in ops) == n_moe
    # report rows name their layers and module paths
    for m in report.layers:
        assert m.layer is not None and m.module.startswith(f"model.layers.{m.layer}.")
    assert "kimi_dep.dsa_attention" in report.table() or kinds.count("dsa") == 0


def test_kinds_option_limits_rewrites():
    cfg = preset("k31-small")
    report, _ = _graph_ops(cfg, {"kinds": ("kda",)})
    assert report.rewritten("dsa") == [] and report.rewritten("moe") == []
    assert len(report.rewritten("kda")) == 6
    assert all("not in options kinds" in m.reason for m in report.stock("dsa") + report.stock("moe"))


def test_new_nodes_carry_module_stack():
    graphs = []

    def capture(gm, example_inputs):
        from dep_compile.backend import kimi_dep

        fn = kimi_dep(gm, example_inputs, options={"inductor": False})
        graphs.append(gm)
        return fn

    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    meta = RequestBatch(cache, 2, start_len=5).step(1)
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(torch.randint(0, 512, (2,)), meta, cache)
    new = [n for n in graphs[0].graph.nodes if "kimi_dep" in str(n.target)]
    assert len(new) == 3 + 3 + 1 + 8  # 3 KDA + 1 DSA + 3 MoE + 8 AttnRes -> RMSNorm points
    for n in new:
        assert n.meta.get("nn_module_stack"), n.name
        assert n.meta.get("stack_trace"), n.name


def test_no_matches_reports_zero_and_compiles():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    out = torch.compile(model, backend="kimi_dep", options={"inductor": False})(x)
    import dep_compile

    rep = dep_compile.last_report()
    assert rep.layers == [] and rep.num_rewritten == 0
    assert "nothing rewritten" in rep.summary()
    torch.testing.assert_close(out, model(x))
