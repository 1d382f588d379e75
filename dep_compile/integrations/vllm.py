"""vLLM integration: the dep_compile passes as a vLLM ``InductorPass`` at ``post_grad_custom_post_pass``.

This is the only module of the package that imports vllm (it requires it). vLLM resolves a pass
named in ``--compilation-config`` with ``__import__(module).__dict__[name]``, i.e. from a
*top-level* module's namespace, so the ready instance lives in the tiny top-level module
``dep_compile_vllm`` (``dep_compile_vllm.kimi_dep_pass``), which imports this one; ``import
dep_compile`` never imports vllm.

What the pass sees there: Inductor's post-grad graph (aten, functionalized, no real tensors).
Linears are ``mm(x, permute(w))``/``addmm``, norms are decomposed, the kimi_k3 mutating ops are
wrapped in ``auto_functionalized_v2``; ``dep_compile.passes`` match both that form and the
Dynamo form. Weight packing cannot be done there (no tensors): call :func:`pack_model_weights`
on the model before compiling it, or the kimi_dep ops concatenate their weight blocks per call.

A graph served from Inductor's or vLLM's compile cache skips the pass; the kimi_dep ops then
rebuild their prepared layers from the ``layer`` strings they carry (``dep_compile.ops.registry``),
so cache hits are safe.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from vllm.compilation.passes.inductor_pass import InductorPass

from dep_compile.config import DepOptions
from dep_compile.debug.report import MatchReport, last_report
from dep_compile.ops.packing import pack_params
from dep_compile.passes.calls import functionalized_op, op_args
from dep_compile.passes.manager import DepPostGradPass

PASS_NAME = "dep_compile_vllm.kimi_dep_pass"  # the qualified name vLLM's config resolves
log = logging.getLogger("vllm.dep_compile")  # under vLLM's logger, so its handler prints it in every process
NO_MATCH = ("kimi_dep: no kimi_k3 op in graph {graph}, so nothing was rewritten: this model's compiled graph does "
            "not call the dep_compile stock ops (vLLM's own K3 model is not torch.compiled, and other models hold "
            "vLLM's ops). Serve K3 / K3.1 with the dep_compile model: "
            "hf_overrides={{\"architectures\": [\"DepKimiK3ForCausalLM\"]}} (docs/vllm.md)")
# What a user can set when a DSA / KDA layer stays stock, by the start of its reason (docs/vllm.md, "Step kinds").
ADVICE = {
    "prefill-shaped step": "the graph was traced with a static q_len above max_q: trace steps as [n, q] with q "
                           "dynamic (the dep_compile model DepKimiK3ForCausalLM does), or raise the kimi_dep option "
                           "max_q",
    "auto_functionalized v1": 'set inductor_compile_config={"enable_auto_functionalized_v2": true} '
                              "(compilation_config() does)",
    "policy:": "add the kind to the kimi_dep option kinds",
}


def step_kinds(graph: fx.Graph, max_q: int) -> str:
    """Which steps the graph's attention ops serve, read off their ``q_len`` arguments."""
    qs = set()
    for n in graph.nodes:
        op = functionalized_op(n) or n.target
        schema = getattr(op, "_schema", None)
        if n.op == "call_function" and schema is not None and any(a.name == "q_len" for a in schema.arguments):
            q = op_args(n, op)["q_len"]
            qs.add(None if isinstance(q, (fx.Node, torch.SymInt)) else int(q))
    if not qs:
        return "no attention op"
    if None in qs:
        return (f"every step on this graph, q_len symbolic: decode (q = 1) and verify (q <= max_q = {max_q}) groups "
                f"run the rewritten ops; prefill-shaped groups (q > {max_q}) run the stock cores inside them")
    return "; ".join(f"steps of q = {q} only" + (" (prefill-shaped: DSA/KDA stay stock)" if q > max_q else "")
                     for q in sorted(qs))


def stock_attention_warning(report: MatchReport) -> str | None:
    """One warning for a graph whose DSA or KDA layers stay stock: each layer's reason, and what to set."""
    stock = [m for m in report.layers if m.kind in ("dsa", "kda") and not m.rewritten]
    if not stock:
        return None
    lines = []
    for m in stock:
        fix = next((v for k, v in ADVICE.items() if k in m.reason), "see the reason and docs/vllm.md")
        lines.append(f"  {m.module} ({m.kind}): {m.reason} -> {fix}")
    return (f"kimi_dep: {len(stock)} DSA/KDA layer(s) of graph {report.graph} stay stock, so steps of this graph run "
            f"them unspecialized:\n" + "\n".join(lines))


class KimiDepInductorPass(DepPostGradPass, InductorPass):
    """The kimi_dep rewrite (DSA, KDA, MoE; MLA stays stock) as a vLLM post-grad pass.

    :class:`DepPostGradPass` (it holds only the options dict, so it deep-copies and pickles to
    workers; ``inductor``/``inductor_config`` have no effect here) that vLLM accepts as an
    ``InductorPass``. ``uuid()`` also hashes this file: stable across processes, different when
    the passes, this integration or the options change.
    """

    explains_no_match = True  # NO_MATCH below replaces the manager's generic line: one warning, with the fix

    def __call__(self, graph: fx.Graph) -> None:
        """Rewrite the graph; log the match report (one line a layer), or why nothing matched."""
        super().__call__(graph)
        report = last_report()
        if not report.layers:
            log.warning(NO_MATCH.format(graph=report.graph))
            return
        kinds = step_kinds(graph, DepOptions.from_dict(self.options).max_q)
        log.info("kimi_dep match report (steps served: %s)\n%s", kinds, report.table())
        warning = stock_attention_warning(report)
        if warning:
            log.warning(warning)

    def uuid(self) -> str:
        return self.manager().uuid(Path(__file__))


def compilation_config(options: dict[str, Any] | None = None, splitting_ops: list[str] | None = None) -> dict:
    """The ``CompilationConfig`` fragment that installs the pass (JSON-safe when ``options`` is None).

    - ``inductor_passes.post_grad_custom_post_pass = "dep_compile_vllm.kimi_dep_pass"``: vLLM
      resolves the name and adds the pass to its PostGradPassManager. ``inductor_passes`` is
      typed ``dict[str, str]``, so a pass with non-default ``options`` cannot go there: it is
      placed in ``inductor_compile_config`` instead (Python only; vLLM checks it is an InductorPass).
    - ``inductor_compile_config.enable_auto_functionalized_v2 = True``: vLLM turns v2 off by
      default; under v1 the kimi_k3 mutating ops are wrapped in ``auto_functionalized`` v1, which
      the pass reports as a near miss and leaves stock (and v1 clones a view-of-pool cache whole).
    - ``use_inductor_graph_partition = True``: vLLM then partitions at Inductor codegen time,
      after the passes ran, so the post-grad pass sees whole layers (off, vLLM splits the Dynamo
      graph at ``splitting_ops`` before Inductor and no attention subgraph reaches the pass whole).
      ``splitting_ops`` then only names the ops kept out of CUDA graphs: None keeps vLLM's default
      (its attention ops), ``[]`` asks for full CUDA graphs.
    """
    cfg: dict[str, Any] = {
        "use_inductor_graph_partition": True,
        "inductor_compile_config": {"enable_auto_functionalized_v2": True},
    }
    if options is None:
        cfg["inductor_passes"] = {"post_grad_custom_post_pass": PASS_NAME}
    else:
        cfg["inductor_compile_config"]["post_grad_custom_post_pass"] = KimiDepInductorPass(options)
    if splitting_ops is not None:
        cfg["splitting_ops"] = list(splitting_ops)
    return cfg


def pack_model_weights(model: nn.Module) -> list[str]:
    """Pack a stock (vLLM-named) K3/K3.1 model's row-stacked weights once, before compiling.

    DSA: ``[fused_qkv_a_g_proj | indexer.wk | indexer.weights_proj]`` (or ``[fused |
    indexer.wk_weights_proj]``); MoE: ``[shared_experts.gate_up_proj | routed_expert_down_proj]``.
    Each group's params become adjacent row views of one tensor (``pack_params``), which is what
    the kimi_dep ops read as one matrix without copying; FP8 block-scaled groups pack their codes and,
    apart, their block scales (each part's block rows stay its own). Returns the packed modules' names.
    Do it before ``torch.compile`` (docs/design.md §5.4: never between tracing and compile_fx).
    """
    packed = []
    with torch.no_grad():
        for name, m in model.named_modules():
            groups = []
            if hasattr(m, "fused_qkv_a_g_proj") and hasattr(m, "indexer"):
                idx = m.indexer
                rest = [idx.wk_weights_proj] if hasattr(idx, "wk_weights_proj") else [idx.wk, idx.weights_proj]
                groups.append([m.fused_qkv_a_g_proj, *rest])
            if hasattr(m, "routed_expert_down_proj") and getattr(m, "shared_experts", None) is not None:
                groups.append([m.shared_experts.gate_up_proj, m.routed_expert_down_proj])
            for g in groups:
                ws = [lin.weight for lin in g]
                scales = [getattr(lin, "weight_scale", None) for lin in g]
                if not (_rows_of_one_kind(ws) and (all(s is None for s in scales) or _rows_of_one_kind(scales))):
                    continue  # parts in different formats: the passes leave such a layer stock
                for params in (ws, scales):
                    if params[0] is not None:
                        pack_params(params)
                packed.append(name)
    return packed


def _rows_of_one_kind(ps: list) -> bool:
    """Whether ``ps`` are matrices of one width and dtype (row groups ``pack_params`` can stack)."""
    return all(p is not None and p.dim() == 2 and p.shape[1] == ps[0].shape[1] and p.dtype == ps[0].dtype
               for p in ps)


__all__ = ["KimiDepInductorPass", "compilation_config", "pack_model_weights", "step_kinds", "PASS_NAME"]
