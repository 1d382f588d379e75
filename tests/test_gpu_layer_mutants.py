"""Tests of the tests: layer parity bounds derived from a higher-precision reference, and mutants that must fail them.

Per layer kind (DSA, KDA, MoE), one step from identical inputs and caches, run three ways:

* ``ref``: the stock layer in FP32 on the CPU: the readable reference ops on FP32 weights,
  activations and caches (the FP8 index keys stay FP8: that is the cache format);
* ``stock``: the stock layer in BF16 on the device (on CUDA the stock ops' CUDA code);
* ``kimi_dep``: the layer compiled by kimi_dep (pattern-only) on the device.

Quantities: the layer output and every cache entry the step wrote (latents; index keys
dequantized; KDA conv and recurrent states). Metrics per quantity: the relative Frobenius error
and the *gain* error ``|<got, ref> / <ref, ref> - 1|``, which sees a systematic scale error while
zero-mean rounding noise averages out over the elements. The bound of each metric is ``K = 2``
times stock's own error against ``ref`` (the rewrite may be at most twice as far from the
higher-precision result as the stock BF16 layer), floored for a gain at ``GAIN_SIGMAS`` standard
errors of its estimate (stock's relative error / sqrt(elements)) and for index keys at one FP8
step. The real kimi_dep layer must pass every bound.

Mutants: kimi_dep with one parameter wrong, set on its prepared layer object (the object the
compiled op looks up at run time) or by scaling one weight tensor in place; each must FAIL some
bound: the DSA softmax scale x 1.01, KDA ``lower_bound`` x 1.01, the KDA gated-norm eps x 10,
MoE top-k - 1, an output weight x 1.01 (DSA, KDA o_proj; MoE routed up-projection); the router
scale x 1.01 in :func:`check_router`. Parameters no output can show at this precision are left to
the honour checks: the MoE router scale at the layer output (the latent RMSNorm after the experts
divides any common scale of the routing weights out), eps x 10 of norms whose inputs' mean square
dwarfs eps (DSA's 1e-6 norms; the MoE latent norm, 0.97x its bound on the CPU).

Test data that lets the parameters matter, as in a trained model: the DSA step's cached latents
at std 2 (the benchmark's 0.5 x ``LATENT_GAIN``), so attention is not near-uniform (otherwise
a 1 % softmax-scale error stays below BF16 noise); KDA ``A_log = 0``, so the decay gate is off
saturation (random ``A_log`` saturates it, where ``lower_bound`` hardly acts). The DSA context
equals top-k, so every position is selected on every side: with a longer context, FP8 index
keys and queries quantized from BF16 instead of FP32 values select a few different tokens at
the top-k boundary, which moves the output by ~10 % (measured at full size with 4K context: stock
9.8e-2 from the FP32 reference, LATENT_GAIN 1) and leaves no bound to derive. The selection
itself is honoured-checked (top-k / 4).

Honour checks: kimi_dep with a parameter changed on its prepared object (or a weight x 1.5)
against stock with the same change on the module (or the same weight): within the bounds, while
the change moves stock by more than them (so the check can fail): norm eps, softmax scale,
top-k, weights as given, the KDA lower bound, the router scale (router alone).

CUDA (``@pytest.mark.cuda``), full width: one K3.1 DSA layer (2 requests, 2048 context, top-2048),
a KDA layer (4 requests), a MoE layer with 32 experts top-16 (the K3 widths; fewer experts so
the FP32 CPU reference stays small). CPU: the same machinery at ``k31-small`` size, where stock
and kimi_dep both call the references (there it shows the bounds catch the mutants).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_attention as ba  # noqa: E402

from dep_compile.ops import registry  # noqa: E402
from dep_compile.ops.dsa import PreparedDsa  # noqa: E402
from dep_compile.ops.kda import PreparedKda  # noqa: E402
from dep_compile.ops.moe import EpMoeLayer  # noqa: E402
from dep_compile.stock import StepMeta, preset  # noqa: E402
from dep_compile.stock.cache import FP8_REL  # noqa: E402
from dep_compile.stock.model import init_weights  # noqa: E402
from helpers import MoeBlock  # noqa: E402

K = 2.0  # bound = K x stock's own error against the FP32 reference
OLD_OUT_TOL = ba.OUT_TOL  # the old parity bound (kimi_dep vs BF16 stock), printed for each mutant
GAIN_SIGMAS = 4.0  # floor of a gain bound, in standard errors of the gain estimate
ROUTER_FLOOR = 1e-6  # FP32 resolution of the routing weights: logits summed in another order
LATENT_GAIN = 4.0  # DSA cached latents at std 2 (the benchmark's 0.5 x 4): attention not near-uniform


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in FP32 on the CPU."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm())


def gain(a: torch.Tensor, b: torch.Tensor) -> float:
    """|<a, b> / <b, b> - 1|: a's systematic scale error against b (zero-mean rounding noise averages out)."""
    a, b = a.detach().double().cpu().flatten(), b.detach().double().cpu().flatten()
    return abs(float(a @ b / (b @ b)) - 1.0)


def errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per quantity (output, written cache entries): :func:`rel` as ``q``, :func:`gain` as ``q gain``."""
    out = {}
    for q in ref:
        out[q], out[f"{q} gain"] = rel(got[q], ref[q]), gain(got[q], ref[q])
    return out


def bounds_from(e_stock: dict[str, float], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """``K x`` stock's error per metric, floored: a gain at ``GAIN_SIGMAS`` standard errors of its
    estimate (stock's relative error over sqrt(elements)), index keys at one FP8 step."""
    bound = {}
    for q, t in ref.items():
        bound[q] = K * max(e_stock[q], FP8_REL if q == "index_cache" else 0.0)
        bound[f"{q} gain"] = K * max(e_stock[f"{q} gain"], GAIN_SIGMAS * e_stock[q] / t.numel() ** 0.5)
    return bound


@dataclasses.dataclass
class Layer:
    """A stock layer, its kimi_dep compilation, one step, and the FP32 reference's quantities."""

    block: nn.Module
    dep: Callable
    key: str  # the registry key of kimi_dep's prepared layer (the same after a recompile)
    run: Callable[[Callable], dict[str, torch.Tensor]]  # one step from fresh caches: {"out": .., <cache>: ..}
    ref: dict[str, torch.Tensor]
    router: tuple | None = None  # MoE: (x, the FP32 reference's router) for check_router

    @property
    def prepared(self) -> object:
        """The prepared object the compiled op looks up now (a recompile registers a new one)."""
        return registry.lookup(self.key)

    def bounds(self) -> tuple[dict[str, float], dict[str, float]]:
        """(stock's errors against the reference, the bounds); asserts kimi_dep passes every bound."""
        with torch.no_grad():
            e_stock = errors(self.run(self.block), self.ref)
            e_dep = errors(self.run(self.dep), self.ref)  # also (re)compiles before the prepared object is read
        zero = [q for q in self.ref if q != "index_cache" and not e_stock[q] > 0]
        assert not zero, f"stock equals the FP32 reference in {zero}: no bound to derive"
        bound = bounds_from(e_stock, self.ref)
        bad = {q: e for q, e in e_dep.items() if not e <= bound[q]}
        assert not bad, f"kimi_dep fails the bound: {bad}; bounds {bound}"
        return e_stock, bound


def _fp32_cpu(t):
    """A BF16 tensor as FP32 on the CPU; FP8 and FP32 tensors (and non-tensors) as they are, on the CPU."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.float().cpu() if t.dtype == torch.bfloat16 else t.cpu()


def _key(cls: type) -> str:
    """The registry key of the layer of ``cls`` the last kimi_dep compile registered (not its probe)."""
    return [k for k, p in registry._PREPARED.items() if isinstance(p, cls) and "@probe#" not in k][-1]


def _compile(block: nn.Module, run_fn) -> Callable:
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False, options={"inductor": False})
    with torch.no_grad():
        run_fn(dep)  # compiles
    return dep


def _quantities(step: ba.Step, out: torch.Tensor, caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output and the cache entries the step wrote (index keys dequantized by their scales)."""
    got = {"out": out}
    for name, t in caches.items():
        if name != "index_scale":
            got[name] = ba._entries(name, t)[ba._written(name, step.meta)].float()
    if "index_cache" in got:
        got["index_cache"] *= ba._entries("index_scale", caches["index_scale"])[ba._written("index_scale", step.meta)
                                                                               ].unsqueeze(-1)
    return got


def attention_layer(kind: str, cfg, device: str, rows: int, q: int, context: int | None, block_size: int) -> Layer:
    """A DSA or KDA layer (bench_attention's builders) and one step; the FP32 reference run on the CPU."""
    block = ba.build_block(cfg, kind, device=device, seed=0)
    step = ba.make_step(cfg, kind, rows, q, context, block_size=block_size, device=device, seed=1)
    if kind == "dsa":
        step.caches["kv_cache"].mul_(LATENT_GAIN)  # exact in BF16
    else:
        block.self_attn.A_log.data.zero_()  # decay gate off saturation (see the module docstring)
    hp = copy.deepcopy(block).float().cpu()
    m = step.meta
    hp_meta = StepMeta(m.q_len, *(t.cpu() for t in (m.slot_mapping, m.block_table, m.seq_lens, m.state_indices,
                                                    m.accepted)))
    hp_step = ba.Step(_fp32_cpu(step.x), hp_meta, {n: _fp32_cpu(t) for n, t in step.caches.items()})
    with torch.no_grad():
        ref = _quantities(hp_step, *ba.run_once(hp, hp_step))
    run = lambda fn: _quantities(step, *ba.run_once(fn, step))  # noqa: E731
    dep = _compile(block, run)
    assert ba.rewritten_op(kind) == f"kimi_dep.{kind}_attention"
    return Layer(block, dep, _key(PreparedDsa if kind == "dsa" else PreparedKda), run, ref)


def moe_layer(cfg, device: str, rows: int) -> Layer:
    """A MoE layer and one batch of ``rows`` tokens; the FP32 reference run on the CPU."""
    block = init_weights(MoeBlock(cfg), seed=0).to(device).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, cfg.hidden_size, generator=g).to(torch.bfloat16).to(device)
    hp = copy.deepcopy(block).float().cpu()
    with torch.no_grad():
        ref = {"out": hp(_fp32_cpu(x))}
    run = lambda fn: {"out": fn(x)}  # noqa: E731
    dep = _compile(block, run)
    assert ba.rewritten_op("moe").startswith("kimi_dep.moe")
    return Layer(block, dep, _key(EpMoeLayer), run, ref, router=(x, hp.mlp.gate))


@contextlib.contextmanager
def changed(obj, name: str, value):
    """``obj.<name>`` (a dotted path) set to ``value`` inside the block."""
    *path, leaf = name.split(".")
    for p in path:
        obj = getattr(obj, p)
    old = getattr(obj, leaf)
    setattr(obj, leaf, value(old) if callable(value) else value)
    try:
        yield
    finally:
        setattr(obj, leaf, old)


@contextlib.contextmanager
def scaled_weight(block: nn.Module, name: str, factor: float):
    """The parameter ``name`` of ``block`` multiplied by ``factor`` in place inside the block (restored bit-exact)."""
    w = block.get_parameter(name)
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            w.copy_(saved)


# (kind, name, context manager factory on (layer)) — each must fail the bound
MUTANTS = {
    "dsa": [("softmax scale x1.01", lambda L: changed(L.prepared, "scale", lambda s: s * 1.01)),
            ("o_proj weight x1.01", lambda L: scaled_weight(L.block, "self_attn.o_proj.weight", 1.01))],
    "kda": [("lower_bound x1.01", lambda L: changed(L.prepared, "lower_bound", lambda v: v * 1.01)),
            ("gated norm eps x10", lambda L: changed(L.prepared, "norm_eps", lambda v: v * 10)),
            ("o_proj weight x1.01", lambda L: scaled_weight(L.block, "self_attn.o_proj.weight", 1.01))],
    "moe": [("top-k - 1", lambda L: changed(L.prepared, "top_k", lambda k: k - 1)),
            ("up_proj weight x1.01", lambda L: scaled_weight(L.block, "mlp.routed_expert_up_proj.weight", 1.01))],
}

# (kind, name, change on kimi_dep's prepared object, the same change on the stock module); a weight
# change is one shared tensor, so both sides see it
HONOURED = {
    "dsa": [("q_a norm eps 1.0", ("q_a_eps", 1.0), ("self_attn.q_a_layernorm.eps", 1.0)),
            ("kv_a norm eps 1.0", ("kv_a_eps", 1.0), ("self_attn.kv_a_layernorm.eps", 1.0)),
            ("index key norm eps 10", ("k_norm_eps", 10.0), ("self_attn.indexer.k_norm.eps", 10.0)),
            ("softmax scale x1.5", ("scale", lambda s: s * 1.5), ("self_attn.scale", lambda s: s * 1.5)),
            ("top-k / 4", ("topk", lambda k: k // 4), ("self_attn.indexer.topk", lambda k: k // 4)),
            ("q_b weight x1.5", None, "self_attn.q_b_proj.weight")],
    "kda": [("lower_bound x0.5", ("lower_bound", lambda v: v * 0.5), ("self_attn.lower_bound", lambda v: v * 0.5)),
            ("gated norm eps 1.0", ("norm_eps", 1.0), ("self_attn.o_norm.eps", 1.0)),
            ("f_b weight x1.5", None, "self_attn.f_b_proj.weight")],
    "moe": [("top-k / 2", ("top_k", lambda k: k // 2), ("mlp.gate.top_k", lambda k: k // 2)),
            ("latent norm eps 1.0", ("norm_eps", 1.0), ("mlp.routed_expert_norm.eps", 1.0)),
            ("up_proj weight x1.5", None, "mlp.routed_expert_up_proj.weight")],
}


def check_mutants(kind: str, L: Layer, bound: dict[str, float]) -> list[str]:
    """Each mutant of ``kind`` run through kimi_dep: the ones that pass the bound on every quantity."""
    passed = []
    with torch.no_grad():
        stock_out = L.run(L.block)["out"]
    for name, mutate in MUTANTS[kind]:
        with mutate(L), torch.no_grad():
            got = L.run(L.dep)
        errs = errors(got, L.ref)
        ratio = max(errs[q] / bound[q] for q in bound)
        old = "passes" if rel(got["out"], stock_out) <= OLD_OUT_TOL else "fails"
        print(f"{kind} mutant {name}: max error / bound {ratio:.2f} (the old {OLD_OUT_TOL:g} output bound {old})",
              {q: f"{e:.2e}" for q, e in errs.items()})
        if ratio <= 1:
            passed.append(f"{name} ({errs})")
    return passed


def check_honoured(kind: str, L: Layer, bound: dict[str, float]) -> list[str]:
    """kimi_dep with each changed parameter against stock with the same change: the changes it ignores,
    or whose effect on stock is too small for the comparison to fail."""
    with torch.no_grad():
        base = L.run(L.block)
    bad = []
    for name, dep_change, stock_change in HONOURED[kind]:
        if dep_change is None:  # a weight, shared by both sides
            dep_ctx = stock_ctx = lambda w=stock_change: scaled_weight(L.block, w, 1.5)  # noqa: E731
        else:
            dep_ctx = lambda c=dep_change: changed(L.prepared, *c)  # noqa: E731
            stock_ctx = lambda c=stock_change: changed(L.block, *c)  # noqa: E731
        with torch.no_grad():
            with stock_ctx():
                stock = L.run(L.block)
            with dep_ctx():
                dep = L.run(L.dep)
        moved = max(e / bound[q] for q, e in errors(stock, base).items())
        diff = max(e / bound[q] for q, e in errors(dep, stock).items())
        print(f"{kind} honoured {name}: moves stock {moved:.1f} x bound, kimi_dep vs stock {diff:.2f} x bound")
        if not moved > 1:
            bad.append(f"{name}: moves stock by only {moved:.2f} x bound (the check cannot fail)")
        if not diff <= 1:
            bad.append(f"{name}: kimi_dep differs from stock by {diff:.2f} x bound (parameter not honoured)")
    return bad


def check_router(L: Layer) -> list[str]:
    """The router alone, as dense [T, E] routing weights: kimi_dep's ``route`` against stock's Router
    (bound: ``K x`` stock's error against the FP32 reference, at least ``K x ROUTER_FLOOR``); the
    scale x 1.01 mutant must fail it and a scale x 1.5 on both sides must agree. (At the layer
    output the scale is invisible: the latent RMSNorm after the experts divides it out.)"""
    x, hp_gate = L.router
    gate = L.block.mlp.gate
    E = gate.weight.shape[0]

    def dense(routing) -> torch.Tensor:
        w, ids = routing
        return torch.zeros(w.shape[0], E).scatter_(1, ids.long().cpu(), w.float().cpu())

    route = lambda: dense(L.prepared.route(x, gate.weight, gate.e_score_correction_bias))  # noqa: E731
    with torch.no_grad():
        ref = dense(hp_gate(_fp32_cpu(x)))
        bound = K * max(rel(dense(gate(x)), ref), ROUTER_FLOOR)
        errs = {"kimi_dep": rel(route(), ref)}
        with changed(L.prepared, "scale", lambda s: s * 1.01):
            errs["scale x1.01"] = rel(route(), ref)
        with changed(L.prepared, "scale", lambda s: s * 1.5), changed(gate, "scale", lambda s: s * 1.5):
            errs["scale x1.5 vs stock"] = rel(route(), dense(gate(x)))
    print("moe router", {k: f"{v:.2e}" for k, v in errs.items()}, f"bound {bound:.2e}")
    bad = [f"router {k}: {v:.2e} > {bound:.2e}" for k, v in errs.items() if k != "scale x1.01" and not v <= bound]
    return bad + ([] if errs["scale x1.01"] > bound else [f"router scale x1.01 passes: {errs}"])


def check_layer(L: Layer, kind: str) -> None:
    """kimi_dep passes the bound, every mutant fails it, every changed parameter is honoured."""
    e_stock, bound = L.bounds()
    print(kind, "stock error", {q: f"{e:.2e}" for q, e in e_stock.items()})
    passed = check_mutants(kind, L, bound)
    ignored = check_honoured(kind, L, bound) + (check_router(L) if kind == "moe" else [])
    assert not passed and not ignored, f"{kind}: mutants passing the bound {passed}; not honoured {ignored}"


def _layer(kind: str, device: str) -> Layer:
    """The layer of ``kind`` at the test's size on ``device`` (DSA: context = top-k, see the module docstring)."""
    cfg = preset("k31-small") if device == "cpu" else preset("k31")
    if kind == "moe":
        full = device != "cpu"
        return moe_layer(cfg.replace(n_routed_experts=32) if full else cfg, device, rows=16 if full else 8)
    rows = 3 if device == "cpu" else (2 if kind == "dsa" else 4)
    block_size = 4 if device == "cpu" else 64
    return attention_layer(kind, cfg, device, rows=rows, q=1, context=cfg.index_topk if kind == "dsa" else None,
                           block_size=block_size)


@pytest.mark.parametrize("kind", ["dsa", "kda", "moe"])
def test_layer_mutants_cpu(kind):
    check_layer(_layer(kind, "cpu"), kind)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["dsa", "kda", "moe"])
def test_layer_mutants_cuda(kind):
    check_layer(_layer(kind, "cuda"), kind)
