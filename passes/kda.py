"""KDA: in_proj -> split(q, k, v, g, f_a, beta) -> f_b_proj -> kimi_k3.kda_core -> o_proj  ==>  kimi_dep.kda_attention."""

from __future__ import annotations

import torch

from dep_compile.ops.kda import PreparedKda
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.registry import register

from .base import Found, LayerPass, PassContext, check_bf16, check_only_user, check_q_len
from .fx_match import as_linear, op_args, require, single_user, split_part, val

KDA_CORE = torch.ops.kimi_k3.kda_core
KDA_ATTENTION = torch.ops.kimi_dep.kda_attention


class KdaPass(LayerPass):
    """Rewrites each stock KDA attention layer into one ``kimi_dep.kda_attention`` call."""

    kind = "kda"
    anchors = (KDA_CORE,)
    stock_op = "kimi_k3.kda_core"

    def rewrite(self, ctx: PassContext, found: Found):
        core = found.anchor
        a = op_args(core, KDA_CORE.default)
        # q, k, v, g (output gate), f_a, beta: the six last-dim parts of one in_proj split
        parts = {}
        for name, want in (("q", 0), ("k", 1), ("v", 2), ("g_out", 3), ("beta", 5)):
            sp = split_part(a[name])
            require(sp is not None, f"core input {name} is not a part of a split in_proj", a[name])
            require(sp[1] == want, f"core input {name} is split part {sp[1]}, expected {want}", a[name])
            parts[name] = sp
        src, _, sizes = parts["q"]
        require(all(p[0] is src for p in parts.values()), "q, k, v, g, beta come from different splits", core)
        fb = as_linear(a["g_raw"])
        require(fb is not None and fb[2] is None, "g_raw is not f_b_proj(f_a)", a["g_raw"])
        f_a, f_b_w, _ = fb
        sp = split_part(f_a)
        require(sp is not None and sp[0] is src and sp[1] == 4, "f_b_proj's input is not split part 4 (f_a)", f_a)
        in_proj = as_linear(src)
        require(in_proj is not None and in_proj[2] is None, "the split's input is not a bias-free in_proj", src)
        require(single_user(src) is not None, "in_proj output has users besides its split", src)
        x, in_w, _ = in_proj
        HD = val(a["q"]).shape[-1]
        H = val(a["beta"]).shape[-1]
        F_rank = val(f_a).shape[-1]
        require(sizes == [HD, HD, HD, HD, F_rank, H], f"in_proj split sizes {sizes} are not q,k,v,g,f_a,beta", src)
        in_w_t = ctx.param(in_w, "in_proj weight")
        require(in_w_t.shape[0] == sum(sizes), f"in_proj has {in_w_t.shape[0]} rows, split {sum(sizes)}", in_w)
        ctx.param(f_b_w, "f_b_proj weight")
        # the output: o_proj(core) and nothing else reads the core's output
        core_out = ctx.result(core)  # the core itself, or getitem 0 of its auto_functionalized wrapper
        o_user = single_user(core_out)
        o_proj = as_linear(o_user) if o_user is not None else None
        require(o_proj is not None and o_proj[0] is core_out and o_proj[2] is None, "core output does not feed only o_proj", core)
        o_w = o_proj[1]
        ctx.param(o_w, "o_proj weight")
        check_bf16("KDA activations/weights", x, in_w, f_b_w, o_w, a["conv_state"])
        require(val(a["recurrent_state"]).dtype == torch.float32, "recurrent state is not FP32", a["recurrent_state"])
        check_only_user(a["conv_state"], core, "conv state")
        check_only_user(a["recurrent_state"], core, "recurrent state")
        q_len = a["q_len"]
        check_q_len(q_len, ctx.options.max_q, core)
        require(val(x).dim() == 2, "in_proj input is not [T, hidden]", x)

        opts = ctx.options
        prepared = PreparedKda(
            heads=H, head_dim=HD // H, f_rank=F_rank, lower_bound=float(a["lower_bound"]), norm_eps=float(a["norm_eps"]),
            in_proj=DepProjection("kda_in_proj", opts.projection_tables["kda_in_proj"]),
            o_proj=DepProjection("o_proj", opts.oproj_table),
        )
        key = register(found.module, prepared)
        split = a["q"].args[0]
        region = ctx.verified_region(x, o_user, {src, split, *split.users, a["g_raw"], core, core_out, o_user})
        ctx.replace(region, o_user, KDA_ATTENTION.default, (
            x, in_w, f_b_w, a["conv_weight"], a["A_log"], a["dt_bias"], a["o_norm_weight"], o_w, a["conv_state"],
            a["recurrent_state"], a["state_indices"], a["accepted"], q_len, key), found.module)
        tactics = {p.name: p.policies(opts.batches) for p in (prepared.in_proj, prepared.o_proj)}
        return "kimi_dep.kda_attention", tactics

