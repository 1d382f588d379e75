"""DSA: projections of x -> norms -> q_b / wq_b -> indexer -> sparse MLA -> sigmoid gate -> o_proj
==>  kimi_dep.dsa_attention over one packed [q_a | kv_a | gate | wk | wv] projection.

Unfused (conceptually)::

    q_a, kv_a, gate, k_idx, w_idx = row ranges of linears of x  # one fused a-proj, or several
    q_a = rms(q_a); c_kv, k_rope = kv_a ranges; latent = cat([rms(c_kv), k_rope], -1)
    q = q_b(q_a).view(T, H, nope + rope); q_idx = wq_b(q_a).view(T, Hi, Di)
    topk = kimi_k3.dsa_indexer(q_idx, w_idx, layer_norm(k_idx), index caches, metadata, q_len, topk)
    o = kimi_k3.sparse_mla_decode(q, latent, kv_b_w, kv_cache, metadata, topk, q_len, scale, nope)
    #   (or kimi_k3.sparse_mla_decode_fp8(q, latent, kv_b_w, kv_cache, kv_scale, ...) on an FP8 latent cache)
    out = o_proj((o.float() * sigmoid(gate.float())).to(bf16))

Fused replacement: ``kimi_dep.dsa_attention(x, [packed row blocks], norms' weights, q_b_w, kv_b_w, wq_b_w,
k_norm_w, k_norm_b, o_proj_w, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens,
q_len, layer)``, or ``kimi_dep.dsa_attention_fp8`` (the same with ``kv_scale`` after ``kv_cache``) on an
FP8 latent cache, the format carried in ``PreparedDsa.latent_cache``.

Checks: the five roles are row ranges of bias-free linears of x that tile whole weights in the
order q_a | kv_a | gate | wk | wv (so they pack); the norms are the stock FP32 RMSNorm / LayerNorm
(eps carried); q_b and wq_b read the normed q_a; the latent is exactly [rms(c_kv) | k_rope]; the
gate is sigmoid of the FP32 gate range times the FP32 attention output, rounded once to BF16, and
feeds only o_proj; indexer and sparse MLA share their metadata; the latent cache is BF16, or FP8
e4m3 with an FP32 [NB, BS] scale tensor (the FP8 op); caches have no other reader; every other node
is plumbing; then translation validation.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from dep_compile.ops.dsa import PreparedDsa
from dep_compile.ops.projection import DepProjection
from dep_compile.ops.sparse_mla import reserve_sparse_mla

from .base import (Found, LayerPass, PassContext, check_bf16, check_only_user, check_q_len, dense_scales,
                   packed_segments, probe_step, tagged)
from .calls import call, constant, is_call, op_args, op_name, producer, require, shapes_of, single_user, val
from .trees import factors, match_layer_norm, match_rms_norm
from .validate import CODE_ROW_ULP, ProbeInputs, ProbeRandom, Quantized
from .walkers import cast_to, linear, part_of, skip_identity, unview, upcast_from

Node = torch.fx.Node
SPARSE_MLA = torch.ops.kimi_k3.sparse_mla_decode
SPARSE_MLA_FP8 = torch.ops.kimi_k3.sparse_mla_decode_fp8  # on an FP8 latent cache with per-token scales
INDEXER = torch.ops.kimi_k3.dsa_indexer
DSA_ATTENTION = torch.ops.kimi_dep.dsa_attention
DSA_ATTENTION_FP8 = torch.ops.kimi_dep.dsa_attention_fp8
ROLES = ("q_a", "kv_a", "gate", "wk", "wv")
FP8 = torch.float8_e4m3fn


class DsaCache(enum.Enum):
    """The caches a DSA layer writes (the names the probe's verdict gives them), in the probe's draw order."""

    KV = "kv_cache"  # latent rows [NB, BS, kv_lora + rope], BF16 or FP8 e4m3
    INDEX = "index_cache"  # FP8 index keys [NB, BS, index_dim]
    INDEX_SCALE = "index_scale"  # FP32 [NB, BS]
    KV_SCALE = "kv_scale"  # FP32 [NB, BS], an FP8 latent cache only


# Random probe contents by cache: index keys and FP8 latent rows as e4m3 codes, scales powers of two or positive.
_PROBE_CACHE = {
    DsaCache.INDEX: lambda t, dtype: t.mul(4).clamp(-8, 8).to(FP8),
    DsaCache.INDEX_SCALE: lambda t, dtype: t.abs().add(0.01).to(dtype),
    DsaCache.KV_SCALE: lambda t, dtype: torch.exp2(t.round().clamp(-2, 2) - 6).to(dtype),
    DsaCache.KV: lambda t, dtype: t.mul(32).clamp(-448, 448).to(FP8) if dtype == FP8 else (t * 0.5).to(dtype),
}


def _rows(node, what, claimed):
    """A role read from a projection of x: (the linear, lo, hi) of its output columns."""
    node = skip_identity(node, claimed)
    got = part_of(node, claimed)
    root, lo, hi = got if got is not None else (node, 0, val(node).shape[-1])
    lin = linear(root, f"the projection {what} comes from", claimed)
    return lin, lo, hi


def packed_weights(x, roles: dict, ctx: PassContext, anchor) -> list:
    """The linears whose weights' rows, stacked, are the roles in order q_a | kv_a | gate | wk | wv."""
    weights, cover, width = [], 0, 0
    for name in ROLES:
        lin, lo, hi = roles[name]
        require(lin.x is x, f"{name} is projected from another input than the layer's", lin.node)
        if not weights or lin.w is not weights[-1].w:
            require(not weights or cover == width, f"{name}: the previous projection's rows are not all used in "
                    "order (q_a | kv_a | gate | wk | wv)", lin.node)
            require(all(w.w is not lin.w for w in weights), f"{name} reuses a projection out of order", lin.node)
            weights.append(lin)
            cover, width = 0, ctx.param(lin.w, f"{name} projection weight").shape[0]
        require(lo == cover, f"{name} is rows [{lo}, {hi}) of its projection, expected to start at {cover} "
                "(q_a | kv_a | gate | wk | wv, in order)", lin.node)
        cover = hi
    require(cover == width, "the last projection's rows are not all used", anchor)
    return weights


@dataclasses.dataclass
class DsaMatch:
    """A stock DSA layer found by ``find_dsa``: input, weights, the two ops' arguments, sizes, eps."""

    x: Node
    pack: list  # the projection weights, stacked rows = q_a | kv_a | gate | wk | wv
    q_a_norm_w: Node
    kv_a_norm_w: Node
    q_b_w: Node
    wq_b_w: Node
    k_norm_w: Node
    k_norm_b: Node
    o_w: Node
    output: Node
    mla: dict  # the sparse MLA op's arguments by name
    indexer: dict  # the indexer op's arguments by name
    heads: int
    rope: int
    q_lora: int
    kv_lora: int
    gate_width: int
    index_heads: int
    index_dim: int
    eps: tuple  # q_a, kv_a, k_norm
    claimed: set
    latent_cache: str  # "bfloat16" | "float8_e4m3fn" (kv_scale in mla)
    mla_op: object  # the sparse MLA overload matched: SPARSE_MLA or SPARSE_MLA_FP8 (.default)
    cache_shapes: dict  # cache name -> the shape the ops see (post-grad: a view of a pooled base)
    scales: list  # FP8 block-scaled projections: their scales [*pack, q_b, wq_b, o_proj]; empty for BF16
    segments: tuple  # the packed projection's row segments, then o_proj's (FP8; each None for BF16)

    def caches(self) -> dict:
        """The caches the layer writes, by role."""
        a, ia = self.mla, self.indexer
        nodes = {DsaCache.KV: a["kv_cache"], DsaCache.INDEX: ia["index_cache"], DsaCache.INDEX_SCALE: ia["index_scale"],
                 DsaCache.KV_SCALE: a.get("kv_scale")}
        return {role: n for role, n in nodes.items() if n is not None}

    def probe_inputs(self, rng: ProbeRandom) -> ProbeInputs:
        """A random step for the probe: paged caches of a few blocks a request, in shuffled blocks; two
        requests longer than the indexer's top-k, whose cached index keys make the selection decisive
        (``decisive_index``), the others at most top-k long (they select every position)."""
        a, ia = self.mla, self.indexer
        values, B, q = probe_step(rng, self.x, a["q_len"])
        bs = rng.size(self.cache_shapes["kv_cache"][1])
        pairs = max(int(ia["topk"]) - q, 0)
        short = min(2 * bs, pairs) + 1
        lens = [2 * pairs + q if b < 2 else q + int(torch.randint(0, short, (1,), generator=rng.g)) for b in range(B)]
        need = [-(-n // bs) for n in lens]
        blocks = sum(need) + 1
        perm = torch.randperm(blocks, generator=rng.g)
        table = torch.empty(B, -(-max(lens) // bs), dtype=torch.int64)
        used = 0
        for b in range(B):
            table[b, : need[b]] = perm[used: used + need[b]]
            table[b, need[b]:] = perm[-1]
            used += need[b]
        pos = torch.tensor([n - q + i for n in lens for i in range(q)])
        req = torch.arange(B).repeat_interleave(q)
        meta = {a["block_table"]: table, ia["seq_lens"]: torch.tensor(lens),
                a["slot_mapping"]: table[req, pos // bs] * bs + pos % bs}
        for node, t in meta.items():
            values[node] = t.to(val(node).dtype).to(rng.device)
        caches = self.caches()
        drawn = {}
        for role, node in caches.items():
            rest = tuple(rng.size(d) for d in self.cache_shapes[role.value][1:])
            t = torch.randn((blocks, *rest), generator=rng.g)
            drawn[role] = _PROBE_CACHE[role](t, val(node).dtype)
        decisive_index(drawn, table, lens, q, rng.g)
        for role, node in caches.items():
            values[node] = drawn[role].to(rng.device)
        return ProbeInputs(values, caches, B * q)


# Why the probe's selection must be decisive (issue #29): its attention output is a near-cancelling mean of
# top-k random latent rows (RMS ~ top-k^-1/2 of a row's), so one position flipped at a near-tie of random index
# logits moves it by 2-3 % RMS. On the H200 the Triton core missed stock by 1.3 % RMS at 1 request x 4 tokens
# for such flips, not for a wrong value: a BF16 ulp of the index query moves its FP8 codes by 2^-3, enough to
# reorder random logits near the top-k boundary (on a CPU, one ulp of noise in 30 % of the index query and
# weights flips 1-4 positions a token: 2.7-3.8 % RMS at full size). So each cached index key is a power-of-two
# multiple of one random e4m3 vector u and its logit is exactly c_t * f (c_t one number a token, the same
# rounding at every position): |f| on a ladder of ratio 2^(1/32) (never near-tied) from 2^20 (dwarfing the
# logits of the step's own keys, O(1), which thus rank between the two signs) to at most 2^84 (logits far
# below FP32's 2^127 with keys up to 256). Positions come in pairs with equal latent rows and opposite f, so
# whatever c_t's sign (the query decides it) a token selects every pair once, every step position it sees,
# and the pairs of smallest |f| once more: the same rows. A wrong key or scale read, a wrong top-k or a wrong
# causal offset still changes the rows.
LADDER_BASE = 2.0 ** 20
LADDER_STEP = 2.0 ** (1 / 32)


def decisive_index(caches: dict, table: torch.Tensor, lens: list, q: int, g: torch.Generator) -> None:
    """Write each request's cached index keys and scales (and pair its latent rows) so that no rounding of the
    index query changes the rows a token attends to (``caches`` by role, on the CPU; ``table`` [B, MB];
    ``lens`` the context lengths, this step's ``q`` tokens included)."""
    keys, scales = caches[DsaCache.INDEX], caches[DsaCache.INDEX_SCALE]  # [NB, BS, Di] e4m3, [NB, BS] FP32
    bs = keys.shape[1]
    u = torch.randn(keys.shape[2], generator=g).mul(4).clamp(-8, 8).to(FP8).float()  # [Di], |u| <= 8
    latent = [caches[r] for r in (DsaCache.KV, DsaCache.KV_SCALE) if r in caches]
    for b, n in enumerate(lens):
        p = torch.randperm(n - q, generator=g)  # the cached positions, shuffled
        half = (n - q) // 2
        plus = p[: n - q - half]  # the rest, p[len(plus) + i], pairs with plus[i]
        f = LADDER_BASE * LADDER_STEP ** torch.randperm(len(plus), generator=g).double()
        f = torch.cat([f, -f[:half]]).float()  # [n - q]
        mult = 2.0 ** torch.randint(0, 6, (n - q,), generator=g).float()  # keys up to 256 (e4m3: 448)
        blk, off = table[b, p // bs], p % bs  # p = [plus; minus]
        keys[blk, off] = (mult[:, None] * u).to(FP8)
        scales[blk, off] = f / mult
        src, dst = torch.arange(half), len(plus) + torch.arange(half)  # plus[i] -> minus[i]
        for t in latent:
            t[blk[dst], off[dst]] = t[blk[src], off[src]]


def as_quantized(caches: dict) -> dict:
    """The DSA caches to compare, by name: the latent rows (FP8: codes with their per-token scales) and the
    index keys, FP8 codes with their per-token scales (compared in code steps on the rows the step wrote; the
    keys are a LayerNorm's output, so with the row floor)."""
    kv = caches[DsaCache.KV]
    if DsaCache.KV_SCALE in caches:
        kv = Quantized(kv, caches[DsaCache.KV_SCALE])
    return {"kv_cache": kv,  # [c_kv | k_rope] under one scale: no row floor (k_rope would raise it over c_kv)
            "index_keys": Quantized(caches[DsaCache.INDEX], caches[DsaCache.INDEX_SCALE], row_floor=CODE_ROW_ULP)}


def find_dsa(ctx: PassContext, S: Node) -> DsaMatch:
    """Check that the layer around sparse-MLA call ``S`` is the stock DSA; NoMatch names the failed check."""
    mla_op = (SPARSE_MLA_FP8 if is_call(S, SPARSE_MLA_FP8) else SPARSE_MLA).default
    a = op_args(S, mla_op)
    I = producer(a["topk_indices"])  # the indexer call (its auto_functionalized wrapper post-grad)
    require(is_call(I, INDEXER), "sparse MLA's selection does not come from the DSA indexer", I)
    I_out = ctx.result(I)
    require(I_out is a["topk_indices"] and single_user(I_out) is S, "indexer output has other users", I)
    ia = op_args(I, INDEXER.default)
    for name in ("slot_mapping", "block_table", "q_len"):
        same = ia[name] is a[name] or (type(a[name]) is int and ia[name] == a[name])  # ints > 256 are not interned
        require(same, f"indexer and sparse MLA disagree on {name}", I)
    S_out = ctx.result(S)
    claimed = {S, I, I_out, S_out}
    T = val(a["q"]).shape[0]
    H, qk = val(a["q"]).shape[-2:]
    Hi, Di = val(ia["q_idx"]).shape[-2:]

    # MLA query: q = view(q_b(rms(q_a)))
    q_b = linear(unview(a["q"], (T, H * qk), "q", claimed), "q_b_proj", claimed)
    q_a_n = q_b.x
    q_a, q_a_norm_w, q_a_eps = match_rms_norm(q_a_n, "q_a_layernorm", claimed)
    # latent: cat([rms(c_kv), k_rope], -1)
    cat = call(a["latent"], ("cat", "concat", "concatenate"), "the latent", claimed)
    tensors = cat["tensors"]
    require(isinstance(tensors, (list, tuple)) and len(tensors) == 2 and cat["dim"] in (-1, val(a["latent"]).dim() - 1),
            "the latent is not a last-dim cat of two parts", a["latent"])
    c_kv, kv_a_norm_w, kv_a_eps = match_rms_norm(tensors[0], "kv_a_layernorm", claimed)
    k_rope = tensors[1]
    ckv_lin, ckv_lo, ckv_hi = _rows(c_kv, "c_kv", claimed)
    rope_lin, rope_lo, rope_hi = _rows(k_rope, "k_rope", claimed)
    require(rope_lin.node is ckv_lin.node and rope_lo == ckv_hi,
            "k_rope is not the columns right after c_kv in one projection (kv_a = [c_kv | k_rope])", k_rope)
    kv_lora, rope = ckv_hi - ckv_lo, rope_hi - rope_lo
    require(a["nope"] == qk - rope, f"q head dim {qk} != nope {a['nope']} + rope {rope}", a["q"])
    # indexer query: view(wq_b(normed q_a))
    wq_b = linear(unview(ia["q_idx"], (T, Hi * Di), "indexer query", claimed), "indexer wq_b", claimed)
    require(wq_b.x is q_a_n, "indexer wq_b does not read the normed q_a", wq_b.node)
    # indexer keys and weights
    k_raw, k_norm_w, k_norm_b, k_eps = match_layer_norm(ia["k"], "indexer k_norm", claimed)
    # output: o_proj((o.float() * sigmoid(gate.float())).to(bf16))
    o_f = single_user(S_out)
    require(o_f is not None and single_user(o_f) is not None, "sparse MLA output does not feed one gate product", S)
    o_cast = single_user(single_user(o_f))
    require(o_cast is not None, "the gate product has several users", o_f)
    gated = cast_to(o_cast, torch.bfloat16, "the gated output", claimed)
    require(val(gated).dtype == torch.float32, "the gate product is not FP32", gated)
    o, sig = factors(gated, "mul", "the gated output (o * sigmoid(gate))", claimed)
    if op_name(o) == "sigmoid":
        o, sig = sig, o
    gate = call(sig, "sigmoid", "the gated output's gate factor (o * sigmoid(gate))", claimed)["input"]
    require(upcast_from(o, torch.bfloat16, "the attention output in the gate", claimed) is S_out,
            "the gate multiplies something other than the sparse MLA output", gated)
    gate = upcast_from(gate, torch.bfloat16, "the gate", claimed)
    o_user = single_user(o_cast)
    require(o_user is not None, "the gated output has several users", o_cast)
    o_lin = linear(o_user, "o_proj", claimed)
    require(o_lin.x is o_cast, "the gated output does not feed o_proj directly", o_user)

    roles = {"q_a": _rows(q_a, "q_a", claimed), "kv_a": (ckv_lin, ckv_lo, rope_hi),
             "gate": _rows(gate, "gate", claimed), "wk": _rows(k_raw, "index keys", claimed),
             "wv": _rows(ia["weights"], "index weights", claimed)}
    x = roles["q_a"][0].x
    pack_lins = packed_weights(x, roles, ctx, S)
    pack = [lin.w for lin in pack_lins]
    scales = dense_scales(ctx, [*((f"packed a-projection {i}", lin, False) for i, lin in enumerate(pack_lins)),
                                ("q_b_proj", q_b, True), ("wq_b", wq_b, True), ("o_proj", o_lin, False)], S)
    q_lora, gate_width = val(q_a).shape[-1], val(gate).shape[-1]
    require(gate_width == val(S_out).shape[-1], f"gate width {gate_width} != attention output "
            f"{val(S_out).shape[-1]}", gate)
    require(val(k_raw).shape[-1] == Di and val(ia["weights"]).shape[-1] == Hi,
            "index keys / weights widths differ from the indexer query's", I)
    check_bf16("DSA activations", x, a["q"], a["latent"], ia["q_idx"], ia["weights"], ia["k"])
    if not scales:
        check_bf16("DSA weights", q_b.w, wq_b.w, o_lin.w, *pack)
    segments = (packed_segments(pack_lins), packed_segments([o_lin]))
    latent = ("kv_cache", "kv_scale") if mla_op is SPARSE_MLA_FP8.default else ("kv_cache",)
    shapes = {**shapes_of(S, mla_op, latent), **shapes_of(I, INDEXER.default, ("index_cache", "index_scale"))}
    latent_cache = check_latent_cache(mla_op, a, shapes)
    for n in (a["kv_cache"], ia["index_cache"], ia["index_scale"]) + ((a["kv_scale"],) if "kv_scale" in a else ()):
        check_only_user(n, I if n in (ia["index_cache"], ia["index_scale"]) else S, n.name)
    check_q_len(a["q_len"], ctx.options.max_q, S)
    for w, what in ((q_b.w, "q_b_proj"), (wq_b.w, "wq_b"), (o_lin.w, "o_proj"), (a["kv_b_weight"], "kv_b_proj"),
                    (q_a_norm_w, "q_a norm weight"), (kv_a_norm_w, "kv_a norm weight"),
                    (k_norm_w, "k_norm weight"), (k_norm_b, "k_norm bias")):
        ctx.param(w, what)
    return DsaMatch(x, pack, q_a_norm_w, kv_a_norm_w, q_b.w, wq_b.w, k_norm_w, k_norm_b, o_lin.w, o_user, a, ia,
                    H, rope, q_lora, kv_lora, gate_width, Hi, Di, (q_a_eps, kv_a_eps, k_eps), claimed, latent_cache,
                    mla_op, shapes, scales, segments)


def check_latent_cache(mla_op, a: dict, shapes: dict) -> str:
    """The latent cache format of a sparse-MLA call (``a``: its arguments, ``shapes``: its caches'):
    "bfloat16" (the BF16 op on a BF16 cache) or "float8_e4m3fn" (the FP8 op on an FP8 e4m3 cache with an
    FP32 [NB, BS] scale tensor)."""
    dtype = val(a["kv_cache"]).dtype
    if mla_op is SPARSE_MLA.default:
        require(dtype == torch.bfloat16, f"latent cache is {dtype}, not bfloat16 (the BF16 sparse MLA op)",
                a["kv_cache"])
        return "bfloat16"
    require(dtype == torch.float8_e4m3fn, f"FP8 latent cache is {dtype}, not float8_e4m3fn", a["kv_cache"])
    sv = val(a["kv_scale"])
    require(sv is not None and sv.dtype == torch.float32, f"latent scales are {getattr(sv, 'dtype', None)}, not "
            "float32", a["kv_scale"])
    require(tuple(shapes["kv_scale"]) == tuple(shapes["kv_cache"][:2]), f"latent scales {list(shapes['kv_scale'])} "
            f"are not one per cache row {list(shapes['kv_cache'][:2])}", a["kv_scale"])
    return "float8_e4m3fn"


class DsaPass(LayerPass):
    """Rewrites each stock DSA attention layer (``find_dsa``) into one ``kimi_dep.dsa_attention`` call
    (``kimi_dep.dsa_attention_fp8`` on an FP8 latent cache)."""

    kind = "dsa"
    anchors = (SPARSE_MLA, SPARSE_MLA_FP8)
    stock_op = "kimi_k3.dsa_indexer + kimi_k3.sparse_mla_decode"

    def rewrite(self, ctx: PassContext, found: Found):
        m = find_dsa(ctx, found.anchor)
        a, ia, opts = m.mla, m.indexer, ctx.options
        proj, oproj = opts.tables_for(val(a["kv_cache"]).device, fp8=bool(m.scales))
        prepared = PreparedDsa(
            heads=m.heads, nope=int(a["nope"]), rope=m.rope, q_lora=m.q_lora, kv_lora=m.kv_lora,
            gate_width=m.gate_width, index_heads=m.index_heads, index_dim=m.index_dim, topk=int(ia["topk"]),
            scale=constant(a["scale"], "the sparse MLA softmax scale", found.anchor), q_a_eps=m.eps[0],
            kv_a_eps=m.eps[1], k_norm_eps=m.eps[2],
            projection=DepProjection("dsa_qkv_a_g_index", proj["dsa_qkv_a_g_index"], m.segments[0]),
            o_proj=DepProjection("o_proj", oproj, m.segments[1]), sparse_mla=opts.sparse_mla,
            latent_cache=m.latent_cache,
        )
        fp8 = m.latent_cache == "float8_e4m3fn"
        require(sum(prepared.split_sizes) == sum(ctx.param(w, "packed weight").shape[0] for w in m.pack),
                "packed rows do not add up to q_a | kv_a | gate | wk | wv", found.anchor)
        # the sparse-MLA kernel, chosen (and FlashInfer's workspace allocated) now, outside any graph
        reserve_sparse_mla(opts.sparse_mla, val(a["kv_cache"]), heads=m.heads, kv_lora=m.kv_lora, nope=int(a["nope"]))
        target, op = ((DSA_ATTENTION_FP8, "kimi_dep.dsa_attention_fp8") if fp8
                      else (DSA_ATTENTION, "kimi_dep.dsa_attention"))
        ctx.commit(found, x=m.x, output=m.output, claimed=m.claimed, target=target.default, args=(
            m.x, m.pack, m.q_a_norm_w, m.kv_a_norm_w, m.q_b_w, a["kv_b_weight"], m.wq_b_w, m.k_norm_w, m.k_norm_b,
            m.o_w, a["kv_cache"], *((a["kv_scale"],) if fp8 else ()), ia["index_cache"], ia["index_scale"],
            a["slot_mapping"], a["block_table"], ia["seq_lens"], a["q_len"], None, m.scales), prepared=prepared,
            probe=m.probe_inputs, compared=as_quantized, fp8_activations=bool(m.scales),
            pack=[(m.pack, "DSA projection")] + ([(m.scales[:len(m.pack)], "DSA projection scales")] if m.scales else []))
        tactics = {p.name: p.policies(opts.batches) for p in (prepared.projection, prepared.o_proj)}
        return tagged(op, "fp8_block" if m.scales else None), tactics
