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

aten, prims = torch.ops.aten, torch.ops.prims
# Post-grad (aten, functionalized) spellings, as Inductor hands graphs to post_grad_custom_post_pass.
AF_V2 = torch.ops.higher_order.auto_functionalized_v2
AF_V1 = torch.ops.higher_order.auto_functionalized
_ATEN_CASTS = (prims.convert_element_type, aten._to_copy)
_ATEN_VIEWS = (aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze)


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
        for a in overload._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and bases is not None:
                index = node.kwargs.get(f"_{a.name}_base_index")
                require(isinstance(index, int), f"mutated {a.name} has no single base", node)
                bound[a.name] = bases[index]
        return bound
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
    if is_call(node, "t", torch.t, aten.t):
        return src
    if is_call(node, "transpose", torch.transpose, aten.transpose):
        dims = {int(d) for d in node.args[1:3]}
        return src if dims in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1}) else None
    if is_call(node, "permute", torch.permute, aten.permute):
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
    if is_call(node, *_MATMUL_FNS, *_MATMUL_METHODS, aten.mm):
        w = transposed(node.args[1])
        return (node.args[0], w, None) if w is not None else None
    if is_call(node, torch.addmm, "addmm", aten.addmm):
        if any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or len(node.args) > 3:
            return None
        w = transposed(node.args[2])
        return (node.args[1], w, node.args[0]) if w is not None else None
    return None


def is_cast(node: Any, dtype: torch.dtype | None = None) -> bool:
    """A dtype cast (``.float()``, ``.to(dtype)``, ``prims.convert_element_type``), to ``dtype`` if given."""
    if not isinstance(node, Node):
        return False
    if is_call(node, *_ATEN_CASTS):
        if is_call(node, aten._to_copy):
            if set(node.kwargs) - {"dtype"} or len(node.args) != 1:
                return False  # a device / layout / memory-format copy, not a cast
            to = node.kwargs.get("dtype")
        else:
            to = node.args[1]
        return dtype is None or to == dtype
    if not is_call(node, *_CAST_METHODS):
        return False
    if dtype is None:
        return True
    v = val(node)
    return v is not None and v.dtype == dtype


def is_view(node: Any) -> bool:
    """A reshaping view of a projection (``.view``/``.reshape`` or their aten forms)."""
    return is_call(node, "view", "reshape", torch.reshape, *_ATEN_VIEWS)


def strip_casts(node: Any) -> Any:
    """Follow dtype casts (``.float()``, ``.to(dtype)``, ``convert_element_type``) back to their source."""
    while is_cast(node):
        node = node.args[0]
    return node


def uncast(node: Any) -> Any:
    """One dtype cast (``.float()``, ``.to(dtype)``, ``convert_element_type``) back to its source, if ``node`` is one."""
    return node.args[0] if is_cast(node) else node


def getitem_of(node: Any) -> tuple[Node, Any] | None:
    if isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return None


def split_sizes(node: Any) -> tuple[Node, list[int]] | None:
    """If ``node`` splits its input on the last dim by explicit sizes, (input, sizes).

    Post-grad spellings: ``aten.split_with_sizes(x, sizes, dim)``, and ``aten.split.Tensor(x,
    n, dim)`` (equal chunks, as ``chunk`` decomposes) when ``n`` divides the dim exactly.
    """
    x = val(node.args[0]) if isinstance(node, Node) and node.args else None
    if is_call(node, aten.split_with_sizes):
        sizes, dim = arg(node, 1, "split_sizes"), arg(node, 2, "dim", 0)
    elif is_call(node, aten.split):
        size, dim = arg(node, 1, "split_size"), arg(node, 2, "dim", 0)
        if not isinstance(size, int) or x is None or size <= 0 or x.shape[-1] % size:
            return None
        sizes = [size] * (x.shape[-1] // size)
    elif is_call(node, "split", torch.split, "split_with_sizes"):
        sizes = arg(node, 1, "split_size_or_sections", node.kwargs.get("split_size"))
        dim = arg(node, 2, "dim", 0)
    else:
        return None
    if not isinstance(sizes, (list, tuple)) or x is None or dim not in (-1, x.dim() - 1):
        return None
    if is_call(node, aten.split_with_sizes, aten.split) and sum(sizes) != x.shape[-1]:
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


def _is_last_dim(node: Node, dims: Any) -> bool:
    x = val(node)
    return (x is not None and isinstance(dims, (list, tuple)) and len(dims) == 1
            and dims[0] in (-1, x.dim() - 1))


def _binary(node: Any, target, *, scalar: bool = False):
    """(a, b) of ``aten.<target>(a, b)`` (b a Python number when ``scalar``), else None."""
    if not is_call(node, target) or len(node.args) != 2 or (set(node.kwargs) - {"alpha"}):
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args
    if scalar != isinstance(b, (int, float)):
        return None
    return a, b


def _other(node: Node, target, one: Any):
    """The operand of commutative binary ``node`` (aten ``target``) that is not ``one``, else None."""
    ab = _binary(node, target)
    if ab is None:
        return None
    a, b = ab
    return b if a is one else a if b is one else None


def match_rms_norm(node: Any, into: set | None = None) -> tuple[Node, Node, float]:
    """``(F.rms_norm(x.float(), shape, w.float(), eps)).to(dtype)`` -> (x, w, eps); else NoMatch.

    Post-grad (decomposed) form: ``xf = convert(x, f32); r = rsqrt(mean(pow(xf, 2), [-1], keepdim)
    + eps); convert(mul(mul(xf, r), convert(w, f32)), dtype)``. Its nodes are added to ``into``.
    """
    inner = node.args[0] if is_cast(node) else node
    if is_call(inner, F.rms_norm, torch.rms_norm):
        w = arg(inner, 2, "weight")
        eps = arg(inner, 3, "eps")
        require(w is not None and isinstance(eps, float), "RMSNorm without weight or eps", node)
        return uncast(inner.args[0]), uncast(w), eps
    require(is_call(inner, aten.mul), "expected an RMSNorm", node)
    # mul(normed, w) with normed = mul(xf, rsqrt(...)); either operand order
    for normed, w in (inner.args, inner.args[::-1]):
        if is_call(normed, aten.mul) and not isinstance(w, (int, float)):
            break
    else:
        raise NoMatch("expected an RMSNorm", node)
    xf, r = None, None
    for a, b in (normed.args, normed.args[::-1]):
        if is_call(b, aten.rsqrt):
            xf, r = a, b
    require(r is not None, "expected an RMSNorm (no rsqrt)", node)
    ms_eps = _binary(r.args[0], aten.add, scalar=True)
    require(ms_eps is not None, "RMSNorm without eps", r)
    ms, eps = ms_eps
    require(is_call(ms, aten.mean) and _is_last_dim(xf, arg(ms, 1, "dim")) and arg(ms, 2, "keepdim", False) is True,
            "RMSNorm is not a mean over the last dim", ms)
    sq = ms.args[0]
    require(_binary(sq, aten.pow, scalar=True) == (xf, 2) or _other(sq, aten.mul, xf) is xf,
            "RMSNorm does not square its input", sq)
    require(is_cast(xf, torch.float32), "RMSNorm input is not cast to FP32", xf)
    require(val(w) is not None and val(w).dtype == torch.float32, "RMSNorm weight is not FP32", w)
    if into is not None:
        into.update({node, inner, normed, r, r.args[0], ms, sq, xf} | ({w} if is_cast(w) else set()))
    return uncast(xf), uncast(w), float(eps)


def match_layer_norm(node: Any, into: set | None = None) -> tuple[Node, Node, Node, float]:
    """``F.layer_norm(x.float(), shape, w.float(), b.float(), eps).to(dtype)`` -> (x, w, b, eps).

    Post-grad (decomposed) form: ``xf = convert(x, f32); var, mean = var_mean(xf, [-1],
    correction=0, keepdim); convert(add(mul(mul(sub(xf, mean), rsqrt(add(var, eps))), w), b), dtype)``.
    """
    inner = node.args[0] if is_cast(node) else node
    if is_call(inner, F.layer_norm, torch.layer_norm):
        w, b, eps = arg(inner, 2, "weight"), arg(inner, 3, "bias"), arg(inner, 4, "eps")
        require(w is not None and b is not None and isinstance(eps, float), "LayerNorm without weight/bias/eps", node)
        return uncast(inner.args[0]), uncast(w), uncast(b), eps
    require(is_call(inner, aten.add) and _binary(inner, aten.add) is not None, "expected a LayerNorm", node)
    for scaled, b in (inner.args, inner.args[::-1]):
        if is_call(scaled, aten.mul):
            break
    else:
        raise NoMatch("expected a LayerNorm (no affine scale)", node)
    for normed, w in (scaled.args, scaled.args[::-1]):
        if is_call(normed, aten.mul) and any(is_call(a, aten.rsqrt) for a in normed.args):
            break
    else:
        raise NoMatch("expected a LayerNorm (no normalization)", node)
    centered, r = normed.args if is_call(normed.args[1], aten.rsqrt) else normed.args[::-1]
    sub = _binary(centered, aten.sub)
    require(sub is not None, "LayerNorm does not center its input", centered)
    xf, mean = sub
    var_eps = _binary(r.args[0], aten.add, scalar=True)
    require(var_eps is not None, "LayerNorm without eps", r)
    var, eps = var_eps
    gv, gm = getitem_of(var), getitem_of(mean)
    require(gv is not None and gm is not None and gv[0] is gm[0] and (gv[1], gm[1]) == (0, 1),
            "LayerNorm statistics are not one var_mean", r)
    vm = gv[0]
    require(is_call(vm, aten.var_mean) and vm.args[0] is xf and _is_last_dim(xf, arg(vm, 1, "dim"))
            and vm.kwargs.get("correction") == 0 and vm.kwargs.get("keepdim") is True,
            "LayerNorm statistics are not a biased var_mean over the last dim", vm)
    require(is_cast(xf, torch.float32), "LayerNorm input is not cast to FP32", xf)
    for p, what in ((w, "weight"), (b, "bias")):
        require(val(p) is not None and val(p).dtype == torch.float32, f"LayerNorm {what} is not FP32", p)
    if into is not None:
        into.update({node, inner, scaled, normed, centered, r, r.args[0], var, mean, vm, xf}
                    | {p for p in (w, b) if is_cast(p)})
    return uncast(xf), uncast(w), uncast(b), float(eps)


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
