"""Structural matching helpers for Dynamo FX graphs: linears however spelled, splits, casts, norms."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

Node = fx.Node

_LINEAR_FNS = {F.linear, torch._C._nn.linear}
_MATMUL_FNS = {torch.matmul, operator.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
_CAST_METHODS = {"float", "bfloat16", "half", "to", "type"}


class NoMatch(Exception):
    """A structural check failed: ``reason`` says which, ``node`` where."""

    def __init__(self, reason: str, node: Node | None = None):
        super().__init__(reason)
        self.reason, self.node = reason, node


def require(cond: Any, reason: str, node: Node | None = None) -> None:
    if not cond:
        raise NoMatch(reason, node)


def val(node: Any):
    """The fake value Dynamo recorded for a node (None for non-nodes)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def is_call(node: Any, *targets) -> bool:
    """True if ``node`` calls one of ``targets`` (functions, op packets or overloads, method names)."""
    if not isinstance(node, Node):
        return False
    for t in targets:
        if isinstance(t, str):
            if node.op == "call_method" and node.target == t:
                return True
        elif node.op == "call_function":
            if node.target is t or getattr(node.target, "overloadpacket", None) is t:
                return True
    return False


def op_args(node: Node, overload) -> dict[str, Any]:
    """Bind a custom-op call's args and kwargs to its schema's argument names."""
    names = [a.name for a in overload._schema.arguments]
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def transposed(node: Any) -> Node | None:
    """If ``node`` is a 2-D transpose of some tensor (``w.t()``, ``w.T``, ``transpose``, ``permute``), that tensor."""
    if not isinstance(node, Node):
        return None
    src = node.args[0] if node.args else None
    if is_call(node, "t", torch.t):
        return src
    if is_call(node, "transpose", torch.transpose):
        dims = {int(d) for d in node.args[1:3]}
        return src if dims in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1}) else None
    if is_call(node, "permute", torch.permute):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return src if list(dims) == [1, 0] else None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return src
    return None


def as_linear(node: Any) -> tuple[Node, Node, Any] | None:
    """If ``node`` is ``x W^T (+ b)`` however spelled, (x, W, b); else None.

    Spellings: ``F.linear``, ``x @ W.t()``, ``torch.matmul``/``mm``/``.matmul`` with a transposed
    weight, ``torch.addmm(b, x, W.t())``.
    """
    if not isinstance(node, Node):
        return None
    if is_call(node, *_LINEAR_FNS):
        return node.args[0], node.args[1], arg(node, 2, "bias")
    if is_call(node, *_MATMUL_FNS, *_MATMUL_METHODS):
        w = transposed(node.args[1])
        return (node.args[0], w, None) if w is not None else None
    if is_call(node, torch.addmm, "addmm"):
        w = transposed(node.args[2])
        return (node.args[1], w, node.args[0]) if w is not None else None
    return None


def strip_casts(node: Any) -> Any:
    """Follow dtype casts (``.float()``, ``.to(dtype)``) back to their source."""
    while isinstance(node, Node) and is_call(node, *_CAST_METHODS):
        node = node.args[0]
    return node


def uncast(node: Any) -> Any:
    """One dtype cast (``.float()``, ``.to(dtype)``) back to its source, if ``node`` is one."""
    return node.args[0] if isinstance(node, Node) and is_call(node, *_CAST_METHODS) else node


def getitem_of(node: Any) -> tuple[Node, Any] | None:
    if isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return None


def split_sizes(node: Any) -> tuple[Node, list[int]] | None:
    """If ``node`` splits its input on the last dim by explicit sizes, (input, sizes)."""
    if not is_call(node, "split", torch.split, "split_with_sizes"):
        return None
    sizes = arg(node, 1, "split_size_or_sections", node.kwargs.get("split_size"))
    dim = arg(node, 2, "dim", 0)
    x = val(node.args[0])
    if not isinstance(sizes, (list, tuple)) or x is None or dim not in (-1, x.dim() - 1):
        return None
    return node.args[0], [int(s) for s in sizes]


def split_part(node: Any) -> tuple[Node, int, list[int]] | None:
    """If ``node`` is part ``i`` of a last-dim split by sizes (method or function), (input, i, sizes)."""
    gi = getitem_of(node)
    if gi is None:
        return None
    src, index = gi
    s = split_sizes(src)
    if s is not None and isinstance(index, int):
        return s[0], index, s[1]
    return None


def single_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def match_rms_norm(node: Any) -> tuple[Node, Node, float]:
    """``(F.rms_norm(x.float(), shape, w.float(), eps)).to(dtype)`` -> (x, w, eps); else NoMatch."""
    inner = node.args[0] if is_call(node, *_CAST_METHODS) else node
    require(is_call(inner, F.rms_norm, torch.rms_norm), "expected an RMSNorm", node)
    w = arg(inner, 2, "weight")
    eps = arg(inner, 3, "eps")
    require(w is not None and isinstance(eps, float), "RMSNorm without weight or eps", node)
    return uncast(inner.args[0]), uncast(w), eps


def match_layer_norm(node: Any) -> tuple[Node, Node, Node, float]:
    """``F.layer_norm(x.float(), shape, w.float(), b.float(), eps).to(dtype)`` -> (x, w, b, eps)."""
    inner = node.args[0] if is_call(node, *_CAST_METHODS) else node
    require(is_call(inner, F.layer_norm, torch.layer_norm), "expected a LayerNorm", node)
    w, b, eps = arg(inner, 2, "weight"), arg(inner, 3, "bias"), arg(inner, 4, "eps")
    require(w is not None and b is not None and isinstance(eps, float), "LayerNorm without weight/bias/eps", node)
    return uncast(inner.args[0]), uncast(w), uncast(b), eps


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
