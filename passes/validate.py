"""Translation validation: run a matched stock region and its replacement on the same random probe.

A rewrite is kept only when the structure proves it (the walkers) *and* a probe observes it: the
region's own nodes are evaluated eagerly (the stock ops, as traced) on random inputs, the
replacement op is called on copies of the same, and their outputs and every cache they write are
compared. A difference beyond rounding leaves the layer stock with "semantic check failed" and the
numbers.

The validator knows no family: each pass hands :class:`Probe` a builder of its random inputs (the
layer input, its caches by role, its step metadata; :class:`ProbeInputs`) and, where a cache's
stored codes are not comparable as values, a view to compare instead (FP8 codes and their scales:
:class:`Quantized`). Caches are compared on the elements the step wrote (those either run changed),
so the untouched rest of a cache neither sets the bound's scale nor dilutes the RMS. Values the region reads from
outside it are weights: the real parameters (Dynamo graphs) or random tensors of their shapes
(post-grad graphs hold no real tensors): the rewrite must hold for every weight. On CPU the
replacement runs with cuBLAS tactics, where a correct rewrite computes what stock does to the bit,
so the bound there is one BF16 rounding; on CUDA its kernels run as configured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx

from dep_compile.ops.packing import unpacked_ok
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.registry import register
from dep_compile.ops.shapes import size_hint

from .calls import AF_V1, NoMatch, functionalized_op, mutated_names, schema_of, val, writes

Node = fx.Node
# Bounds on |replacement - stock| / max|stock| per tensor (and, on CUDA, the RMS ratio too).
CPU_MAX_REL = 2.0 ** -7  # one BF16 rounding at the tensor's largest value: cuBLAS tactics, same references
CUDA_MAX_REL = 2.0 ** -5  # kernels vs the stock CUDA ops: BF16 roundings in another order (seen: <= 6.7e-3)
CUDA_RMS_REL = 2.0 ** -7
# A layer that quantizes activations to FP8 e4m3 (FP8 block-scaled projections) turns a one-ulp BF16 difference
# in a projection's input into a code step (2^-3 of the value) for the ~1 in 32 values that lie within a BF16 ulp
# of an e4m3 rounding boundary: ~1.3 % RMS where BF16 rounding noise is ~0.3 %. Measured on the H200 between
# kimi_dep's FP8 split-K and stock's cuBLAS FP8 GEMMs: RMS 1.0 % and 1.5 % on K3.1's layers. Its RMS bound is 4x.
CUDA_RMS_REL_FP8 = 2.0 ** -5
# A cache stored as FP8 codes (:class:`Quantized`) is compared in code steps: two roundings of one value may
# straddle an e4m3 rounding boundary and land one step (2^-3 of the value) apart. A BF16 ulp is 2^-4 of an e4m3
# step, so where the kernels' input to the quantizer differs by an ulp in a fraction p of values, about p / 16
# of the codes move (measured with the power-of-two quantizer: 2.0 % at p = 0.3, 6.3 % at p = 1; 1 % RMS noise
# moves 9.6 %, within the FP8 layers' 2^-5 RMS value bound). A quantizer rounding the wrong way moves half.
CODE_MAX_STEPS = 1.0
CODE_MAX_MOVED = 2.0 ** -3  # of the written codes
# Where a cache's whole row comes out of a normalization (a LayerNorm before a key quantizer), a one-ulp difference in
# the normalization's input moves each output by about 2^-8 of the row's largest value, however small the output:
# near zero the e4m3 grid is far finer than that (seen on the H200, 64 requests x q = 2: 3 steps, 0.1 % of the
# codes). Such a cache (``Quantized.row_floor``) counts no code step below this fraction of the row's largest
# written value. Not for rows with other parts under the same scale (an unnormalized part would raise the floor
# over the normalized one).
CODE_ROW_ULP = 2.0 ** -8
PROBE_SIZE = 4  # a symbolic token count's free symbols, in a probe (or their hints, if smaller)


def token_symbols(x: Node) -> frozenset:
    """The free symbols of the layer input's token count (x [T, ...]; T = n*q in a vLLM step): the sizes a
    probe may shrink. Other symbolic sizes (``dynamic=True`` makes every dim one) keep their hints."""
    t = val(x).shape[0] if isinstance(val(x), torch.Tensor) else None
    return frozenset(t.node.expr.free_symbols) if isinstance(t, torch.SymInt) else frozenset()


class ProbeRandom:
    """The probe's seeded source of random tensors, on the device the layer runs on, and its sizes: the token
    count's symbols (``small``) at min(hint, PROBE_SIZE), so a layer traced with a dynamic batch is probed at a
    few tokens whatever its example (vLLM traces at its token budget); every other size at its hint."""

    def __init__(self, device: torch.device, seed: int, small: frozenset = frozenset()):
        self.g = torch.Generator().manual_seed(seed)
        self.device = device
        self.small = small

    def size(self, d: int | torch.SymInt) -> int:
        """A size as the probe takes it (an int as is; a SymInt with the ``small`` symbols shrunk)."""
        if not isinstance(d, torch.SymInt):
            return int(d)
        node, env = d.node, d.node.shape_env
        hints = {} if env is None else getattr(env, "backed_var_to_val", None) or env.var_to_val  # torch 2.13+ / 2.11
        free = node.expr.free_symbols
        if not (free & self.small) or not all(s in hints for s in free):
            return size_hint(d)
        return int(node.expr.xreplace({s: min(int(hints[s]), PROBE_SIZE) if s in self.small else hints[s]
                                       for s in free}))

    def randn(self, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(tuple(self.size(s) for s in shape), generator=self.g)
        return (t * scale if scale != 1.0 else t).to(dtype).to(self.device)

    def weight_like(self, v: torch.Tensor) -> torch.Tensor:
        """A random weight of ``v``'s shape and dtype, at a scale that keeps activations O(1)."""
        shape = tuple(self.size(s) for s in v.shape)
        if v.dtype in (torch.int32, torch.int64):
            return torch.zeros(shape, dtype=v.dtype, device=self.device)
        t = torch.randn(shape, generator=self.g) * (shape[-1] ** -0.5 if len(shape) >= 2 else 0.1)
        if len(shape) == 1:
            t = t + 1.0
        return t.to(v.dtype).to(self.device)


@dataclasses.dataclass
class ProbeInputs:
    """A family's random probe: a value for each graph node the probe stands in for (the layer input,
    the caches, the step metadata), the caches among them by role, and the tokens in the step."""

    values: dict  # node -> tensor (or int)
    caches: dict  # role (an enum member; its value names the tensor in the verdict) -> node
    tokens: int


@dataclasses.dataclass
class Quantized:
    """A cache stored as FP8 e4m3 codes with a power-of-two scale a row, compared as values in code steps (two
    roundings of one row may differ by one doubling of its scale, not more)."""

    codes: torch.Tensor  # [..., D] float8_e4m3fn
    scales: torch.Tensor  # [...] FP32, one a row of D codes
    row_floor: float = 0.0  # no code step counts below this fraction of its row's largest value (CODE_ROW_ULP)

    def values(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float().unsqueeze(-1)

    def steps(self) -> torch.Tensor:
        """One code step at each stored value: the e4m3 spacing at its code (2^-9 below the normals), scaled."""
        binade = torch.floor(torch.log2(self.codes.float().abs().clamp_min(2.0 ** -6)))
        return torch.exp2(binade - 3) * self.scales.float().abs().unsqueeze(-1)


class Error(NamedTuple):
    """A compared tensor's difference: relative (max and RMS, ``unit == "rel"``) or in code steps (the largest,
    and the fraction of written codes that moved; ``unit == "steps"``)."""

    max: float
    spread: float
    unit: str = "rel"


def compare_as_stored(caches: dict) -> dict:
    """Caches to compare, by name: each as it is stored."""
    return {role.value: t for role, t in caches.items()}


@dataclasses.dataclass
class Probe:
    """What a pass hands the check: the region, its input and output, the replacement call, and the
    family's probe builder (and, where stored codes are not values, what of its caches to compare)."""

    region: set
    x: Node
    output: Node
    target: Any
    args: tuple
    key_index: int | None  # position of the ``layer`` string in ``args`` (None: the op takes none)
    prepared: Any
    module: str
    inputs: Callable[[ProbeRandom], ProbeInputs]
    compared: Callable[[dict], dict] = compare_as_stored  # caches by role -> tensors to compare, by name
    fp8_activations: bool = False  # the layer quantizes activations to FP8 between GEMMs (CUDA_RMS_REL_FP8)


@dataclasses.dataclass
class Verdict:
    """The probe's numbers: per compared tensor, max |diff| / max |stock| (and RMS ratio)."""

    errors: dict  # name -> Error
    seconds: float
    tokens: int
    module: str = ""  # the layer the probe ran on

    def summary(self, module: str = "") -> str:
        rel = {k: e for k, e in self.errors.items() if e.unit == "rel"}
        worst = max(rel.items(), key=lambda kv: kv[1].max) if rel else ("-", Error(0.0, 0.0))
        codes = "".join(f"; {k} {e.max:.2g} step at {e.spread:.1%} of written codes"
                        for k, e in self.errors.items() if e.unit == "steps" and e.max > 0)
        shared = f"; same structure as {self.module}, observed there" if module and module != self.module else ""
        return (f"probe {self.tokens} tokens: worst {worst[0]} max {worst[1].max:.2e} rms {worst[1].spread:.2e} "
                f"({len(self.errors)} tensors){codes}{shared}")


def _cublas(prepared: Any) -> Any:
    """A copy of a prepared layer with every projection on cuBLAS (torch.mm; FP8 weights: stock's op)."""
    changes = {f.name: dataclasses.replace(getattr(prepared, f.name), table={}) for f in dataclasses.fields(prepared)
               if isinstance(getattr(prepared, f.name), DepProjection)}
    return dataclasses.replace(prepared, **changes)


class _Evaluator:
    """Evaluates region nodes eagerly; nodes outside it are weights (real or random) or derived from them."""

    def __init__(self, gm: fx.GraphModule, real: dict, rng: ProbeRandom, values: dict, caches: list, region: set):
        self.gm, self.real, self.rng, self.region = gm, real, rng, region
        self.env: dict = dict(values)
        self.probe_tensors = {id(t) for t in caches}

    def value(self, a: Any) -> Any:
        """``a`` with its nodes evaluated and its symbolic sizes at their probe values (``ProbeRandom.size``)."""
        return fx.node.map_aggregate(a, self._leaf)

    def _leaf(self, a: Any) -> Any:
        if isinstance(a, Node):
            return self._node(a)
        return self.rng.size(a) if isinstance(a, torch.SymInt) else a

    def _node(self, n: Node) -> Any:
        if n not in self.env:
            if n in self.region:
                raise NoMatch(f"semantic check: {n.name} is used before it is computed", n)
            self.env[n] = self._outside(n)
        return self.env[n]

    def _outside(self, n: Node) -> Any:
        """A value the region reads from outside it: a weight, a view or cast of one, a size."""
        v = val(n)
        if n.op == "placeholder":
            if n in self.real:
                t = self.real[n]
                if isinstance(t, torch.SymInt):
                    return self.rng.size(t)
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.dim() > 0 \
                        and not _is_weight_buffer(n):
                    raise NoMatch(f"semantic check: the layer reads graph input {n.name}, not a weight", n)
                return t
            if isinstance(v, (torch.SymInt, int)):
                return self.rng.size(v)
            if isinstance(v, torch.Tensor):
                return self.rng.weight_like(v)
            raise NoMatch(f"semantic check: no probe value for graph input {n.name}", n)
        if n.op == "get_attr":
            return getattr(self.gm, n.target)
        if n.op in ("call_function", "call_method") and not writes(n):
            return self.run(n)
        raise NoMatch(f"semantic check: cannot evaluate {n.name} ({n.op}) outside the layer", n)

    def run(self, n: Node) -> Any:
        """Evaluate one call node (its inputs first); it may write only the probe's caches."""
        if functionalized_op(n) is not None:
            return self._functionalized(n)
        args, kwargs = self.value(n.args), self.value(n.kwargs)
        if n.op == "call_method":
            if writes(n):
                raise NoMatch(f"semantic check: {n.name} writes in place ({n.target})", n)
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        schema = schema_of(n)
        if schema is not None:
            self._check_writes(n, schema, {**dict(zip([a.name for a in schema.arguments], args)), **kwargs})
        elif writes(n):
            raise NoMatch(f"semantic check: {n.name} writes into an argument", n)
        return n.target(*args, **kwargs)

    def _check_writes(self, n: Node, op, bound: dict) -> None:
        """A mutating op inside the region may write only the probe's own caches."""
        for name in mutated_names(op):
            if id(bound.get(name)) not in self.probe_tensors:
                raise NoMatch(f"semantic check: {n.name} writes {name}, which is not a cache of the layer", n)

    def _functionalized(self, n: Node) -> tuple:
        """An ``auto_functionalized(_v2)`` call run as the plain op on the probe tensors (in place)."""
        op = n.args[0]
        if n.target is AF_V1:
            kwargs = self.value(dict(n.kwargs))
            self._check_writes(n, op, kwargs)
            return (op(**kwargs), *(kwargs[name] for name in mutated_names(op)))
        bases = [self._node(b) for b in n.kwargs["_all_bases"]]
        kwargs = {k: self.value(v) for k, v in n.kwargs.items() if not k.startswith("_")}
        for name in mutated_names(op):
            kwargs[name] = bases[n.kwargs[f"_{name}_base_index"]]
        self._check_writes(n, op, kwargs)
        return (op(**kwargs), *bases)


def _is_weight_buffer(n: Node) -> bool:
    """A placeholder Dynamo lifted from a module buffer (its source names ``_buffers``)."""
    src = getattr(n, "meta", {}).get("grapharg")
    name = repr(getattr(src, "source", "")) if src is not None else n.name
    return "buffers" in name


def error(got: torch.Tensor, ref: torch.Tensor) -> Error:
    """max |got - ref| / max |ref| and rms(got - ref) / rms(ref); inf on a shape or dtype mismatch."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return Error(math.inf, math.inf)
    if not torch.is_floating_point(ref):
        return Error(0.0, 0.0) if torch.equal(got, ref) else Error(math.inf, math.inf)
    if ref.numel() == 0:
        return Error(0.0, 0.0)
    d = (got.float() - ref.float())
    if not torch.isfinite(got.float()).all() or not torch.isfinite(ref.float()).all():
        same = torch.equal(torch.isfinite(got.float()), torch.isfinite(ref.float()))
        return Error(0.0, 0.0) if same and torch.equal(got[torch.isfinite(got.float())],
                                                       ref[torch.isfinite(ref.float())]) else Error(math.inf, math.inf)
    scale = ref.float().abs().max().clamp_min(1e-30)
    rms = ref.float().pow(2).mean().sqrt().clamp_min(1e-30)
    return Error((d.abs().max() / scale).item(), (d.pow(2).mean().sqrt() / rms).item())


def cache_error(got: Any, ref: Any, before: Any) -> Error:
    """A cache's difference on the elements the step wrote (changed from ``before`` by either run)."""
    if isinstance(ref, Quantized):
        return code_error(got, ref, before)
    if not torch.is_floating_point(ref) or got.shape != ref.shape or got.dtype != ref.dtype:
        return error(got, ref)
    wrote = (got != before) | (ref != before)
    return error(got[wrote], ref[wrote])


def code_error(got: Quantized, ref: Quantized, before: Quantized) -> Error:
    """The largest difference of written FP8 values in code steps (the coarser of the two stored grids, at least
    ``ref.row_floor`` of the row's largest value), and the fraction of written codes that moved."""
    g, r, b = got.values(), ref.values(), before.values()
    if g.shape != r.shape:
        return Error(math.inf, math.inf, "steps")
    wrote = (g != b) | (r != b)
    if not wrote.any():
        return Error(0.0, 0.0, "steps")
    row_ulp = (r.abs().amax(-1, keepdim=True) * ref.row_floor).expand_as(r)[wrote]  # no unit is below it
    g, r = g[wrote], r[wrote]
    if not (torch.isfinite(g).all() and torch.isfinite(r).all()):
        return Error(math.inf, math.inf, "steps")
    # the replacement's grid counts up to one doubling of stock's scale: a larger scale of its own is no unit
    ref_step = ref.steps()[wrote]
    step = torch.maximum(torch.minimum(torch.maximum(got.steps()[wrote], ref_step), 2 * ref_step), row_ulp)
    steps = (g - r).abs() / step
    return Error(steps.max().item(), (steps > 0).float().mean().item(), "steps")


def _over(e: Error, on_cpu: bool, rms: float) -> bool:
    """Whether a compared tensor's difference is beyond rounding."""
    if e.unit == "steps":
        return e.max > CODE_MAX_STEPS * (1 + 2.0 ** -10) or e.spread > CODE_MAX_MOVED
    return e.max > (CPU_MAX_REL if on_cpu else CUDA_MAX_REL) or (not on_cpu and e.spread > rms)


def signature(probe: Probe) -> str:
    """The region's computation up to renaming: every node's op, constants and operands (region nodes by
    position, outside values by first appearance with their shape and dtype), and the prepared layer.

    Two layers with one signature compute the same function of their outside values, and are
    rewritten into the same op, which receives those values unchanged (the walkers pass every outside
    value through, checked to be a parameter, a cache or step metadata): one probe observes both,
    on the first layer's weights (K3's 93 layers need a handful).
    """
    order = sorted(probe.region, key=lambda n: n._sort_key)
    index = {n: i for i, n in enumerate(order)}
    outside: dict = {}

    def name(a):
        if a in index:
            return f"%{index[a]}"
        if a not in outside:
            v = val(a)
            outside[a] = f"${len(outside)}:{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}" \
                         f":{getattr(v, 'dtype', '')}"
        return outside[a]

    parts = [repr(dataclasses.asdict(probe.prepared) if dataclasses.is_dataclass(probe.prepared) else probe.prepared)]
    for n in order:
        args = fx.node.map_arg((n.args, n.kwargs), name)
        parts.append(f"{n.op}:{getattr(n.target, '__name__', n.target)}:{args}")
    parts.append(str(fx.node.map_arg(probe.args[:probe.key_index], name)))
    parts.append(f"out=%{index[probe.output]}")
    return "\n".join(parts)


def check(probe: Probe, gm: fx.GraphModule, real: dict, seed: int = 0) -> Verdict:
    """Run the stock region and the replacement on one random probe; NoMatch if they disagree."""
    t0 = time.perf_counter()
    device = val(probe.x).device
    if device.type == "meta":
        device = torch.device("cpu")
    on_cpu = device.type == "cpu"
    rng = ProbeRandom(device, seed, token_symbols(probe.x))
    with torch.no_grad():
        inputs = probe.inputs(rng)
        stock_caches = {role: inputs.values[node] for role, node in inputs.caches.items()}
        fresh = {role: t.clone() for role, t in stock_caches.items()}
        before = {role: t.clone() for role, t in stock_caches.items()}
        ev = _Evaluator(gm, real, rng, inputs.values, list(stock_caches.values()), probe.region)
        for n in sorted(probe.region, key=lambda n: n._sort_key):
            ev.env[n] = ev.run(n)
        stock_out = ev.env[probe.output]
        # the replacement, on copies of the untouched probe caches
        for role, node in inputs.caches.items():
            ev.env[node] = fresh[role]
        args = list(ev.value(probe.args))
        if probe.key_index is not None:
            prepared = _cublas(probe.prepared) if on_cpu else probe.prepared
            args[probe.key_index] = register(f"{probe.module}@probe", prepared)
        with unpacked_ok():  # weights are packed once compile_fx returns, after the probe
            out = probe.target(*args)
    errors = {"output": error(out, stock_out)}
    got, ref, old = probe.compared(fresh), probe.compared(stock_caches), probe.compared(before)
    for name in ref:
        errors[name] = cache_error(got[name], ref[name], old[name])
    verdict = Verdict(errors, time.perf_counter() - t0, inputs.tokens, probe.module)
    bound = CPU_MAX_REL if on_cpu else CUDA_MAX_REL
    rms = CUDA_RMS_REL_FP8 if probe.fp8_activations else CUDA_RMS_REL
    bad = {k: e for k, e in errors.items() if _over(e, on_cpu, rms)}
    if bad:
        detail = ", ".join(f"{k} max {e.max:.3g} steps, {e.spread:.1%} of written codes moved" if e.unit == "steps"
                           else f"{k} max {e.max:.3g} rms {e.spread:.3g}" for k, e in bad.items())
        raise NoMatch(f"semantic check failed: the replacement differs from the stock layer on a random probe "
                      f"({detail}; bound {bound:.3g} of the largest written value"
                      f"{'' if on_cpu else f', rms {rms:.3g}'}; codes {CODE_MAX_STEPS:.0f} step at "
                      f"{CODE_MAX_MOVED:.1%})", probe.output)
    return verdict


__all__ = ["Error", "Probe", "ProbeInputs", "ProbeRandom", "Quantized", "Verdict", "cache_error", "check",
           "code_error", "compare_as_stored", "error", "signature", "token_symbols", "PROBE_SIZE", "CPU_MAX_REL",
           "CUDA_MAX_REL", "CUDA_RMS_REL", "CUDA_RMS_REL_FP8", "CODE_MAX_STEPS", "CODE_MAX_MOVED", "CODE_ROW_ULP"]
