"""The linear walker's transposed-weight spellings, in every form a supported torch traces them to.

torch 2.13's Dynamo records ``w.T`` as ``getattr(w, "T")``; torch 2.14's as the aten op ``numpy_T`` (``w.mT``:
``aten.mT``). A spelling the walker does not know leaves the layer stock, so each form is pinned here, on any torch.
"""

import operator

import pytest
import torch
from torch.fx import Graph

from dep_compile.passes.walkers import linear_of

W = torch.randn(4, 8)
X = torch.randn(3, 8)

TRANSPOSES = {
    "getattr_T": lambda g, w: g.call_function(getattr, (w, "T")),
    "getattr_mT": lambda g, w: g.call_function(getattr, (w, "mT")),
    "aten_numpy_T": lambda g, w: g.call_function(torch.ops.aten.numpy_T, (w,)),
    "aten_mT": lambda g, w: g.call_function(torch.ops.aten.mT, (w,)),
    "t": lambda g, w: g.call_method("t", (w,)),
    "transpose": lambda g, w: g.call_method("transpose", (w, 0, 1)),
    "permute": lambda g, w: g.call_method("permute", (w, 1, 0)),
}
NOT_TRANSPOSES = {
    "permute_identity": lambda g, w: g.call_method("permute", (w, 0, 1)),
    "transpose_same_dim": lambda g, w: g.call_method("transpose", (w, 1, 1)),
    "getattr_H_unclaimed": lambda g, w: g.call_function(getattr, (w, "H")),  # not a spelling the walker accepts
}


def _matmul(spell):
    """``x @ spell(w)`` as an FX graph with Dynamo's fake values; (the matmul node, the weight node)."""
    g = Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["example_value"], w.meta["example_value"] = X, W
    wt = spell(g, w)
    wt.meta["example_value"] = W.t()
    mm = g.call_function(operator.matmul, (x, wt))
    mm.meta["example_value"] = X @ W.t()
    return mm, w


@pytest.mark.parametrize("name", sorted(TRANSPOSES))
def test_each_transposed_weight_spelling_is_a_linear(name):
    mm, w = _matmul(TRANSPOSES[name])
    claims = set()
    lin = linear_of(mm, claims)
    assert lin is not None and lin.w is w and lin.bias is None
    assert mm in claims and mm.args[1] in claims  # the call and the weight's transpose both claimed


@pytest.mark.parametrize("name", sorted(NOT_TRANSPOSES))
def test_a_weight_not_transposed_is_no_linear(name):
    mm, _ = _matmul(NOT_TRANSPOSES[name])
    assert linear_of(mm) is None


@pytest.mark.parametrize("spelling", ["T", "mT", "t()"])
def test_the_installed_torch_traces_matmul_by_transposed_weight_to_a_linear(spelling):
    """Whatever form this torch's Dynamo gives ``x @ w.T``, the walker reads it as the linear it is."""
    lin_module = torch.nn.Linear(8, 4, bias=False)
    fn = {"T": lambda x: x @ lin_module.weight.T, "mT": lambda x: x @ lin_module.weight.mT,
          "t()": lambda x: x @ lin_module.weight.t()}[spelling]
    found = []

    def backend(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
        found.append(linear_of(out))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(X)
    assert len(found) == 1 and found[0] is not None
    assert found[0].w.op == "placeholder"  # the weight itself, not its transpose
