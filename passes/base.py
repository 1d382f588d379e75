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

from .fx_match import NoMatch, is_call, layer_index, module_path, require, val

Node = fx.Node


class PassContext:
    """What every pass needs about the graph it rewrites: the real parameters behind placeholders,
    the fake mode of the trace, zero-copy weight packing, and finalizers to run after compile_fx."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: DepOptions):
        self.gm, self.graph, self.options = gm, gm.graph, options
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.real: dict[Node, Any] = dict(zip(placeholders, example_inputs))
        self.fake_mode = next((v.fake_mode for v in map(val, placeholders) if hasattr(v, "fake_mode")), None)
        self.finalizers: list[Callable[[], None]] = []

    def param(self, node: Any, what: str) -> torch.Tensor:
        """The real nn.Parameter behind a placeholder, or NoMatch naming ``what``."""
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
        self.finalizers.append(lambda: pack_params(params))
        return list(nodes)

    def layer_region(self, x: Node, output: Node, limit: int = 2000) -> set[Node]:
        """The nodes between the layer input ``x`` and ``output``: ancestors of ``output`` that depend on ``x``.

        The walk stops at ``x`` and at graph inputs, so it stays inside one layer.
        """
        seen, stack = set(), [output]
        while stack:
            n = stack.pop()
            if n in seen or n is x or n.op in ("placeholder", "get_attr"):
                continue
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
            for u in n.users:
                require(u in region or n is output,
                        f"intermediate {n.name} has a user outside the layer ({u.name}); rewrite would drop it", n)

    def replace(self, region: Iterable[Node], output: Node, target, args: tuple, layer: str) -> Node:
        """Replace ``region`` (whose only value used outside is ``output``) by one call to ``target``.

        The call is inserted where ``output`` stood; ``nn_module_stack`` and ``stack_trace`` are
        copied from ``output``, and its fake value is computed in the trace's fake mode. Region
        nodes are erased, then any pure node that only fed them (casts, views, norms).
        """
        region = set(region)
        self.check_region(region, output)
        with self.graph.inserting_before(output):
            new = self.graph.call_function(target, args)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in output.meta:
                new.meta[key] = output.meta[key]
        new.meta["example_value"] = self._fake_call(target, args)
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

    def _fake_call(self, target, args):
        vals = fx.node.map_aggregate(args, lambda a: val(a) if isinstance(a, Node) else a)
        if self.fake_mode is None:
            return None
        with self.fake_mode:
            return target(*vals)


_PLUMBING = ("float", "to", "bfloat16", "view", "reshape", "split", "chunk", "contiguous", operator.getitem,
             torch.split, torch.reshape, F.rms_norm, torch.rms_norm, F.layer_norm, torch.layer_norm)


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
    while isinstance(node, Node) and node.op == "call_method" and node.target in ("squeeze", "view", "reshape", "contiguous"):
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


def check_only_user(cache: Node, user: Node, what: str) -> None:
    """Mutation safety: the cache's only reader/writer in the graph is the op being replaced."""
    require(set(cache.users) == {user}, f"{what} has other users ({', '.join(u.name for u in cache.users)})", cache)


__all__ = ["PassContext", "LayerPass", "Found", "NoMatch", "require", "check_bf16", "check_only_user", "strip_view"]
