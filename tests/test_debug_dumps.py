"""Dumps and the explain CLI: graphs before/after, the report as JSON and text, near misses."""

from __future__ import annotations

import json

import torch

from dep_compile.__main__ import main
from dep_compile.debug.report import CPU_TACTICS
from dep_compile.stock import preset

from helpers import run_pair


def test_explain_cli_prints_table_and_writes_dumps(tmp_path, capsys):
    assert main(["explain", "--preset", "k31-small", "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rewrote 15 of 15" in out and "kimi_k3.kda_core" in out and "6 ->   0" in out
    (before_file,) = tmp_path.glob("graph_*.0_before_passes.py")
    g = before_file.name.split(".")[0]  # graph_<n>: n counts the graphs compiled in this process
    before = before_file.read_text()
    after = (tmp_path / f"{g}.1_after_passes.py").read_text()
    assert "kimi_k3.kda_core" in before and "kimi_dep.kda_attention" not in before
    assert "kimi_dep.kda_attention" in after and "kimi_k3.kda_core" not in after
    # per pass: after the DSA pass the KDA cores are still there, after the KDA pass they are gone
    after_dsa = (tmp_path / f"{g}.0.1_after_dsa_pass.py").read_text()
    after_kda = (tmp_path / f"{g}.0.2_after_kda_pass.py").read_text()
    assert "kimi_dep.dsa_attention" in after_dsa and "kimi_k3.kda_core" in after_dsa
    assert "kimi_k3.kda_core" not in after_kda and "kimi_k3.routed_experts" in after_kda
    report = json.loads((tmp_path / f"{g}.report.json").read_text())
    assert len(report["layers"]) == 15 and all(m["rewritten"] for m in report["layers"])
    assert "model.layers.3.self_attn" in (tmp_path / f"{g}.report.txt").read_text()
    assert json.loads((tmp_path / f"{g}.near_misses.json").read_text()) == []
    # on a machine without CUDA the table says what runs there, not the GPU's split-K tactics
    if not torch.cuda.is_available():
        assert CPU_TACTICS in out and "splitk" not in out.lower(), out


def test_near_misses_name_the_failed_check(tmp_path, monkeypatch):
    monkeypatch.setenv("DEP_COMPILE_DUMP_DIR", str(tmp_path))
    cfg = preset("k31-small", num_layers=4, scoring_func="softmax")
    run_pair(cfg, steps=2, batch=2)
    (misses_file,) = tmp_path.glob("*.near_misses.json")
    misses = json.loads(misses_file.read_text())
    assert [m["module"] for m in misses] == [f"model.layers.{i}.mlp" for i in (1, 2, 3)]
    assert all(m["failed_check"] == "router scoring is softmax, not sigmoid" and m["node"] for m in misses)


def test_report_emitted_as_structured_trace_artifact(monkeypatch):
    seen = []
    def record(kind, metadata_fn=None, payload_fn=None, **kw):
        if kind == "artifact" and metadata_fn is not None:
            seen.append((kind, metadata_fn(), payload_fn()))

    monkeypatch.setattr(torch._logging, "trace_structured", record)
    run_pair(preset("k31-small", num_layers=4), steps=1, batch=2)
    names = [m["name"] for kind, m, _ in seen if kind == "artifact"]
    assert any(n.startswith("kimi_dep_match_report") for n in names)
