"""The passes' structure: one commit path, a validator that knows no family, one rule for "writes in
place", no private names across modules, no import circle."""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import torch
import torch.fx as fx

from dep_compile.passes import base, calls
from dep_compile.stock import preset

from helpers import run_pair

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Every module of the project by its import name (``passes/`` is installed as ``dep_compile.passes``)."""
    out = {}
    for p in [*(ROOT / "dep_compile").rglob("*.py"), *(ROOT / "passes").glob("*.py")]:
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":
            parts = ["dep_compile", "passes", *parts[1:]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, str, str | None]]:
    """Each import in module ``name`` (at load or inside a function) of a project module:
    (that module, the name imported from it or None for the module itself, the local alias)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            mod = ".".join([*(parts[: len(parts) - node.level + 1] if node.level else []),
                            *([node.module] if node.module else [])])
            for a in node.names:
                full = f"{mod}.{a.name}"
                found.append((full, None, a.asname or a.name) if full in modules else (mod, a.name, a.asname or a.name))
    out = []
    for target, imported, alias in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((target, imported, alias))
    return out


def test_no_import_circle():
    """No module imports (at load or lazily) a module that imports it back, directly or through others."""
    modules = _modules()
    edges = {m: {t for t, _, _ in _imports(m, p, modules)} for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_private_names_across_modules():
    """No module reads another project module's private names (``validate._x``, ``from .x import _y``)."""
    modules = _modules()
    bad = []
    for name, path in modules.items():
        module_aliases = set()
        for target, imported, alias in _imports(name, path, modules):
            if imported is None:
                module_aliases.add(alias)
            elif imported.startswith("_"):
                bad.append(f"{name}: from {target} import {imported}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert not bad, bad


def test_the_validator_knows_no_family():
    """Adding a family or a format touches that family's pass and op, not the validator."""
    source = (ROOT / "passes" / "validate.py").read_text()
    words = r"\b(dsa|kda|moe|mla|attn_?res|kv_cache|kv_scale|index_(cache|scale|keys)|conv_state|recurrent_state|" \
            r"state_indices|accepted|block_table|slot_mapping|seq_lens|q_len|topk|prefix|bank)\b"
    assert not re.findall(words, source, flags=re.IGNORECASE)


def test_every_rewrite_goes_through_commit(monkeypatch):
    """Each rewritten layer and each fused AttnRes point is one ``PassContext.commit``, and the graph is
    edited only inside it."""
    commits, edits, inside = [], [], []
    real_commit, real_replace = base.PassContext.commit, base.PassContext.replace

    def commit(self, found, **kw):
        commits.append(found.module)
        inside.append(True)
        try:
            return real_commit(self, found, **kw)
        finally:
            inside.pop()

    def replace(self, *a, **kw):
        edits.append(bool(inside))
        return real_replace(self, *a, **kw)

    monkeypatch.setattr(base.PassContext, "commit", commit)
    monkeypatch.setattr(base.PassContext, "replace", replace)
    r = run_pair(preset("k31-small", num_layers=4), steps=1, batch=2)
    report = r.report
    kept = [m.module for m in report.rewritten()] + [m.module for m in report.points if m.rewritten]
    assert report.num_rewritten == 7 and len(kept) == 7 + 8, report.table()
    assert sorted(commits) == sorted(kept) and edits == [True] * len(kept)
    assert r.logits_err == 0.0 and r.cache_err == 0.0


# ---- one rule for "writes in place" ------------------------------------------------------------------

def _graph(build) -> list[fx.Node]:
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    build(g, x, y)
    return [n for n in g.nodes if n.op != "placeholder"]


def test_written_names_what_each_call_writes():
    cases = {
        "x.add_(y)": (lambda g, x, y: g.call_method("add_", (x, y)), ["x"]),
        "x.add(y)": (lambda g, x, y: g.call_method("add", (x, y)), []),
        "x.__setitem__(0, y)": (lambda g, x, y: g.call_method("__setitem__", (x, 0, y)), ["x"]),
        "x.__getitem__(0)": (lambda g, x, y: g.call_method("__getitem__", (x, 0)), []),
        "x[0] = y": (lambda g, x, y: g.call_function(operator.setitem, (x, 0, y)), ["x"]),
        "x += y": (lambda g, x, y: g.call_function(operator.iadd, (x, y)), ["x"]),
        "x + y": (lambda g, x, y: g.call_function(operator.add, (x, y)), []),
        "torch.relu_(x)": (lambda g, x, y: g.call_function(torch.relu_, (x,)), ["x"]),
        "F.relu(x, inplace=True)": (lambda g, x, y: g.call_function(torch.nn.functional.relu, (x,),
                                                                     {"inplace": True}), ["x"]),
        "torch.add(x, x, out=y)": (lambda g, x, y: g.call_function(torch.add, (x, x), {"out": y}), ["y"]),
        "aten.add_.Tensor(x, y)": (lambda g, x, y: g.call_function(torch.ops.aten.add_.Tensor, (x, y)), ["x"]),
        "aten.add.Tensor(x, y)": (lambda g, x, y: g.call_function(torch.ops.aten.add.Tensor, (x, y)), []),
        "kimi_k3.attn_res (packet)": (lambda g, x, y: g.call_function(
            torch.ops.kimi_k3.attn_res, (x, y, x, x, 1e-6, 1, -1)), ["x", "y"]),
        "auto_functionalized_v2": (lambda g, x, y: g.call_function(
            calls.AF_V2, (torch.ops.kimi_k3.attn_res.default,), {"_all_bases": [x, y]}), ["x", "y"]),
    }
    for what, (build, want) in cases.items():
        node = _graph(build)[-1]
        assert [w.name for w in calls.written(node)] == want, what
        assert calls.writes(node) == bool(want), what


def test_one_rule_serves_the_backend_the_validator_and_erasure():
    """The backend's mutated inputs, the base's erasure and the validator all read ``calls.written``."""
    from dep_compile import backend
    from dep_compile.passes import validate

    for module in (backend, base, validate):
        source = Path(module.__file__).read_text()
        assert "alias_info" not in source and 'endswith("_")' not in source, module.__name__

    def step(x, state, other):  # Dynamo records an in-place method and an item assignment
        state.mul_(2)
        other[0] = x
        return x + state.sum()

    graphs = []
    torch.compile(step, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(
        torch.randn(3), torch.randn(2, 3), torch.randn(2, 3))
    assert sorted(n.name for n in backend.mutated_inputs(graphs[0])) == ["l_other_", "l_state_"]
