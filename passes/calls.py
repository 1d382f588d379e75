"""Canonical calls: every call of a graph read in one form, whatever its spelling.

Dynamo graphs hold calls as written (``F.linear(input=x, weight=w)``, ``x @ w.t()``, ``x.sigmoid()``,
``x[..., :n]``); Inductor's post-grad graphs hold aten overloads (``aten.mm(x, permute(w))``,
``split_with_sizes``, ``convert_element_type``) and wrap mutating ops in ``auto_functionalized_v2``.
:func:`bind` reads any of them as a canonical op name and its arguments by name (keywords and
positions alike, defaults filled); :func:`op_args` binds a custom op's call (its wrapper's too) to its
schema; :func:`writes` says whether running a node writes into an input. The walkers
(``passes/walkers.py``) and the expressions (``passes/trees.py``) build on these.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

Node = fx.Node

aten, prims = torch.ops.aten, torch.ops.prims
# Post-grad (aten, functionalized) spellings, as Inductor hands graphs to post_grad_custom_post_pass.
AF_V2 = torch.ops.higher_order.auto_functionalized_v2
AF_V1 = torch.ops.higher_order.auto_functionalized


class NoMatch(Exception):
    """A structural check failed: ``reason`` says which, ``node`` where."""

    def __init__(self, reason: str, node: Node | None = None):
        super().__init__(reason)
        self.reason, self.node = reason, node


def require(cond: Any, reason: str, node: Node | None = None) -> None:
    if not cond:
        raise NoMatch(reason, node)


def val(node: Any):
    """The fake value Dynamo (``example_value``) or Inductor (``val``) recorded for a node (None for non-nodes)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None



_OPERATORS = {operator.mul: "mul", operator.truediv: "div", operator.add: "add", operator.sub: "sub",
              operator.neg: "neg", operator.matmul: "matmul", operator.getitem: "getitem", operator.pow: "pow"}
_ALIASES = {"true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub", "__matmul__": "matmul",
            "_softmax": "softmax", "_unsafe_view": "view", "reshape": "view", "split_with_sizes": "split",
            "unsafe_split": "split", "convert_element_type": "cast", "_to_copy": "cast", "float": "cast",
            "bfloat16": "cast", "half": "cast", "double": "cast", "to": "cast", "type": "cast", "_linear": "linear"}
# Argument names by position, for the calls the walkers read (aten overloads bind through their schemas).
_SIGNATURES = {
    "linear": ("input", "weight", "bias"), "matmul": ("input", "other"), "mm": ("input", "other"),
    "addmm": ("input", "mat1", "mat2"), "t": ("input",), "transpose": ("input", "dim0", "dim1"),
    "split": ("input", "split_size_or_sections", "dim"), "chunk": ("input", "chunks", "dim"),
    "narrow": ("input", "dim", "start", "length"), "slice": ("input", "dim", "start", "end", "step"),
    "cat": ("tensors", "dim"), "concat": ("tensors", "dim"), "concatenate": ("tensors", "dim"),
    "rms_norm": ("input", "normalized_shape", "weight", "eps"),
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "mean": ("input", "dim", "keepdim", "dtype"), "sum": ("input", "dim", "keepdim", "dtype"),
    "pow": ("input", "exponent"), "square": ("input",), "rsqrt": ("input",), "add": ("input", "other", "alpha"),
    "sub": ("input", "other", "alpha"), "mul": ("input", "other"), "div": ("input", "other", "rounding_mode"),
    "sigmoid": ("input",), "tanh": ("input",), "topk": ("input", "k", "dim", "largest", "sorted"),
    "gather": ("input", "dim", "index", "sparse_grad"), "getitem": ("input", "index"), "cast": ("input",),
}
_DEFAULTS = {
    "linear": {"bias": None}, "addmm": {"beta": 1, "alpha": 1}, "split": {"dim": 0}, "chunk": {"dim": 0},
    "slice": {"dim": 0, "start": None, "end": None, "step": 1}, "cat": {"dim": 0}, "concat": {"dim": 0},
    "concatenate": {"dim": 0}, "rms_norm": {"weight": None, "eps": None},
    "layer_norm": {"weight": None, "bias": None, "eps": 1e-5}, "mean": {"dim": None, "keepdim": False, "dtype": None},
    "sum": {"dim": None, "keepdim": False, "dtype": None}, "add": {"alpha": 1}, "sub": {"alpha": 1},
    "div": {"rounding_mode": None}, "topk": {"dim": -1, "largest": True, "sorted": True},
    "gather": {"sparse_grad": False},
}
_KW_ALIASES = {"self": "input", "tensor": "input", "mat2": "other", "split_size": "split_size_or_sections",
               "split_sizes": "split_size_or_sections", "sections": "split_size_or_sections", "axis": "dim",
               "x": "input", "a": "input"}


def op_name(node: Any) -> str | None:
    """The canonical name of a call (``"linear"``, ``"mul"``, ``"cast"``, ``"split"``, ...), else None."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        return _ALIASES.get(node.target, node.target)
    if node.op != "call_function":
        return None
    t = node.target
    if t in _OPERATORS:
        return _OPERATORS[t]
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = getattr(t, "overloadpacket", t)
        ns = packet._qualified_op_name.split("::")[0]
        if ns not in ("aten", "prims"):
            return None  # custom ops are matched by identity (is_call)
        name = packet.__name__
        return _ALIASES.get(name, name)
    if t is getattr:
        return "getattr"
    name = getattr(t, "__name__", None)
    module = getattr(t, "__module__", None) or ""
    if not isinstance(name, str) or not (module.startswith("torch") or module == "builtins" and callable(t)):
        return None
    return _ALIASES.get(name, name)


def bind(node: Any) -> dict | None:
    """A call's arguments by canonical name (positional and keyword alike, defaults filled), else None.

    Casts bind ``input`` and their result ``dtype`` (from the node's fake value). Aten overloads bind
    through their schemas; other calls through ``_SIGNATURES``, where an argument the signature does
    not name (``out=``, say) makes the call unbindable.
    """
    name = op_name(node)
    if name is None:
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        names = [_KW_ALIASES.get(a.name, a.name) for a in t._schema.arguments]
        if name == "addmm":
            names = ["input", "mat1", "mat2", "beta", "alpha"]
        out = {n: a.default_value for n, a in zip(names, t._schema.arguments) if a.has_default_value()}
        out.update(zip(names, node.args))
        for k, v in node.kwargs.items():
            out[_KW_ALIASES.get(k, k)] = v
    elif name in ("permute", "view", "einsum", "getattr"):
        return {"args": tuple(node.args), **node.kwargs}
    else:
        sig = _SIGNATURES.get(name)
        if sig is None:
            return {"input": node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))} \
                if len(node.args) <= 1 and set(node.kwargs) <= {"input", "self"} else None
        if name == "cast":
            out = {"input": node.args[0] if node.args else node.kwargs.get("self", node.kwargs.get("input"))}
        else:
            if len(node.args) > len(sig):
                return None
            out = dict(_DEFAULTS.get(name, {}))
            out.update(zip(sig, node.args))
            for k, v in node.kwargs.items():
                k = _KW_ALIASES.get(k, k)
                if k not in sig and k not in _DEFAULTS.get(name, {}):
                    return None
                out[k] = v
    if name == "cast":
        v, src = val(node), val(out.get("input"))
        if not isinstance(v, torch.Tensor) or not isinstance(src, torch.Tensor) or v.device != src.device:
            return None
        out = {"input": out["input"], "dtype": v.dtype}
    return out


def call(node: Any, names: str | tuple, what: str, claims: set | None = None) -> dict:
    """``node``'s bound arguments if it calls one of ``names``; claims it; NoMatch naming ``what`` otherwise."""
    names = (names,) if isinstance(names, str) else names
    require(op_name(node) in names, f"{what} is not {' / '.join(names)}", node if isinstance(node, Node) else None)
    b = bind(node)
    require(b is not None, f"{what}: cannot read the arguments of {op_name(node)}", node)
    if claims is not None:
        claims.add(node)
    return b


def is_call(node: Any, *targets) -> bool:
    """True if ``node`` calls one of ``targets`` (functions, op packets or overloads, method names)."""
    if not isinstance(node, Node):
        return False
    wrapped = functionalized_op(node)
    for t in targets:
        if isinstance(t, str):
            if node.op == "call_method" and node.target == t:
                return True
        elif node.op == "call_function":
            if node.target is t or getattr(node.target, "overloadpacket", None) is t:
                return True
            if wrapped is not None and (wrapped is t or getattr(wrapped, "overloadpacket", None) is t):
                return True
    return False


def functionalized_op(node: Any):
    """The OpOverload an ``auto_functionalized(_v2)`` node wraps (post-grad form of a mutating op), else None."""
    if isinstance(node, Node) and node.op == "call_function" and node.target in (AF_V2, AF_V1):
        return node.args[0]
    return None


def is_functionalized(node: Any) -> bool:
    return functionalized_op(node) is not None


def result(node: Node) -> Node | None:
    """The node holding a call's tensor output: the call itself, or ``getitem(af, 0)`` of an
    ``auto_functionalized`` wrapper (None when nothing reads it)."""
    if not is_functionalized(node):
        return node
    outs = [u for u in node.users if getitem_of(u) == (node, 0)]
    return outs[0] if len(outs) == 1 else None


def producer(node: Any) -> Any:
    """The call that produced ``node``: ``getitem(af, 0)`` -> the ``auto_functionalized`` node; else ``node``."""
    gi = getitem_of(node)
    if gi is not None and gi[1] == 0 and is_functionalized(gi[0]):
        return gi[0]
    return node


def base_outputs(node: Node) -> dict[int, Node]:
    """An ``auto_functionalized_v2`` node's getitems of updated bases: {position in _all_bases: getitem}."""
    out = {}
    for u in node.users:
        gi = getitem_of(u)
        if gi is not None and gi[0] is node and isinstance(gi[1], int) and gi[1] >= 1:
            out[gi[1] - 1] = u
    return out


def op_args(node: Node, overload) -> dict[str, Any]:
    """Bind a custom-op call's args and kwargs to its schema's argument names.

    For an ``auto_functionalized_v2`` wrapper (post-grad graphs), each mutated argument is bound
    to its base in ``_all_bases`` (the buffer the op writes through, possibly a pooled cache the
    argument is a view of); the view kwargs stay on the node. v1 wrappers keep the tensor itself.
    """
    names = [a.name for a in overload._schema.arguments]
    if is_functionalized(node):
        bound = {k: v for k, v in node.kwargs.items() if not k.startswith("_")}
        bases = node.kwargs.get("_all_bases")
        for name in mutated_names(overload) if bases is not None else ():
            index = node.kwargs.get(f"_{name}_base_index")
            require(isinstance(index, int), f"mutated {name} has no single base", node)
            bound[name] = bases[index]
    else:
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
    missing = [a.name for a in overload._schema.arguments if a.name not in bound and not a.has_default_value()]
    require(not missing, f"{overload._schema.name} call lacks {missing}", node)
    return bound


def shapes_of(node: Node, overload, names: tuple) -> dict:
    """The shapes ``overload`` sees for its cache arguments ``names``: the tensors' own, or for an
    ``auto_functionalized_v2`` call the views of their bases (``_<name>_size``)."""
    bound = op_args(node, overload)
    return {name: tuple(node.kwargs.get(f"_{name}_size") or val(bound[name]).shape) for name in names}


# ---- writes in place ------------------------------------------------------------------------------

_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul)
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in _INPLACE_OPERATORS}


def schema_of(node: Node):
    """The schema of an op call (Dynamo records custom ops by their packet: its default overload's), else None."""
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        t = getattr(t, "default", None)
    return getattr(t, "_schema", None)


def mutated_names(op) -> list[str]:
    """The arguments an op (an OpOverload, or its schema) writes in place: those its schema marks ``(a!)``."""
    schema = getattr(op, "_schema", op)
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def written(node: Any) -> list:
    """What running ``node`` writes in place: the self of an in-place method (``x.add_()``,
    ``x.__setitem__``) or operator (``x[i] = y``, ``x += y``), an op's ``(a!)`` arguments, an ``out=``
    tensor, the input of ``inplace=True``; the bases of an ``auto_functionalized`` call, which stands
    for a mutating op."""
    if not isinstance(node, Node) or node.op not in ("call_method", "call_function"):
        return []
    t = node.target
    if node.op == "call_method":
        inplace = t in _INPLACE_DUNDERS or (t.endswith("_") and not t.endswith("__"))
        return list(node.args[:1]) if inplace else []
    if t in _INPLACE_OPERATORS:
        return list(node.args[:1])
    out = [node.kwargs["out"]] if node.kwargs.get("out") is not None else []
    if node.kwargs.get("inplace") is True:
        out += list(node.args[:1]) or [node.kwargs.get("input")]
    if t is AF_V2:
        return out + list(node.kwargs.get("_all_bases", ()))
    if t is AF_V1:
        return out + [node.kwargs.get(name) for name in mutated_names(node.args[0])]
    schema = schema_of(node)
    if schema is not None:
        names = [a.name for a in schema.arguments]
        for name in mutated_names(schema):
            i = names.index(name)
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(name))
    elif not isinstance(t, torch._ops.OpOverload):
        name = getattr(t, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):  # torch.relu_, torch.Tensor.add_
            out += list(node.args[:1])
    return [w for w in out if w is not None]


def writes(node: Any) -> bool:
    """``node`` writes into one of its inputs when it runs (:func:`written`)."""
    return bool(written(node))


def position(node: Node):
    """The node's place in graph order (FX keeps ``_sort_key`` ordered as nodes are inserted)."""
    return node._sort_key


def getitem_of(node: Any) -> tuple[Node, Any] | None:
    if isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return None


def single_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def last_dim(node: Any, dim: Any) -> bool:
    """``dim`` names the last dim of ``node``'s value."""
    v = val(node)
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(v, torch.Tensor) and isinstance(dim, int) and dim in (-1, v.dim() - 1)


def constant(x: Any, what: str, node: Any) -> float:
    """An op's number argument as float; NoMatch where the graph computes it (for one, a Python float
    that ``torch.compile(dynamic=True)`` made a graph input: the value may change without a recompile)."""
    require(scalar(x) is not None, f"{what} is {x.name if isinstance(x, Node) else repr(x)}, not a constant", node)
    return float(x)


UNSPECIALIZED_HINT = ("compile without dynamic=True (automatic dynamic shapes keep floats constant) or set "
                      "torch._dynamo.config.specialize_float = True")


def unspecialized_floats(graph: torch.fx.Graph) -> list[str]:
    """The graph inputs read as Python floats (``item`` of a 0-d floating tensor): the floats
    ``torch.compile(dynamic=True)`` leaves unspecialized."""
    return sorted({n.args[0].name for n in graph.nodes if op_name(n) in ("item", "_local_scalar_dense")
                   and isinstance(n.args[0], Node) and n.args[0].op == "placeholder"
                   and isinstance(val(n.args[0]), torch.Tensor) and val(n.args[0]).dim() == 0
                   and val(n.args[0]).is_floating_point()})


def scalar(x: Any) -> float | None:
    """A Python number argument as float (None for nodes and others)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


# ---- module paths ------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"layers[\.\[]\'?(\d+)")


def module_path(node: Node, up: int = 0) -> str:
    """The module path the node was traced in (``model.layers.3.self_attn``), ``up`` levels above."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<unknown>"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['?([^'\]]+)'?\]", r".\1", path).strip(".")
    parts = path.split(".")
    return ".".join(parts[: len(parts) - up]) if up else path


def layer_index(path: str) -> int | None:
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None
