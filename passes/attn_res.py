"""AttnRes -> RMSNorm: a ``kimi_k3.attn_res`` point whose output only an RMSNorm reads
==>  ``kimi_dep.attn_res_norm`` (one launch on CUDA).

Unfused (conceptually)::

    h = kimi_k3.attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot)  # mutates prefix, bank
    y = F.rms_norm(h.float(), (D,), w.float(), norm_eps).to(bf16)                 # or written out

Fused replacement: ``y = kimi_dep.attn_res_norm(prefix, bank, delta, query, w, eps, num_blocks,
write_slot, norm_eps)``. In the stock decoder the input_layernorm and the post_attention_layernorm
each follow an AttnRes point; the final norm reads ``prefix + delta``, not an AttnRes output.

Checks: the norm is exactly an RMSNorm over the AttnRes output (``fx_match.match_rms_norm``: FP32
math, BF16 in and out, its eps and a weight parameter); the AttnRes output has no other reader;
prefix, bank, delta, output BF16, the weights BF16 parameters; nothing reads or writes prefix or
bank between the AttnRes call and the norm (the fused call sits where the norm ended); every other
node between them is plumbing; then translation validation on a random probe (random prefix, bank
and delta; post-grad, random weights too), output, prefix and bank compared.

AttnRes points are glue, not layers: the manager runs this pass on every graph, whatever option
``kinds`` says, and the report lists its rows apart (``MatchReport.points``).
"""

from __future__ import annotations

import time
import types

import torch

from dep_compile.ops import attn_res as _attn_res_op  # noqa: F401  (registers kimi_dep::attn_res_norm)
from dep_compile.ops.shapes import size_hint

from . import validate
from .base import Found, LayerPass, PassContext, check_bf16
from .fx_match import (NoMatch, is_functionalized, is_plumbing, match_rms_norm, op_args, op_name,
                       position, require, single_user, val)

Node = torch.fx.Node
ATTN_RES = torch.ops.kimi_k3.attn_res
ATTN_RES_NORM = torch.ops.kimi_dep.attn_res_norm
_NORM_SEARCH = 24  # nodes after the AttnRes output searched for the norm's final cast


def _norm_output(h: Node) -> Node:
    """The node ending the RMSNorm that reads ``h``: the first BF16 value downstream of ``h`` (the
    cast back) through which ``match_rms_norm`` reads ``h`` (NoMatch with that walker's reason otherwise)."""
    user = single_user(h)
    require(user is not None, f"the AttnRes output has {len(h.users)} readers "
            f"({', '.join(u.name for u in h.users)}); only a lone RMSNorm is fused", h)
    seen, frontier, ends = {user}, [user], []
    while frontier and len(seen) < _NORM_SEARCH:
        n = frontier.pop()
        if getattr(val(n), "dtype", None) == torch.bfloat16:
            ends.append(n)
            continue
        for u in n.users:
            if u not in seen:
                seen.add(u)
                frontier.append(u)
    first = None
    for c in sorted(ends, key=position):
        try:
            x, _, _ = match_rms_norm(c, "the norm after AttnRes", set())
        except NoMatch as e:
            first = first or e
            continue
        if x is h:
            return c
    if first is not None:
        raise NoMatch(f"the AttnRes output is not read by an RMSNorm: {first.reason}", first.node)
    raise NoMatch(f"the AttnRes output is not read by a norm rounded back to BF16 (its reader: "
                  f"{op_name(user) or user.target} {user.name})", user)


def _region(anchor: Node, output: Node) -> set[Node]:
    """The anchor, ``output`` and every node between them that depends on the anchor."""
    seen, stack = set(), [output]
    while stack:
        n = stack.pop()
        if n in seen or n.op in ("placeholder", "get_attr") or position(n) < position(anchor):
            continue
        seen.add(n)
        if n is not anchor:
            stack.extend(n.all_input_nodes)
    depends = {anchor}
    for n in sorted(seen, key=position):
        if any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    return depends


def _check_order(anchor: Node, output: Node, region: set[Node], states: list[Node]) -> None:
    """Moving the AttnRes write to where the norm ends is safe: nothing between the two reads or writes
    prefix or bank (post-grad: the bases, or the updated bases the anchor returns)."""
    lo, hi = position(anchor), position(output)
    readers = [u for s in states for u in s.users]
    if is_functionalized(anchor):
        readers += [u for g in anchor.users if g not in region for u in g.users]
    for u in readers:
        require(u in region or not lo < position(u) < hi,
                f"{u.name} reads or writes the AttnRes prefix / bank between the AttnRes call and its norm", u)


def _probe(ctx: PassContext, region: set[Node], anchor: Node, output: Node, a: dict, args: tuple,
           module: str) -> validate.Verdict:
    """Run the stock AttnRes + norm (the region's nodes as traced) and the fused op on one random probe."""
    t0 = time.perf_counter()
    x = val(a["prefix"])
    device = x.device if x.device.type != "meta" else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    rand = lambda v: (torch.randn(tuple(size_hint(s) for s in v.shape), generator=g)  # noqa: E731
                      .to(v.dtype).to(device))
    fresh = {"prefix": rand(val(a["prefix"])), "bank": rand(val(a["bank"]))}
    inputs = types.SimpleNamespace(g=g, device=device, caches={k: t.clone() for k, t in fresh.items()})
    inputs.values = {a["delta"]: rand(val(a["delta"])), a["prefix"]: inputs.caches["prefix"],
                     a["bank"]: inputs.caches["bank"]}
    with torch.no_grad():
        ev = validate._Evaluator(ctx.gm, ctx.real, inputs, region)
        for n in sorted(region, key=position):
            ev.env[n] = ev.run(n)
        ev.env[a["prefix"]], ev.env[a["bank"]] = fresh["prefix"], fresh["bank"]
        out = ATTN_RES_NORM.default(*ev.value(args))
    errors = {"output": validate._error(out, ev.env[output])}
    errors.update({k: validate._error(fresh[k], inputs.caches[k]) for k in fresh})
    verdict = validate.Verdict(errors, time.perf_counter() - t0, size_hint(x.shape[0]), module)
    on_cpu = device.type == "cpu"
    bound = validate.CPU_MAX_REL if on_cpu else validate.CUDA_MAX_REL
    bad = {k: e for k, e in errors.items() if e[0] > bound or (not on_cpu and e[1] > validate.CUDA_RMS_REL)}
    require(not bad, "semantic check failed: the fused AttnRes + RMSNorm differs from stock on a random probe ("
            + ", ".join(f"{k} max {e[0]:.3g} rms {e[1]:.3g}" for k, e in bad.items())
            + f"; bound {bound:.3g} of the largest value)", output)
    return verdict


class AttnResPass(LayerPass):
    """Fuses each AttnRes point and the RMSNorm reading it into one ``kimi_dep.attn_res_norm`` call."""

    kind = "attn_res"
    anchors = (ATTN_RES,)
    stock_op = "kimi_k3.attn_res"

    def rewrite(self, ctx: PassContext, found: Found):
        anchor = found.anchor
        a = op_args(anchor, ATTN_RES.default)
        for name in ("eps", "num_blocks", "write_slot"):
            require(not isinstance(a[name], Node), f"AttnRes {name} is computed in the graph, not a constant", anchor)
        h = ctx.result(anchor)
        check_bf16("AttnRes tensors", a["prefix"], a["bank"], a["delta"], a["query"], h)
        require(val(h).dim() == 2, f"the AttnRes output is {val(h).dim()}-D, not [T, D]", h)
        out = _norm_output(h)
        claimed = {anchor, h}
        _, w, norm_eps = match_rms_norm(out, "the norm after AttnRes", claimed)
        ctx.param(w, "the norm weight")
        ctx.param(a["query"], "the AttnRes query")
        check_bf16("the norm weight", w)
        if is_functionalized(anchor):
            views = [k for k in anchor.kwargs if k.startswith("_") and not k.endswith("_base_index")
                     and k != "_all_bases"]
            require(not views, f"the AttnRes state is a view of a larger tensor ({', '.join(views)})", anchor)
        region = _region(anchor, out)
        for n in sorted(region - claimed, key=position):
            require(is_plumbing(n), f"unmatched op {op_name(n) or n.target} ({n.name}) between "
                    "the AttnRes call and its norm: its meaning is not accounted for", n)
        ctx.check_region(region, out)
        _check_order(anchor, out, region, [a["prefix"], a["bank"]])
        args = (a["prefix"], a["bank"], a["delta"], a["query"], w, float(a["eps"]), int(a["num_blocks"]),
                int(a["write_slot"]), float(norm_eps))
        if ctx.options.validate:  # one probe per structure (validate.signature): K3's 186 points need ~30
            t0 = time.perf_counter()
            try:
                sig = validate.signature(validate.Probe(region, a["delta"], out, ATTN_RES_NORM.default, args, len(args),
                                                        None, found.module, {}, {}))
                if sig not in ctx.verdicts:
                    ctx.verdicts[sig] = _probe(ctx, region, anchor, out, a, args, found.module)
                ctx.verdict = ctx.verdicts[sig]
            finally:
                ctx.validate_seconds += time.perf_counter() - t0
        ctx.mutating = True
        try:
            ctx.replace(region, out, ATTN_RES_NORM.default, args, found.module)
        finally:
            ctx.mutating = False
        return "kimi_dep.attn_res_norm", {}

