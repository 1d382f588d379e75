"""Post-grad replacements of mutating ops: a new ``auto_functionalized_v2`` call that takes over the
bases, view kwargs and updated-base outputs of the calls it replaces (docs/design.md §5.2(b))."""

from __future__ import annotations

import operator

import torch.fx as fx

from .calls import AF_V2, base_outputs, is_functionalized, mutated_names, position, require, val

Node = fx.Node


def replace_functionalized(graph: fx.Graph, region: set[Node], output: Node, target, args: tuple) -> Node:
    """Post-grad: call mutating ``target`` as ``auto_functionalized_v2``, taking each mutated
    argument's base and view kwargs (``_<arg>_base_index``, ``_size``/``_stride``/``_storage_offset``,
    ``_slice_*``, ``_alias``) from the wrapped call in ``region`` that mutated the argument of the
    same name, with ``_all_bases`` concatenated. The old calls' updated-base getitems are
    redirected to the new call's; ``eager_input_vals`` is rebuilt from the new node's inputs.
    Returns the getitem of the op's output.
    """
    schema = target._schema
    names = [a.name for a in schema.arguments]
    mutated = mutated_names(schema)
    olds = sorted((n for n in region if is_functionalized(n)), key=position)
    for n in olds:
        require(n.target is AF_V2, "mutating op is wrapped in auto_functionalized v1; only v2 is rewritten "
                "(set Inductor's enable_auto_functionalized_v2=True)", n)
    kwargs = {k: v for k, v in zip(names, args) if k not in mutated}
    bases: list[Node] = []
    moved: dict[Node, int] = {}  # old updated-base getitem -> index in the new _all_bases
    offsets: dict[Node, int] = {}
    for n in olds:
        offsets[n] = len(bases)
        for b in n.kwargs["_all_bases"]:
            require(b not in bases, f"two replaced ops mutate one base {getattr(b, 'name', b)}", n)
            bases.append(b)
        for i, g in base_outputs(n).items():
            moved[g] = offsets[n] + i
    taken: set[str] = set()
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
                taken.add(k)
    for n in olds:  # every view kwarg of the replaced calls must belong to a mutated arg of the new op
        extra = [k for k in n.kwargs if k.startswith("_") and k != "_all_bases" and k not in taken]
        require(not extra, f"replaced call mutates {extra}, which the new op does not take", n)
    kwargs["_all_bases"] = bases
    out_val = val(output)
    with graph.inserting_before(output):
        af = graph.call_function(AF_V2, (target,), kwargs)
        outs = [graph.call_function(operator.getitem, (af, i)) for i in range(len(bases) + 1)]
    outs[0].meta["val"] = out_val
    for g, j in moved.items():
        outs[j + 1].meta["val"] = val(g)
    for j, o in enumerate(outs[1:]):
        if "val" not in o.meta:
            o.meta["val"] = val(bases[j])
    af.meta["val"] = tuple(o.meta["val"] for o in outs)
    af.meta["eager_input_vals"] = eager_vals(af)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in output.meta:
            for n in (af, *outs):
                n.meta[key] = output.meta[key]
    for g, j in moved.items():
        g.replace_all_uses_with(outs[j + 1])
        graph.erase_node(g)  # else the old call keeps a user and survives (and runs)
    for o in outs[1:]:
        if not o.users:
            graph.erase_node(o)
    return outs[0]


def eager_vals(node: Node):
    """``eager_input_vals`` of a new node, from its own inputs (fake values; non-tensors None)."""
    return fx.node.map_aggregate((node.args, node.kwargs), lambda a: val(a) if isinstance(a, Node) else None)

