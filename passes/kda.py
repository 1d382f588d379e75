"""KDA: one linear in_proj read as q | k | v | g | f_a | beta -> f_b_proj(f_a) -> kimi_k3.kda_core -> o_proj
==>  kimi_dep.kda_attention (packed in_proj, prepared core with F_B inside, o_proj).

Unfused (conceptually)::

    y = in_proj(x)                                   # [T, 4*H*D + F + H], one bias-free linear
    q, k, v, g, f_a, beta = last-dim ranges of y      # split / chunk / slices, in this order
    o = kimi_k3.kda_core(q, k, v, f_b_proj(f_a), beta, g, conv_w, A_log, dt_bias, o_norm_w,
                         conv_state, recurrent_state, state_indices, accepted, q_len, lower_bound, eps)
    out = o_proj(o)

Fused replacement: ``kimi_dep.kda_attention(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w,
o_proj_w, conv_state, recurrent_state, state_indices, accepted, q_len, layer)``.

Checks: each core input is exactly its range of the in_proj output (no op between, no other
order), f_b_proj reads the f_a range, the ranges tile the in_proj rows, the core output feeds only
o_proj, BF16 weights and activations, an FP32 recurrent state, the states read by nothing else,
q_len at most ``max_q``; every other node of the layer is plumbing; then translation validation.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from dep_compile.ops.kda import PreparedKda
from dep_compile.ops.projection import DepProjection

from .base import (Found, LayerPass, PassContext, check_bf16, check_only_user, check_q_len, dense_scales,
                   packed_segments, probe_step, tagged)
from .calls import constant, op_args, require, shapes_of, single_user, val
from .validate import ProbeInputs, ProbeRandom
from .walkers import linear, part_of, skip_identity

Node = torch.fx.Node
KDA_CORE = torch.ops.kimi_k3.kda_core
KDA_ATTENTION = torch.ops.kimi_dep.kda_attention


class KdaState(enum.Enum):
    """The per-request states a KDA layer writes (the names the probe's verdict gives them)."""

    CONV = "conv_state"
    RECURRENT = "recurrent_state"


@dataclasses.dataclass
class KdaMatch:
    """A stock KDA layer found by ``find_kda``: its input, the core's arguments, the weights and sizes."""

    x: Node
    in_w: Node
    f_b_w: Node
    o_w: Node
    output: Node
    core: dict  # the core op's arguments by name
    heads: int
    head_dim: int
    f_rank: int
    claimed: set
    state_shapes: dict  # conv_state / recurrent_state -> the shape the core sees (post-grad: a view of a pool)
    scales: list  # FP8 block-scaled projections: their scales [in_proj, f_b_proj, o_proj]; empty for BF16
    segments: tuple  # in_proj's row segments, then o_proj's (FP8; each None for BF16)

    def probe_inputs(self, rng: ProbeRandom) -> ProbeInputs:
        """A random step for the probe: the layer input, B + 2 state slots of random states (BF16 conv,
        FP32 recurrent), random slots for the B requests and random accepted counts."""
        a = self.core
        values, B, q = probe_step(rng, self.x, a["q_len"])
        slots = B + 2
        meta = {"state_indices": torch.randperm(slots, generator=rng.g)[:B],
                "accepted": torch.randint(1, q + 1, (B,), generator=rng.g)}
        for name, t in meta.items():
            values[a[name]] = t.to(val(a[name]).dtype).to(rng.device)
        caches = {role: a[role.value] for role in KdaState}
        for role, node in caches.items():
            shape = (slots, *self.state_shapes[role.value][1:])
            values[node] = rng.randn(shape, val(node).dtype, scale=0.5)
        return ProbeInputs(values, caches, B * q)


def find_kda(ctx: PassContext, core: Node) -> KdaMatch:
    """Check that the layer around KDA core call ``core`` is the stock KDA; NoMatch names the failed check."""
    a = op_args(core, KDA_CORE.default)
    claimed = {core}
    HD, H = val(a["q"]).shape[-1], val(a["beta"]).shape[-1]
    f_lin = linear(skip_identity(a["g_raw"], claimed), "g_raw (f_b_proj)", claimed)
    F_rank = val(f_lin.x).shape[-1]
    want = {"q": (0, HD), "k": (HD, 2 * HD), "v": (2 * HD, 3 * HD), "g_out": (3 * HD, 4 * HD),
            "f_a": (4 * HD, 4 * HD + F_rank), "beta": (4 * HD + F_rank, 4 * HD + F_rank + H)}
    parts = {name: (f_lin.x if name == "f_a" else a[name]) for name in want}
    src = None
    for name, (lo, hi) in want.items():
        got = part_of(skip_identity(parts[name], claimed), claimed)
        require(got is not None, f"core input {name} is not a last-dim range of the in_proj output", parts[name])
        require(got[1:] == (lo, hi), f"core input {name} is in_proj columns [{got[1]}, {got[2]}), "
                f"expected [{lo}, {hi}) (q, k, v, g, f_a, beta)", parts[name])
        require(src is None or got[0] is src, "core inputs come from different projections", parts[name])
        src = got[0]
    in_lin = linear(src, "the in_proj", claimed)
    x, in_w = in_lin.x, in_lin.w
    in_w_t = ctx.param(in_w, "in_proj weight")
    require(in_w_t.shape[0] == 4 * HD + F_rank + H,
            f"in_proj has {in_w_t.shape[0]} rows; q, k, v, g, f_a, beta take {4 * HD + F_rank + H}", in_w)
    ctx.param(f_lin.w, "f_b_proj weight")
    core_out = ctx.result(core)  # the core itself, or getitem 0 of its auto_functionalized wrapper
    claimed.add(core_out)
    o_user = single_user(core_out)
    require(o_user is not None, "core output has several users", core)
    o_lin = linear(o_user, "the core's output user (o_proj)", claimed)
    require(o_lin.x is core_out, "core output does not feed o_proj directly", o_user)
    ctx.param(o_lin.w, "o_proj weight")
    scales = dense_scales(ctx, [("in_proj", in_lin, False), ("f_b_proj", f_lin, True), ("o_proj", o_lin, False)], core)
    check_bf16("KDA activations", x, a["conv_state"], *parts.values())
    if not scales:
        check_bf16("KDA weights", in_w, f_lin.w, o_lin.w)
    require(val(a["recurrent_state"]).dtype == torch.float32, "recurrent state is not FP32", a["recurrent_state"])
    check_only_user(a["conv_state"], core, "conv state")
    check_only_user(a["recurrent_state"], core, "recurrent state")
    check_q_len(a["q_len"], ctx.options.max_q, core)
    require(val(x).dim() == 2, "in_proj input is not [T, hidden]", x)
    return KdaMatch(x, in_w, f_lin.w, o_lin.w, o_user, a, H, HD // H, F_rank, claimed,
                    shapes_of(core, KDA_CORE.default, tuple(s.value for s in KdaState)), scales,
                    (packed_segments([in_lin]), packed_segments([o_lin])))


class KdaPass(LayerPass):
    """Rewrites each stock KDA attention layer (``find_kda``) into one ``kimi_dep.kda_attention`` call."""

    kind = "kda"
    anchors = (KDA_CORE,)
    stock_op = "kimi_k3.kda_core"

    def rewrite(self, ctx: PassContext, found: Found):
        m = find_kda(ctx, found.anchor)
        a, opts = m.core, ctx.options
        proj, oproj = opts.tables_for(val(a["recurrent_state"]).device, fp8=bool(m.scales))
        prepared = PreparedKda(
            heads=m.heads, head_dim=m.head_dim, f_rank=m.f_rank,
            lower_bound=constant(a["lower_bound"], "KDA lower_bound", found.anchor),
            norm_eps=constant(a["norm_eps"], "KDA norm eps", found.anchor),
            in_proj=DepProjection("kda_in_proj", proj["kda_in_proj"], m.segments[0]),
            o_proj=DepProjection("o_proj", oproj, m.segments[1]),
        )
        ctx.commit(found, x=m.x, output=m.output, claimed=m.claimed, target=KDA_ATTENTION.default, args=(
            m.x, m.in_w, m.f_b_w, a["conv_weight"], a["A_log"], a["dt_bias"], a["o_norm_weight"], m.o_w,
            a["conv_state"], a["recurrent_state"], a["state_indices"], a["accepted"], a["q_len"], None, m.scales),
            prepared=prepared, probe=m.probe_inputs, fp8_activations=bool(m.scales))
        tactics = {p.name: p.policies(opts.batches) for p in (prepared.in_proj, prepared.o_proj)}
        return tagged("kimi_dep.kda_attention", "fp8_block" if m.scales else None), tactics
