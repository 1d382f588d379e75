"""Translation validation and pass errors: a rewrite whose replacement computes something else, or a
pass that raises, leaves the layer stock with the reason, never a wrong answer or a failed compile."""

from __future__ import annotations

import pytest

import dep_compile.passes.dsa as dsa_pass
import dep_compile.passes.kda as kda_pass
import dep_compile.passes.moe as moe_pass
from dep_compile.ops.dsa import PreparedDsa
from dep_compile.ops.kda import PreparedKda
from dep_compile.stock import preset

from helpers import run_pair

CFG = preset("k31-small", num_layers=4)


def _off_by(cls, field, factor):
    """A stand-in for ``cls`` that builds the prepared layer with ``field`` scaled: a matching bug the
    structural checks do not see (the graph says one thing, the op is told another)."""
    return lambda **kw: cls(**{**kw, field: kw[field] * factor})


def _wrong_moe_top_k(monkeypatch):
    """(A wrong routed_scaling_factor would not do: the latent RMSNorm after the experts divides it out.)"""
    real = moe_pass.dep_moe_supported

    def wrong(ctx, R):
        m = real(ctx, R)
        m.top_k //= 2
        return m

    monkeypatch.setattr(moe_pass, "dep_moe_supported", wrong)


BUGS = {
    "kda": lambda mp: mp.setattr(kda_pass, "PreparedKda", _off_by(PreparedKda, "lower_bound", 1.05)),
    "dsa": lambda mp: mp.setattr(dsa_pass, "PreparedDsa", _off_by(PreparedDsa, "scale", 1.03)),
    "moe": _wrong_moe_top_k,
}


@pytest.mark.parametrize("kind", sorted(BUGS))
def test_validation_catches_a_replacement_that_computes_something_else(kind, monkeypatch):
    BUGS[kind](monkeypatch)
    checked = run_pair(CFG, steps=3, batch=2)
    bad = checked.report.stock(kind)
    assert bad and all(m.check == "semantic" and m.reason.startswith("semantic check failed") for m in bad), \
        checked.report.table()
    assert checked.logits_err == 0.0 and checked.cache_err == 0.0
    others = [m for m in checked.report.layers if m.kind not in (kind, "mla")]
    assert all(m.rewritten and m.validation.startswith("probe") for m in others), checked.report.table()
    # the same bug without the check: rewritten, and wrong (so the check above is what saved it)
    unchecked = run_pair(CFG, steps=3, batch=2, options={"validate": False})
    assert len(unchecked.report.rewritten(kind)) == len(bad)
    assert all(m.validation.startswith("off") for m in unchecked.report.rewritten())
    assert unchecked.logits_err > 1e-2 or unchecked.cache_err > 1e-2


def test_a_pass_that_raises_leaves_its_layers_stock(monkeypatch):
    def boom(self, ctx, found):
        raise RuntimeError("boom")

    monkeypatch.setattr(kda_pass.KdaPass, "rewrite", boom)
    r = run_pair(CFG, steps=2, batch=2)
    kda = r.report.stock("kda")
    assert len(kda) == 3 and all(m.check == "internal error" and "RuntimeError: boom" in m.reason for m in kda)
    assert len(r.report.rewritten("dsa")) == 1 and len(r.report.rewritten("moe")) == 3
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_rewritten_layers_report_their_probe():
    r = run_pair(CFG, steps=1, batch=3)
    for m in r.report.rewritten():
        assert m.validation.startswith("probe 3 tokens: worst") and "max 0.00e+00" in m.validation, m.validation


def test_structure_alone_refuses_a_bit_reinterpreting_view():
    """``view(float16)`` keeps the shape but not the values: the structural check refuses it by itself."""
    from near_miss_variants import CATALOGUE  # noqa: PLC0415
    from dep_compile.stock import build_model  # noqa: PLC0415

    v = next(v for v in CATALOGUE if v.name == "dsa_index_query_bit_view")
    model = build_model(CFG, seed=1)
    v.apply(model, CFG)
    r = run_pair(CFG, steps=2, batch=2, start_len=24, model=model, options={"validate": False})
    (dsa,) = r.report.stock("dsa")
    assert dsa.check == "structure", dsa.reason
    assert r.logits_err == 0.0 and r.cache_err == 0.0
