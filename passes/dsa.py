"""DSA: fused a-proj + indexer projections -> norms -> q_b -> indexer -> sparse MLA -> gate -> o_proj
==>  kimi_dep.dsa_attention over one packed [q_a | kv_a | gate | wk | wv] projection."""

from __future__ import annotations

import operator

import torch

from dep_compile.ops.dsa import PreparedDsa
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.registry import register
from dep_compile.ops.sparse_mla import reserve_sparse_mla

from .base import Found, LayerPass, PassContext, check_bf16, check_only_user, check_q_len
from .fx_match import (as_linear, is_call, is_view, match_layer_norm, match_rms_norm, op_args, producer, require,
                       single_user, split_part, strip_casts, val)

SPARSE_MLA = torch.ops.kimi_k3.sparse_mla_decode
INDEXER = torch.ops.kimi_k3.dsa_indexer
DSA_ATTENTION = torch.ops.kimi_dep.dsa_attention


def _linear(node, what):
    lin = as_linear(node)
    require(lin is not None and lin[2] is None, f"{what} is not a bias-free linear", node)
    return lin[0], lin[1]


def _unview(node, what):
    require(is_view(node), f"{what} is not a view of a projection", node)
    return node.args[0]


def _part(node, index, what):
    sp = split_part(node)
    require(sp is not None and sp[1] == index, f"{what} is not part {index} of a last-dim split", node)
    return sp[0], sp[2]


class DsaPass(LayerPass):
    """Rewrites each stock DSA attention layer into one ``kimi_dep.dsa_attention`` call."""

    kind = "dsa"
    anchors = (SPARSE_MLA,)
    stock_op = "kimi_k3.dsa_indexer + kimi_k3.sparse_mla_decode"

    def rewrite(self, ctx: PassContext, found: Found):
        S = found.anchor
        a = op_args(S, SPARSE_MLA.default)
        I = producer(a["topk_indices"])  # the indexer call (its auto_functionalized wrapper post-grad)
        require(is_call(I, INDEXER), "sparse MLA's selection does not come from the DSA indexer", I)
        I_out = ctx.result(I)
        require(single_user(I_out) is S, "indexer output has other users", I)
        ia = op_args(I, INDEXER.default)
        for name in ("slot_mapping", "block_table", "q_len"):
            require(ia[name] is a[name], f"indexer and sparse MLA disagree on {name}", I)
        S_out = ctx.result(S)
        region = {S, I, I_out, S_out}

        # MLA query: view(q_b(rms(q_a))), q_a = fused[0]
        q_b_out = _unview(a["q"], "q")
        q_a_n, q_b_w = _linear(q_b_out, "q_b_proj")
        q_a, q_a_norm_w, q_a_eps = match_rms_norm(q_a_n, into=region)
        fused, sizes = _part(q_a, 0, "q_a")
        x, fused_w = _linear(fused, "fused_qkv_a_g_proj")
        require(len(sizes) == 3, f"fused a-proj split into {len(sizes)} parts, expected q_a | kv_a | gate", fused)
        region |= {a["q"], q_b_out, q_a_n, fused}
        # latent: cat([rms(c_kv), k_rope]) with c_kv, k_rope = fused[1].split
        lat = a["latent"]
        require(is_call(lat, torch.cat, torch.ops.aten.cat) and len(lat.args[0]) == 2,
                "latent is not cat([norm(c_kv), k_rope])", lat)
        c_n, k_rope = lat.args[0]
        c_kv, kv_a_norm_w, kv_a_eps = match_rms_norm(c_n, into=region)
        kv_a, kv_sizes = _part(c_kv, 0, "c_kv")
        kv_a2, _ = _part(k_rope, 1, "k_rope")
        require(kv_a is kv_a2, "c_kv and k_rope come from different splits", lat)
        fused2, _ = _part(kv_a, 1, "kv_a")
        require(fused2 is fused, "kv_a is not part 1 of the fused a-proj", kv_a)
        region |= {lat, c_n}
        # indexer query: view(wq_b(normed q_a))
        wq_b_out = _unview(ia["q_idx"], "indexer query")
        q_a_n2, wq_b_w = _linear(wq_b_out, "indexer wq_b")
        require(q_a_n2 is q_a_n, "indexer wq_b does not read the normed q_a", wq_b_out)
        region |= {ia["q_idx"], wq_b_out}
        # indexer keys and weights: separate wk / weights_proj, or one merged wk_weights_proj
        k_raw, k_norm_w, k_norm_b, k_eps = match_layer_norm(ia["k"], into=region)
        region.add(ia["k"])
        w_node = ia["weights"]
        if split_part(k_raw) is not None:
            merged, _ = _part(k_raw, 0, "index keys")
            merged2, _ = _part(w_node, 1, "index weights")
            require(merged is merged2, "index keys and weights come from different splits", w_node)
            x2, m_w = _linear(merged, "wk_weights_proj")
            require(x2 is x, "wk_weights_proj reads another input than the fused a-proj", merged)
            pack = [fused_w, m_w]
            region |= {merged}
        else:
            x2, wk_w = _linear(k_raw, "indexer wk")
            x3, wp_w = _linear(w_node, "indexer weights_proj")
            require(x2 is x and x3 is x, "indexer projections read another input than the fused a-proj", k_raw)
            pack = [fused_w, wk_w, wp_w]
            region |= {k_raw, w_node}
        # output: o_proj((o.float() * sigmoid(gate.float())).to(bf16)), gate = fused[2]
        o_f = single_user(S_out)
        require(o_f is not None and strip_casts(o_f) is S_out, "sparse MLA output does not feed only the gate", S)
        mul = single_user(o_f)
        require(is_call(mul, operator.mul, torch.mul, torch.ops.aten.mul), "sparse MLA output is not multiplied by the gate", o_f)
        sig = mul.args[1] if mul.args[0] is o_f else mul.args[0]
        require(is_call(sig, torch.sigmoid, torch.ops.aten.sigmoid), "the output gate is not a sigmoid", sig)
        gate, _ = _part(strip_casts(sig.args[0]), 2, "gate")
        require(gate is fused, "the gate is not part 2 of the fused a-proj", sig)
        o_cast = single_user(mul)
        o_user = single_user(o_cast) if o_cast is not None else None
        o_lin = as_linear(o_user)
        require(o_lin is not None and o_lin[0] is o_cast and o_lin[2] is None, "gated output does not feed only o_proj", mul)
        o_w = o_lin[1]
        region |= {o_f, mul, sig, o_cast, o_user}

        H, qk = val(a["q"]).shape[-2:]
        nope = a["nope"]
        Hi, Di = val(ia["q_idx"]).shape[-2:]
        q_lora, kv_width, gate_width = sizes
        kv_lora, rope = kv_sizes
        require(qk == nope + rope, f"q head dim {qk} != nope {nope} + rope {rope}", a["q"])
        check_bf16("DSA activations/weights", x, fused_w, q_b_w, wq_b_w, o_w, a["kv_cache"])
        for n in (a["kv_cache"], ia["index_cache"], ia["index_scale"]):
            check_only_user(n, S if n is a["kv_cache"] else I, n.name)
        check_q_len(a["q_len"], ctx.options.max_q, S)
        for w, what in ((q_b_w, "q_b_proj"), (wq_b_w, "wq_b"), (o_w, "o_proj"), (a["kv_b_weight"], "kv_b_proj")):
            ctx.param(w, what)

        opts = ctx.options
        prepared = PreparedDsa(
            heads=H, nope=nope, rope=rope, q_lora=q_lora, kv_lora=kv_lora, gate_width=gate_width, index_heads=Hi,
            index_dim=Di, topk=int(ia["topk"]), scale=float(a["scale"]), q_a_eps=q_a_eps, kv_a_eps=kv_a_eps,
            k_norm_eps=k_eps,
            projection=DepProjection("dsa_qkv_a_g_index", opts.projection_tables["dsa_qkv_a_g_index"]),
            o_proj=DepProjection("o_proj", opts.oproj_table), sparse_mla=opts.sparse_mla,
        )
        require(sum(prepared.split_sizes) == sum(ctx.param(w, "packed weight").shape[0] for w in pack),
                "packed rows do not add up to q_a | kv_a | gate | wk | wv", fused)
        # the sparse-MLA kernel, chosen (and FlashInfer's workspace allocated) now, outside any graph
        reserve_sparse_mla(opts.sparse_mla, val(a["kv_cache"]), heads=H, kv_lora=kv_lora, nope=nope)
        key = register(found.module, prepared)
        region = ctx.verified_region(x, o_user, region)
        packed = ctx.pack(pack, "DSA projection")
        ctx.replace(region, o_user, DSA_ATTENTION.default, (
            x, packed, q_a_norm_w, kv_a_norm_w, q_b_w, a["kv_b_weight"], wq_b_w, k_norm_w, k_norm_b, o_w,
            a["kv_cache"], ia["index_cache"], ia["index_scale"], a["slot_mapping"], a["block_table"],
            ia["seq_lens"], a["q_len"], key), found.module)
        tactics = {p.name: p.policies(opts.batches) for p in (prepared.projection, prepared.o_proj)}
        return "kimi_dep.dsa_attention", tactics
