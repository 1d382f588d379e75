"""DepPassManager: runs the DSA, KDA, MoE (and MLA report) passes, then the AttnRes glue pass, over one graph."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from dep_compile.config import DepOptions
from dep_compile.debug import dump
from dep_compile.debug.report import LayerMatch, MatchReport, record

from .attn_res import AttnResPass, link_points
from .base import LayerPass, PassContext
from .dsa import DsaPass
from .calls import UNSPECIALIZED_HINT, unspecialized_floats
from .kda import KdaPass
from .mla import MlaPass
from .moe import MoePass

log = logging.getLogger("dep_compile")

# Specific first: each family's anchor op is distinct, so order only fixes the report's grouping.
PASSES: tuple[type[LayerPass], ...] = (DsaPass, KdaPass, MoePass, MlaPass)
# Glue between the layers (option ``kinds`` names it "attn_res"); its rows go to ``MatchReport.points``.
GLUE: tuple[type[LayerPass], ...] = (AttnResPass,)


@dataclasses.dataclass
class RewriteResult:
    """The report of one run and the weight swaps to do once compile_fx has returned."""

    report: MatchReport
    finalizers: list[Callable[[], None]]

    def finalize(self) -> None:
        for f in self.finalizers:
            f()
        self.finalizers.clear()


class DepPassManager:
    """Applies every pass once (each rewrite removes its anchor, so one sweep is the fixed point)."""

    _graphs = 0

    def __init__(self, options: DepOptions):
        self.options = options
        self.passes = [p() for p in PASSES]
        self.glue = [p() for p in GLUE]

    def run(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, postgrad: bool = False,
            warn_no_match: bool = True) -> RewriteResult:
        """Rewrite ``gm`` in place. ``postgrad``: it is Inductor's post-grad graph (no real inputs);
        ``warn_no_match=False``: the caller says itself why a graph with no subgraph was left alone."""
        t0 = time.perf_counter()
        graph_name = f"{'postgrad_' if postgrad else ''}graph_{DepPassManager._graphs}"
        DepPassManager._graphs += 1
        if self.options.dump_dir:
            dump.write_before(self.options.dump_dir, graph_name, gm)
        ctx = PassContext(gm, example_inputs, self.options, postgrad=postgrad)
        rows: list[LayerMatch] = []
        for i, p in enumerate(self.passes, 1):
            if i > 1 and self.options.dump_dir:
                dump.write_stage(self.options.dump_dir, graph_name, i - 1, self.passes[i - 2].kind, gm)
            for found in p.find(gm.graph):
                if p.kind != "mla" and p.kind not in self.options.kinds:
                    rows.append(LayerMatch(found.layer, found.module, p.kind, False,
                                           f"policy: kind {p.kind!r} not in options kinds {self.options.kinds}", p.stock_name(found),
                                           check="policy"))
                    continue
                rows.append(p.apply(ctx, found))
        points = [p.apply(ctx, found) if p.kind in self.options.kinds else
                  LayerMatch(found.layer, found.module, p.kind, False,
                             f"policy: kind {p.kind!r} not in options kinds {self.options.kinds}", p.stock_name(found),
                             check="policy")
                  for p in self.glue for found in p.find(gm.graph)]
        ahead = self.options.attn_res_ahead and "attn_res" in self.options.kinds
        partition_ops = self.options.inductor_config.get("custom_should_partition_ops", ())
        linked, link_refusals = link_points(gm.graph, partition_ops) if ahead else (0, [])
        gm.graph.lint()
        gm.recompile()
        rows.sort(key=lambda m: (m.layer if m.layer is not None else 1 << 30, m.kind == "moe"))
        for m in rows + points:  # as Inductor counts its pattern matches
            counters["kimi_dep"][f"{m.kind}_{'rewritten' if m.rewritten else 'stock'}"] += 1
        report = MatchReport(graph_name, rows, time.perf_counter() - t0, self.options.fingerprint(),
                             ctx.validate_seconds, points, linked, link_refusals)
        record(report)
        dump.emit_trace_artifact(report)
        if self.options.dump_dir:
            dump.write_after(self.options.dump_dir, report, gm)
        log.info("%s", report.summary())
        if not rows and warn_no_match:
            log.warning("kimi_dep: no DSA, KDA, MoE or MLA subgraph found in %s; the graph is compiled unchanged",
                        report.graph)
        if rows and not points:
            log.info("kimi_dep: no AttnRes -> RMSNorm pair found in %s", report.graph)
        for m in report.stock() + report.stock_points():
            if m.kind != "mla":
                log.warning("kimi_dep: %s %s left stock: %s", m.kind, m.module, m.reason)
        constants = any("not a constant" in m.reason for m in report.stock() + report.stock_points())
        if constants and (floats := unspecialized_floats(gm.graph)):  # what the stock layers still read
            log.warning("kimi_dep: %s reads %d Python floats as graph inputs (%s): torch.compile(dynamic=True) does "
                        "not specialize floats, so the layers whose eps or scales they are stay stock; %s",
                        report.graph, len(floats), ", ".join(floats[:4]) + (", ..." if len(floats) > 4 else ""),
                        UNSPECIALIZED_HINT)
        return RewriteResult(report, ctx.finalizers)

    @staticmethod
    def hashed_files() -> list[Path]:
        """The sources a rewritten graph depends on: every pass file, the prepared-layer registry and
        each class a compiled graph bakes in (``registry.prepared``: the Prepared* layers, DepProjection)."""
        from dep_compile.ops import registry

        baked = {Path(inspect.getsourcefile(c)) for c in registry.prepared_classes()} | {Path(registry.__file__)}
        return [*sorted(Path(__file__).parent.glob("*.py")), *sorted(baked)]

    def uuid(self, *extra_files: Path) -> str:
        """Stable over processes: a hash of the options and of :meth:`hashed_files` (and ``extra_files``)."""
        h = hashlib.sha256()
        for f in [*self.hashed_files(), *extra_files]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        h.update(self.options.fingerprint().encode())
        return h.hexdigest()


class DepPostGradPass(CustomGraphPass):
    """The passes as an Inductor ``post_grad_custom_post_pass`` (hook (b) of docs/design.md §5.2, post-grad).

    Install with ``torch._inductor.config.post_grad_custom_post_pass = DepPostGradPass(options)``
    and compile with plain Inductor. It holds only the options dict, so it pickles and deep-copies;
    ``uuid()`` covers the pass files and the options, so Inductor's FX cache never serves a graph
    rewritten by other code. On a cache hit the pass does not run; the kimi_dep ops rebuild their
    prepared layers from the ``layer`` strings they carry (``dep_compile.ops.registry``).
    """

    explains_no_match = False  # a subclass that logs its own reason for a graph with no subgraph

    def __init__(self, options: dict | None = None):
        self.options = dict(options or {})
        DepOptions.from_dict(self.options)  # reject unknown options at construction

    def manager(self) -> DepPassManager:
        return DepPassManager(DepOptions.from_dict(self.options))

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:  # a bare Graph: wrap it so the passes can recompile and dump
            gm = fx.GraphModule(torch.nn.Module(), graph)
        self.manager().run(gm, None, postgrad=True, warn_no_match=not self.explains_no_match)

    def uuid(self) -> str:
        return self.manager().uuid()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"
