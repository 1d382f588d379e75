"""AttnRes -> RMSNorm: a ``kimi_k3.attn_res`` point whose output only an RMSNorm reads
==>  ``kimi_dep.attn_res_norm`` (one launch on CUDA).

Unfused (conceptually)::

    h = kimi_k3.attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot)  # mutates prefix, bank
    y = F.rms_norm(h.float(), (D,), w.float(), norm_eps).to(bf16)                 # or written out

Fused replacement: ``y = kimi_dep.attn_res_norm(prefix, bank, delta, query, w, eps, num_blocks,
write_slot, norm_eps)``. In the stock decoder the input_layernorm and the post_attention_layernorm
each follow an AttnRes point; the final norm reads ``prefix + delta``, not an AttnRes output.

Checks: the norm is exactly an RMSNorm over the AttnRes output (``trees.match_rms_norm``: FP32
math, BF16 in and out, its eps and a weight parameter); the AttnRes output has no other reader;
prefix, bank, delta, output BF16, the weights BF16 parameters; nothing reads or writes prefix or
bank between the AttnRes call and the norm (the fused call sits where the norm ended); every other
node between them is plumbing; then translation validation on a random probe (random prefix, bank
and delta; post-grad, random weights too), output, prefix and bank compared.

AttnRes points are glue, not layers: the manager runs this pass on every graph, whatever option
``kinds`` says, and the report lists its rows apart (``MatchReport.points``).

Then ``link_points`` links each two consecutive fused points of the graph that read one bank with nothing
between them touching it (through any view), no CUDA-graph partition point between them, and share eps: the first
computes the second's bank part (on CUDA on a side stream, ``ops/attn_res.py``), so that part runs beside the
sublayer between them. The bank's contents not changing in between is this check's; the op checks at run time
only that the part it takes was computed from its own bank, query and schedule (identity, not contents). The
report says how many pairs were linked and why the others were not.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable

import torch
import torch._inductor.config
from torch.multiprocessing.reductions import StorageWeakRef

from .base import Found, LayerPass, PassContext, check_bf16
from .calls import (NoMatch, base_outputs, functionalized_op, is_call, is_functionalized, op_args, op_name, position,
                    require, single_user, val, written)
from .functionalized import eager_vals
from .trees import match_rms_norm
from .validate import ProbeInputs, ProbeRandom

Node = torch.fx.Node
ATTN_RES = torch.ops.kimi_k3.attn_res
ATTN_RES_NORM = torch.ops.kimi_dep.attn_res_norm
_NORM_SEARCH = 24  # nodes after the AttnRes output searched for the norm's final cast


class AttnResState(enum.Enum):
    """What an AttnRes point writes in place (the names the probe's verdict gives them), in draw order."""

    PREFIX = "prefix"
    BANK = "bank"


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


def _probe_inputs(a: dict):
    """The probe's builder for an AttnRes point with arguments ``a``: random prefix, bank (as traced) and delta."""

    def inputs(rng: ProbeRandom) -> ProbeInputs:
        caches = {role: a[role.value] for role in AttnResState}
        values = {node: rng.randn(val(node).shape, val(node).dtype) for node in (*caches.values(), a["delta"])}
        return ProbeInputs(values, caches, values[a["prefix"]].shape[0])

    return inputs


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
        args = (a["prefix"], a["bank"], a["delta"], a["query"], w, float(a["eps"]), int(a["num_blocks"]),
                int(a["write_slot"]), float(norm_eps))
        # one probe per structure (validate.signature): K3's 186 points need ~30
        ctx.commit(found, x=a["delta"], output=out, claimed=claimed, target=ATTN_RES_NORM.default, args=args,
                   prepared=None, probe=_probe_inputs(a), stops=(a["prefix"], a["bank"]),
                   check=lambda region: _check_order(anchor, out, region, [a["prefix"], a["bank"]]),
                   span="between the AttnRes call and its norm")
        return "kimi_dep.attn_res_norm", {}


def _shares_storage(node: Any, ref: Node) -> bool:
    """``node``'s traced value is a view of ``ref``'s storage (or has no traced tensor value, so it might be)."""
    v, r = val(node), val(ref)
    if not isinstance(v, torch.Tensor):
        return True
    return StorageWeakRef(v.untyped_storage()) == StorageWeakRef(r.untyped_storage())


def _partition_point(node: Node, partition_ops: set[str]) -> str | None:
    """The op at which Inductor's graph partition cuts a CUDA-graphed graph (a custom partition op, or one tagged
    cudagraph_unsafe), if ``node`` calls one: a fork and its join must be captured in the same graph."""
    op = functionalized_op(node) or (node.target if node.op == "call_function" else None)
    if isinstance(op, torch._ops.OpOverloadPacket):
        names, overloads = {op._qualified_op_name}, [getattr(op, o) for o in op.overloads()]
    elif isinstance(op, torch._ops.OpOverload):
        names, overloads = {op.name(), f"{op.name()}.{op._overloadname}"}, [op]
    else:
        return None
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    if names & partition_ops or any(unsafe is not None and unsafe in o.tags for o in overloads):
        return min(names)
    return None


def _link_blocker(a: Node, b: Node, partition_ops: set[str]) -> str | None:
    """Why fused point ``b`` cannot take its bank part from the fused point ``a`` before it (None: it can)."""
    x, y = op_args(a, ATTN_RES_NORM.default), op_args(b, ATTN_RES_NORM.default)
    between = []  # the nodes after a, up to b (walking the graph's list: a scan of it per pair is quadratic)
    n = a.next
    while n is not b:
        between.append(n)
        n = n.next
    if is_functionalized(b):  # post-grad: b's bank must be the bank a returns, read by b alone
        bank_index = a.kwargs.get("_bank_base_index")
        out = base_outputs(a).get(bank_index) if isinstance(bank_index, int) else None
        if out is None or y["bank"] is not out:
            return "the second point's bank is not the one the first returns"
        if set(out.users) != {b}:  # Inductor would then give b a copy: the part's bank would never match
            others = ", ".join(u.name for u in out.users if u is not b)
            return f"the bank the first point returns is also read by {others}"
    else:  # Dynamo graph: one bank tensor, written in place; nothing between the two may touch it, through a view
        if y["bank"] is not x["bank"]:
            return "the two points read different banks"
        touching = [n.name for n in between if x["bank"] in n.all_input_nodes
                    or any(_shares_storage(w, x["bank"]) for w in written(n))]
        if touching:
            return f"{', '.join(touching)} read or write the bank (or a tensor that may share its memory) between them"
    cuts = [f"{n.name} ({op})" for n in between if (op := _partition_point(n, partition_ops))]
    if cuts:
        return f"a CUDA-graph partition point between them: {', '.join(cuts)}"
    if float(x["eps"]) != float(y["eps"]):  # the giver computes the part with its own eps
        return f"their eps differ ({x['eps']} and {y['eps']})"
    if not (isinstance(y["query"], Node) and position(y["query"]) < position(a)):
        return "the second point's query is not defined before the first point"
    return None


def link_points(graph: torch.fx.Graph, partition_ops: Iterable[str] = ()) -> tuple[int, list[str]]:
    """Link consecutive fused points (module docstring): (pairs linked, a line per pair not linked).
    ``partition_ops``: op names Inductor's graph partition cuts at besides its own (``custom_should_partition_ops``)."""
    fused = [n for n in graph.nodes if is_call(n, ATTN_RES_NORM.default)]
    cut = set(partition_ops) | set(torch._inductor.config.custom_should_partition_ops)
    linked, refused = 0, []
    for a, b in zip(fused, fused[1:]):
        why = _link_blocker(a, b, cut)
        if why is not None:
            refused.append(f"{a.name} -> {b.name}: {why}")
            continue
        y = op_args(b, ATTN_RES_NORM.default)
        a.kwargs = {**a.kwargs, "next_query": y["query"], "next_num_blocks": int(y["num_blocks"]),
                    "next_write_slot": int(y["write_slot"]), "part_out": linked}
        b.kwargs = {**b.kwargs, "part_in": linked}
        for n in (a, b):
            if is_functionalized(n):
                n.meta["eager_input_vals"] = eager_vals(n)
        linked += 1
    return linked, refused
