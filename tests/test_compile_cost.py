"""Matching cost grows linearly with layer count, validation runs one probe per layer structure (CPU).

The passes are timed alone, on copies of one traced graph per depth, in CPU time (``time.process_time``,
the least of three runs): the wall clock of a whole compile measured the machine's load as much as the
passes (2 of 3 runs failed on an idle 2-core machine). Whole-graph walks are counted, not timed: the node
visits a layer is a deterministic property, and a quadratic pass fails its bound on any machine (a timed
mutant's growth was 2.50 here and 1.49 in CI, 2026-12-03, against a bound of 1.6). Translation validation
is counted too: one probe per layer structure (AttnRes points: per bank state).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compile_cost as cc  # noqa: E402

DEPTHS = (16, 64)
PER_LAYER_GROWTH = 1.6  # per-layer pass CPU time at 64 layers over that at 16: linear ~1, quadratic -> 4
PER_LAYER_VISITS_GROWTH = 1.1  # per-layer whole-graph node visits, 64 over 16: 0.99 measured, quadratic -> 4


@pytest.fixture(scope="module")
def graphs():
    return {n: cc.trace(n) for n in DEPTHS}


def per_layer_growth(measure, graphs) -> tuple[float, dict]:
    per = {n: measure(*graphs[n]) / n for n in DEPTHS}
    return per[64] / per[16], per


def test_pass_time_linear_in_layers(graphs):
    growth, per = per_layer_growth(cc.pass_cpu_seconds, graphs)
    print(f"pass CPU ms per layer: {({n: round(v * 1e3, 2) for n, v in per.items()})}, growth {growth:.2f}")
    assert growth < PER_LAYER_GROWTH, per


def test_whole_graph_walks_linear_in_layers(graphs):
    growth, per = per_layer_growth(cc.whole_graph_visits, graphs)
    print(f"whole-graph node visits per layer: {per}, growth {growth:.3f}")
    assert growth < PER_LAYER_VISITS_GROWTH, per


def test_a_quadratic_pass_fails_the_bound(graphs, monkeypatch):
    """The mutant: every rewrite first lints the whole graph (an O(nodes) walk per layer, so O(layers^2)
    in all). Counted (2026-12-03): 7009 -> 25802 node visits a layer from 16 to 64 layers (growth 3.68),
    against 640 -> 634 (0.99) for the passes as they are."""
    from dep_compile.passes.base import PassContext

    commit = PassContext.commit

    def quadratic_commit(self, *args, **kwargs):
        self.gm.graph.lint()
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(PassContext, "commit", quadratic_commit)
    growth, per = per_layer_growth(cc.whole_graph_visits, graphs)
    print(f"quadratic mutant: whole-graph node visits per layer {per}, growth {growth:.2f}")
    assert growth >= PER_LAYER_VISITS_GROWTH, per


def test_validation_runs_one_probe_per_layer_structure(graphs):
    """DSA, KDA and MoE layers: one probe per structure, whatever the depth. AttnRes points: one per distinct
    bank state (how many blocks it mixes, whether it writes one), so at most two per bank block (K3: <= 32)."""
    counts = {}
    for n in DEPTHS:
        count, report = cc.probes(*graphs[n])
        assert report.num_rewritten == 2 * n - 1  # every attention layer and every MoE (layer 0 is dense)
        assert all(m.validation.startswith("probe") for m in report.layers if m.rewritten), report.table()
        assert all(m.validation.startswith("probe") for m in report.points if m.rewritten), report.table()
        assert 0 < count["attn_res"] <= 2 * cc.preset("k31-small", num_layers=n).attn_res_blocks, count
        counts[n] = count["layers"]
    assert counts[16] == counts[64] > 0, counts
