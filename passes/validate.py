"""Translation validation: run a matched stock region and its replacement on the same random probe.

A rewrite is kept only when the structure proves it (the walkers in ``fx_match``) *and* a probe
observes it: the region's own nodes are evaluated eagerly (the stock ops, as traced) on random
inputs and small random caches, the replacement op is called on copies of the same, and their
outputs and every cache they write are compared. A difference beyond rounding leaves the layer
stock with "semantic check failed" and the numbers.

The probe keeps the traced batch (static graphs burn it into views) and shrinks only the caches:
a few state slots, a few paged blocks per request, with two requests longer than the indexer's
top-k so its selection matters. Weights are the real parameters (Dynamo graphs) or random tensors
of their shapes (post-grad graphs hold no real tensors): the rewrite must hold for every weight.
On CPU the replacement runs with cuBLAS tactics, where a correct rewrite computes what stock does
to the bit, so the bound there is one BF16 rounding; on CUDA its kernels run as configured.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from typing import Any

import torch
import torch.fx as fx

from dep_compile.ops.packing import unpacked_ok
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.registry import register
from dep_compile.ops.shapes import size_hint

from .fx_match import AF_V1, AF_V2, NoMatch, functionalized_op, val

Node = fx.Node
FP8 = torch.float8_e4m3fn
# Bounds on |replacement - stock| / max|stock| per tensor (and, on CUDA, the RMS ratio too).
CPU_MAX_REL = 2.0 ** -7  # one BF16 rounding at the tensor's largest value: cuBLAS tactics, same references
CUDA_MAX_REL = 2.0 ** -5  # kernels vs the stock CUDA ops: BF16 roundings in another order (seen: <= 6.7e-3)
CUDA_RMS_REL = 2.0 ** -7
META_ROLES = ("slot_mapping", "block_table", "seq_lens", "state_indices", "accepted")
CACHE_ROLES = ("conv_state", "recurrent_state", "kv_cache", "index_cache", "index_scale", "kv_scale")


@dataclasses.dataclass
class Probe:
    """What a pass hands the check: the region, its input and output, the replacement call, and the
    nodes standing for each cache / metadata role (``q_len`` and the indexer's ``topk`` too)."""

    region: set
    x: Node
    output: Node
    target: Any
    args: tuple
    key_index: int  # position of the ``layer`` string in ``args``
    prepared: Any
    module: str
    roles: dict  # role -> node (or int for q_len / topk)
    shapes: dict  # cache role -> the shape the op sees (post-grad: the view of a pooled base)


@dataclasses.dataclass
class Verdict:
    """The probe's numbers: per compared tensor, max |diff| / max |stock| (and RMS ratio)."""

    errors: dict
    seconds: float
    tokens: int
    module: str = ""  # the layer the probe ran on

    def summary(self, module: str = "") -> str:
        worst = max(self.errors.items(), key=lambda kv: kv[1][0]) if self.errors else ("-", (0.0, 0.0))
        shared = f"; same structure as {self.module}, observed there" if module and module != self.module else ""
        return (f"probe {self.tokens} tokens: worst {worst[0]} max {worst[1][0]:.2e} rms {worst[1][1]:.2e} "
                f"({len(self.errors)} tensors){shared}")


def shapes_of(node: Node, overload, names: tuple) -> dict:
    """The shapes ``overload`` sees for its cache arguments ``names``: the tensors' own, or for an
    ``auto_functionalized_v2`` call the views of their bases (``_<name>_size``)."""
    from .fx_match import op_args

    bound = op_args(node, overload)
    return {name: tuple(node.kwargs.get(f"_{name}_size") or val(bound[name]).shape) for name in names}


def _cublas(prepared: Any) -> Any:
    """A copy of a prepared layer with every projection on cuBLAS (torch.mm)."""
    changes = {f.name: DepProjection(getattr(prepared, f.name).name, {}) for f in dataclasses.fields(prepared)
               if isinstance(getattr(prepared, f.name), DepProjection)}
    return dataclasses.replace(prepared, **changes)


class _Inputs:
    """Random probe tensors for one region: the layer input, caches and step metadata."""

    def __init__(self, probe: Probe, device: torch.device, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.device = device
        r = probe.roles
        xv = val(probe.x)
        self.T = size_hint(xv.shape[0])
        q = r.get("q_len", 1)
        self.q = size_hint(val(q)) if isinstance(q, Node) else int(q)
        if self.T % self.q:
            raise NoMatch(f"semantic check: {self.T} tokens are not whole requests of q_len={self.q}", probe.x)
        self.B = self.T // self.q
        self.values: dict = {}
        self.values[probe.x] = self._randn(tuple(size_hint(s) for s in xv.shape), xv.dtype)
        if isinstance(q, Node):
            self.values[q] = self.q
        self._metadata(probe)
        for role in CACHE_ROLES:
            if role in r:
                self.values[r[role]] = self._cache(role, probe.shapes[role], val(r[role]).dtype)
        self.caches = {role: self.values[r[role]] for role in CACHE_ROLES if role in r}

    def _randn(self, shape, dtype):
        return torch.randn(shape, generator=self.g).to(dtype).to(self.device)

    def _metadata(self, probe: Probe) -> None:
        r, B, q = probe.roles, self.B, self.q
        self.slots = B + 2
        if "kv_cache" in r:
            bs = size_hint(probe.shapes["kv_cache"][1])
            topk = int(r.get("topk", 0))
            long = topk + 2 * bs + q  # longer than the top-k: the indexer's selection matters
            lens = [long if b < 2 else q + int(torch.randint(0, 2 * bs, (1,), generator=self.g)) for b in range(B)]
            width = -(-max(lens) // bs)
            need = [-(-n // bs) for n in lens]
            self.blocks = sum(need) + 1
            perm = torch.randperm(self.blocks, generator=self.g)
            table = torch.empty(B, width, dtype=torch.int64)
            used = 0
            for b in range(B):
                table[b, : need[b]] = perm[used: used + need[b]]
                table[b, need[b]:] = perm[-1]
                used += need[b]
            pos = torch.tensor([n - q + i for n in lens for i in range(q)])
            req = torch.arange(B).repeat_interleave(q)
            slots = table[req, pos // bs] * bs + pos % bs
            meta = {"block_table": table, "seq_lens": torch.tensor(lens), "slot_mapping": slots}
        else:
            meta = {}
        meta["state_indices"] = torch.randperm(self.slots, generator=self.g)[:B]
        meta["accepted"] = torch.randint(1, q + 1, (B,), generator=self.g)
        for role in META_ROLES:
            if role in r and role in meta:
                self.values[r[role]] = meta[role].to(val(r[role]).dtype).to(self.device)
            elif role in r:
                raise NoMatch(f"semantic check: no probe value for {role}", r[role])

    def _cache(self, role: str, shape, dtype):
        rest = tuple(size_hint(s) for s in shape[1:])
        lead = self.slots if role in ("conv_state", "recurrent_state") else self.blocks
        t = torch.randn((lead, *rest), generator=self.g)
        if role == "index_cache":
            return t.mul(4).clamp(-8, 8).to(FP8).to(self.device)
        if role == "index_scale":
            return t.abs().add(0.01).to(dtype).to(self.device)
        if role == "kv_cache" and dtype == FP8:  # FP8 latent rows, with power-of-two kv_scale
            return t.mul(32).clamp(-448, 448).to(FP8).to(self.device)
        if role == "kv_scale":
            return torch.exp2(t.round().clamp(-2, 2) - 6).to(dtype).to(self.device)
        return (t * 0.5).to(dtype).to(self.device)


class _Evaluator:
    """Evaluates region nodes eagerly; nodes outside it are weights (real or random) or derived from them."""

    def __init__(self, gm: fx.GraphModule, real: dict, inputs: _Inputs, region: set):
        self.gm, self.real, self.inputs, self.region = gm, real, inputs, region
        self.env: dict = dict(inputs.values)
        self.probe_tensors = {id(t) for t in inputs.caches.values()}

    def value(self, a: Any) -> Any:
        return fx.node.map_arg(a, self._node) if isinstance(a, (Node, list, tuple, dict)) else a

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
                    return size_hint(t)
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.dim() > 0 \
                        and not _is_weight_buffer(n):
                    raise NoMatch(f"semantic check: the layer reads graph input {n.name}, not a weight", n)
                return t
            if isinstance(v, (torch.SymInt, int)):
                return size_hint(v)
            if isinstance(v, torch.Tensor):
                return _random_like(v, self.inputs)
            raise NoMatch(f"semantic check: no probe value for graph input {n.name}", n)
        if n.op == "get_attr":
            return getattr(self.gm, n.target)
        if n.op in ("call_function", "call_method") and not _mutates(n):
            return self.run(n)
        raise NoMatch(f"semantic check: cannot evaluate {n.name} ({n.op}) outside the layer", n)

    def run(self, n: Node) -> Any:
        """Evaluate one call node (its inputs first)."""
        if functionalized_op(n) is not None:
            return self._functionalized(n)
        args, kwargs = self.value(n.args), self.value(n.kwargs)
        if n.op == "call_method":
            if n.target.endswith("_") and not n.target.startswith("__"):
                raise NoMatch(f"semantic check: {n.name} writes in place ({n.target})", n)
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        schema = _schema(n)
        if schema is not None and schema.is_mutable:
            self._check_writes(n, schema, {**dict(zip([a.name for a in schema.arguments], args)), **kwargs})
        if kwargs.get("out") is not None or kwargs.get("inplace") is True:
            raise NoMatch(f"semantic check: {n.name} writes into an argument", n)
        return n.target(*args, **kwargs)

    def _check_writes(self, n: Node, schema, bound: dict) -> None:
        """A mutating op inside the region may write only the probe's own caches."""
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and id(bound.get(a.name)) not in self.probe_tensors:
                raise NoMatch(f"semantic check: {n.name} writes {a.name}, which is not a cache of the layer", n)

    def _functionalized(self, n: Node) -> tuple:
        """An ``auto_functionalized(_v2)`` call run as the plain op on the probe tensors (in place)."""
        op = n.args[0]
        if n.target is AF_V1:
            kwargs = self.value(dict(n.kwargs))
            self._check_writes(n, op._schema, kwargs)
            out = op(**kwargs)
            mutated = [kwargs[a.name] for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            return (out, *mutated)
        bases = [self._node(b) for b in n.kwargs["_all_bases"]]
        kwargs = {k: self.value(v) for k, v in n.kwargs.items() if not k.startswith("_")}
        for a in op._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                kwargs[a.name] = bases[n.kwargs[f"_{a.name}_base_index"]]
        self._check_writes(n, op._schema, kwargs)
        return (op(**kwargs), *bases)


def _is_weight_buffer(n: Node) -> bool:
    """A placeholder Dynamo lifted from a module buffer (its source names ``_buffers``)."""
    src = getattr(n, "meta", {}).get("grapharg")
    name = repr(getattr(src, "source", "")) if src is not None else n.name
    return "buffers" in name


def _schema(n: Node):
    """The schema of an op call (Dynamo records custom ops by their packet: its default overload's)."""
    t = n.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = getattr(t, "default", None)
    return getattr(t, "_schema", None)


def _mutates(n: Node) -> bool:
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.startswith("__")
    if n.target in (AF_V1, AF_V2) or n.target is operator.setitem:
        return True
    if n.kwargs.get("out") is not None or n.kwargs.get("inplace") is True:
        return True
    schema = _schema(n)
    return bool(schema is not None and schema.is_mutable)


def _random_like(v: torch.Tensor, inputs: _Inputs) -> torch.Tensor:
    """A random weight of ``v``'s shape and dtype, at a scale that keeps activations O(1)."""
    shape = tuple(size_hint(s) for s in v.shape)
    if v.dtype in (torch.int32, torch.int64):
        return torch.zeros(shape, dtype=v.dtype, device=inputs.device)
    scale = shape[-1] ** -0.5 if len(shape) >= 2 else 0.1
    t = torch.randn(shape, generator=inputs.g) * scale
    if len(shape) == 1:
        t = t + 1.0
    return t.to(v.dtype).to(inputs.device)


def _error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref| / max |ref|, rms(got - ref) / rms(ref)); inf on a shape or dtype mismatch."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return math.inf, math.inf
    if not torch.is_floating_point(ref):
        return (0.0, 0.0) if torch.equal(got, ref) else (math.inf, math.inf)
    d = (got.float() - ref.float())
    if not torch.isfinite(got.float()).all() or not torch.isfinite(ref.float()).all():
        same = torch.equal(torch.isfinite(got.float()), torch.isfinite(ref.float()))
        return (0.0, 0.0) if same and torch.equal(got[torch.isfinite(got.float())], ref[torch.isfinite(ref.float())]) \
            else (math.inf, math.inf)
    scale = ref.float().abs().max().clamp_min(1e-30)
    rms = ref.float().pow(2).mean().sqrt().clamp_min(1e-30)
    return (d.abs().max() / scale).item(), (d.pow(2).mean().sqrt() / rms).item()


def _dequantized(caches: dict) -> dict:
    """Caches to compare: FP8 index keys and FP8 latent rows times their per-token scales (codes alone
    are not comparable)."""
    out = {k: v for k, v in caches.items() if k not in ("index_cache", "index_scale", "kv_scale")}
    if "kv_scale" in caches:
        out["kv_cache"] = caches["kv_cache"].float() * caches["kv_scale"].float().unsqueeze(-1)
    if "index_cache" in caches:
        out["index_keys"] = caches["index_cache"].float() * caches["index_scale"].float().unsqueeze(-1)
    return out


def signature(probe: Probe) -> str:
    """The region's computation up to renaming: every node's op, constants and operands (region nodes by
    position, outside values by first appearance with their shape and dtype), and the prepared layer.

    Two layers with one signature compute the same function of their outside values, and are
    rewritten into the same op, which receives those values unchanged (the walkers pass every outside
    value through, checked to be a parameter or a cache / metadata role): one probe observes both,
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
    with torch.no_grad():
        inputs = _Inputs(probe, device, seed)
        fresh = {role: t.clone() for role, t in inputs.caches.items()}
        ev = _Evaluator(gm, real, inputs, probe.region)
        for n in sorted(probe.region, key=lambda n: n._sort_key):
            ev.env[n] = ev.run(n)
        stock_out = ev.env[probe.output]
        stock_caches = dict(inputs.caches)
        # the replacement, on copies of the untouched probe caches
        on_cpu = device.type == "cpu"
        prepared = _cublas(probe.prepared) if on_cpu else probe.prepared
        key = register(f"{probe.module}@probe", prepared)
        for role, t in fresh.items():
            ev.env[probe.roles[role]] = t
        args = list(ev.value(probe.args))
        args[probe.key_index] = key
        with unpacked_ok():  # weights are packed once compile_fx returns, after the probe
            out = probe.target(*args)
    errors = {"output": _error(out, stock_out)}
    got, ref = _dequantized(fresh), _dequantized(stock_caches)
    for name in ref:
        errors[name] = _error(got[name], ref[name])
    verdict = Verdict(errors, time.perf_counter() - t0, inputs.T, probe.module)
    bad = {k: e for k, e in errors.items()
           if e[0] > (CPU_MAX_REL if on_cpu else CUDA_MAX_REL) or (not on_cpu and e[1] > CUDA_RMS_REL)}
    if bad:
        detail = ", ".join(f"{k} max {e[0]:.3g} rms {e[1]:.3g}" for k, e in bad.items())
        raise NoMatch(f"semantic check failed: the replacement differs from the stock layer on a random probe "
                      f"({detail}; bound {CPU_MAX_REL if on_cpu else CUDA_MAX_REL:.3g} of the largest value)",
                      probe.output)
    return verdict


__all__ = ["Probe", "Verdict", "check", "shapes_of", "signature", "CACHE_ROLES", "META_ROLES"]
