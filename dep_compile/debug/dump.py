"""Pattern-match debugging dumps: graphs before/after the passes, the report, near misses."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.fx as fx

from .report import MatchReport


def graph_code(gm: fx.GraphModule) -> str:
    """The graph as readable Python (shapes and dtypes in comments)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def write_before(dump_dir: str, graph: str, gm: fx.GraphModule) -> None:
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{graph}.0_before_passes.py").write_text(graph_code(gm))


def write_stage(dump_dir: str, graph: str, index: int, kind: str, gm: fx.GraphModule) -> None:
    """The graph after one pass family (``graph_N.0.<i>_after_<kind>_pass.py``)."""
    (Path(dump_dir) / f"{graph}.0.{index}_after_{kind}_pass.py").write_text(graph_code(gm))


def write_after(dump_dir: str, report: MatchReport, gm: fx.GraphModule) -> None:
    """The rewritten graph, the report (JSON and text) and the near misses of one graph."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    g = report.graph
    (d / f"{g}.1_after_passes.py").write_text(graph_code(gm))
    (d / f"{g}.report.json").write_text(report.to_json())
    (d / f"{g}.report.txt").write_text(report.table() + "\n")
    misses = [dict(layer=m.layer, module=m.module, kind=m.kind, check=m.check, failed_check=m.reason, node=m.node)
              for m in report.near_misses()]
    (d / f"{g}.near_misses.json").write_text(json.dumps(misses, indent=2))


def emit_trace_artifact(report: MatchReport) -> None:
    """The report as a structured-trace artifact (shown by tlparse under TORCH_TRACE)."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"kimi_dep_match_report_{report.graph}", "encoding": "json"},
        payload_fn=report.to_json,
    )
