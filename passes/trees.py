"""Expressions of several calls, read by walkers: RMSNorm and LayerNorm in every spelling, and the
operands of a commutative product or sum.

Every check is a ``require`` naming the piece that differs and its node, as in the passes; there is
no second pattern language.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .calls import aten, bind, call, dtype_of, getitem_of, is_call, last_dim, op_name, require, scalar, val
from .walkers import cast_to, fp32_use, upcast_from

Node = fx.Node

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


def _fused_norm(inner: Any, name: str, what: str, claims: set) -> dict:
    """The arguments of a fused ``F.rms_norm`` / ``F.layer_norm`` call: over the last dim, eps a constant."""
    b = call(inner, name, what, claims)
    require(isinstance(b["eps"], float), f"{what}: eps is {b['eps']!r}, not a constant", inner)
    shape = b["normalized_shape"]
    require(isinstance(shape, (list, tuple)) and len(shape) == 1 and shape[0] == val(b["input"]).shape[-1],
            f"{what} normalizes over {shape}, not the last dim", inner)
    return b


def match_rms_norm(node: Any, what: str, claims: set) -> tuple[Node, Node, float]:
    """``node`` is the stock RMSNorm ``F.rms_norm(x.float(), (D,), w.float(), eps).to(x.dtype)`` -> (x, w, eps).

    Also written out by hand, as the post-grad graph decomposes it: ``xf * rsqrt(mean(xf^2, -1,
    keepdim) + eps) * wf``, multiplied in that order (another order rounds differently). The input
    is a BF16 tensor upcast once, the weight a parameter used in FP32, the result cast back to BF16.
    """
    inner = cast_to(node, torch.bfloat16, f"{what} output", claims)
    require(dtype_of(inner) == torch.float32, f"{what} is computed in {dtype_of(inner)}, not FP32", inner)
    if op_name(inner) == "rms_norm":
        b = _fused_norm(inner, "rms_norm", what, claims)
        xf, wf, eps = b["input"], b["weight"], b["eps"]
        require(wf is not None, f"{what} has no weight", inner)
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
        b = _fused_norm(inner, "layer_norm", what, claims)
        xf, wf, bf, eps = b["input"], b["weight"], b["bias"], b["eps"]
        require(wf is not None and bf is not None, f"{what} has no weight or bias", inner)
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




def factors(node: Any, name: str, what: str, claims: set) -> tuple[Any, Any]:
    """The two operands of commutative call ``node`` (``"mul"``, or ``"add"`` with alpha 1) in written
    order, claiming it; the caller tells them apart by what they are, not by their place."""
    b = call(node, name, what, claims)
    require(b.get("alpha", 1) == 1, f"{what}: {name} with alpha {b.get('alpha')}", node)
    return b["input"], b["other"]
