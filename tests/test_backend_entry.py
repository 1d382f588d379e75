"""The ``kimi_dep`` backend's entry: the torch_dynamo_backends entry point in a fresh process,
option checking, ``mode`` mapping to Inductor, and a graph with nothing to rewrite."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

import dep_compile
from dep_compile.backend import kimi_dep
from dep_compile.config import DepOptions


class Tiny(torch.nn.Module):
    """Nothing kimi_dep rewrites: Linear -> ReLU -> Linear."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _x():
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def _dynamo_graph(model, x):
    """The FX graph and example inputs Dynamo hands a backend for ``model(x)``."""
    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(x)
    assert len(seen) == 1
    return seen[0]


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

_FRESH = textwrap.dedent("""
    import sys
    import torch
    assert "dep_compile" not in sys.modules
    assert "kimi_dep" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with torch.no_grad():
        out = torch.compile(m, backend="kimi_dep")(x)
        torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)  # FP32, same GEMMs: ~1 ulp
    assert "dep_compile" in sys.modules, "the entry point loads the package lazily"
    from dep_compile import last_report
    assert last_report() is not None and last_report().layers == []
    print("FRESH-OK")
""")


def test_entry_point_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300,
                          cwd="/")  # not the repo root: nothing importable by accident
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FRESH-OK" in proc.stdout


def test_registered_once_under_its_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert "kimi_dep" in torch._dynamo.list_backends()
    assert lookup_backend("kimi_dep") is kimi_dep


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

VALID = ["kinds", "projection_tables", "oproj_table", "front_max", "batches", "max_q", "moe_top_k", "sparse_mla",
         "attn_res_ahead",
         "dump_dir", "validate", "inductor", "inductor_config"]


def test_valid_list_is_every_option():
    assert sorted(VALID) == sorted(f.name for f in dataclasses.fields(DepOptions))
    assert sorted(DepOptions.HELP) == sorted(VALID)


def test_unknown_option_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        DepOptions.from_dict({"front_maxx": 4, "kinds": ("dsa",)})
    msg = str(e.value)
    assert "unknown option(s) ['front_maxx']" in msg, msg
    # each option on a line of its own, with its help (a name inside another option's help text does not count)
    listed = re.findall(r"^  (\w+): ", msg, re.M)
    assert listed == [f.name for f in dataclasses.fields(DepOptions)], msg
    for name in VALID:
        assert f"\n  {name}: {DepOptions.HELP[name]}" in msg, name
    # The same through the backend itself, before anything is compiled.
    gm, inputs = _dynamo_graph(Tiny(), _x())
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        kimi_dep(gm, inputs, options={"bogus": 1})


def test_removed_verify_option_is_unknown():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['verify'\]"):
        DepOptions.from_dict({"verify": True})


def test_unknown_option_through_torch_compile():
    compiled = torch.compile(Tiny(), backend="kimi_dep", options={"bogus": 1})
    with pytest.raises(Exception) as e:
        compiled(_x())
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(c, ValueError) and "bogus" in str(c) for c in chain), repr(e.value)


@pytest.mark.parametrize("name, value", [
    ("kinds", ("mla",)), ("kinds", "dsa"), ("kinds", ("dsa", "kda", "moe", "mla")),
    ("front_max", 0), ("front_max", -3), ("front_max", True), ("front_max", 2.0), ("front_max", "64"),
    ("max_q", "x"), ("max_q", 0), ("moe_top_k", None), ("sparse_mla", "flashmla"),
    ("batches", (1, 0)), ("batches", (1, "2")),
    ("validate", 1), ("validate", "yes"), ("validate", None), ("inductor", "no"),
    ("inductor_config", [("max_autotune", True)]),
    ("dump_dir", 3),
    ("projection_tables", {"no_such_projection": {}}),
])
def test_bad_option_values_name_the_option(name, value):
    assert name in VALID  # a known option: the error below is its value check, not "unknown option"
    with pytest.raises(ValueError, match=rf"^kimi_dep: {name}: expected "):
        DepOptions.from_dict({name: value})


def test_bad_tactic_tables_raise():
    with pytest.raises(ValueError, match="oproj_table"):
        DepOptions.from_dict({"oproj_table": {0: "cublas"}})
    with pytest.raises(ValueError, match="kda_in_proj"):
        DepOptions.from_dict({"projection_tables": {"kda_in_proj": {4: "splitk"}}})


def test_good_options_are_normalized():
    o = DepOptions.from_dict({"kinds": ["kda", "moe"], "batches": (8, 1, 8, 2), "front_max": 16, "max_q": 4})
    assert o.kinds == ("kda", "moe") and o.batches == (1, 2, 8) and o.front_max == 16 and o.max_q == 4
    assert DepOptions.from_dict(None) == DepOptions.from_dict({})
    assert DepOptions.from_dict({}).validate is True and DepOptions.from_dict({"validate": False}).validate is False
    assert o.fingerprint() != DepOptions.from_dict({}).fingerprint()


# ---------------------------------------------------------------------------------------------
# mode -> Inductor config
# ---------------------------------------------------------------------------------------------


def _patched_compile_fx():
    def fake(gm, example_inputs, config_patches=None, **kw):
        return gm.forward

    return mock.patch("torch._inductor.compile_fx.compile_fx", side_effect=fake)


def test_mode_reaches_compile_fx_directly():
    gm, inputs = _dynamo_graph(Tiny(), _x())
    with _patched_compile_fx() as cf:
        kimi_dep(gm, inputs, mode="reduce-overhead")
    patches = cf.call_args.kwargs["config_patches"]
    assert patches.get("triton.cudagraphs") is True, patches
    # mode and inductor_config merge; the explicit config patch wins where both set a key.
    with _patched_compile_fx() as cf:
        kimi_dep(gm, inputs, mode="max-autotune-no-cudagraphs",
                 options={"inductor_config": {"coordinate_descent_tuning": False, "epilogue_fusion": False}})
    patches = cf.call_args.kwargs["config_patches"]
    assert patches["max_autotune"] is True and not patches.get("triton.cudagraphs")
    assert patches["coordinate_descent_tuning"] is False and patches["epilogue_fusion"] is False
    # No mode, no patches.
    with _patched_compile_fx() as cf:
        kimi_dep(gm, inputs)
    assert not cf.call_args.kwargs.get("config_patches")


def test_mode_reaches_compile_fx_through_torch_compile():
    model, x = Tiny(), _x()
    with _patched_compile_fx() as cf:
        out = torch.compile(model, backend="kimi_dep", mode="reduce-overhead")(x)
    assert cf.called, "kimi_dep must hand the graph to compile_fx"
    assert cf.call_args.kwargs["config_patches"].get("triton.cudagraphs") is True
    torch.testing.assert_close(out, model(x))  # the patched compile_fx runs the graph as traced: exact


def test_mode_with_options_is_torchs_error():
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(Tiny(), backend="kimi_dep", mode="reduce-overhead", options={"inductor": False})


# ---------------------------------------------------------------------------------------------
# Nothing to rewrite
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inductor", [True, False])
def test_nothing_to_rewrite_compiles_and_reports_zero_matches(inductor):
    model, x = Tiny(), _x()
    before = len(dep_compile.reports())
    with torch.no_grad():
        out = torch.compile(model, backend="kimi_dep", options={"inductor": inductor}, fullgraph=True)(x)
        exp = model(x)
    # FP32 throughout; Inductor may reorder the GEMM epilogue (bias add): 1e-5 is a few ulps at O(10).
    torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    reports = dep_compile.reports()
    assert len(reports) == before + 1
    report = dep_compile.last_report()
    assert report is reports[-1]
    assert report.layers == [] and report.num_rewritten == 0
    assert report.rewritten() == [] and report.stock() == [] and report.near_misses() == []
    assert "nothing rewritten" in report.summary()
