"""The match report: per layer, what kimi_dep rewrote or left stock, and why."""

from __future__ import annotations

import dataclasses
import json

import torch

CPU_TACTICS = "torch.mm on CPU (the measured tactic tables are for CUDA)"
CPU_TACTICS_FP8 = "stock's FP8 op on CPU (the measured tactic tables are for CUDA)"


@dataclasses.dataclass
class LayerMatch:
    """One stock subgraph the passes found (an attention layer or a MoE)."""

    layer: int | None
    module: str
    kind: str  # "dsa" | "kda" | "moe" | "mla" | "attn_res" (an AttnRes -> RMSNorm point)
    rewritten: bool
    reason: str  # why it stayed stock ("" when rewritten)
    op: str  # the op now in the graph
    tactics: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)  # projection -> batch -> tactic
    node: str = ""  # the node a failed check names
    check: str = ""  # which check left it stock: "structure", "semantic", "internal error" or "policy"
    validation: str = ""  # rewritten: the translation-validation probe's numbers (or why it did not run)

    @property
    def status(self) -> str:
        return "rewritten" if self.rewritten else "stock"


@dataclasses.dataclass
class MatchReport:
    """Every subgraph found in one compiled graph, in layer order, plus the pass time.

    ``layers`` holds the attention layers and MoEs; ``points`` the AttnRes -> RMSNorm points (glue,
    two a layer), which the table shows as one count line plus a row per point left stock.
    """

    graph: str
    layers: list[LayerMatch]
    pass_seconds: float = 0.0
    options: str = ""
    validate_seconds: float = 0.0  # the part of pass_seconds spent in translation validation
    points: list[LayerMatch] = dataclasses.field(default_factory=list)  # AttnRes -> RMSNorm points
    points_linked: int = 0  # consecutive fused points whose second's bank part the first computes (side stream)
    link_refusals: list[str] = dataclasses.field(default_factory=list)  # why the other pairs were not linked

    def rewritten(self, kind: str | None = None) -> list[LayerMatch]:
        return [m for m in self.layers if m.rewritten and (kind is None or m.kind == kind)]

    def stock(self, kind: str | None = None) -> list[LayerMatch]:
        return [m for m in self.layers if not m.rewritten and (kind is None or m.kind == kind)]

    def stock_points(self) -> list[LayerMatch]:
        return [m for m in self.points if not m.rewritten]

    def near_misses(self) -> list[LayerMatch]:
        """Subgraphs that looked like DSA/KDA/MoE (or an AttnRes pair) but failed a check (not policy skips)."""
        return [m for m in self.stock() + self.stock_points() if m.kind != "mla" and not m.reason.startswith("policy:")]

    @property
    def num_rewritten(self) -> int:
        return len(self.rewritten())

    def summary(self) -> str:
        kinds = sorted({m.kind for m in self.layers})
        parts = [f"{k}: {len(self.rewritten(k))}/{len([m for m in self.layers if m.kind == k])}" for k in kinds]
        if not self.layers:
            return f"{self.graph}: no DSA, KDA, MoE or MLA subgraph found; nothing rewritten"
        return (f"{self.graph}: rewrote {self.num_rewritten} of {len(self.layers)} ({', '.join(parts)}) in "
                f"{self.pass_seconds * 1e3:.1f} ms (validation {self.validate_seconds * 1e3:.1f} ms)"
                + (f"; fused {len(self.points) - len(self.stock_points())} of {len(self.points)} AttnRes -> RMSNorm "
                   "points" if self.points else ""))

    def table(self) -> str:
        """A fixed-width text table, one row per subgraph."""
        head = ("layer", "module", "kind", "status", "op", "tactics / reason")
        rows = []
        for m in self.layers:
            if m.rewritten:
                detail = _tactics(m.tactics, fp8="fp8_block" in (m.op or ""))
            else:
                detail = ("structure check failed: " if m.check == "structure" else "") + m.reason \
                    + (f" [node {m.node}]" if m.node else "")
            rows.append(("" if m.layer is None else str(m.layer), m.module, m.kind, m.status, m.op, detail))
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        widths[-1] = len(head[-1])
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
        return "\n".join([self.summary(), fmt(head), *(fmt(r) for r in rows), *self._point_lines()])

    def _point_lines(self) -> list[str]:
        """AttnRes points: one line counting the fused ones per layer, then a line per point left stock."""
        if not self.points:
            return []
        per_layer: dict = {}
        for m in self.points:
            if m.rewritten:
                per_layer[m.layer] = per_layer.get(m.layer, 0) + 1
        runs: list[list] = []  # [first layer, last layer, points fused in each]
        for k, n in per_layer.items():
            if runs and isinstance(k, int) and runs[-1][1] == k - 1 and runs[-1][2] == n:
                runs[-1][1] = k
            else:
                runs.append([k, k, n])
        counts = ", ".join(f"layer {lo}: {n}" if lo == hi else f"layers {lo}-{hi}: {n} each" for lo, hi, n in runs)
        lines = [f"AttnRes -> RMSNorm: {sum(per_layer.values())} of {len(self.points)} points fused into "
                 f"kimi_dep.attn_res_norm ({counts or 'none'})"]
        for m in self.stock_points():
            lines.append(f"  stock {m.module}: {m.reason}" + (f" [node {m.node}]" if m.node else ""))
        if self.points_linked or self.link_refusals:
            lines.append(f"  bank part a point early, on a side stream (CUDA): {self.points_linked} of "
                         f"{self.points_linked + len(self.link_refusals)} consecutive pairs")
            lines += [f"  not linked {r}" for r in self.link_refusals]
        return lines

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)


def _tactics(tactics: dict[str, dict[int, str]], fp8: bool = False) -> str:
    """Each projection's tactics by batch; on a machine without CUDA where every one is cuBLAS (the
    default tables: ``DepOptions.tables_for``), what runs there instead (``fp8``: FP8 block-scaled weights)."""
    if not torch.cuda.is_available() and all(t == "cublas" for tab in tactics.values() for t in tab.values()):
        return CPU_TACTICS_FP8 if fp8 else CPU_TACTICS
    return "; ".join(f"{p}: {_bins(tab)}" for p, tab in tactics.items())


def _bins(tab: dict[int, str]) -> str:
    """{1: a, 2: a, 4: b} -> "1-2:a 4:b" (runs of batches with one tactic)."""
    runs: list[list] = []
    for b, t in tab.items():
        if runs and runs[-1][2] == t:
            runs[-1][1] = b
        else:
            runs.append([b, b, t])
    return " ".join(f"{lo}:{t}" if lo == hi else f"{lo}-{hi}:{t}" for lo, hi, t in runs)


_REPORTS: list[MatchReport] = []


def record(report: MatchReport) -> None:
    _REPORTS.append(report)


def last_report() -> MatchReport | None:
    return _REPORTS[-1] if _REPORTS else None


def all_reports() -> list[MatchReport]:
    return list(_REPORTS)
