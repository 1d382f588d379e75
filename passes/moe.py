"""MoE: router | latent down-proj -> kimi_k3.routed_experts -> latent RMSNorm -> up-proj, + shared SiTU expert
==>  kimi_dep.moe (the EpMoeLayer schedule) over a packed [shared gate_up | latent down] front.

Unfused (conceptually)::

    scores = sigmoid(linear(x.float(), W_gate.float()))               # FP32 [T, E]
    ids = topk(scores + bias, k, dim=-1, largest=True).indices        # bias steers selection only
    w = gather(scores, -1, ids); w = w / w.sum(-1, keepdim=True) * scale   # FP32, into the experts
    routed = kimi_k3.routed_experts(down(x), w13, w2, w, ids, start, ep, beta, beta_lin)
    out = up(rms(routed)) + down_s(situ(gate_up(x)))                   # situ with the experts' betas

Fused replacement: ``kimi_dep.moe(x, [gate_up_w, down_w], W_gate, bias, w13, w2, norm_w, up_w, down_s_w, layer)``.

Checks (``dep_moe_supported``): every op of the router, the latent norm and SiTU as written above
(constants, dims, ``largest``, ``keepdim``, each cast and its place, gate before up in gate_up), top-k =
``moe_top_k``, FP32 routing weights into the experts, BF16 weights, experts divisible over the EP
group; every other node plumbing; then translation validation.
"""

from __future__ import annotations

import dataclasses

import torch

from dep_compile.ops.moe import EpMoeLayer
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.shapes import size_hint
from dep_compile.stock.mxfp4 import GROUP, Mxfp4Weight, group_size, random_mxfp4
from dep_compile.stock.mxfp4_tiles import Mxfp4Tiles, as_mxfp4, check_tiles, random_tiles, scale_range_why

from .base import Found, LayerPass, PassContext, check_bf16, dense_scales, packed_segments, tagged
from .calls import NoMatch, bind, call, constant, dtype_of, is_call, last_dim, op_args, op_name, require, scalar, val
from .trees import factors, match_rms_norm
from .validate import ProbeInputs, ProbeRandom
from .walkers import cast_to, fp32_use, linear, linear_of, part_of, skip_identity, upcast_from

Node = torch.fx.Node
EXPERTS = torch.ops.kimi_k3.routed_experts
EXPERTS_MXFP4 = torch.ops.kimi_k3.routed_experts_mxfp4  # the experts as K3 ships them (stock/mxfp4.py)
MOE = torch.ops.kimi_dep.moe
MOE_MXFP4 = torch.ops.kimi_dep.moe_mxfp4
MXFP4_TENSORS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def match_router(ids_node, weights_node, top_k_expected: int, claimed: set):
    """Check the one-group sigmoid top-k router; return (x, gate_w, bias, top_k, scale)."""
    ids = skip_identity(ids_node, claimed)
    if op_name(ids) == "cast":  # int64 ids read as int32 (or back): the values are expert indices
        require(dtype_of(ids) in (torch.int32, torch.int64), "topk_ids are cast to a non-integer dtype", ids)
        ids = skip_identity(call(ids, "cast", "topk_ids", claimed)["input"], claimed)
    require(op_name(ids) == "getitem" and ids.args[1] == 1, "topk_ids are not topk(...).indices", ids_node)
    topk = call(ids.args[0], "topk", "the expert selection", claimed)
    claimed.add(ids)
    keyed = topk["input"]
    require(topk["k"] == top_k_expected, f"top-k is {topk['k']}, expected {top_k_expected} (options moe_top_k)",
            ids.args[0])
    require(last_dim(keyed, topk["dim"]), "topk is not over the experts (last dim)", ids.args[0])
    require(topk["largest"] is True, "topk does not select the largest scores", ids.args[0])
    require(op_name(keyed) == "add", "expert selection is not sigmoid scores + correction bias (grouped top-k, "
            "n_group > 1, or no bias)", keyed)
    add = call(keyed, "add", "the selection key", claimed)
    require(add.get("alpha", 1) == 1, "the selection key adds the bias with alpha", keyed)
    scores, bias = add["input"], add["other"]
    if op_name(bias) in ("sigmoid", "softmax") or not isinstance(scores, Node) or scores.op == "placeholder":
        scores, bias = bias, scores
    if op_name(scores) in ("softmax", "_softmax"):
        raise NoMatch("router scoring is softmax, not sigmoid", scores)
    require(op_name(scores) == "sigmoid", "expert selection is not sigmoid scores + correction bias "
            "(grouped top-k, n_group > 1, another scoring, or no bias)", keyed)
    logits = call(scores, "sigmoid", "router scores", claimed)["input"]
    lin = linear(logits, "router logits", claimed)
    require(dtype_of(logits) == torch.float32, "router logits are not FP32", logits)
    x = upcast_from(lin.x, torch.bfloat16, "the router input", claimed)
    gate_w = fp32_use(lin.w, "the router weight", claimed)
    require(isinstance(bias, Node) and dtype_of(bias) == torch.float32, "the correction bias is not an FP32 tensor",
            keyed)
    # weights: (gather(scores, -1, ids) / sum) * scale, FP32 into the experts
    w = skip_identity(weights_node, claimed)
    require(dtype_of(w) == torch.float32, f"topk_weights reach the experts as {dtype_of(w)}, not FP32", weights_node)
    mul = call(w, "mul", "the routing weights' scaling", claimed)
    div, scale = mul["input"], scalar(mul["other"])
    if scale is None:
        div, scale = mul["other"], scalar(mul["input"])
    if scale is None:  # neither operand is a number: name the one that is not the renormalization
        constant(mul["other"] if op_name(mul["input"]) == "div" else mul["input"], "the routed_scaling_factor", w)
    d = call(div, "div", "the renormalization", claimed)
    require(d.get("rounding_mode") is None, "the renormalization rounds", div)
    gather, total = d["input"], d["other"]
    g = call(gather, "gather", "the selected scores", claimed)
    require(g["input"] is scores and last_dim(scores, g["dim"]) and skip_identity(g["index"], claimed) is ids,
            "topk_weights are not the selected (unbiased) scores", gather)
    s = call(total, "sum", "the renormalization's sum", claimed)
    require(s["input"] is gather and last_dim(gather, s["dim"]) and s.get("keepdim") is True and s.get("dtype") is None,
            "renormalization is not a keepdim sum over the selected experts", total)
    return x, gate_w, bias, int(topk["k"]), scale


def _bounded(node, beta: float, what: str, claimed: set):
    """``node`` is ``beta * tanh(v / beta)`` in FP32 (factors in either order): v, through plumbing."""
    a, b = factors(node, "mul", what, claimed)
    t, c = (a, b) if scalar(b) is not None else (b, a)
    require(scalar(c) == beta, f"{what} is scaled by {c if scalar(c) is not None else 'a tensor'}, not {beta}", node)
    d = call(call(t, "tanh", what, claimed)["input"], "div", f"{what}: tanh's argument", claimed)
    require(scalar(d["other"]) == beta and d.get("rounding_mode") is None, f"{what} is not tanh(v / {beta})", t)
    return skip_identity(d["input"], claimed)


def _has_constant_factor(node) -> bool:
    b = bind(node) if op_name(node) == "mul" else None
    return b is not None and any(scalar(b[k]) is not None for k in ("input", "other"))


def match_situ(out, beta: float, beta_lin: float, claimed: set):
    """``out`` is SiTU(gate_up) in FP32, rounded once to BF16, with the experts' betas: the gate_up linear.

    SiTU as the references write it: ``((beta * tanh(g / beta)) * sigmoid(g)) * (beta_lin * tanh(u / beta_lin))``,
    each product's factors in either order, no other association (it rounds differently).
    """
    prod = cast_to(out, torch.bfloat16, "the SiTU output", claimed)
    require(dtype_of(prod) == torch.float32, "SiTU is not computed in FP32", prod)
    what = f"the shared expert's activation (SiTU(beta={beta}, beta_lin={beta_lin}) of gate | up)"
    gate_f, up_f = factors(prod, "mul", what, claimed)
    if _has_constant_factor(gate_f):  # the up factor is the one scaled by a constant
        gate_f, up_f = up_f, gate_f
    u = _bounded(up_f, beta_lin, f"{what}: the up factor", claimed)
    bounded, sig = factors(gate_f, "mul", f"{what}: the gate factor", claimed)
    if op_name(bounded) == "sigmoid":
        bounded, sig = sig, bounded
    g = skip_identity(call(sig, "sigmoid", f"{what}: the gate's sigmoid", claimed)["input"], claimed)
    require(_bounded(bounded, beta, f"{what}: the gate's tanh", claimed) is g,
            f"{what}: its tanh and sigmoid read different gates", gate_f)
    g, u = part_of(g, claimed), part_of(u, claimed)
    require(g is not None and u is not None and g[0] is u[0], "SiTU's gate and up are not halves of one tensor", prod)
    width = val(g[0]).shape[-1]
    require(g[1:] == (0, width // 2) and u[1:] == (width // 2, width) and width % 2 == 0,
            f"SiTU reads gate columns [{g[1]}, {g[2]}) and up [{u[1]}, {u[2]}); expected the first and second "
            f"halves of {width}", prod)
    gate_up = upcast_from(g[0], torch.bfloat16, "gate_up", claimed)
    return linear(gate_up, "the shared expert's gate_up_proj", claimed)


def _up_and_norm(R: Node, claimed: set):
    """The up-projection reading RMSNorm(experts' output): (its Linear, norm weight, eps)."""
    frontier, seen = [R], set()
    for _ in range(16):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                lin = linear_of(u)
                if lin is not None:
                    trial = set(claimed)
                    try:
                        r_in, norm_w, eps = match_rms_norm(lin.x, "the latent RMSNorm", trial)
                    except NoMatch:
                        r_in = None
                    if r_in is R:
                        claimed |= trial
                        linear(u, "the up-projection", claimed, bias=True)
                        return lin, norm_w, eps
                nxt.append(u)
        frontier = nxt
    raise NoMatch("no up-projection reads an RMSNorm of the experts' output", R)


@dataclasses.dataclass
class MoeMatch:
    """A K3 MoE found by ``dep_moe_supported``: its input, weights, constants and claimed nodes."""

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
    claimed: set
    experts: tuple  # the experts' weight nodes: (w13, w2), or MXFP4 (w13 codes, scales, w2 codes, scales)
    mxfp4: bool
    layout: str | None  # MXFP4: "checkpoint", or the tiles made at load time ("tiles 64x128")
    scales: list  # FP8 block-scaled projections: their scales [gate_up, latent down, up, shared down]; empty: BF16
    front_segments: tuple | None  # FP8: the packed front's row segments (None: BF16)

    def probe_inputs(self, rng: ProbeRandom) -> ProbeInputs:
        """A random layer input for the probe, and for MXFP4 experts random codes and E8M0 scales, drawn as tiles of
        the same shape where the weights are tiles (the stock op and the replacement read the same; a MoE writes
        no cache)."""
        xv = val(self.x)
        values = {self.x: rng.randn(xv.shape, xv.dtype)}
        if self.mxfp4:
            for codes, scales in (self.experts[:2], self.experts[2:]):
                w = as_mxfp4("probe", val(codes), val(scales))
                shape = tuple(size_hint(d) for d in w.shape)
                if isinstance(w, Mxfp4Tiles):
                    drawn = random_tiles(shape, w.block_n, w.block_k, rng.g, shape[-1] ** -0.5)
                else:
                    drawn = Mxfp4Weight(*random_mxfp4(shape, rng.g, shape[-1] ** -0.5))
                values[codes], values[scales] = drawn[0].to(rng.device), drawn[1].to(rng.device)
        return ProbeInputs(values, {}, rng.size(xv.shape[0]))


def check_mxfp4_experts(ctx: PassContext, a: dict, latent: int) -> str:
    """The MXFP4 experts' tensors are weights as loaded (the kernels read them as they are), both in the
    checkpoint's layout (uint8 E2M1 codes two a byte and uint8 E8M0 scales, one per 32 inputs) or both tiles
    made at load time (int32 words and int16 scales, one block_k, the up half starting at a tile), in the shapes
    of w13 [E, 2I, Lat] and w2 [E, Lat, I]; returns the layout ("checkpoint", or "tiles 64x128": block_n x block_k)."""
    t = {name: ctx.param(a[name], f"MXFP4 {name} (the kernels read codes and scales as loaded)") for name in MXFP4_TENSORS}
    forms = {}
    for w in ("w13", "w2"):
        codes, scales = t[f"{w}_packed"], t[f"{w}_scale"]
        if codes.dtype == torch.int32:
            require(scales.dtype == torch.int16, f"{w} tile scales are {scales.dtype}, not int16", a[f"{w}_scale"])
            try:
                check_tiles(w, codes, scales)
            except ValueError as e:
                raise NoMatch(str(e), a[f"{w}_scale"]) from None
            forms[w] = Mxfp4Tiles(codes, scales)
            if not ctx.postgrad:  # real weights: the readers agree only on the bytes tile_mxfp4 writes
                why = scale_range_why(forms[w])
                require(why is None, f"{w}: {why}", a[f"{w}_scale"])
            continue
        require(codes.dtype == torch.uint8, f"{w} codes are {codes.dtype}, not uint8 (two E2M1 a byte) nor int32 tiles",
                a[f"{w}_packed"])
        require(scales.dtype == torch.uint8, f"{w} scales are {scales.dtype}, not uint8 E8M0 (MXFP4)", a[f"{w}_scale"])
        g = group_size(codes, scales)
        require(codes.shape[:-1] == scales.shape[:-1] and g == GROUP, f"{w} has one scale per {g} inputs "
                f"({list(scales.shape)} for codes {list(codes.shape)}), not per {GROUP} (MXFP4)", a[f"{w}_scale"])
        forms[w] = Mxfp4Weight(codes, scales)
    w13, w2 = forms["w13"], forms["w2"]
    require(type(w13) is type(w2), "w13 and w2 are in different MXFP4 layouts (tiles and the checkpoint's)",
            a["w2_packed"])
    E, two_i, lat = w13.shape
    require(lat == latent and tuple(w2.shape) == (E, latent, two_i // 2),
            f"MXFP4 expert shapes w13 {list(w13.shape)} / w2 {list(w2.shape)} do not fit latent {latent}",
            a["w13_packed"])
    if isinstance(w13, Mxfp4Weight):
        return "checkpoint"
    require(w13.block_k == w2.block_k and (two_i // 2) % w13.block_n == 0,
            f"MXFP4 tiles w13 {w13.block_n} x {w13.block_k} / w2 {w2.block_n} x {w2.block_k}: the kernels need one "
            f"block_k and the up half ({two_i // 2} gate rows) starting at a tile", a["w13_packed"])
    return f"tiles {w13.block_n}x{w13.block_k}" + ("" if w2.block_n == w13.block_n else f"/{w2.block_n}")


def dep_moe_supported(ctx: PassContext, R: Node) -> MoeMatch:
    """Check that the MoE around experts call ``R`` is K3's kind; NoMatch names the failed condition.

    K3's kind: a latent down-projection feeding the experts, a latent RMSNorm and up-projection
    after them, a shared SiTU expert added to that, a one-group sigmoid router (correction bias
    for selection only, renormalized, scaled) at top-k = ``options.moe_top_k``, BF16 weights,
    and an expert count that the EP size divides.
    """
    opts = ctx.options
    mxfp4 = is_call(R, EXPERTS_MXFP4)
    a = op_args(R, (EXPERTS_MXFP4 if mxfp4 else EXPERTS).default)
    claimed = {R}
    down = linear(skip_identity(a["x"], claimed), "the experts' input (latent down-projection)", claimed)
    x = down.x
    rx, gate_w, bias, top_k, scale = match_router(a["topk_ids"], a["topk_weights"], opts.moe_top_k, claimed)
    require(rx is x, "router and latent down-proj read different inputs", a["x"])
    up, norm_w, norm_eps = _up_and_norm(R, claimed)
    if up.bias is not None:  # post-grad: Inductor folded "+ shared" into addmm(shared, normed, up_w^T)
        add, shared_out = up.node, up.bias
        sd = linear(shared_out, "the shared expert's down_proj", claimed)
    else:
        users = list(up.node.users)
        require(len(users) == 1, "no shared expert: the up-projection is not added to one", up.node)
        add = users[0]
        folded = linear_of(add)
        if folded is not None and folded.bias is up.node:  # post-grad: addmm(up, situ, down_w^T)
            sd = linear(add, "the shared expert's down_proj", claimed, bias=True)
        else:
            require(op_name(add) == "add", "no shared expert: the up-projection is not added to one", add)
            ab = call(add, "add", "the sum of routed and shared outputs", claimed)
            require(ab.get("alpha", 1) == 1, "routed and shared outputs are added with alpha", add)
            shared_out = ab["other"] if ab["input"] is up.node else ab["input"]
            require(up.node in (ab["input"], ab["other"]), "no shared expert added to the up-projection", add)
            sd = linear(shared_out, "the add's other operand (a shared expert's down_proj)", claimed)
    gu = match_situ(sd.x, constant(a["beta"], "SiTU beta", R), constant(a["beta_lin"], "SiTU beta_lin", R), claimed)
    require(gu.x is x, "shared expert reads another input than the router", gu.node)
    experts = tuple(a[n] for n in (MXFP4_TENSORS if mxfp4 else ("w13", "w2")))
    scales = dense_scales(ctx, [("shared gate_up_proj", gu, False), ("latent down-projection", down, False),
                                ("up-projection", up, True), ("shared down_proj", sd, True)], R)
    check_bf16("MoE activations/weights", x, *([] if scales else [down.w, gu.w, sd.w, up.w]),
               *([] if mxfp4 else experts))
    latent = ctx.param(down.w, "latent down-proj").shape[0]
    layout = check_mxfp4_experts(ctx, a, latent) if mxfp4 else None
    shared_inter = ctx.param(sd.w, "shared down_proj").shape[1]
    ep_size = int(a["ep_size"])
    E, E_local = ctx.param(gate_w, "router weight").shape[0], val(experts[0]).shape[0]
    # ep_size 1 with fewer local experts: one rank's share run alone (benchmarks), no dispatch
    require(E == E_local * ep_size or (ep_size == 1 and E % E_local == 0),
            f"{E} experts != {E_local} local x EP size {ep_size}", R)
    require(ctx.param(gu.w, "shared gate_up").shape[0] == 2 * shared_inter, "shared gate_up is not 2x down's width", gu.w)
    for w, what in ((up.w, "up-proj"), (bias, "correction bias"), (norm_w, "latent norm weight")):
        ctx.param(w, what)
    return MoeMatch(x, down.w, gate_w, bias, norm_w, up.w, gu.w, sd.w, add, a, top_k, scale, norm_eps,
                    shared_inter, latent, ep_size, claimed, experts, mxfp4, layout, scales,
                    packed_segments([gu, down]))


class MoePass(LayerPass):
    """Rewrites each K3 MoE (``dep_moe_supported``) into one ``kimi_dep.moe`` call (``kimi_dep.moe_mxfp4`` on
    MXFP4 experts)."""

    kind = "moe"
    anchors = (EXPERTS, EXPERTS_MXFP4)
    module_up = 1  # the anchor is traced inside mlp.experts; report the mlp
    stock_op = "kimi_k3.routed_experts"

    def stock_name(self, found: Found) -> str:
        return "kimi_k3.routed_experts_mxfp4" if is_call(found.anchor, EXPERTS_MXFP4) else self.stock_op

    def rewrite(self, ctx: PassContext, found: Found):
        opts = ctx.options
        m = dep_moe_supported(ctx, found.anchor)
        a = m.args
        prepared = EpMoeLayer(
            shared_inter=m.shared_inter, latent=m.latent, top_k=m.top_k, scale=m.scale, beta=float(a["beta"]),
            beta_lin=float(a["beta_lin"]), norm_eps=m.norm_eps, expert_start=int(a["expert_start"]), ep_size=m.ep_size,
            front_max=opts.front_max,
            front=DepProjection("moe_front", opts.tables_for(val(m.experts[0]).device, fp8=bool(m.scales))[0]["moe_front"],
                                m.front_segments),
        )
        front = [m.gu_w, m.down_w]
        target, op = (MOE_MXFP4, "kimi_dep.moe_mxfp4") if m.mxfp4 else (MOE, "kimi_dep.moe")
        ctx.commit(found, x=m.x, output=m.output, claimed=m.claimed, target=target.default, args=(
            m.x, front, m.gate_w, m.bias, *m.experts, m.norm_w, m.up_w, m.sd_w, None, m.scales), prepared=prepared,
            probe=m.probe_inputs, fp8_activations=bool(m.scales),
            pack=[(front, "MoE front")] + ([(m.scales[:2], "MoE front scales")] if m.scales else []))
        op = tagged(op, f"ep{m.ep_size}" if m.ep_size > 1 else None, "fp8_block" if m.scales else None,
                    m.layout if m.layout != "checkpoint" else None)
        return op, {"moe_front": prepared.front.policies([b for b in opts.batches if b <= opts.front_max])}
