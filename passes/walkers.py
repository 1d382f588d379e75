"""Walkers: follow a value back through plumbing, casts, linears and last-dim parts.

Each walker recognises one piece of math in every spelling whose meaning is provably the same
(``F.linear``, ``x @ w.t()``, ``einsum``, post-grad ``mm(x, permute(w))``; ``split``, ``chunk``,
slices, ``narrow``) and adds each node it accounts for to a ``claims`` set. A node of a rewritten
region that no walker claimed and that is not value-preserving plumbing (:func:`is_plumbing`)
keeps the layer stock.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.fx as fx

from dep_compile.stock import ops as _stock_ops  # noqa: F401 - registers the kimi_k3 op named below

from .calls import bind, dtype_of, is_call, last_dim, op_args, op_name, require, val

Node = fx.Node
FP8_LINEAR = torch.ops.kimi_k3.fp8_block_linear

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
    attribute = name == "getattr" and node.args[1] in ("T", "mT")  # torch <= 2.13 traces ``w.T`` as the attribute
    return node.args[0] if attribute or name in ("numpy_T", "mT") else None  # torch 2.14: the attribute's aten op


_EINSUM_2D = re.compile(r"^([a-z])([a-z]),([a-z])\2->\1\3$")
_EINSUM_ND = re.compile(r"^\.\.\.([a-z]),([a-z])\1->\.\.\.\2$")


@dataclasses.dataclass
class Linear:
    """``x W^T (+ bias)``: the nodes of input, weight and bias (None), and the call; for an FP8 block-scaled
    linear (``kimi_k3.fp8_block_linear``) also its block scales' node and its row segments."""

    x: Node
    w: Node
    bias: Any
    node: Node
    scale: Node | None = None
    segments: tuple[int, ...] | None = None


def linear_of(node: Any, claims: set | None = None) -> Linear | None:
    """If ``node`` is ``x W^T (+ b)`` however spelled, its parts (claiming the call and the weight's
    transpose); else None.

    Spellings: ``F.linear`` (positional or keyword), ``x @ W.t()``, ``torch.matmul``/``mm``/``.matmul``
    with a transposed weight, ``torch.addmm(b, x, W.t())`` (beta = alpha = 1), ``torch.einsum("tk,nk->tn",
    x, W)`` (any letters, or ``"...k,nk->...n"``), and the aten forms ``mm(x, permute(W, [1, 0]))``; and
    the FP8 block-scaled linear ``kimi_k3.fp8_block_linear(x, W, W_scale, segments)``.
    """
    name = op_name(node)
    if is_call(node, FP8_LINEAR):
        b = op_args(node, FP8_LINEAR.default)
        segments = b["segments"]
        if not isinstance(segments, (list, tuple)) or not all(isinstance(n, int) for n in segments):
            return None
        lin = Linear(b["x"], b["weight"], None, node, b["weight_scale"], tuple(segments))
    elif name == "linear":
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


