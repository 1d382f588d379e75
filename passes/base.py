"""The pass base: a context over one Dynamo graph (params, fake mode, packing) and region replacement."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from dep_compile.config import DepOptions
from dep_compile.debug.report import LayerMatch
from dep_compile.ops.packing import pack_params

from .fx_match import (AF_V2, NoMatch, base_outputs, is_call, is_functionalized, layer_index, module_path, require,
                       val)

Node = fx.Node


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
        return t

    def pack(self, nodes: list[Node], what: str) -> list[Node]:
        """Schedule zero-copy packing of row-stacked parameters; return their nodes for the op.

        The params' ``.data`` become row slices of one packed tensor once compile_fx has
        returned (design.md §5: swapping earlier breaks the compile), so no second copy of the
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
        from .fx_match import result

        out = result(node)
        require(out is not None, "the op's output is not read once", node)
        return out

    def layer_region(self, x: Node, output: Node, limit: int = 2000) -> set[Node]:
        """The nodes between the layer input ``x`` and ``output``: ancestors of ``output`` that depend on ``x``.

        The walk stops at ``x`` and at graph inputs, so it stays inside one layer.
        """
        seen, stack = set(), [output]
        while stack:
            n = stack.pop()
            if n in seen or n is x or n.op in ("placeholder", "get_attr"):
                continue
            if self.postgrad and _position(n) < _position(x):
                continue  # post-grad graphs are reordered for locality: a weight's permute/cast may sit earlier
            require(n._sort_key > x._sort_key, f"{n.name} is computed before the layer input {x.name}", n)
            seen.add(n)
            require(len(seen) <= limit, f"layer region past {limit} nodes", output)
            stack.extend(n.all_input_nodes)
        depends: set[Node] = set()
        for n in sorted(seen, key=_position):
            if any(a is x or a in depends for a in n.all_input_nodes):
                depends.add(n)
        return depends

    def verified_region(self, x: Node, output: Node, matched: set[Node]) -> set[Node]:
        """The layer region, after checking that each node in it was matched or is plumbing.

        Plumbing (casts, splits and their parts, views, norms matched through their callers)
        carries no arithmetic the match did not check; anything else means the layer computes
        something the rewrite would not, so it stays stock.
        """
        region = self.layer_region(x, output)
        for n in region - matched:
            require(is_call(n, *_PLUMBING), f"unmatched op {getattr(n.target, '__name__', n.target)} inside the layer", n)
        return region

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
        region = set(region)
        self.check_region(region, output)
        if self.postgrad and target._schema.is_mutable:
            new = self._replace_functionalized(region, output, target, args)
        else:
            with self.graph.inserting_before(output):
                new = self.graph.call_function(target, args)
            new.meta["val" if self.postgrad else "example_value"] = self._fake_call(target, args)
            if self.postgrad:
                new.meta["eager_input_vals"] = _eager_vals(new)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in output.meta:
                new.meta[key] = output.meta[key]
        output.replace_all_uses_with(new)
        frontier = []
        for n in sorted(region, key=_position, reverse=True):  # reverse topological order
            if not n.users:
                frontier.extend(a for a in n.all_input_nodes if a not in region)
                self.graph.erase_node(n)
        while frontier:
            n = frontier.pop()
            if n.graph is self.graph and not n.users and _pure(n):
                frontier.extend(n.all_input_nodes)
                self.graph.erase_node(n)
        return new

    def _replace_functionalized(self, region: set[Node], output: Node, target, args: tuple) -> Node:
        """Post-grad: call mutating ``target`` as ``auto_functionalized_v2``, taking each mutated
        argument's base and view kwargs (``_<arg>_base_index``, ``_size``/``_stride``/``_storage_offset``,
        ``_slice_*``, ``_alias``) from the wrapped call in ``region`` that mutated the argument of the
        same name, with ``_all_bases`` concatenated. The old calls' updated-base getitems are
        redirected to the new call's; ``eager_input_vals`` is rebuilt from the new node's inputs.
        Returns the getitem of the op's output.
        """
        schema = target._schema
        names = [a.name for a in schema.arguments]
        mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        olds = sorted((n for n in region if is_functionalized(n)), key=_position)
        for n in olds:
            require(n.target is AF_V2, "mutating op is wrapped in auto_functionalized v1; only v2 is rewritten "
                    "(set Inductor's enable_auto_functionalized_v2=True)", n)
        kwargs = {k: v for k, v in zip(names, args) if k not in mutated}
        bases: list[Node] = []
        moved: dict[Node, int] = {}  # old updated-base getitem -> index in the new _all_bases
        offsets: dict[Node, int] = {}
        for n in olds:
            offsets[n] = len(bases)
            for i, b in enumerate(n.kwargs["_all_bases"]):
                require(b not in bases, f"two replaced ops mutate one base {getattr(b, 'name', b)}", n)
                bases.append(b)
            for i, g in base_outputs(n).items():
                moved[g] = offsets[n] + i
        claimed: set[str] = set()
        for m in mutated:
            owners = [n for n in olds if f"_{m}_base_index" in n.kwargs]
            require(len(owners) == 1, f"mutated {m}: {len(owners)} replaced calls mutate an argument of that name",
                    output)
            n = owners[0]
            for k, v in n.kwargs.items():
                if k.startswith(f"_{m}_"):
                    if k == f"_{m}_base_index":
                        require(isinstance(v, int), f"mutated {m} has no single base", n)
                        v = v + offsets[n]
                    kwargs[k] = v
                    claimed.add(k)
        for n in olds:  # every view kwarg of the replaced calls must belong to a mutated arg of the new op
            extra = [k for k in n.kwargs if k.startswith("_") and k != "_all_bases" and k not in claimed]
            require(not extra, f"replaced call mutates {extra}, which the new op does not take", n)
        kwargs["_all_bases"] = bases
        out_val = val(output)
        with self.graph.inserting_before(output):
            af = self.graph.call_function(AF_V2, (target,), kwargs)
            outs = [self.graph.call_function(operator.getitem, (af, i)) for i in range(len(bases) + 1)]
        outs[0].meta["val"] = out_val
        for g, j in moved.items():
            outs[j + 1].meta["val"] = val(g)
        for j, o in enumerate(outs[1:]):
            if "val" not in o.meta:
                o.meta["val"] = val(bases[j])
        af.meta["val"] = tuple(o.meta["val"] for o in outs)
        af.meta["eager_input_vals"] = _eager_vals(af)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in output.meta:
                for n in (af, *outs):
                    n.meta[key] = output.meta[key]
        for g, j in moved.items():
            g.replace_all_uses_with(outs[j + 1])
            self.graph.erase_node(g)  # else the old call keeps a user and survives (and runs)
        for o in outs[1:]:
            if not o.users:
                self.graph.erase_node(o)
        return outs[0]

    def _fake_call(self, target, args):
        vals = fx.node.map_aggregate(args, lambda a: val(a) if isinstance(a, Node) else a)
        if self.fake_mode is None:
            return None
        with self.fake_mode:
            return target(*vals)


_aten = torch.ops.aten
_PLUMBING = ("float", "to", "bfloat16", "view", "reshape", "split", "chunk", "contiguous", operator.getitem,
             torch.split, torch.reshape, F.rms_norm, torch.rms_norm, F.layer_norm, torch.layer_norm,
             # post-grad spellings of the same plumbing (decomposed norms are matched node by node)
             torch.ops.prims.convert_element_type, _aten.split_with_sizes, _aten.split, _aten.view,
             _aten.reshape, _aten._unsafe_view, _aten.unsqueeze, _aten.squeeze)


def _eager_vals(node: Node):
    """``eager_input_vals`` of a new node, from its own inputs (fake values; non-tensors None)."""
    return fx.node.map_aggregate((node.args, node.kwargs), lambda a: val(a) if isinstance(a, Node) else None)


def _position(node: Node):
    """The node's place in graph order (FX keeps ``_sort_key`` ordered as nodes are inserted)."""
    return node._sort_key


def _pure(node: Node) -> bool:
    """A computation node that writes nothing (safe to erase once unused)."""
    if node.op == "call_method":
        return not node.target.endswith("_")
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", node.target)
    if isinstance(packet, torch._ops.OpOverloadPacket):
        return not any(getattr(packet, o)._schema.is_mutable for o in packet.overloads())
    return not getattr(node.target, "__name__", "").endswith("_")


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
        """Rewrite one found subgraph, or leave it stock with the failed check as the reason."""
        try:
            op, tactics = self.rewrite(ctx, found)
        except NoMatch as e:
            return LayerMatch(found.layer, found.module, self.kind, False, e.reason, self.stock_op,
                              node=e.node.name if e.node is not None else "")
        return LayerMatch(found.layer, found.module, self.kind, True, "", op, tactics)

    stock_op: str = ""

    def rewrite(self, ctx: PassContext, found: Found) -> tuple[str, dict]:  # pragma: no cover - abstract
        raise NotImplementedError


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


def check_only_user(cache: Node, user: Node, what: str) -> None:
    """Mutation safety: the cache's only reader/writer in the graph is the op being replaced.

    Post-grad graphs end with ``copy_(input, updated)`` for every mutated graph input: that
    write-back into the base is not a reader (the updated value it copies is redirected).
    """
    users = {u for u in cache.users if not (is_call(u, _aten.copy_) and u.args[0] is cache)}
    require(users == {user}, f"{what} has other users ({', '.join(u.name for u in cache.users)})", cache)


__all__ = ["PassContext", "LayerPass", "Found", "NoMatch", "require", "check_bf16", "check_only_user", "check_q_len",
           "strip_view"]
