"""MoE: router | latent down-proj -> kimi_k3.routed_experts -> latent RMSNorm -> up-proj (+ shared expert)
==>  kimi_dep.moe (the EpMoeLayer schedule) over a packed [shared gate_up | latent down] front."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F

from dep_compile.ops.moe import EpMoeLayer
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.registry import register

from .base import Found, LayerPass, PassContext, check_bf16
from .fx_match import (NoMatch, arg, as_linear, getitem_of, is_call, is_cast, match_rms_norm, op_args, require,
                       single_user, split_sizes, strip_casts, transposed, uncast, val)

aten = torch.ops.aten
Node = torch.fx.Node
EXPERTS = torch.ops.kimi_k3.routed_experts
MOE = torch.ops.kimi_dep.moe


def _const(node, *candidates):
    """The scalar operand of a binary node whose other operand is one of ``candidates``."""
    a, b = node.args[:2]
    if a in candidates and isinstance(b, (int, float)):
        return float(b)
    if b in candidates and isinstance(a, (int, float)):
        return float(a)
    return None


def match_router(ids_node, weights_node, top_k_expected: int):
    """Check the one-group sigmoid top-k router; return (x, gate_w, bias, top_k, scale, region).

    Expected: logits = linear(x.float(), W.float()); scores = sigmoid(logits);
    ids = topk(scores + bias, k).indices; w = gather(scores, ids); w = w / w.sum(-1) * scale.
    """
    gi_node = strip_casts(ids_node)
    gi = getitem_of(gi_node)
    require(gi is not None and gi[1] == 1 and is_call(gi[0], torch.topk, "topk", aten.topk),
            "topk_ids are not topk(...).indices", ids_node)
    topk = gi[0]
    keyed = topk.args[0]
    k = arg(topk, 1, "k")
    if is_call(topk, aten.topk):  # post-grad: topk(x, k, dim=-1, largest=True, sorted=True), all positional
        dim, largest = arg(topk, 2, "dim", -1), arg(topk, 3, "largest", True)
        require(dim in (-1, val(keyed).dim() - 1) and largest is True, "topk is not the largest over the experts", topk)
    require(is_call(keyed, operator.add, torch.add, aten.add) and len(keyed.args) == 2
            and keyed.kwargs.get("alpha", 1) == 1, "expert selection is not scores + correction bias "
            "(grouped top-k, n_group > 1, or no bias)", keyed)
    scores, bias = keyed.args
    if is_call(scores, torch.softmax, F.softmax, "softmax", aten._softmax, aten.softmax):
        raise NoMatch("router scoring is softmax, not sigmoid", scores)
    require(is_call(scores, torch.sigmoid, "sigmoid", aten.sigmoid), "router scores are not sigmoid(logits)", scores)
    lin = as_linear(scores.args[0])
    require(lin is not None and lin[2] is None, "router logits are not a linear of the hidden state", scores)
    x, gate_w = uncast(lin[0]), uncast(lin[1])
    require(val(scores).dtype == torch.float32, "router logits are not FP32", scores)
    require(k == top_k_expected, f"top-k is {k}, expected {top_k_expected} (options moe_top_k)", topk)
    # weights: ((gather(scores, 1, ids) / sum) * scale)
    mul = strip_casts(weights_node)
    require(is_call(mul, operator.mul, torch.mul, aten.mul), "topk_weights are not scaled by routed_scaling_factor", weights_node)
    div = mul.args[0] if isinstance(mul.args[0], torch.fx.Node) else mul.args[1]
    scale = _const(mul, div)
    require(scale is not None and is_call(div, operator.truediv, torch.div, aten.div) and not div.kwargs,
            "topk_weights are not renormalized", mul)
    gather, total = div.args
    require(is_call(gather, "gather", torch.gather, aten.gather) and gather.args[0] is scores
            and strip_casts(arg(gather, 2, "index")) is gi_node,
            "topk_weights are not the selected scores", div)
    require(is_call(total, "sum", torch.sum, aten.sum) and total.args[0] is gather, "renormalization is not by the sum", total)
    if is_call(total, aten.sum):
        require(list(total.args[1]) in ([-1], [val(gather).dim() - 1]) and arg(total, 2, "keepdim", False) is True,
                "renormalization is not a keepdim sum over the selected experts", total)
    region = {topk, gi_node, keyed, scores, scores.args[0], mul, div, gather, total}
    region |= {n for n in (ids_node, weights_node) if n.op in ("call_function", "call_method")}
    return x, gate_w, bias, k, scale, region


def match_situ(out, beta, beta_lin):
    """Check that ``out`` is SiTU(gate_up) with the experts' betas; return (gate_up, region)."""
    region, stack, gate_up = set(), [out], None
    allowed = {"float", "to", "chunk", torch.tanh, torch.sigmoid, operator.truediv, operator.mul, operator.getitem}
    # post-grad spellings: casts, chunk(2) as an equal split, elementwise ops
    post = (torch.ops.prims.convert_element_type.default, aten.tanh.default, aten.sigmoid.default, aten.div.Tensor,
            aten.mul.Tensor)
    consts = set()
    while stack:
        n = stack.pop()
        if n in region:
            continue
        if as_linear(n) is not None:
            gate_up = n if gate_up in (None, n) else None
            require(gate_up is not None, "SiTU reads two projections", out)
            continue
        target = n.target
        if is_call(n, aten.split):
            sp = split_sizes(n)
            require(sp is not None and len(sp[1]) == 2 and sp[1][0] == sp[1][1], "SiTU's gate|up split is not two halves", n)
        else:
            require(n.op in ("call_function", "call_method") and (target in allowed or target in post),
                    f"unexpected op {target} inside SiTU", n)
        region.add(n)
        for a in n.args:
            if isinstance(a, torch.fx.Node):
                stack.append(a)
            elif isinstance(a, float):
                consts.add(a)
    require(gate_up is not None, "shared expert has no gate_up projection", out)
    require({beta, beta_lin} <= consts, f"SiTU constants {sorted(consts)} lack beta={beta}, beta_lin={beta_lin}", out)
    return gate_up, region


def _decomposed_norm_output(xf):
    """Post-grad RMSNorm from its FP32 input cast ``xf``: mul(xf, rsqrt) -> mul(., w) -> cast; the cast, or None."""
    muls = [u for u in xf.users if is_call(u, aten.mul) and any(is_call(a, aten.rsqrt) for a in u.args)]
    if len(muls) != 1:
        return None
    scaled = single_user(muls[0])
    out = single_user(scaled) if scaled is not None else None
    return out if is_cast(out) else None


@dataclasses.dataclass
class MoeMatch:
    """A K3 MoE found by ``dep_moe_supported``: its input, weights, constants and matched region."""

    x: Node
    down_w: Node
    gate_w: Node
    bias: Node
    norm_w: Node
    up_w: Node
    gu_w: Node
    sd_w: Node
    output: Node
    args: dict
    top_k: int
    scale: float
    norm_eps: float
    shared_inter: int
    latent: int
    ep_size: int
    region: set


def dep_moe_supported(ctx: PassContext, R: Node) -> MoeMatch:
    """Check that the MoE around experts call ``R`` is K3's kind; NoMatch names the failed condition.

    K3's kind: a latent down-projection feeding the experts, a latent RMSNorm and up-projection
    after them, a shared SiTU expert added to that, a one-group sigmoid router (correction bias
    for selection only, renormalized, scaled) at top-k = ``options.moe_top_k``, BF16 weights,
    and an expert count that the EP size divides.
    """
    opts = ctx.options
    a = op_args(R, EXPERTS.default)
    x_down = as_linear(a["x"])
    require(x_down is not None and x_down[2] is None, "experts' input is not a latent down-projection", a["x"])
    x, down_w, _ = x_down
    rx, gate_w, bias, top_k, scale, region = match_router(a["topk_ids"], a["topk_weights"], opts.moe_top_k)
    require(rx is x, "router and latent down-proj read different inputs", a["x"])
    # routed -> RMSNorm -> up-proj -> + shared
    n_user = single_user(R)
    require(n_user is not None, "experts' output has several users", R)
    norm_nodes: set = set()
    if is_call(n_user, "float"):
        normed = single_user(single_user(n_user))
    elif is_cast(n_user, torch.float32):  # post-grad: the decomposed norm's output cast, past pow/mean/rsqrt/mul
        normed = _decomposed_norm_output(n_user)
    else:
        normed = None
    require(normed is not None, "no latent RMSNorm after the experts", R)
    r_in, norm_w, norm_eps = match_rms_norm(normed, into=norm_nodes)
    require(r_in is R, "latent RMSNorm does not read the experts' output", normed)
    up = single_user(normed)
    up_lin = as_linear(up)
    require(up_lin is not None and up_lin[0] is normed, "no up-projection after the latent norm", normed)
    if up_lin[2] is not None:  # post-grad: Inductor folded "+ shared" into addmm(shared, normed, up_w^T)
        add, shared_out, sd = up, up_lin[2], as_linear(up_lin[2])
        require(sd is not None and sd[2] is None, "the up-projection's bias is not a shared expert's down_proj", up)
    else:
        add = single_user(up)
        require(add is not None, "no shared expert: up-projection is not added to one", up)
        if is_call(add, aten.addmm) and add.args[0] is up:  # post-grad: addmm(up, situ, down_w^T)
            w = transposed(add.args[2]) if as_linear(add) is not None else None
            require(w is not None, "the add's other operand is not a shared expert's down_proj", add)
            shared_out, sd = add, (add.args[1], w, None)
        else:
            require(is_call(add, operator.add, torch.add, aten.add) and add.kwargs.get("alpha", 1) == 1,
                    "no shared expert: up-projection is not added to one", up)
            shared_out = add.args[1] if add.args[0] is up else add.args[0]
            sd = as_linear(shared_out)
            require(sd is not None and sd[2] is None, "the add's other operand is not a shared expert's down_proj", add)
    gate_up, situ_region = match_situ(sd[0], float(a["beta"]), float(a["beta_lin"]))
    gu = as_linear(gate_up)
    require(gu[0] is x and gu[2] is None, "shared expert reads another input than the router", gate_up)
    gu_w, sd_w = gu[1], sd[1]
    check_bf16("MoE activations/weights", x, down_w, gu_w, sd_w, up_lin[1], a["w13"], a["w2"])
    shared_inter = ctx.param(sd_w, "shared down_proj").shape[1]
    ep_size = int(a["ep_size"])
    E, E_local = ctx.param(gate_w, "router weight").shape[0], val(a["w13"]).shape[0]
    # ep_size 1 with fewer local experts: one rank's share run alone (benchmarks), no dispatch
    require(E == E_local * ep_size or (ep_size == 1 and E % E_local == 0),
            f"{E} experts != {E_local} local x EP size {ep_size}", R)
    require(ctx.param(gu_w, "shared gate_up").shape[0] == 2 * shared_inter, "shared gate_up is not 2x down's width", gu_w)
    latent = ctx.param(down_w, "latent down-proj").shape[0]
    for w, what in ((gate_w, "router weight"), (up_lin[1], "up-proj"), (bias, "correction bias")):
        ctx.param(w, what)
    region |= {a["x"], R, normed, up, add, shared_out, gate_up} | situ_region | norm_nodes
    return MoeMatch(x, down_w, gate_w, bias, norm_w, up_lin[1], gu_w, sd_w, add, a, top_k, scale, norm_eps,
                    shared_inter, latent, ep_size, region)


class MoePass(LayerPass):
    """Rewrites each K3 MoE (``dep_moe_supported``) into one ``kimi_dep.moe`` call."""

    kind = "moe"
    anchors = (EXPERTS,)
    module_up = 1  # the anchor is traced inside mlp.experts; report the mlp
    stock_op = "kimi_k3.routed_experts"

    def rewrite(self, ctx: PassContext, found: Found):
        opts = ctx.options
        m = dep_moe_supported(ctx, found.anchor)
        a = m.args
        prepared = EpMoeLayer(
            shared_inter=m.shared_inter, latent=m.latent, top_k=m.top_k, scale=m.scale, beta=float(a["beta"]),
            beta_lin=float(a["beta_lin"]), norm_eps=m.norm_eps, expert_start=int(a["expert_start"]), ep_size=m.ep_size,
            front_max=opts.front_max, front=DepProjection("moe_front", opts.projection_tables["moe_front"]),
        )
        key = register(found.module, prepared)
        region = ctx.verified_region(m.x, m.output, m.region)
        front = ctx.pack([m.gu_w, m.down_w], "MoE front")
        ctx.replace(region, m.output, MOE.default, (m.x, front, m.gate_w, m.bias, a["w13"], a["w2"], m.norm_w, m.up_w,
                                                    m.sd_w, key), found.module)
        op = "kimi_dep.moe" if m.ep_size == 1 else f"kimi_dep.moe[ep{m.ep_size}]"
        return op, {"moe_front": prepared.front.policies([b for b in opts.batches if b <= opts.front_max])}
