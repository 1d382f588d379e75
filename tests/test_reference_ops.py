"""The stock ``kimi_k3`` reference ops against independent plain computations written here.

Every expected value below is computed from the definitions in docs/design.md §2-3 with
plain FP64 loops; nothing calls the helpers in ``dep_compile.stock.reference``. Inputs are
random (never zeros). Tolerances are stated next to each comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

import dep_compile.stock  # noqa: F401  (registers the kimi_k3 ops)
from dep_compile.stock import preset
from dep_compile.stock.layers import Router
from dep_compile.stock.reference.common import fp8_pow2_quantize

from helpers import same_bits

ops = torch.ops.kimi_k3
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# KDA core
# ---------------------------------------------------------------------------------------------

KDA_H, KDA_D, KDA_W, KDA_SLOTS = 2, 8, 4, 5
KDA_LB, KDA_EPS = -5.0, 1e-5


def _kda_inputs(B: int, q_len: int, seed: int):
    g = _gen(seed)
    H, D, W, S = KDA_H, KDA_D, KDA_W, KDA_SLOTS
    HD, T = H * D, B * q_len
    return dict(
        q=_randn(g, T, HD), k=_randn(g, T, HD), v=_randn(g, T, HD), g_raw=_randn(g, T, HD),
        beta=_randn(g, T, H), g_out=_randn(g, T, HD),
        conv_weight=_randn(g, 3 * HD, W, scale=0.5),
        A_log=torch.log(torch.empty(H).uniform_(1, 16, generator=g)),
        dt_bias=0.5 * torch.randn(HD, generator=g),
        o_norm_weight=(1 + 0.1 * torch.randn(D, generator=g)).to(BF16),
        conv_state=_randn(g, S, W - 1, 3 * HD),
        recurrent_state=0.5 * torch.randn(S, H, D, D, generator=g),
    )


def _kda_expected(inp, state_indices, accepted, q_len):
    """A step-by-step FP64 KDA: conv with state + SiLU, L2 norms (eps 1e-6, q * D^-1/2), the
    decay gate, the delta rule on S [H, Dv, Dk], gated RMSNorm. Returns (out, conv_state,
    recurrent_state) with the states as they must be after the step."""
    H, D, W = KDA_H, KDA_D, KDA_W
    HD = H * D
    f = {n: t.double() for n, t in inp.items()}
    conv_state, rec = f["conv_state"].clone(), f["recurrent_state"].clone()
    T = f["q"].shape[0]
    out = torch.zeros(T, HD, dtype=torch.float64)
    for b, slot in enumerate(state_indices.tolist()):
        if slot < 0:
            continue  # padding: output stays 0, states untouched
        acc = int(accepted[b])
        hist = f["conv_state"][slot]  # [W-1, 3HD], oldest first
        S = f["recurrent_state"][slot].clone()  # [H, Dv, Dk]
        xs = []
        for i in range(q_len):
            t = b * q_len + i
            x = torch.cat([f["q"][t], f["k"][t], f["v"][t]])
            xs.append(x)
            window = torch.cat([hist, torch.stack(xs)])[-W:]  # [W, 3HD]; last row = this token
            y = torch.zeros(3 * HD, dtype=torch.float64)
            for j in range(W):
                y += f["conv_weight"][:, j] * window[j]
            y = y * torch.sigmoid(y)  # SiLU
            qc, kc, vc = y[:HD].view(H, D), y[HD:2 * HD].view(H, D), y[2 * HD:].view(H, D)
            beta = torch.sigmoid(f["beta"][t])
            o = torch.zeros(H, D, dtype=torch.float64)
            for h in range(H):
                qh = qc[h] / torch.sqrt((qc[h] ** 2).sum() + 1e-6) * D ** -0.5
                kh = kc[h] / torch.sqrt((kc[h] ** 2).sum() + 1e-6)
                a = math.exp(float(f["A_log"][h]))
                gate = KDA_LB * torch.sigmoid(a * (f["g_raw"][t, h * D:(h + 1) * D] + f["dt_bias"][h * D:(h + 1) * D]))
                S[h] = S[h] @ torch.diag(torch.exp(gate))
                S[h] = S[h] + beta[h] * torch.outer(vc[h] - S[h] @ kh, kh)
                oh = S[h] @ qh
                rms = torch.sqrt((oh ** 2).mean() + KDA_EPS)
                o[h] = oh / rms * f["o_norm_weight"] * torch.sigmoid(f["g_out"][t, h * D:(h + 1) * D])
            out[t] = o.reshape(HD)
            if i + 1 == acc:
                rec[slot] = S
                conv_state[slot] = torch.cat([hist, torch.stack(xs)])[-(W - 1):]
    return out, conv_state, rec


def _run_kda(inp, state_indices, accepted, q_len):
    conv_state, rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    out = ops.kda_core(
        inp["q"], inp["k"], inp["v"], inp["g_raw"], inp["beta"], inp["g_out"], inp["conv_weight"],
        inp["A_log"], inp["dt_bias"], inp["o_norm_weight"], conv_state, rec, state_indices, accepted,
        q_len, KDA_LB, KDA_EPS)
    return out, conv_state, rec


@pytest.mark.parametrize("q_len, accepted", [(1, [1, 1, 1]), (3, [1, 3, 2]), (3, [2, 1, 3])])
def test_kda_core_against_fp64_loop(q_len, accepted):
    inp = _kda_inputs(3, q_len, seed=10 + q_len + accepted[0])
    state_indices = torch.tensor([3, 0, -1], dtype=torch.int32)  # request 2 is padding
    acc = torch.tensor(accepted, dtype=torch.int32)
    out, conv, rec = _run_kda(inp, state_indices, acc, q_len)
    exp_out, exp_conv, exp_rec = _kda_expected(inp, state_indices, acc, q_len)

    assert out.dtype == BF16 and out.shape == inp["q"].shape
    # Output O(1) after the gated RMSNorm; the op rounds the conv output and the result to BF16
    # (rel. 2^-8 each), which moves outputs by ~5e-3 here (seen). A wrong state layout, gate
    # or norm moves them by O(1).
    torch.testing.assert_close(out.double(), exp_out, atol=3e-2, rtol=3e-2)
    # Padding request: exact zeros.
    assert torch.equal(out[2 * q_len:], torch.zeros_like(out[2 * q_len:]))
    # The conv state is copied BF16 input taps: exact.
    assert torch.equal(conv, exp_conv.to(BF16))
    # The FP32 state follows from BF16-rounded conv outputs (seen: <= 3e-3): 1e-2 on O(1) entries.
    torch.testing.assert_close(rec.double(), exp_rec, atol=1e-2, rtol=1e-2)
    # Untouched slots (the padding request has none; slots 1, 2, 4 are free): bit-exact.
    for s in (1, 2, 4):
        assert torch.equal(conv[s], inp["conv_state"][s])
        assert torch.equal(rec[s], inp["recurrent_state"][s])


def test_kda_verify_commits_state_after_accepted_tokens():
    """The committed state after a q=3 verify with accepted=a equals the state after a decode
    steps of the first a tokens (and the rejected tokens' effect is gone)."""
    q_len = 3
    inp = _kda_inputs(2, q_len, seed=21)
    si = torch.tensor([1, 4], dtype=torch.int32)
    acc = torch.tensor([2, 1], dtype=torch.int32)
    out_v, conv_v, rec_v = _run_kda(inp, si, acc, q_len)

    conv, rec = inp["conv_state"].clone(), inp["recurrent_state"].clone()
    outs = []
    for i in range(2):  # token i of both requests as a decode step; request 1 stops after 1
        rows = [i, q_len + i] if i < 1 else [i]
        step_si = si if i < 1 else si[:1]
        one = {n: inp[n][rows] for n in ("q", "k", "v", "g_raw", "beta", "g_out")}
        outs.append(ops.kda_core(
            one["q"], one["k"], one["v"], one["g_raw"], one["beta"], one["g_out"], inp["conv_weight"],
            inp["A_log"], inp["dt_bias"], inp["o_norm_weight"], conv, rec, step_si,
            torch.ones(len(rows), dtype=torch.int32), 1, KDA_LB, KDA_EPS))
    # Same reference arithmetic token by token: states bit-exact, outputs too.
    assert torch.equal(conv, conv_v) and torch.equal(rec, rec_v)
    assert torch.equal(out_v[[0, q_len, 1]], torch.cat([outs[0], outs[1]]))
    # The commit really is partial: the verify's last token did move the state it discarded.
    assert not torch.equal(rec_v[1], _run_kda(inp, si, torch.tensor([3, 1], dtype=torch.int32), q_len)[2][1])


# ---------------------------------------------------------------------------------------------
# MLA / sparse MLA decode (absorbed) against unabsorbed attention
# ---------------------------------------------------------------------------------------------

MLA_H, NOPE, ROPE, VDIM, KVL = 3, 16, 8, 12, 20  # v != nope catches W_UK / W_UV mix-ups
NB, BS = 12, 4


def _mla_inputs(seq_lens, q_len, seed, padding_last=False):
    g = _gen(seed)
    B = len(seq_lens)
    T = B * q_len
    block_table = torch.randperm(NB, generator=g)[: B * 3].view(B, 3).to(torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (seq_lens.long().view(-1, 1) - q_len + torch.arange(q_len)).view(-1)
    req = torch.arange(B).repeat_interleave(q_len)
    slots = block_table[req, pos // BS].long() * BS + pos % BS
    if padding_last:
        slots[-q_len:] = -1
    return dict(
        q=_randn(g, T, MLA_H, NOPE + ROPE), latent=_randn(g, T, KVL + ROPE),
        kv_b=_randn(g, MLA_H * (NOPE + VDIM), KVL, scale=KVL ** -0.5),
        kv_cache=_randn(g, NB, BS, KVL + ROPE), slots=slots, block_table=block_table, seq_lens=seq_lens,
        pos=pos, scale=(NOPE + ROPE) ** -0.5,
    )


def _unabsorbed(inp, q_len, positions_of):
    """Plain multi-head attention: expand each context latent with kv_b_proj into per-head
    K_nope / V, K = [K_nope | k_rope] (k_rope shared by all heads), softmax(q.K * scale) V.
    The context is built from the *old* cache plus this step's latents (the insert)."""
    T = inp["q"].shape[0]
    w = inp["kv_b"].double().view(MLA_H, NOPE + VDIM, KVL)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    out = torch.zeros(T, MLA_H * VDIM, dtype=torch.float64)
    for t in range(T):
        if int(inp["slots"][t]) < 0:
            continue
        b = t // q_len
        step_start = int(inp["seq_lens"][b]) - q_len
        rows = []
        for p in positions_of(t):
            if p >= step_start:  # this step's token: taken from the latent input
                rows.append(inp["latent"][b * q_len + p - step_start].double())
            else:
                blk = int(inp["block_table"][b, p // BS])
                rows.append(inp["kv_cache"][blk, p % BS].double())
        ctx = torch.stack(rows)
        c, k_rope = ctx[:, :KVL], ctx[:, KVL:]
        for h in range(MLA_H):
            k = torch.cat([c @ w_uk[h].t(), k_rope], -1)  # [n, nope + rope]
            v = c @ w_uv[h].t()  # [n, v]
            p = torch.softmax(k @ inp["q"][t, h].double() * inp["scale"], 0)
            out[t, h * VDIM:(h + 1) * VDIM] = p @ v
    return out


def _expected_cache(inp):
    cache = inp["kv_cache"].clone()
    for t, s in enumerate(inp["slots"].tolist()):
        if s >= 0:
            cache[s // BS, s % BS] = inp["latent"][t]
    return cache


@pytest.mark.parametrize("q_len, seq_lens, padding", [(1, [5, 9, 1], False), (1, [3, 7, 4], True),
                                                      (3, [5, 11, 3], False)])
def test_mla_decode_against_unabsorbed_attention(q_len, seq_lens, padding):
    inp = _mla_inputs(seq_lens, q_len, seed=30 + q_len, padding_last=padding)
    cache = inp["kv_cache"].clone()
    out = ops.mla_decode(inp["q"], inp["latent"], inp["kv_b"], cache, inp["slots"], inp["block_table"],
                         inp["seq_lens"], q_len, inp["scale"], NOPE)
    exp = _unabsorbed(inp, q_len, lambda t: range(int(inp["pos"][t]) + 1))  # causal
    assert out.shape == (len(seq_lens) * q_len, MLA_H * VDIM) and out.dtype == BF16
    # Absorbed decode rounds the absorbed query and the latent output to BF16 (rel. 2^-8 each);
    # outputs are O(1): 3e-2 covers that, a wrong head split / position is O(1) off.
    torch.testing.assert_close(out.double(), exp, atol=3e-2, rtol=3e-2)
    # The insert: exactly this step's latents at their slots, nothing else touched.
    assert torch.equal(cache, _expected_cache(inp))
    if padding:
        assert torch.equal(out[-q_len:], torch.zeros_like(out[-q_len:]))


def test_sparse_mla_decode_all_selected_equals_dense():
    q_len = 2
    inp = _mla_inputs([4, 10, 7], q_len, seed=41)
    K = 12
    topk = torch.full((inp["q"].shape[0], K), -1, dtype=torch.int32)
    for t, p in enumerate(inp["pos"].tolist()):
        topk[t, : p + 1] = torch.arange(p + 1)
    c_dense, c_sparse = inp["kv_cache"].clone(), inp["kv_cache"].clone()
    dense = ops.mla_decode(inp["q"], inp["latent"], inp["kv_b"], c_dense, inp["slots"], inp["block_table"],
                           inp["seq_lens"], q_len, inp["scale"], NOPE)
    sparse = ops.sparse_mla_decode(inp["q"], inp["latent"], inp["kv_b"], c_sparse, inp["slots"],
                                   inp["block_table"], topk, q_len, inp["scale"], NOPE)
    # Same tokens, same math: equal up to BF16 rounding of the output (one ulp, 1e-2 on O(1)).
    torch.testing.assert_close(sparse, dense, atol=1e-2, rtol=1e-2)
    assert torch.equal(c_dense, c_sparse)


def test_sparse_mla_decode_subset_against_unabsorbed():
    q_len = 1
    inp = _mla_inputs([6, 12, 9], q_len, seed=42)
    g = _gen(43)
    K = 5
    topk = torch.full((3, K), -1, dtype=torch.int32)
    chosen = []
    for t, p in enumerate(inp["pos"].tolist()):
        n = min(K - (t == 0), p + 1)  # request 0 uses one -1 pad
        sel = torch.randperm(p + 1, generator=g)[:n].sort().values
        topk[t, :n] = sel.to(torch.int32)
        chosen.append(sel.tolist())
    cache = inp["kv_cache"].clone()
    out = ops.sparse_mla_decode(inp["q"], inp["latent"], inp["kv_b"], cache, inp["slots"], inp["block_table"],
                                topk, q_len, inp["scale"], NOPE)
    exp = _unabsorbed(inp, q_len, lambda t: chosen[t])
    torch.testing.assert_close(out.double(), exp, atol=3e-2, rtol=3e-2)  # as the dense test
    assert torch.equal(cache, _expected_cache(inp))


# ---------------------------------------------------------------------------------------------
# DSA indexer and the FP8 power-of-two quantizer
# ---------------------------------------------------------------------------------------------

IDX_H, IDX_D, IDX_TOPK, IDX_NB = 4, 32, 8, 24


def _is_pow2(x: torch.Tensor) -> bool:
    m, _ = torch.frexp(x.double())
    return bool((m == 0.5).all())


def _fp8_exact(g, *shape, pow2: float):
    """Values exactly representable as FP8 e4m3 x ``pow2`` whose rows' amax is 448 x pow2, so the
    op's own per-row power-of-two quantization of them is lossless."""
    x = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8).float()
    x[..., 0] = 448.0 * torch.where(torch.rand(shape[:-1], generator=g) < 0.5, -1.0, 1.0)
    return (x * pow2).to(BF16)


def test_fp8_pow2_quantizer():
    g = _gen(50)
    x = torch.randn(64, IDX_D, generator=g) * torch.exp(torch.empty(64, 1).uniform_(-8, 8, generator=g))
    values, scale = fp8_pow2_quantize(x)
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert _is_pow2(scale), "scales must be powers of two"
    vf = values.float()
    assert bool((vf.abs() <= 448).all())
    amax = x.abs().amax(-1)
    # Smallest power of two with amax / scale <= 448: half of it would overflow the range.
    assert bool((amax / scale <= 448).all()) and bool((amax / (scale / 2) > 448).all())
    # Roundtrip: e4m3 keeps 3 mantissa bits, so half an ulp is <= 2^-4 relative for normals and
    # 2^-10 absolute (x scale) in the subnormal range.
    err = (vf * scale.unsqueeze(-1) - x).abs()
    assert bool((err <= x.abs() * 2 ** -4 + scale.unsqueeze(-1) * 2 ** -10).all())


def _indexer_inputs(seq_lens, q_len, seed):
    g = _gen(seed)
    B = len(seq_lens)
    T = B * q_len
    block_table = torch.randperm(IDX_NB, generator=g)[: B * 8].view(B, 8).to(torch.int32)  # 32 tokens each
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (seq_lens.long().view(-1, 1) - q_len + torch.arange(q_len)).view(-1)
    req = torch.arange(B).repeat_interleave(q_len)
    slots = block_table[req, pos // BS].long() * BS + pos % BS
    return dict(
        q=_fp8_exact(g, T, IDX_H, IDX_D, pow2=2.0 ** -7), w=_randn(g, T, IDX_H), k=_randn(g, T, IDX_D),
        index_cache=(torch.randn(IDX_NB, BS, IDX_D, generator=g) * 4).clamp(-8, 8).to(FP8),
        index_scale=torch.rand(IDX_NB, BS, generator=g) + 0.01,
        slots=slots, block_table=block_table, seq_lens=seq_lens, pos=pos,
    )


def _assert_topk_selection(sel: list[int], keys: torch.Tensor, k: int, tol: float):
    """``sel`` is a top-``k`` of ``keys``: k distinct indices, ascending, none beaten by an
    unselected key by more than ``tol`` (ties within ``tol`` may go either way)."""
    assert len(sel) == k and len(set(sel)) == k and sel == sorted(sel)
    order = torch.argsort(keys, descending=True)
    kth = float(keys[order[k - 1]])
    must = {int(i) for i in range(keys.numel()) if keys[i] > kth + tol}
    never = {int(i) for i in range(keys.numel()) if keys[i] < kth - tol}
    assert must <= set(sel), f"missing {sorted(must - set(sel))}"
    assert not (never & set(sel)), f"wrongly selected {sorted(never & set(sel))}"


@pytest.mark.parametrize("q_len, seq_lens", [(1, [20, 5, 12]), (2, [14, 9, 24])])
def test_dsa_indexer_against_brute_force(q_len, seq_lens):
    inp = _indexer_inputs(seq_lens, q_len, seed=60 + q_len)
    icache, iscale = inp["index_cache"].clone(), inp["index_scale"].clone()
    out = ops.dsa_indexer(inp["q"], inp["w"], inp["k"], icache, iscale, inp["slots"], inp["block_table"],
                          inp["seq_lens"], q_len, IDX_TOPK)
    assert out.dtype == torch.int32 and out.shape == (len(seq_lens) * q_len, IDX_TOPK)

    # The key insert: a power-of-two scale per token, FP8 values within e4m3 rounding of k.
    for t, s in enumerate(inp["slots"].tolist()):
        blk, off = s // BS, s % BS
        sc = iscale[blk, off]
        assert _is_pow2(sc)
        deq = icache[blk, off].float() * sc
        kf = inp["k"][t].float()
        assert bool((deq - kf).abs().le(kf.abs() * 2 ** -4 + sc * 2 ** -10).all())
    written = torch.zeros(IDX_NB, BS, dtype=torch.bool)
    written.view(-1)[inp["slots"]] = True
    assert torch.equal(icache[~written], inp["index_cache"][~written])  # nothing else touched
    assert torch.equal(iscale[~written], inp["index_scale"][~written])

    # Brute force over the cache as written: logits[s] = sum_h w[h] * ReLU(q[h] . k[s]), FP64.
    for t in range(out.shape[0]):
        b, n = t // q_len, int(inp["pos"][t]) + 1
        blocks = inp["block_table"][b].long()[torch.arange(n) // BS]
        offs = torch.arange(n) % BS
        keys = icache[blocks, offs].double() * iscale[blocks, offs].double().unsqueeze(-1)
        dots = torch.relu(inp["q"][t].double() @ keys.t())  # [H, n]
        logits = (inp["w"][t].double().unsqueeze(-1) * dots).sum(0)
        sel = out[t].tolist()
        if n <= IDX_TOPK:  # a short sequence selects every token, -1 padded
            assert sel == list(range(n)) + [-1] * (IDX_TOPK - n)
        else:
            # q is FP8-exact, so only FP32 summation order separates op from brute force:
            # 1e-5 of the logits' range decides near-ties.
            _assert_topk_selection(sel, logits, IDX_TOPK, tol=1e-5 * float(logits.abs().max()))


def test_dsa_indexer_sort_topk_exact_when_untied():
    """With well-separated logits, the selection equals a sort-based top-k exactly."""
    inp = _indexer_inputs([30], 1, seed=70)
    icache, iscale = inp["index_cache"].clone(), inp["index_scale"].clone()
    # One head, weight 1: logits = ReLU(q . k[s]); make every key positive-aligned with q.
    q = inp["q"].clone()
    w = torch.zeros_like(inp["w"])
    w[:, 0] = 1.0
    out = ops.dsa_indexer(q, w + 1e-3, inp["k"], icache, iscale, inp["slots"], inp["block_table"],
                          inp["seq_lens"], 1, IDX_TOPK)
    blocks = inp["block_table"][0].long()[torch.arange(30) // BS]
    keys = icache[blocks, torch.arange(30) % BS].double() * iscale[blocks, torch.arange(30) % BS].double().unsqueeze(-1)
    logits = ((w[0].double() + 1e-3).unsqueeze(-1) * torch.relu(q[0].double() @ keys.t())).sum(0)
    srt = torch.sort(logits, descending=True)
    gap = float(srt.values[IDX_TOPK - 1] - srt.values[IDX_TOPK])
    assert gap > 1e-4 * float(logits.abs().max()), "test inputs must not tie at the boundary"
    assert out[0].tolist() == sorted(srt.indices[:IDX_TOPK].tolist())


# ---------------------------------------------------------------------------------------------
# Router and routed experts
# ---------------------------------------------------------------------------------------------


def _router_cfg():
    return preset("k3-small").replace(hidden_size=48, n_routed_experts=32, num_experts_per_tok=6,
                                      routed_scaling_factor=2.5)


def _sort_route(x, weight, bias, k, scale):
    """Sort-based sigmoid routing in FP64: (keys used for selection, ids [T, k], weights [T, k])."""
    scores = torch.sigmoid(x.double() @ weight.detach().double().t())
    keys = scores + bias.detach().double()
    ids = torch.argsort(keys, dim=-1, descending=True)[:, :k]
    w = scores.gather(1, ids)
    return keys, ids, w / w.sum(-1, keepdim=True) * scale


@pytest.mark.parametrize("bias_scale", [0.05, 10.0])
def test_router_against_sort_selection(bias_scale):
    cfg = _router_cfg()
    g = _gen(80)
    r = Router(cfg)  # as built: BF16 gate weight, FP32 correction bias
    r.weight.data = (torch.randn(r.weight.shape, generator=g) * cfg.hidden_size ** -0.5).to(BF16)
    r.e_score_correction_bias.data = torch.randn(cfg.n_routed_experts, generator=g) * bias_scale
    x = _randn(g, 9, cfg.hidden_size)
    w, ids = r(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (9, 6)
    keys, exp_ids, exp_w = _sort_route(x, r.weight, r.e_score_correction_bias, 6, cfg.routed_scaling_factor)
    agree = 0
    for t in range(9):
        # FP32 vs FP64 router logits differ by ~1e-6: 1e-5 decides near-ties of the keys.
        _assert_topk_selection(sorted(ids[t].tolist()), keys[t], 6, tol=1e-5)
        # Weights: the sigmoid scores of the chosen experts (never the bias), renormalized, x scale.
        scores = torch.sigmoid(x[t].double() @ r.weight.detach().double().t())
        mine = scores[ids[t]] / scores[ids[t]].sum() * cfg.routed_scaling_factor
        torch.testing.assert_close(w[t].double(), mine, atol=1e-5, rtol=1e-5)  # FP32 math
        assert abs(float(w[t].sum()) - cfg.routed_scaling_factor) < 1e-5
        if set(ids[t].tolist()) == set(exp_ids[t].tolist()):  # the sort picked the same experts
            agree += 1
            o, eo = torch.argsort(ids[t]), torch.argsort(exp_ids[t])
            torch.testing.assert_close(w[t, o].double(), exp_w[t, eo], atol=1e-5, rtol=1e-5)  # FP32 math
    assert agree >= 8  # random keys: at most one token may hold a near-tie at the boundary
    if bias_scale > 1:  # a large bias dominates selection; the weights still ignore it
        top_bias = set(torch.argsort(r.e_score_correction_bias, descending=True)[:6].tolist())
        assert all(set(ids[t].tolist()) == top_bias for t in range(9))


EXP_T, EXP_LAT, EXP_I, EXP_E, EXP_K = 7, 24, 16, 16, 4


def _experts_inputs(seed):
    g = _gen(seed)
    x = _randn(g, EXP_T, EXP_LAT)
    w13 = _randn(g, EXP_E, 2 * EXP_I, EXP_LAT, scale=EXP_LAT ** -0.5)
    w2 = _randn(g, EXP_E, EXP_LAT, EXP_I, scale=EXP_I ** -0.5)
    ids = torch.stack([torch.randperm(EXP_E, generator=g)[:EXP_K] for _ in range(EXP_T)])
    tw = torch.rand(EXP_T, EXP_K, generator=g) + 0.1
    return x, w13, w2, tw, ids


def _experts_loop(x, w13, w2, tw, ids, start, beta=4.0, beta_lin=25.0):
    """Per token, per selected local expert: SiTU(x W13^T) W2^T, weighted, in FP64."""
    E = w13.shape[0]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if not 0 <= e < E:
                continue  # another rank's expert
            h = w13[e].double() @ x[t].double()
            gt, up = h[:EXP_I], h[EXP_I:]
            a = beta * torch.tanh(gt / beta) * torch.sigmoid(gt) * beta_lin * torch.tanh(up / beta_lin)
            out[t] += float(tw[t, j]) * (w2[e].double() @ a)
    return out


def _experts(x, w13, w2, tw, ids, start):
    """kimi_k3.routed_experts on this rank's experts only (ep_size 1: no dispatch)."""
    return ops.routed_experts(x, w13, w2, tw, ids, expert_start=start, ep_size=1, beta=4.0, beta_lin=25.0)


def test_routed_experts_against_per_token_loop():
    x, w13, w2, tw, ids = _experts_inputs(90)
    out = _experts(x, w13, w2, tw, ids, 0)
    assert out.dtype == BF16 and out.shape == (EXP_T, EXP_LAT)
    # The op rounds h and SiTU(h) to BF16 per expert and the sum once: 3e-2 on O(1) outputs.
    torch.testing.assert_close(out.double(), _experts_loop(x, w13, w2, tw, ids, 0), atol=3e-2, rtol=3e-2)


def test_routed_experts_local_range_ignores_other_ranks():
    x, w13, w2, tw, ids = _experts_inputs(91)
    start, n_local = 5, 6
    w13_l, w2_l = w13[start:start + n_local].contiguous(), w2[start:start + n_local].contiguous()
    out = _experts(x, w13_l, w2_l, tw, ids, start)
    exp = _experts_loop(x, w13[start:start + n_local], w2[start:start + n_local], tw, ids, start)
    torch.testing.assert_close(out.double(), exp, atol=3e-2, rtol=3e-2)  # as above
    # Same as all 16 experts with the non-local picks' weights zeroed.
    local = (ids >= start) & (ids < start + n_local)
    full = _experts(x, w13, w2, tw * local, ids, 0)
    torch.testing.assert_close(out, full, atol=1e-2, rtol=1e-2)  # one BF16 ulp of summation order
    # Moving non-local picks to other non-local experts changes nothing (bit-exact).
    moved = torch.where(local, ids, (ids + 7) % start)
    assert torch.equal(out, _experts(x, w13_l, w2_l, tw, moved, start))
    # A token with no local expert gets exact zeros.
    t0 = int(local.any(-1).nonzero()[0])
    ids2 = ids.clone()
    ids2[t0] = torch.tensor([0, 1, 2, 15])
    z = _experts(x, w13_l, w2_l, tw, ids2, start)
    assert torch.equal(z[t0], torch.zeros_like(z[t0])) and bool(out[t0].abs().sum() > 0)


# ---------------------------------------------------------------------------------------------
# AttnRes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("write_slot, num_blocks", [(-1, 2), (1, 2), (0, 1), (-1, 3)])
def test_attn_res_against_definition(write_slot, num_blocks):
    g = _gen(100 + write_slot + 10 * num_blocks)
    T, Dm, NBANK, eps = 3, 16, 3, 1e-5
    prefix, delta = _randn(g, T, Dm), _randn(g, T, Dm)
    bank, query = _randn(g, NBANK, T, Dm), _randn(g, Dm, scale=0.5)
    p, bk = prefix.clone(), bank.clone()
    out = ops.attn_res(p, bk, delta, query, eps, num_blocks, write_slot)

    new_prefix = (prefix.double() + delta.double()).to(BF16)  # prefix += delta, rounded to BF16
    assert torch.equal(p, new_prefix)
    exp_bank = bank.clone()
    if write_slot >= 0:
        exp_bank[write_slot] = new_prefix
    assert torch.equal(bk, exp_bank)
    src = torch.cat([exp_bank[:num_blocks], new_prefix.unsqueeze(0)]).double()  # [n, T, D]
    normed = src / torch.sqrt((src ** 2).mean(-1, keepdim=True) + eps)
    logits = (normed * query.double()).sum(-1)  # [n, T]
    exp = (torch.softmax(logits, 0).unsqueeze(-1) * src).sum(0)  # un-normalized sources
    assert out.dtype == BF16 and out.shape == (T, Dm)
    # BF16 output of an FP32 mix of O(1) sources: 1e-2 (about two BF16 ulps).
    torch.testing.assert_close(out.double(), exp, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# opcheck: schema, fake kernels, mutation annotations, AOT dispatch
# ---------------------------------------------------------------------------------------------


def _experts_args(x, w13, w2, tw, ids, start):
    """Positional arguments of kimi_k3.routed_experts (ep_size 1: no dispatch)."""
    return (x, w13, w2, tw, ids, start, 1, 4.0, 25.0)


def _opcheck_cases():
    kda = _kda_inputs(2, 2, seed=110)
    si, acc = torch.tensor([1, -1], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    mla = _mla_inputs([6, 9], 2, seed=111)
    idx = _indexer_inputs([6, 13], 2, seed=112)
    topk = torch.full((4, 8), -1, dtype=torch.int32)
    for t, p in enumerate(mla["pos"].tolist()):
        topk[t, : min(p + 1, 8)] = torch.arange(min(p + 1, 8))
    x, w13, w2, tw, ids = _experts_inputs(113)
    g = _gen(114)
    return {
        "kda_core": (ops.kda_core, (
            kda["q"], kda["k"], kda["v"], kda["g_raw"], kda["beta"], kda["g_out"], kda["conv_weight"], kda["A_log"],
            kda["dt_bias"], kda["o_norm_weight"], kda["conv_state"], kda["recurrent_state"], si, acc, 2, KDA_LB,
            KDA_EPS)),
        "mla_decode": (ops.mla_decode, (
            mla["q"], mla["latent"], mla["kv_b"], mla["kv_cache"], mla["slots"], mla["block_table"],
            mla["seq_lens"], 2, mla["scale"], NOPE)),
        "dsa_indexer": (ops.dsa_indexer, (
            idx["q"], idx["w"], idx["k"], idx["index_cache"], idx["index_scale"], idx["slots"], idx["block_table"],
            idx["seq_lens"], 2, 8)),
        "sparse_mla_decode": (ops.sparse_mla_decode, (
            mla["q"], mla["latent"], mla["kv_b"], mla["kv_cache"].clone(), mla["slots"], mla["block_table"], topk, 2,
            mla["scale"], NOPE)),
        "routed_experts": (ops.routed_experts,
                           _experts_args(x, w13[2:8].contiguous(), w2[2:8].contiguous(), tw, ids, 2)),
        "attn_res": (ops.attn_res,
                     (_randn(g, 3, 16), _randn(g, 3, 3, 16), _randn(g, 3, 16), _randn(g, 16), 1e-5, 2, 1)),
    }


# torch's SchemaCheckMode (opcheck's test_schema) compares tensors with allclose, which CPU
# torch cannot run on float8_e4m3fn; ops with an FP8 cache skip it and get _check_mutations.
_NO_FP8_SCHEMA_CHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _check_mutations(op, args):
    """Exactly the arguments the schema marks as written change; the output aliases no input."""
    schema = op.default._schema if hasattr(op, "default") else op._schema
    written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    assert written, "every stateful op declares what it mutates"
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    out = op(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if b is None:
            continue
        changed = not same_bits(a, b)
        assert changed == (i in written), f"argument {schema.arguments[i].name}: changed={changed}"
        assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["kda_core", "mla_decode", "dsa_indexer", "sparse_mla_decode", "routed_experts",
                                  "attn_res"])
def test_opcheck_kimi_k3(name):
    op, args = _opcheck_cases()[name]
    has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
    torch.library.opcheck(op, args, test_utils=_NO_FP8_SCHEMA_CHECK if has_fp8 else "ALL")
    if name != "routed_experts":  # the one op that mutates nothing
        _check_mutations(op, args)


def _captured_kimi_dep_calls() -> dict:
    """One real call of each kimi_dep op: rewrite a small decoder's Dynamo graph with the backend
    (pattern-only), run it under an FX interpreter and keep each op's first arguments. Built from
    a real rewrite so the arguments follow the ops' current signatures."""
    from dep_compile.backend import kimi_dep
    from dep_compile.stock import KimiCache, RequestBatch, build_model

    cfg = preset("k31-small", num_layers=4)  # KDA, DSA and MoE layers
    model = build_model(cfg, seed=130)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4, seed=131)
    meta = RequestBatch(cache, 2, start_len=20, seed=132).step(2, [1, 2])  # verify: q_len 2
    ids = torch.randint(0, cfg.vocab_size, (4,), generator=_gen(133))
    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    pristine = cache.snapshot()
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True, dynamic=False)(ids, meta, cache)
    for i, lc in enumerate(cache.layers):  # undo the capture run's cache writes
        for n, t in lc.tensors().items():
            t.copy_(pristine[f"layer.{i}.{n}"])
    gm, inputs = seen[0]
    kimi_dep(gm, inputs, options={"inductor": False})
    calls: dict = {}

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            name = str(target)
            if name.startswith("kimi_dep.") and name.split(".")[1] not in calls:
                assert not kwargs
                clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a
                calls[name.split(".")[1]] = (target, tuple(
                    [clone(x) for x in a] if isinstance(a, (list, tuple)) else clone(a) for a in args))
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return calls


def test_opcheck_kimi_dep_ops():
    """The rewritten-layer ops, with the arguments and prepared layers of a real rewrite."""
    calls = _captured_kimi_dep_calls()
    assert set(calls) == {"kda_attention", "dsa_attention", "moe", "attn_res_norm"}, sorted(calls)
    for name, (op, args) in calls.items():
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args)
        torch.library.opcheck(op, args, test_utils=_NO_FP8_SCHEMA_CHECK if has_fp8 else "ALL")
        if name != "moe":  # the one op that mutates nothing
            _check_mutations(op, args)
