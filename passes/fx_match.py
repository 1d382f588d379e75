"""FX matching helpers: every call read through one canonical form, whatever its spelling.

Dynamo graphs hold calls as written (``F.linear(input=x, weight=w)``, ``x @ w.t()``, ``x.sigmoid()``,
``x[..., :n]``); Inductor's post-grad graphs hold aten overloads (``aten.mm(x, permute(w))``,
``split_with_sizes``, ``convert_element_type``). :func:`bind` reads any of them as a canonical op
name and its arguments by name (keywords and positions alike, defaults filled), and the walkers
below (:func:`linear_of`, :func:`part_of`, :func:`match_rms_norm`, ...) recognise each piece of
math in every spelling whose meaning is provably the same, adding each node they account for to a
``claims`` set. A node of a rewritten region that no walker claimed and that is not value-preserving
plumbing (:func:`is_plumbing`) keeps the layer stock.
"""

from __future__ import annotations

import dataclasses
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


# ---- canonical calls -----------------------------------------------------------------------------

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
        for a in overload._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and bases is not None:
                index = node.kwargs.get(f"_{a.name}_base_index")
                require(isinstance(index, int), f"mutated {a.name} has no single base", node)
                bound[a.name] = bases[index]
    else:
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
    missing = [a.name for a in overload._schema.arguments if a.name not in bound and not a.has_default_value()]
    require(not missing, f"{overload._schema.name} call lacks {missing}", node)
    return bound


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


# ---- value-preserving plumbing ---------------------------------------------------------------------

_VIEWS = ("view", "contiguous", "clone", "squeeze", "unsqueeze", "flatten", "detach")


def is_plumbing(node: Any) -> bool:
    """A node that leaves values as they are: a reshaping view (row-major order kept), ``contiguous``,
    ``clone``, or a cast to the dtype its input already has. Transposes, casts that change the dtype
    and every arithmetic op are not plumbing."""
    name = op_name(node)
    if name in _VIEWS:  # a ``view(dtype)`` reinterprets bits: only same-dtype views keep values
        src = node.args[0] if node.args else None
        return dtype_of(node) is not None and dtype_of(node) == dtype_of(src)
    if name == "cast":
        b = bind(node)
        return b is not None and dtype_of(b["input"]) == b.get("dtype")
    return False


def skip_identity(node: Any, claims: set | None = None) -> Any:
    """Follow identity casts, ``contiguous``/``clone`` and shape-keeping views back to their source."""
    while is_plumbing(node) and node.args:
        src = node.args[0] if node.args else None
        if not isinstance(src, Node):
            src = bind(node).get("input") if op_name(node) == "cast" else None
        if not isinstance(src, Node):
            break
        v, s = val(node), val(src)
        if not (isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor) and v.shape == s.shape
                and v.dtype == s.dtype):
            break
        if claims is not None:
            claims.add(node)
        node = src
    return node


def unview(node: Any, shape: tuple, what: str, claims: set) -> Node:
    """``node`` is a row-major reshape (chain of views) of a tensor of ``shape``; that tensor."""
    src = node
    while is_plumbing(src):
        claims.add(src)
        src = src.args[0] if src.args and isinstance(src.args[0], Node) else bind(src).get("input")
        v = val(src)
        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape):
            return src
    v = val(src)
    require(isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape), f"{what} is not a reshape of a "
            f"{list(shape)} tensor", node)
    require(dtype_of(src) == dtype_of(node), f"{what} reinterprets a {dtype_of(src)} tensor as {dtype_of(node)}", node)
    return src


def cast_to(node: Any, dtype: torch.dtype, what: str, claims: set) -> Node:
    """``node`` is a cast to ``dtype`` (or already of it, through plumbing): the source tensor."""
    node = skip_identity(node, claims)
    if op_name(node) == "cast":
        b = bind(node)
        require(b is not None and b.get("dtype") == dtype, f"{what} is cast to {b and b['dtype']}, not {dtype}", node)
        claims.add(node)
        return b["input"]
    require(dtype_of(node) == dtype, f"{what} is {dtype_of(node)}, not {dtype}", node)
    return node


def upcast_from(node: Any, src_dtype: torch.dtype, what: str, claims: set) -> Node:
    """``node`` is an exact FP32 copy of a ``src_dtype`` tensor (one upcast, or an FP32 tensor when
    ``src_dtype`` is FP32): that tensor."""
    src = cast_to(node, torch.float32, what, claims)
    require(dtype_of(src) == src_dtype, f"{what} is cast to FP32 from {dtype_of(src)}, not {src_dtype}", node)
    return skip_identity(src, claims)


def fp32_use(node: Any, what: str, claims: set) -> Node:
    """``node`` is a tensor used in FP32 exactly as stored: an FP32 tensor, or one upcast of a BF16 /
    FP32 one; the stored tensor (a parameter, checked by the caller)."""
    src = cast_to(node, torch.float32, what, claims)
    require(dtype_of(src) in (torch.bfloat16, torch.float32), f"{what} is upcast from {dtype_of(src)}", node)
    return skip_identity(src, claims)


# ---- linears -------------------------------------------------------------------------------------

def transposed(node: Any) -> Node | None:
    """If ``node`` is a 2-D transpose of some tensor (``w.t()``, ``w.T``, ``transpose``, ``permute``), that tensor."""
    name = op_name(node)
    v = val(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return None
    if name == "t":
        return bind(node)["input"]
    if name == "transpose":
        b = bind(node)
        return b["input"] if b and {int(b["dim0"]) % 2, int(b["dim1"]) % 2} == {0, 1} else None
    if name == "permute":
        args = node.args[1:]
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        dims = dims or node.kwargs.get("dims", ())
        return node.args[0] if [int(d) % 2 for d in dims] == [1, 0] else None
    if name == "getattr" and node.args[1] in ("T", "mT"):
        return node.args[0]
    return None


_EINSUM_2D = re.compile(r"^([a-z])([a-z]),([a-z])\2->\1\3$")
_EINSUM_ND = re.compile(r"^\.\.\.([a-z]),([a-z])\1->\.\.\.\2$")


@dataclasses.dataclass
class Linear:
    """``x W^T (+ bias)``: the nodes of input, weight and bias (None), and the call."""

    x: Node
    w: Node
    bias: Any
    node: Node


def linear_of(node: Any, claims: set | None = None) -> Linear | None:
    """If ``node`` is ``x W^T (+ b)`` however spelled, its parts (claiming the call and the weight's
    transpose); else None.

    Spellings: ``F.linear`` (positional or keyword), ``x @ W.t()``, ``torch.matmul``/``mm``/``.matmul``
    with a transposed weight, ``torch.addmm(b, x, W.t())`` (beta = alpha = 1), ``torch.einsum("tk,nk->tn",
    x, W)`` (any letters, or ``"...k,nk->...n"``), and the aten forms ``mm(x, permute(W, [1, 0]))``.
    """
    name = op_name(node)
    if name == "linear":
        b = bind(node)
        if b is None or b.get("input") is None or b.get("weight") is None:
            return None
        lin = Linear(b["input"], b["weight"], b["bias"], node)
    elif name in ("matmul", "mm"):
        b = bind(node)
        w = transposed(b["other"]) if b else None
        if w is None:
            return None
        if claims is not None:
            claims.add(b["other"])
        lin = Linear(b["input"], w, None, node)
    elif name == "addmm":
        b = bind(node)
        w = transposed(b["mat2"]) if b else None
        if w is None or b.get("beta", 1) != 1 or b.get("alpha", 1) != 1:
            return None
        if claims is not None:
            claims.add(b["mat2"])
        lin = Linear(b["mat1"], w, b["input"], node)
    elif name == "einsum":
        args = list(node.args)
        eq = args[0] if args and isinstance(args[0], str) else None
        ops = args[1:] if eq else []
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        if eq is None or len(ops) != 2 or node.kwargs:
            return None
        eq = eq.replace(" ", "")
        m = _EINSUM_2D.match(eq) or _EINSUM_ND.match(eq)
        if m is None or len(set(m.groups())) != len(m.groups()):
            return None
        lin = Linear(ops[0], ops[1], None, node)
    else:
        return None
    wv = val(lin.w)
    if not isinstance(wv, torch.Tensor) or wv.dim() != 2 or not isinstance(lin.x, Node):
        return None
    if claims is not None:
        claims.add(node)
    return lin


def linear(node: Any, what: str, claims: set, bias: bool = False) -> Linear:
    """``node`` is a bias-free linear (or with a bias when ``bias``): its parts; NoMatch otherwise."""
    lin = linear_of(node, claims)
    require(lin is not None, f"{what} is not a linear (x W^T)", node if isinstance(node, Node) else None)
    if not bias:
        require(lin.bias is None, f"{what} has a bias", node)
    return lin


# ---- last-dim parts (split, chunk, slices, narrow) -------------------------------------------------

def _split_bounds(node: Node) -> tuple[Node, list[tuple[int, int]]] | None:
    """A last-dim split / chunk of ``input``: (input, [(lo, hi) per part])."""
    b = bind(node)
    name = op_name(node)
    if b is None or not last_dim(b.get("input"), b.get("dim")):
        return None
    size = val(b["input"]).shape[-1]
    if not isinstance(size, int):
        return None
    if name == "split":
        s = b["split_size_or_sections"]
        if isinstance(s, int) and not isinstance(s, bool) and s > 0:
            sizes = [min(s, size - i) for i in range(0, size, s)]
        elif isinstance(s, (list, tuple)) and all(isinstance(v, int) for v in s) and sum(s) == size:
            sizes = list(s)
        else:
            return None
    elif name == "chunk":
        n = b["chunks"]
        if not isinstance(n, int) or n <= 0:
            return None
        step = -(-size // n)
        sizes = [min(step, size - i) for i in range(0, size, step)]
    else:
        return None
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + s))
        lo += s
    return b["input"], bounds


def _slice_bounds(s: Any, size: int) -> tuple[int, int] | None:
    if not isinstance(s, slice) or s.step not in (None, 1):
        return None
    lo, hi = s.start, s.stop
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (lo, hi)):
        return None
    lo, hi, _ = slice(lo, hi).indices(size)
    return (lo, max(lo, hi))


def _direct_part(node: Any) -> tuple[Node, int, int] | None:
    """One level: ``node`` is the last-dim range [lo, hi) of some tensor: (tensor, lo, hi)."""
    name = op_name(node)
    if name == "getitem":
        src, index = node.args
        if isinstance(src, Node) and op_name(src) in ("split", "chunk"):
            sb = _split_bounds(src)
            if sb is None or not isinstance(index, int) or not -len(sb[1]) <= index < len(sb[1]):
                return None
            lo, hi = sb[1][index]
            return sb[0], lo, hi
        v = val(src)
        if not isinstance(v, torch.Tensor) or not isinstance(v.shape[-1], int):
            return None
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) == 2 and idx[0] is Ellipsis:
            last = idx[1]
        elif len(idx) == v.dim() and all(isinstance(i, slice) and i == slice(None) for i in idx[:-1]):
            last = idx[-1]
        else:
            return None
        bounds = _slice_bounds(last, v.shape[-1])
        return (src, *bounds) if bounds else None
    if name in ("slice", "narrow"):
        b = bind(node)
        if b is None or not last_dim(b["input"], b["dim"]):
            return None
        size = val(b["input"]).shape[-1]
        if name == "slice":
            if b["step"] != 1:
                return None
            lo, hi = b["start"], b["end"]
            bounds = _slice_bounds(slice(lo, hi if hi is None or hi < (1 << 62) else None), size)
        else:
            start, length = b["start"], b["length"]
            if not isinstance(start, int) or not isinstance(length, int):
                return None
            start = start + size if start < 0 else start
            bounds = (start, start + length) if 0 <= start and start + length <= size else None
        return (b["input"], *bounds) if bounds else None
    return None


def part_of(node: Any, claims: set | None = None) -> tuple[Node, int, int] | None:
    """If ``node`` is the last-dim range [lo, hi) of a tensor, through nested splits, chunks, slices
    and narrows (ranges composed): (that tensor, lo, hi), claiming the nodes on the way; else None."""
    got = _direct_part(node)
    if got is None:
        return None
    path = [node]
    src, lo, hi = got
    if op_name(node) == "getitem" and op_name(node.args[0]) in ("split", "chunk"):
        path.append(node.args[0])
    inner = part_of(src, claims)
    if inner is not None:
        src, lo, hi = inner[0], inner[1] + lo, inner[1] + hi
    if claims is not None:
        claims.update(path)
    return src, lo, hi


# ---- norms -------------------------------------------------------------------------------------

def _other(node: Any, name: str, one: Any) -> Any:
    """The operand of commutative ``name`` call ``node`` that is not ``one`` (None if neither is)."""
    b = bind(node) if op_name(node) == name else None
    if b is None:
        return None
    a, c = b["input"], b["other"]
    return c if a is one else a if c is one else None


def _match_rsqrt_ms(r: Any, xf: Node, claims: set, what: str) -> float:
    """``rsqrt(mean(xf^2, -1, keepdim) + eps)``: returns eps."""
    rb = call(r, "rsqrt", f"{what}: the normalizer", claims)
    add = rb["input"]
    ab = call(add, "add", f"{what}: mean square + eps", claims)
    require(ab.get("alpha", 1) == 1, f"{what}: eps is added with alpha {ab.get('alpha')}", add)
    ms, eps = ab["input"], scalar(ab["other"])
    if eps is None:
        ms, eps = ab["other"], scalar(ab["input"])
    require(eps is not None, f"{what}: eps is not a constant", add)
    mb = call(ms, "mean", f"{what}: mean square", claims)
    require(last_dim(mb["input"], mb["dim"]) and mb.get("keepdim") is True and mb.get("dtype") is None,
            f"{what}: the mean is not over the last dim with keepdim", ms)
    sq = mb["input"]
    name = op_name(sq)
    if name == "pow":
        pb = call(sq, "pow", f"{what}: square", claims)
        require(pb["input"] is xf and scalar(pb["exponent"]) == 2.0, f"{what} does not square its input", sq)
    elif name == "square":
        require(call(sq, "square", f"{what}: square", claims)["input"] is xf, f"{what} does not square its input", sq)
    else:
        mb2 = call(sq, "mul", f"{what}: square", claims)
        require(mb2["input"] is xf and mb2["other"] is xf, f"{what} does not square its input", sq)
    return eps


def match_rms_norm(node: Any, what: str, claims: set) -> tuple[Node, Node, float]:
    """``node`` is the stock RMSNorm ``F.rms_norm(x.float(), (D,), w.float(), eps).to(x.dtype)`` -> (x, w, eps).

    Also written out by hand, as the post-grad graph decomposes it: ``xf * rsqrt(mean(xf^2, -1,
    keepdim) + eps) * wf``, multiplied in that order (another order rounds differently). The input
    is a BF16 tensor upcast once, the weight a parameter used in FP32, the result cast back to BF16.
    """
    inner = cast_to(node, torch.bfloat16, f"{what} output", claims)
    require(dtype_of(inner) == torch.float32, f"{what} is computed in {dtype_of(inner)}, not FP32", inner)
    if op_name(inner) == "rms_norm":
        b = call(inner, "rms_norm", what, claims)
        xf, wf, eps = b["input"], b["weight"], b["eps"]
        require(wf is not None, f"{what} has no weight", inner)
        require(isinstance(eps, float), f"{what}: eps is {eps!r}, not a constant", inner)
        shape = b["normalized_shape"]
        require(isinstance(shape, (list, tuple)) and len(shape) == 1 and shape[0] == val(xf).shape[-1],
                f"{what} normalizes over {shape}, not the last dim", inner)
    else:
        outer = call(inner, "mul", what, claims)
        wf, normed = None, None
        for a, c in ((outer["input"], outer["other"]), (outer["other"], outer["input"])):
            if op_name(a) == "mul":
                normed, wf = a, c
                break
        require(normed is not None, f"{what} is not x * rsqrt(mean(x^2) + eps) * w", inner)
        nb = call(normed, "mul", what, claims)
        xf = r = None
        for a, c in ((nb["input"], nb["other"]), (nb["other"], nb["input"])):
            if op_name(c) == "rsqrt":
                xf, r = a, c
        require(r is not None, f"{what} has no rsqrt(mean square + eps)", normed)
        eps = _match_rsqrt_ms(r, xf, claims, what)
    x = upcast_from(xf, torch.bfloat16, f"{what} input", claims)
    return x, fp32_use(wf, f"{what} weight", claims), float(eps)


def match_layer_norm(node: Any, what: str, claims: set) -> tuple[Node, Node, Node, float]:
    """``node`` is ``F.layer_norm(x.float(), (D,), w.float(), b.float(), eps).to(x.dtype)`` -> (x, w, b, eps).

    Post-grad (decomposed) form: ``xf = convert(x, f32); var, mean = var_mean(xf, [-1],
    correction=0, keepdim); convert(add(mul(mul(sub(xf, mean), rsqrt(add(var, eps))), w), b), bf16)``.
    """
    inner = cast_to(node, torch.bfloat16, f"{what} output", claims)
    require(dtype_of(inner) == torch.float32, f"{what} is computed in {dtype_of(inner)}, not FP32", inner)
    if op_name(inner) == "layer_norm":
        b = call(inner, "layer_norm", what, claims)
        xf, wf, bf, eps = b["input"], b["weight"], b["bias"], b["eps"]
        require(wf is not None and bf is not None, f"{what} has no weight or bias", inner)
        require(isinstance(eps, float), f"{what}: eps is {eps!r}, not a constant", inner)
        shape = b["normalized_shape"]
        require(isinstance(shape, (list, tuple)) and len(shape) == 1 and shape[0] == val(xf).shape[-1],
                f"{what} normalizes over {shape}, not the last dim", inner)
    else:
        ab = call(inner, "add", what, claims)
        require(ab.get("alpha", 1) == 1, f"{what}: the bias is added with alpha", inner)
        scaled = next((a for a in (ab["input"], ab["other"]) if op_name(a) == "mul"), None)
        require(scaled is not None, f"{what} has no affine scale", inner)
        bf = _other(inner, "add", scaled)
        sb = call(scaled, "mul", what, claims)
        normed = next((a for a in (sb["input"], sb["other"]) if op_name(a) == "mul"
                       and any(op_name(o) == "rsqrt" for o in bind(a).values() if isinstance(o, Node))), None)
        require(normed is not None, f"{what} has no normalization", scaled)
        wf = _other(scaled, "mul", normed)
        nb = call(normed, "mul", what, claims)
        centered, r = (nb["input"], nb["other"]) if op_name(nb["other"]) == "rsqrt" else (nb["other"], nb["input"])
        cb = call(centered, "sub", f"{what} centering", claims)
        require(cb.get("alpha", 1) == 1, f"{what}: centering with alpha", centered)
        xf, mean = cb["input"], cb["other"]
        rb = call(r, "rsqrt", what, claims)
        vb = call(rb["input"], "add", f"{what}: var + eps", claims)
        var, eps = vb["input"], scalar(vb["other"])
        require(eps is not None and vb.get("alpha", 1) == 1, f"{what}: eps is not a constant", rb["input"])
        gv, gm = getitem_of(var), getitem_of(mean)
        require(gv is not None and gm is not None and gv[0] is gm[0] and (gv[1], gm[1]) == (0, 1),
                f"{what}: statistics are not one var_mean", r)
        vm = gv[0]
        require(is_call(vm, aten.var_mean) and vm.args[0] is xf and last_dim(xf, vm.args[1] if len(vm.args) > 1
                                                                             else vm.kwargs.get("dim"))
                and vm.kwargs.get("correction") == 0 and vm.kwargs.get("keepdim") is True,
                f"{what}: statistics are not a biased var_mean over the last dim", vm)
        claims.update({var, mean, vm})
    x = upcast_from(xf, torch.bfloat16, f"{what} input", claims)
    return x, fp32_use(wf, f"{what} weight", claims), fp32_use(bf, f"{what} bias", claims), float(eps)


# ---- expression trees --------------------------------------------------------------------------

_COMMUTATIVE = ("mul", "add")


def match_tree(node: Any, pattern: tuple, binds: dict, claims: set) -> bool:
    """Match ``node`` against ``pattern``, binding variables in ``binds`` and claiming matched calls.

    Patterns: ``("var", name)`` binds a node (through plumbing; one name, one node), ``("const", c)``
    a Python number equal to ``c``, ``(op, *operands)`` a call of canonical ``op`` with those operands
    (``mul`` and ``add`` in either order; ``add`` / ``sub`` with alpha 1, ``div`` without rounding).
    On failure ``binds`` and ``claims`` are left as they were.
    """
    kind = pattern[0]
    if kind == "var":
        n = skip_identity(node) if isinstance(node, Node) else node
        if not isinstance(n, Node) or binds.get(pattern[1], n) is not n:
            return False
        if isinstance(node, Node) and n is not node:
            skip_identity(node, claims)
        binds[pattern[1]] = n
        return True
    if kind == "const":
        return scalar(node) == float(pattern[1])
    b = bind(node) if op_name(node) == kind else None
    if b is None or b.get("alpha", 1) != 1 or b.get("rounding_mode") is not None:
        return False
    operands = [b[k] for k in ("input", "other") if k in b][: len(pattern) - 1] if len(pattern) > 2 \
        else [b["input"]]
    orders = [operands, operands[::-1]] if kind in _COMMUTATIVE else [operands]
    for order in orders:
        trial_b, trial_c = dict(binds), set(claims)
        if all(match_tree(o, p, trial_b, trial_c) for o, p in zip(order, pattern[1:])):
            binds.clear(); binds.update(trial_b)  # noqa: E702
            claims.clear(); claims.update(trial_c | {node})  # noqa: E702
            return True
    return False


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
