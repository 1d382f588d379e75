"""kimi_dep under symbolic shapes: the recompile that automatic dynamic shapes makes when the batch changes,
and ``torch.compile(dynamic=True)``, which also turns Python floats (eps, scales) into graph inputs.

Every case runs several steps through the compiled decoder and through stock eager from identical
caches and compares logits and every cache (on CPU the rewritten ops compute exactly what stock does).
"""

from __future__ import annotations

import logging

import pytest
import torch

import dep_compile
from dep_compile.stock import build_model, preset

from helpers import compare_steps

OPTIONS = {"inductor": False}  # the rewritten graph itself: bit-exact against stock eager on CPU


@pytest.fixture(scope="module")
def model():
    return build_model(preset("k31-small"), seed=0)


def run_steps(model, fn, batch: int, steps: int = 3, q: int = 1) -> tuple[float, float]:
    """``steps`` steps of ``batch`` requests through ``fn`` and through stock eager from the same caches:
    (largest logits difference, largest cache difference)."""
    r = compare_steps(model.config, model, fn, steps=steps, batch=batch, q=q)
    return r.logits_err, r.cache_err


def rewritten_everything(report) -> bool:
    kinds = {m.kind for m in report.layers if m.rewritten}
    return (all(m.rewritten for m in report.layers if m.kind != "mla") and kinds == {"dsa", "kda", "moe"}
            and len(report.points) == 16 and all(p.rewritten for p in report.points))


def test_batch_change_recompiles_with_every_rewrite(model):
    """A new batch size makes Dynamo recompile with a symbolic batch: the second graph is rewritten as the
    first (AttnRes points included), and it serves a third batch size without another compile."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend="kimi_dep", fullgraph=True, options=OPTIONS)
    assert run_steps(model, fn, 4) == (0.0, 0.0)
    first = dep_compile.last_report()
    assert rewritten_everything(first), first.table()
    assert run_steps(model, fn, 8) == (0.0, 0.0)
    second = dep_compile.last_report()
    assert second.graph != first.graph, "the batch change did not recompile"
    assert rewritten_everything(second), second.table()
    assert run_steps(model, fn, 2, q=2) == (0.0, 0.0)  # the dynamic graph, q=2 (verify steps) on top


def test_dynamic_true_leaves_float_inputs_stock_with_one_warning(model, caplog):
    """``dynamic=True``: eps and scales are graph inputs, so no rewrite may bake them in; the layers stay
    stock, each row says which value is not a constant, and one warning says why and what to do."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend="kimi_dep", fullgraph=True, dynamic=True, options=OPTIONS)
    with caplog.at_level(logging.WARNING, logger="dep_compile"):
        assert run_steps(model, fn, 4) == (0.0, 0.0)
    report = dep_compile.last_report()
    stock = [m for m in report.layers + report.points if m.kind != "mla"]
    assert stock and not any(m.rewritten for m in stock), report.table()
    assert all("not a constant" in m.reason for m in stock), [m.reason for m in stock]
    assert all(m.check != "internal error" for m in stock)
    why = [r.getMessage() for r in caplog.records if "Python floats as graph inputs" in r.getMessage()]
    assert len(why) == 1 and "specialize_float" in why[0], why


def test_dynamic_true_with_specialized_floats_rewrites_everything(model):
    """``dynamic=True`` with ``specialize_float``: every dim symbolic (cache pages included), every layer
    rewritten, exact against eager."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        fn = torch.compile(model, backend="kimi_dep", fullgraph=True, dynamic=True, options=OPTIONS)
        assert run_steps(model, fn, 4) == (0.0, 0.0)
        report = dep_compile.last_report()
        assert rewritten_everything(report), report.table()
        assert run_steps(model, fn, 3) == (0.0, 0.0)
