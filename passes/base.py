"""The pass base: a context over one Dynamo graph (params, fake mode, packing) and region replacement."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from dep_compile.config import DepOptions, OptionError
from dep_compile.debug.report import LayerMatch
from dep_compile.ops.packing import pack_params
from dep_compile.ops.registry import register
from dep_compile.stock import fp8_block

from . import validate
from .calls import (AF_V2, NoMatch, base_outputs, is_call, is_functionalized, layer_index, module_path, op_name,
                    position, require, val, writes)
from .calls import result as call_result
from .functionalized import eager_vals, replace_functionalized
from .validate import ProbeInputs, ProbeRandom, compare_as_stored
from .walkers import is_plumbing

Node = fx.Node
FP8_E4M3 = torch.float8_e4m3fn
log = logging.getLogger("dep_compile")


class PassContext:
    """What every pass needs about the graph it rewrites: the real parameters behind placeholders,
    the fake mode of the trace, zero-copy weight packing, and finalizers to run after compile_fx.

    ``postgrad=True``: the graph is Inductor's post-grad graph (aten, functionalized; hook
    ``post_grad_custom_post_pass``). There are no real tensors: parameters are checked by the
    placeholders' fake values, packing is left to ``dep_compile.integrations.vllm.pack_model_weights``,
    and mutating replacements are wrapped in ``auto_functionalized_v2``.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any] | None, options: DepOptions,
                 postgrad: bool = False):
        self.gm, self.graph, self.options, self.postgrad = gm, gm.graph, options, postgrad
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.real: dict[Node, Any] = dict(zip(placeholders, example_inputs or ()))
        self.fake_mode = next((v.fake_mode for v in map(val, placeholders) if hasattr(v, "fake_mode")), None)
        self.finalizers: list[Callable[[], None]] = []
        self.verdict: validate.Verdict | None = None  # the last layer's probe numbers
        self.validate_seconds = 0.0
        self.verdicts: dict[str, validate.Verdict] = {}  # region signature -> its probe
        self.mutating = False  # True while a replacement edits the graph: an error then is not recoverable

    def param(self, node: Any, what: str) -> torch.Tensor:
        """The real nn.Parameter behind a placeholder, or NoMatch naming ``what``.

        Post-grad: the placeholder's (or constant's) fake value; nothing there says it is a
        parameter, so only that it is a graph input read without arithmetic is checked.
        """
        if self.postgrad:
            n = strip_view(node) if isinstance(node, Node) else None
            t = val(n) if n is not None and n.op in ("placeholder", "get_attr") else None
            require(isinstance(t, torch.Tensor), f"{what} is not a graph input (weight)",
                    node if isinstance(node, Node) else None)
            return t
        t = self.real.get(strip_view(node)) if isinstance(node, Node) else None
        require(isinstance(t, torch.nn.Parameter), f"{what} is not a module parameter", node if isinstance(node, Node) else None)
        v = val(node)
        require(v is not None and tuple(v.shape) == tuple(t.shape), f"{what} is a reshaped view of a parameter", node)
        return t

    def pack(self, nodes: list[Node], what: str) -> list[Node]:
        """Schedule zero-copy packing of row-stacked parameters; return their nodes for the op.

        The params' ``.data`` become row slices of one packed tensor once compile_fx has
        returned (docs/design.md §5.4: swapping earlier breaks the compile), so no second copy of the
        weights exists; the op views them as one matrix (``dep_compile.ops.packing``).
        """
        params = [self.param(n, what) for n in nodes]
        K = params[0].shape[1]
        require(all(p.dim() == 2 and p.shape[1] == K and p.dtype == params[0].dtype for p in params),
                f"{what}: weights differ in width or dtype", nodes[0])
        if not self.postgrad:  # post-grad: no real tensors; pack up front (integrations.vllm.pack_model_weights)
            self.finalizers.append(lambda: pack_params(params))
        return list(nodes)

    def result(self, node: Node) -> Node:
        """The node holding a call's tensor output (getitem 0 of a functionalized call), or NoMatch."""
        out = call_result(node)
        require(out is not None, "the op's output is not read once", node)
        return out

    def layer_region(self, x: Node, output: Node, stops: Sequence[Node] = (), limit: int = 2000) -> set[Node]:
        """The nodes between the layer input ``x`` and ``output``: ancestors of ``output`` that depend on ``x``.

        The walk stops at ``x``, at graph inputs and at ``stops`` (state the graph computes earlier and the
        region reads, as AttnRes's prefix and bank), so it stays inside one layer.
        """
        seen, stack, stops = set(), [output], set(stops)
        while stack:
            n = stack.pop()
            if n in seen or n is x or n in stops or n.op in ("placeholder", "get_attr"):
                continue
            if self.postgrad and position(n) < position(x):
                continue  # post-grad graphs are reordered for locality: a weight's permute/cast may sit earlier
            require(n._sort_key > x._sort_key, f"{n.name} is computed before the layer input {x.name}", n)
            seen.add(n)
            require(len(seen) <= limit, f"layer region past {limit} nodes", output)
            stack.extend(n.all_input_nodes)
        depends: set[Node] = set()
        for n in sorted(seen, key=position):
            if any(a is x or a in depends for a in n.all_input_nodes):
                depends.add(n)
        return depends

    def verified_region(self, x: Node, output: Node, claimed: set[Node], stops: Sequence[Node] = (),
                        span: str = "inside the layer") -> set[Node]:
        """The layer region, after checking that the walkers accounted for each node in it.

        A node no walker claimed must be value-preserving plumbing (``walkers.is_plumbing``: a
        reshaping view, ``contiguous``, a cast to the dtype it already has); any other op means the
        layer computes something the rewrite would not, so it stays stock.
        """
        region = self.layer_region(x, output, stops)
        for n in sorted(region - claimed, key=position):
            require(is_plumbing(n), f"unmatched op {op_name(n) or getattr(n.target, '__name__', n.target)} "
                    f"({n.name}) {span}: its meaning is not accounted for", n)
        return region

    def commit(self, found: "Found", *, x: Node, output: Node, claimed: set[Node], target, args: tuple,
               prepared: Any, probe: Callable[[ProbeRandom], ProbeInputs],
               compared: Callable[[dict], dict] = compare_as_stored, pack: Sequence[tuple[list[Node], str]] = (),
               stops: Sequence[Node] = (), check: Callable[[set[Node]], None] | None = None,
               span: str = "inside the layer", fp8_activations: bool = False) -> Node:
        """Check the region, observe the replacement on a random probe, then rewrite: the one way every
        pass changes the graph.

        The region is what lies between the input ``x`` and ``output`` (``layer_region``, its walk also
        stopping at ``stops``); ``claimed``: the nodes the pass's walkers accounted for (the rest must be
        plumbing; ``span`` says where, in the report); ``check(region)``: what else the family requires of
        it. ``args`` holds ``None`` where the op's ``layer`` string goes (an op without one has no
        ``None``; ``prepared`` is then None too). ``probe`` builds the family's random probe inputs and
        ``compared`` says what of its caches to compare (``validate.Probe``). ``pack``: the weight groups
        to pack zero-copy once compile_fx returns. ``fp8_activations``: the layer quantizes activations to FP8
        (its probe's CUDA RMS bound is ``validate.CUDA_RMS_REL_FP8``). Nothing in the graph changes until every
        check passed.
        """
        region = self.verified_region(x, output, claimed, stops, span)
        self.check_region(region, output)
        if check is not None:
            check(region)
        if self.postgrad and target._schema.is_mutable:
            for n in region:
                require(not is_functionalized(n) or n.target is AF_V2, "mutating op is wrapped in "
                        "auto_functionalized v1; only v2 is rewritten (set Inductor's enable_auto_functionalized_v2=True)", n)
        flat: list = []
        fx.node.map_arg(args, flat.append)
        for n in flat:
            require(n is x or n not in region, f"the op's argument {n.name} is computed inside the layer", n)
        key_index = next((i for i, a in enumerate(args) if a is None), None)
        if self.options.validate:
            observed = validate.Probe(region, x, output, target, tuple(args), key_index, prepared, found.module,
                                      probe, compared, fp8_activations)
            t0 = time.perf_counter()
            try:
                sig = validate.signature(observed)
                if sig not in self.verdicts:  # one probe per structure: a failed one raised, leaving none
                    self.verdicts[sig] = validate.check(observed, self.gm, self.real)
                self.verdict = self.verdicts[sig]
            finally:
                self.validate_seconds += time.perf_counter() - t0
        if key_index is not None:
            key = register(found.module, prepared)
            args = tuple(key if i == key_index else a for i, a in enumerate(args))
        for nodes, what in pack:
            self.pack(nodes, what)
        self.mutating = True
        try:
            return self.replace(region, output, target, args, found.module)
        finally:
            self.mutating = False

    def check_region(self, region: Iterable[Node], output: Node) -> None:
        """Every node the rewrite removes is read only inside the region (``output`` excepted)."""
        region = set(region)
        for n in region:
            require(n.op in ("call_function", "call_method"), f"{n.name} ({n.op}) cannot be removed", n)
            redirected = set(base_outputs(n).values()) if is_functionalized(n) else set()
            for u in n.users:
                require(u in region or n is output or u in redirected,
                        f"intermediate {n.name} has a user outside the layer ({u.name}); rewrite would drop it", n)

    def replace(self, region: Iterable[Node], output: Node, target, args: tuple, layer: str) -> Node:
        """Replace ``region`` (whose only value used outside is ``output``) by one call to ``target``.

        The call is inserted where ``output`` stood; ``nn_module_stack`` and ``stack_trace`` are
        copied from ``output``, and its fake value is computed in the trace's fake mode. Region
        nodes are erased, then any pure node that only fed them (casts, views, norms).
        """
        region = set(region)  # checked by ``commit`` (check_region)
        if self.postgrad and target._schema.is_mutable:
            new = replace_functionalized(self.graph, region, output, target, args)
        else:
            fake = self._fake_call(target, args)
            with self.graph.inserting_before(output):
                new = self.graph.call_function(target, args)
            new.meta["val" if self.postgrad else "example_value"] = fake
            if self.postgrad:
                new.meta["eager_input_vals"] = eager_vals(new)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in output.meta:
                new.meta[key] = output.meta[key]
        output.replace_all_uses_with(new)
        frontier = []
        for n in sorted(region, key=position, reverse=True):  # reverse topological order
            if not n.users:
                frontier.extend(a for a in n.all_input_nodes if a not in region)
                self.graph.erase_node(n)
        while frontier:
            n = frontier.pop()
            if n.graph is self.graph and not n.users and _pure(n):
                frontier.extend(n.all_input_nodes)
                self.graph.erase_node(n)
        return new

    def _fake_call(self, target, args):
        vals = fx.node.map_aggregate(args, lambda a: val(a) if isinstance(a, Node) else a)
        if self.fake_mode is None:
            return None
        with self.fake_mode:
            return target(*vals)


_aten = torch.ops.aten


def _pure(node: Node) -> bool:
    """A computation node that writes nothing (safe to erase once unused)."""
    return node.op in ("call_function", "call_method") and not writes(node)


def strip_view(node: Any) -> Any:
    """A param read through a view (``squeeze``, ``view``) -> the param's placeholder."""
    while isinstance(node, Node) and (
            (node.op == "call_method" and node.target in ("squeeze", "view", "reshape", "contiguous"))
            or is_call(node, _aten.squeeze, _aten.view, _aten.reshape, _aten._unsafe_view)):
        node = node.args[0]
    return node


@dataclasses.dataclass
class Found:
    """A stock subgraph a pass located: its anchor, module path and layer."""

    anchor: Node
    module: str
    layer: int | None


class LayerPass:
    """One family: find anchors, check the structure around each, rewrite it into one kimi_dep op."""

    kind: str = ""
    anchors: tuple = ()
    module_up: int = 0  # levels from the anchor's module to the layer's module in the report

    def find(self, graph: fx.Graph) -> list[Found]:
        out = []
        for n in graph.nodes:
            if is_call(n, *self.anchors):
                path = module_path(n, self.module_up)
                out.append(Found(n, path, layer_index(path)))
        return out

    def apply(self, ctx: PassContext, found: Found) -> LayerMatch:
        """Rewrite one found subgraph, or leave it stock with the failed check as the reason.

        An unexpected exception in the pass leaves the layer stock too (the graph is untouched until
        ``commit`` replaces the region), with the exception in the report.
        """
        ctx.verdict = None
        try:
            op, tactics = self.rewrite(ctx, found)
        except NoMatch as e:
            if ctx.mutating:  # a check inside the replacement failed after the graph began to change
                raise
            check = "semantic" if e.reason.startswith("semantic check") else "structure"
            return LayerMatch(found.layer, found.module, self.kind, False, e.reason, self.stock_name(found),
                              node=e.node.name if isinstance(e.node, Node) else "", check=check)
        except Exception as e:  # noqa: BLE001 - a pass bug must not fail the user's compile
            if ctx.mutating or isinstance(e, OptionError):  # a half-edited graph, or an option that cannot hold
                raise
            log.warning("kimi_dep: the %s pass raised on %s; the layer stays stock", self.kind, found.module,
                        exc_info=True)
            return LayerMatch(found.layer, found.module, self.kind, False,
                              f"internal error in the {self.kind} pass: {type(e).__name__}: {e}", self.stock_name(found),
                              check="internal error")
        validation = ctx.verdict.summary(found.module) if ctx.verdict is not None else "off (options validate=False)"
        return LayerMatch(found.layer, found.module, self.kind, True, "", op, tactics, validation=validation)

    stock_op: str = ""

    def stock_name(self, found: Found) -> str:
        """The stock op a row of ``found`` names (the family's, unless the anchor says otherwise)."""
        return self.stock_op

    def rewrite(self, ctx: PassContext, found: Found) -> tuple[str, dict]:  # pragma: no cover - abstract
        raise NotImplementedError


def dense_scales(ctx: PassContext, lins: Sequence[tuple[str, Any, bool]], anchor: Node) -> list[Node]:
    """The block scales of a layer's projections, in order: empty when every one is BF16.

    ``lins``: (name, Linear, runs alone) per projection. FP8 block-scaled ones (``kimi_k3.fp8_block_linear``)
    must be all of them (the layer's ops take one dense format), each weight an e4m3 parameter [N, K] with an
    FP32 parameter of one scale per 128 x 128 block of each of its row segments (another block size or
    transposed scales do not fit: NoMatch), and one that runs alone (``ops.dense.dense_linear``) one segment.
    """
    fp8 = [name for name, lin, _ in lins if lin.scale is not None]
    if not fp8:
        return []
    require(len(fp8) == len(lins), f"{', '.join(fp8)} FP8 block-scaled but {', '.join(n for n, _, _ in lins if n not in fp8)} "
            "not: kimi_dep rewrites a layer whose projections share one dense format", anchor)
    for name, lin, alone in lins:
        w = ctx.param(lin.w, f"the {name} FP8 weight")
        s = ctx.param(lin.scale, f"the {name} FP8 weight scales")
        require(w.dtype == FP8_E4M3 and s.dtype == torch.float32, f"the {name} FP8 weight is {w.dtype} with {s.dtype} "
                "scales, not float8_e4m3fn with float32 scales", lin.node)
        require(w.dim() == 2 and sum(lin.segments) == w.shape[0], f"the {name} FP8 weight {list(w.shape)} is not "
                f"[N, K] with N the sum of its segments {list(lin.segments)}", lin.node)
        want = fp8_block.scale_shape(list(lin.segments), w.shape[1])
        require(tuple(s.shape) == want, f"the {name} weight scales {list(s.shape)} are not one per 128 x 128 block of "
                f"{list(w.shape)} (segments {list(lin.segments)}): {list(want)} expected", lin.scale)
        require(not alone or len(lin.segments) == 1, f"the {name} FP8 weight packs segments {list(lin.segments)}; "
                "kimi_dep runs it as one projection", lin.node)
    return [lin.scale for _, lin, _ in lins]


def packed_segments(lins: Sequence[Any]) -> tuple[int, ...] | None:
    """The row segments of the linears ``lins`` stacked in one ``DepProjection``: each FP8 one's segments in order;
    None for BF16 ones (``dense_scales`` has checked that a layer's projections share one format)."""
    return None if lins[0].segments is None else tuple(n for lin in lins for n in lin.segments)


def tagged(op: str, *tags: str | None) -> str:
    """The report's name of a rewritten op: ``op``, with what it was compiled for in brackets
    (``kimi_dep.moe[ep2, fp8_block]``)."""
    tags = [t for t in tags if t]
    return f"{op}[{', '.join(tags)}]" if tags else op


def check_bf16(what: str, *nodes_or_tensors) -> None:
    for x in nodes_or_tensors:
        t = val(x) if isinstance(x, Node) else x
        require(t is not None and t.dtype == torch.bfloat16,
                f"{what} is {getattr(t, 'dtype', None)}, not bfloat16 (kimi_dep ops are BF16)",
                x if isinstance(x, Node) else None)


def check_q_len(q_len: Any, max_q: int, node: Node) -> None:
    """Tokens per request: a static int up to ``max_q`` (longer steps are prefill-shaped and stay
    stock), or a dynamic SymInt (Dynamo makes ``q_len`` one once it changes between calls): then
    the op serves every q, running its reference path for steps its kernels do not cover."""
    if isinstance(q_len, Node):
        require(isinstance(val(q_len), torch.SymInt), f"q_len is {q_len.name}, neither an int nor a SymInt", node)
        return
    require(isinstance(q_len, int), f"q_len is {q_len!r}, not an int", node)
    require(q_len <= max_q, f"prefill-shaped step: q_len={q_len} > max_q={max_q}", node)


def probe_step(rng: ProbeRandom, x: Node, q_len: Any) -> tuple[dict, int, int]:
    """The probe's step: a random layer input ``x`` [T, ...] read as B requests of q tokens (``q_len`` an
    int, or a SymInt node; symbolic sizes at the probe's, ``ProbeRandom.size``, or at their hints where a
    shrunk T would not be whole requests): ({node: probe value}, B, q)."""
    xv = val(x)

    def sizes() -> tuple[int, int]:
        return rng.size(xv.shape[0]), rng.size(val(q_len)) if isinstance(q_len, Node) else int(q_len)

    tokens, q = sizes()
    if tokens % q:  # T's symbols shrunk apart from q's (T and q_len traced as unrelated symbols)
        rng.small = frozenset()
        tokens, q = sizes()
    require(tokens % q == 0, f"semantic check: {tokens} tokens are not whole requests of q_len={q}", x)
    values = {x: rng.randn(xv.shape, xv.dtype)}
    if isinstance(q_len, Node):
        values[q_len] = q
    return values, tokens // q, q


def check_only_user(cache: Node, user: Node, what: str) -> None:
    """Mutation safety: the cache's only reader/writer in the graph is the op being replaced.

    Post-grad graphs end with ``copy_(input, updated)`` for every mutated graph input: that
    write-back into the base is not a reader (the updated value it copies is redirected).
    """
    users = {u for u in cache.users if not (is_call(u, _aten.copy_) and u.args[0] is cache)}
    require(users == {user}, f"{what} has other users ({', '.join(u.name for u in cache.users)})", cache)


__all__ = ["PassContext", "LayerPass", "Found", "NoMatch", "require", "check_bf16", "check_only_user", "check_q_len",
           "probe_step", "strip_view"]
