#!/usr/bin/env python3
"""Precision study: is each kimi_dep kernel less accurate than the stock CUDA-path op it replaces?

For every kimi_dep kernel of a decode step and its stock counterpart, on the same random inputs
(Kimi K3 head counts and widths; only rows, requests and context are reduced), each side's output
and every state / cache it writes are compared with the same op evaluated in float64 (inputs
upcast, the math in float64, no intermediate rounding). FP8 quantization is an input here, never an
error source: where an op reads FP8 values (the indexer), both sides and the float64 reference read
the same FP8 values and scales.

Pairs (kimi_dep side | stock side, the function the stock op runs on CUDA):

* ``kda``: ``ops.kda_triton.kda_decode_core`` (F_B gate inside) | ``stock.kda_cuda.kda_core_cuda``
  after stock's BF16 ``f_b_proj`` (fla-core's recurrence where fla imports, its torch fallback
  elsewhere): output, recurrent state, conv state; and the recurrent state against a float64
  reference that rounds where the op's contract rounds (``|contract``: conv outputs and F_B gate
  in BF16), which leaves only the FP32 arithmetic of each side;
* ``attn_res_norm``: ``stock.attn_res_cuda.attn_res_norm_cuda`` (the fused kimi_dep op) |
  ``attn_res_cuda`` then stock's ``RMSNorm``: output, prefix, bank;
* ``router``: ``ops.router_triton.route_sigmoid_topk`` | stock's ``Router`` math (FP32 logits,
  sigmoid, top-k, renormalize, scale): logits (the split-K partials summed in the kernel's order),
  the dense ``[T, E]`` routing weights, the fraction of (token, expert) picks that differ from
  float64's;
* ``rms_norm`` (MoE latent norm, DSA q_a norm): ``ops.norm_triton.rms_norm_fused`` | ``RMSNorm``;
  ``situ`` (shared expert): ``ops.moe_triton.situ_fused`` | ``stock.layers.situ``;
* DSA (``ops.dsa_triton`` | ``stock.batched_attention``, the stock ops' CUDA code): the latent cache
  entry, the index keys (LayerNorm + FP8, dequantized), the index logits, the top-k selection
  (fraction of picks that differ from float64's), the absorbed query, the sparse attention (BF16
  latent output), W_UV + gate, and the whole sparse MLA chain (absorb -> attention -> W_UV + gate).

Metrics per output: ``rel-max = max|x - ref| / max|ref|``, ``rel-rms = rms(x - ref) / rms(ref)``
(``ref`` float64), the worst over seeds; for selections, the fraction of picks unlike float64's.
``ratio`` is kimi_dep / stock (rel-rms; rel-max in its own column).

Run from the repository root::

    # CPU, Triton's interpreter (set here when --device cpu), K3 widths, few rows (minutes):
    OMP_NUM_THREADS=1 python3 benchmarks/precision.py --device cpu
    # the H200 (unchanged; not yet run there):
    python3 benchmarks/precision.py --device cuda --out $OUT

On CPU the interpreter is made to round FP32 -> BF16 / FP8 to nearest even, as the GPU does
(``tests/triton_device.py``). Writes ``precision.json`` to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
LOWER_BOUND, KDA_NORM_EPS, RMS_EPS, K_NORM_EPS, L2_EPS = -5.0, 1e-5, 1e-6, 1e-6, 1e-6


@dataclasses.dataclass(frozen=True)
class Size:
    """The widths of one study (``k3``: Kimi K3's; ``small``: a CI-sized copy) and its reduced rows."""

    kda_heads: int = 96
    kda_dim: int = 128
    f_rank: int = 128
    conv_width: int = 4
    hidden: int = 7168
    latent: int = 3584  # MoE latent (the latent RMSNorm)
    q_lora: int = 1536
    shared_inter: int = 6144
    experts: int = 896
    top_k: int = 16
    bank: int = 16
    num_blocks: int = 8
    mla_heads: int = 96
    nope: int = 128
    rope: int = 64
    kv_lora: int = 512
    v_dim: int = 128
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 2048
    block_size: int = 64
    context: int = 4096  # positions per request (> index_topk: the selection is sparse)
    requests: int = 2  # KDA / DSA requests per step
    rows: int = 4  # rows of the row-wise ops (AttnRes, router, norms, SiTU)
    q_len: int = 1

    @property
    def softmax_scale(self) -> float:
        return (self.nope + self.rope) ** -0.5  # K3: 192^-1/2


SIZES = {
    "k3": Size(),
    "small": Size(kda_heads=4, kda_dim=32, f_rank=32, hidden=1024, latent=128, q_lora=64, shared_inter=96,
                  experts=64, top_k=8, bank=4, num_blocks=3, mla_heads=8, nope=32, rope=16, kv_lora=64, v_dim=32,
                  index_heads=4, index_dim=32, index_topk=64, block_size=16, context=256, requests=2, rows=3),
}


# ---------------------------------------------------------------------------------------------
# metrics


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max|got - ref| / max|ref|, rms(got - ref) / rms(ref)) in float64 on the CPU."""
    g, r = got.detach().to("cpu", F64), ref.detach().to("cpu", F64)
    d = g - r
    rmax, rrms = r.abs().max().item(), r.pow(2).mean().sqrt().item()
    return d.abs().max().item() / (rmax or 1.0), d.pow(2).mean().sqrt().item() / (rrms or 1.0)


def pick_mismatch(ids: torch.Tensor, ref_ids: torch.Tensor) -> float:
    """Fraction of the picks in ``ids [T, K]`` (-1 = none) absent from the same row of ``ref_ids``."""
    ids, ref_ids = ids.cpu().long(), ref_ids.cpu().long()
    miss = total = 0
    for a, b in zip(ids, ref_ids):
        sa, sb = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        miss += len(sb - sa)
        total += len(sb)
    return miss / max(total, 1)


# ---------------------------------------------------------------------------------------------
# helpers


def _rng(seed: int):
    g = torch.Generator().manual_seed(seed)
    return g, (lambda *s: torch.randn(*s, generator=g))


def _dev(tensors: dict, device) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{n: (t.to(device) if isinstance(t, torch.Tensor) else t)
                                    for n, t in tensors.items()})


def _rms64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _sparse_splits(T: int, size: Size, device) -> int | None:
    """Splits of the sparse MLA kernel as on the H200 (132 SMs) when run in the interpreter (8 "SMs")."""
    if torch.device(device).type == "cuda":
        return None
    from dep_compile.ops import dsa_triton  # noqa: PLC0415

    block_h = 32 if T < 16 else 64
    return dsa_triton._splits(T, -(-size.mla_heads // block_h), size.index_topk, 64, 132)


# ---------------------------------------------------------------------------------------------
# KDA core


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).to(F64)


def kda_f64(c, q_len: int, contract: bool = False):
    """The KDA core in float64 on CPU copies: (out [T, HD], conv_state [S, W-1, 3HD], rec_state [S, H, D, D]).

    ``contract``: round the conv outputs and the F_B gate to BF16 where the op's contract (the stock
    reference, both kernels) rounds them, so that what is left of an FP32 state's error is arithmetic."""
    x = {n: getattr(c, n).detach().to("cpu", F64) for n in ("q", "k", "v", "g_out", "f_a", "beta", "f_b_w",
                                                            "conv_w", "A_log", "dt_bias", "o_norm_w")}
    conv, rec = c.conv_state.detach().to("cpu", F64).clone(), c.rec_state.detach().to("cpu", F64).clone()
    T, HD = x["q"].shape
    H = x["beta"].shape[1]
    D, W = HD // H, x["conv_w"].shape[1]
    out = torch.zeros(T, HD, dtype=F64)
    g_raw = x["f_a"] @ x["f_b_w"].t()  # [T, HD]
    g_raw = _bf16(g_raw) if contract else g_raw
    for b, slot in enumerate(c.state_indices.cpu().tolist()):
        if slot < 0:
            continue
        rows = slice(b * q_len, (b + 1) * q_len)
        acc = int(c.accepted[b])
        window = torch.cat([conv[slot], torch.cat([x["q"][rows], x["k"][rows], x["v"][rows]], -1)], 0)
        y = F.silu((window.unfold(0, W, 1) * x["conv_w"]).sum(-1))  # [q, 3HD]
        y = _bf16(y) if contract else y
        conv[slot] = window[acc:acc + W - 1]
        qc, kc, vc = (t.reshape(q_len, H, D) for t in y.split(HD, -1))
        qn = qc * torch.rsqrt(qc.pow(2).sum(-1, keepdim=True) + L2_EPS) * D ** -0.5
        kn = kc * torch.rsqrt(kc.pow(2).sum(-1, keepdim=True) + L2_EPS)
        a = torch.exp(x["A_log"]).view(H, 1)
        decay = torch.exp(LOWER_BOUND * torch.sigmoid(a * (g_raw[rows].view(q_len, H, D) + x["dt_bias"].view(H, D))))
        beta = torch.sigmoid(x["beta"][rows])
        S = rec[slot].clone()
        o = torch.empty(q_len, H, D, dtype=F64)
        for t in range(q_len):
            S = S * decay[t].unsqueeze(1)
            pred = torch.einsum("hvk,hk->hv", S, kn[t])
            S = S + beta[t].view(H, 1, 1) * torch.einsum("hv,hk->hvk", vc[t] - pred, kn[t])
            o[t] = torch.einsum("hvk,hk->hv", S, qn[t])
            if t + 1 == acc:
                rec[slot] = S
        o = _rms64(o, x["o_norm_w"], KDA_NORM_EPS) * torch.sigmoid(x["g_out"][rows].view(q_len, H, D))
        out[rows] = o.reshape(q_len, HD)
    return out, conv, rec


def kda_case(size: Size, seed: int, device) -> types.SimpleNamespace:
    """One KDA step's inputs: q/k/v/g/f_a/beta column slices of one packed projection, states in a pool."""
    g, rn = _rng(seed)
    H, D, Fr, W, B, q_len = size.kda_heads, size.kda_dim, size.f_rank, size.conv_width, size.requests, size.q_len
    HD, T, S = H * D, B * q_len, B + 2
    packed = rn(T, 4 * HD + Fr + H).to(BF16)
    # f_a and f_b_w on grids (k/8 and k/16 x (8/F)^1/2, |k| <= 15) where the F_B product is exact in
    # FP32: every side rounds the same g_raw to BF16. With arbitrary BF16 values an FP32 sum lands on
    # the other side of a BF16 rounding boundary for 1-2 of 24576 channels a step (either side, by
    # summation order), and that one ulp, times exp(A_log) <= 16 in the gate, dominates the |contract
    # state comparison.
    grid = lambda n, *s: torch.randint(-15, 16, s, generator=g).float() / n  # noqa: E731
    packed[:, 4 * HD:4 * HD + Fr] = grid(8, T, Fr).to(BF16)  # f_a
    t = dict(packed=packed, f_b_w=(grid(16, HD, Fr) * (8 / Fr) ** 0.5).to(BF16),  # g_raw std ~1.8
             conv_w=(rn(3 * HD, W) * 0.5).to(BF16),
             A_log=torch.log(torch.rand(H, generator=g) * 15 + 1), dt_bias=rn(HD),
             o_norm_w=(1 + 0.2 * rn(D)).to(BF16), conv_state=rn(S, W - 1, 3 * HD).to(BF16),
             rec_state=rn(S, H, D, D) * 0.3, state_indices=torch.randperm(S, generator=g)[:B].to(torch.int32),
             accepted=torch.randint(1, q_len + 1, (B,), generator=g, dtype=torch.int32))
    c = _dev(t, device)
    c.q, c.k, c.v, c.g_out, c.f_a, c.beta = c.packed.split([HD, HD, HD, HD, Fr, H], -1)
    return c


def study_kda(size: Size, seed: int, device, dep=None) -> dict:
    """KDA core: kimi_dep's one-launch kernel vs the stock CUDA core, each against float64."""
    from dep_compile.stock import kda_cuda  # noqa: PLC0415
    dep = dep or __import__("dep_compile.ops.kda_triton", fromlist=["x"])
    c = kda_case(size, seed, device)
    ref_out, ref_conv, ref_rec = kda_f64(c, size.q_len)
    contract_rec = kda_f64(c, size.q_len, contract=True)[2]
    sides = {}
    for side in ("kimi_dep", "stock"):
        conv, rec = c.conv_state.clone(), c.rec_state.clone()
        if side == "kimi_dep":
            out = dep.kda_decode_core(c.q, c.k, c.v, c.f_a, c.f_b_w, c.beta, c.g_out, c.conv_w, c.A_log, c.dt_bias,
                                      c.o_norm_w, conv, rec, c.state_indices, c.accepted, size.q_len, LOWER_BOUND,
                                      KDA_NORM_EPS)
        else:
            g_raw = F.linear(c.f_a, c.f_b_w)  # stock's f_b_proj: BF16
            out = kda_cuda.kda_core_cuda(c.q, c.k, c.v, g_raw, c.beta, c.g_out, c.conv_w, c.A_log, c.dt_bias,
                                         c.o_norm_w, conv, rec, c.state_indices, c.accepted, size.q_len,
                                         LOWER_BOUND, KDA_NORM_EPS)
        live = c.state_indices[c.state_indices >= 0].long().cpu()
        sides[side] = {"kda.out": errors(out, ref_out), "kda.rec_state": errors(rec.cpu()[live], ref_rec[live]),
                       "kda.rec_state|contract": errors(rec.cpu()[live], contract_rec[live]),
                       "kda.conv_state": errors(conv.cpu()[live], ref_conv[live])}
    return sides


# ---------------------------------------------------------------------------------------------
# AttnRes + RMSNorm


def study_attn_res(size: Size, seed: int, device, dep=None) -> dict:
    """The fused AttnRes -> RMSNorm kernel vs the stock kernel then stock's RMSNorm, against float64."""
    from dep_compile.stock import attn_res_cuda  # noqa: PLC0415
    dep = dep or attn_res_cuda
    g, rn = _rng(seed)
    T, D, NB, nb = size.rows, size.hidden, size.bank, size.num_blocks
    # residual-stream-like magnitudes: the prefix and the snapshots grow over layers, deltas are smaller
    # (query: logits RMSNorm(source) . query of std ~4, a softmax that mixes several sources)
    growth = torch.linspace(1, 4, NB).view(NB, 1, 1)
    c = _dev(dict(prefix=(rn(T, D) * 4).to(BF16), bank=(rn(NB, T, D) * growth).to(BF16),
                  delta=rn(T, D).to(BF16), query=(rn(D) * D ** -0.5 * 4).to(BF16),
                  norm_w=(1 + 0.2 * rn(D)).to(BF16)), device)
    write_slot = nb - 1
    p64 = c.prefix.to("cpu", F64) + c.delta.to("cpu", F64)
    bank64 = c.bank.to("cpu", F64).clone()
    bank64[write_slot] = p64
    src = torch.cat([bank64[:nb], p64.unsqueeze(0)], 0)  # [nb+1, T, D]
    logits = (_rms64(src, torch.ones((), dtype=F64), RMS_EPS) * c.query.to("cpu", F64)).sum(-1)
    mix = (torch.softmax(logits, 0).unsqueeze(-1) * src).sum(0)
    ref = _rms64(mix, c.norm_w.to("cpu", F64), RMS_EPS)
    sides = {}
    for side in ("kimi_dep", "stock"):
        prefix, bank = c.prefix.clone(), c.bank.clone()
        if side == "kimi_dep":
            out = dep.attn_res_norm_cuda(prefix, bank, c.delta, c.query, c.norm_w, RMS_EPS, nb, write_slot, RMS_EPS)
        else:
            h = attn_res_cuda.attn_res_cuda(prefix, bank, c.delta, c.query, RMS_EPS, nb, write_slot)
            out = F.rms_norm(h.float(), (D,), c.norm_w.float(), RMS_EPS).to(h.dtype)  # stock.layers.RMSNorm
        sides[side] = {"attn_res_norm.out": errors(out, ref), "attn_res.prefix": errors(prefix, p64),
                       "attn_res.bank": errors(bank, bank64)}
    return sides


# ---------------------------------------------------------------------------------------------
# router, RMSNorm, SiTU


def study_router(size: Size, seed: int, device, dep=None) -> dict:
    """Sigmoid top-k routing: kimi_dep's split-K partials + select kernel vs stock's Router math."""
    from dep_compile.stock.layers import renormalized_topk  # noqa: PLC0415
    dep = dep or __import__("dep_compile.ops.router_triton", fromlist=["x"])
    g, rn = _rng(seed)
    T, Hd, E, K = size.rows, size.hidden, size.experts, size.top_k
    c = _dev(dict(x=rn(T, Hd).to(BF16), w=(rn(E, Hd) * Hd ** -0.5).to(BF16), bias=rn(E) * 0.05), device)
    scale = 2.5
    logits64 = c.x.to("cpu", F64) @ c.w.to("cpu", F64).t()
    s64 = torch.sigmoid(logits64)
    w64, ids64 = renormalized_topk(s64, s64 + c.bias.to("cpu", F64), K, scale)
    dense64 = torch.zeros(T, E, dtype=F64).scatter_(1, ids64, w64)
    sides = {}
    for side in ("kimi_dep", "stock"):
        if side == "kimi_dep":
            weights, ids = dep.route_sigmoid_topk(c.x, c.w, c.bias, K, scale)
            parts = dep.splitk_partials(c.x.contiguous(), c.w, dep.ROUTER_TACTIC)  # what the select kernel sums
            logits = parts[0]
            for s in range(1, parts.shape[0]):  # in slice order, in FP32, as the kernel
                logits = logits + parts[s]
        else:
            logits = F.linear(c.x.float(), c.w.float())  # stock.layers.Router
            scores = torch.sigmoid(logits)
            weights, ids = renormalized_topk(scores, scores + c.bias, K, scale)
        dense = torch.zeros(T, E, dtype=F64).scatter_(1, ids.cpu(), weights.cpu().to(F64))
        sides[side] = {"router.logits": errors(logits, logits64), "router.weights": errors(dense, dense64),
                       "router.picks": (math.nan, pick_mismatch(ids, ids64))}
    return sides


def _situ64(gate_up, beta, beta_lin):
    g, u = gate_up.chunk(2, -1)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))


def study_norm_situ(size: Size, seed: int, device, dep=None) -> dict:
    """The Triton RMSNorm (MoE latent norm, DSA q_a norm) and SiTU vs stock's torch, against float64."""
    from dep_compile.stock.layers import situ  # noqa: PLC0415
    dep = dep or types.SimpleNamespace(norm=__import__("dep_compile.ops.norm_triton", fromlist=["x"]),
                                       moe=__import__("dep_compile.ops.moe_triton", fromlist=["x"]))
    g, rn = _rng(seed)
    T = size.rows
    c = _dev(dict(lat=(rn(T, size.latent) * 3).to(BF16), lat_w=(1 + 0.2 * rn(size.latent)).to(BF16),
                  qa=(rn(T, size.q_lora) * 3).to(BF16), qa_w=(1 + 0.2 * rn(size.q_lora)).to(BF16),
                  gu=(rn(T, 2 * size.shared_inter) * 3).to(BF16)), device)
    cpu = lambda t: t.to("cpu", F64)  # noqa: E731
    refs = {"rms_norm.latent": _rms64(cpu(c.lat), cpu(c.lat_w), RMS_EPS),
            "rms_norm.q_a": _rms64(cpu(c.qa), cpu(c.qa_w), RMS_EPS),
            "situ": _situ64(cpu(c.gu), 4.0, 25.0)}
    stock_norm = lambda x, w: F.rms_norm(x.float(), (x.shape[-1],), w.float(), RMS_EPS).to(x.dtype)  # noqa: E731
    got = {"kimi_dep": {"rms_norm.latent": dep.norm.rms_norm_fused(c.lat, c.lat_w, RMS_EPS),
                        "rms_norm.q_a": dep.norm.rms_norm_fused(c.qa, c.qa_w, RMS_EPS),
                        "situ": dep.moe.situ_fused(c.gu, 4.0, 25.0)},
           "stock": {"rms_norm.latent": stock_norm(c.lat, c.lat_w), "rms_norm.q_a": stock_norm(c.qa, c.qa_w),
                     "situ": situ(c.gu, 4.0, 25.0)}}
    return {side: {k: errors(v, refs[k]) for k, v in outs.items()} for side, outs in got.items()}


# ---------------------------------------------------------------------------------------------
# DSA


def dsa_case(size: Size, seed: int, device) -> types.SimpleNamespace:
    """One DSA decode step: queries, this step's latent / index key rows, paged caches full to ``context``."""
    g, rn = _rng(seed)
    B, q_len, N, BS = size.requests, size.q_len, size.context, size.block_size
    T, H, L, R = B * q_len, size.mla_heads, size.kv_lora, size.rope
    MB = N // BS
    NB = B * MB + 2
    from dep_compile.stock.reference.common import fp8_pow2_quantize  # noqa: PLC0415

    old_keys = rn(NB, BS, size.index_dim)
    k8, k_scale = fp8_pow2_quantize(old_keys)
    t = dict(q=rn(T, H, size.nope + R).to(BF16), kv_a=(rn(T, L + R) * 2).to(BF16), kv_a_w=(1 + 0.2 * rn(L)).to(BF16),
             kv_b=(rn(H * (size.nope + size.v_dim), L) * L ** -0.5 * 2).to(BF16),
             gate=rn(T, H * size.v_dim).to(BF16), kv_cache=rn(NB, BS, L + R).to(BF16),
             q_idx=rn(T, size.index_heads, size.index_dim).to(BF16), w_idx=rn(T, size.index_heads).to(BF16),
             k_idx=(rn(T, size.index_dim) * 3 + 1).to(BF16), k_norm_w=(1 + 0.2 * rn(size.index_dim)).to(BF16),
             k_norm_b=(0.1 * rn(size.index_dim)).to(BF16), index_cache=k8, index_scale=k_scale,
             block_table=torch.randperm(NB, generator=g)[:B * MB].view(B, MB).to(torch.int32),
             seq_lens=torch.full((B,), N, dtype=torch.int32))
    pos = torch.arange(q_len).repeat(B) + N - q_len  # each token's position
    req = torch.arange(T) // q_len
    t["slot_mapping"] = (t["block_table"][req, pos // BS].long() * BS + pos % BS).to(torch.int64)
    return _dev(t, device)


def study_dsa(size: Size, seed: int, device, dep=None) -> dict:
    """DSA kernels vs the stock ops' CUDA code (stock.batched_attention), op by op, against float64."""
    from dep_compile.stock import batched_attention as sb  # noqa: PLC0415
    from dep_compile.stock.paged_insert import insert_rows_paged  # noqa: PLC0415
    from dep_compile.stock.reference.common import fp8_pow2_quantize  # noqa: PLC0415
    dep = dep or __import__("dep_compile.ops.dsa_triton", fromlist=["x"])
    c = dsa_case(size, seed, device)
    T, H, L, R, nope, Di, Hi = (c.q.shape[0], size.mla_heads, size.kv_lora, size.rope, size.nope, size.index_dim,
                                size.index_heads)
    BS, q_len, K = size.block_size, size.q_len, size.index_topk
    cpu = lambda t: t.detach().to("cpu", F64)  # noqa: E731
    slots = c.slot_mapping.cpu()
    blk, off = slots // BS, slots % BS
    out = {"kimi_dep": {}, "stock": {}}

    # 1. the latent cache entry [RMSNorm(c_kv) | k_rope]
    lat64 = torch.cat([_rms64(cpu(c.kv_a[:, :L]), cpu(c.kv_a_w), RMS_EPS), cpu(c.kv_a[:, L:])], -1)
    caches = {}
    for side in out:
        cache = c.kv_cache.clone()
        if side == "kimi_dep":
            dep.latent_insert(c.kv_a, c.kv_a_w, RMS_EPS, cache, c.slot_mapping)
        else:  # the stock layer's kv_a_layernorm, then the stock op's insert
            c_kv = F.rms_norm(c.kv_a[:, :L].float(), (L,), c.kv_a_w.float(), RMS_EPS).to(BF16)
            insert_rows_paged(cache, c.slot_mapping, torch.cat([c_kv, c.kv_a[:, L:]], -1))
        caches[side] = cache
        out[side]["dsa.latent_cache"] = errors(cache.cpu()[blk, off], lat64)

    # 2. the index keys: key LayerNorm, FP8 with a power-of-two scale, inserted (compared dequantized)
    k64 = F.layer_norm(cpu(c.k_idx), (Di,), cpu(c.k_norm_w), cpu(c.k_norm_b), K_NORM_EPS)
    for side in out:
        icache, iscale = c.index_cache.clone(), c.index_scale.clone()
        if side == "kimi_dep":
            dep.index_key_insert(c.k_idx, c.k_norm_w, c.k_norm_b, K_NORM_EPS, icache, iscale, c.slot_mapping)
        else:
            k = F.layer_norm(c.k_idx.float(), (Di,), c.k_norm_w.float(), c.k_norm_b.float(), K_NORM_EPS).to(BF16)
            values, scale = fp8_pow2_quantize(k)
            insert_rows_paged(icache, c.slot_mapping, values)
            insert_rows_paged(iscale.unsqueeze(-1), c.slot_mapping, scale.unsqueeze(-1))
        deq = icache.cpu()[blk, off].to(F64) * iscale.cpu()[blk, off].to(F64).unsqueeze(-1)
        out[side]["dsa.index_keys"] = errors(deq, k64)

    # 3. index logits over the same FP8 cache (stock's insert) and the same FP8 queries, then the top-k
    icache, iscale = c.index_cache.clone(), c.index_scale.clone()
    values, scale = fp8_pow2_quantize(F.layer_norm(c.k_idx.float(), (Di,), c.k_norm_w.float(), c.k_norm_b.float(),
                                                   K_NORM_EPS).to(BF16))
    insert_rows_paged(icache, c.slot_mapping, values)
    insert_rows_paged(iscale.unsqueeze(-1), c.slot_mapping, scale.unsqueeze(-1))
    q8, q_scale = fp8_pow2_quantize(c.q_idx)  # kimi_dep quantizes in-kernel by the same rule (else: BF16-size errors)
    w_fold = c.w_idx.float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)
    keys = sb._gather_rows(icache.view(torch.uint8), c.block_table, sb._context_positions(size.context, c.seq_lens))
    keys64 = keys.view(torch.float8_e4m3fn).cpu().to(F64)  # [B, N, Di]
    kscale64 = sb._gather_rows(iscale, c.block_table, sb._context_positions(size.context, c.seq_lens)).cpu().to(F64)
    req = torch.arange(T) // q_len
    dots = torch.einsum("thd,tnd->thn", q8.cpu().to(F64), keys64[req]).relu()
    logits64 = (dots * (c.w_idx.cpu().to(F64) * q_scale.cpu().to(F64) * (Di ** -0.5) * (Hi ** -0.5)).unsqueeze(-1)
                ).sum(1) * kscale64[req]  # [T, N]; every position visible at decode (seq_len = N)
    sel64 = torch.topk(logits64, K, -1).indices.sort(-1).values
    for side in out:
        if side == "kimi_dep":
            logits = dep.index_logits(c.q_idx, c.w_idx, icache, iscale, c.block_table, c.seq_lens, c.slot_mapping,
                                      q_len)
            sel = dep.select_topk_triton(logits, K)
        else:
            logits = sb._index_logits(q8, w_fold, icache, iscale, c.block_table, c.seq_lens, q_len)
            sel = sb.select_topk_positions(logits, K)
        out[side]["dsa.index_logits"] = errors(logits, logits64)
        out[side]["dsa.topk_picks"] = (math.nan, pick_mismatch(sel, sel64))

    # 4. sparse MLA over float64's selection and the stock-inserted latent cache
    cache = caches["stock"]
    w = c.kv_b.view(H, nope + size.v_dim, L)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    sel = sel64.to(torch.int32).to(c.q.device)
    rows = dep.physical_rows(sel, c.block_table, q_len, BS).cpu().long()  # [T, K] cache rows
    ctx64 = cache.cpu().view(-1, L + R)[rows].to(F64)  # [T, K, L+R]
    qlat64 = torch.einsum("thn,hnl->thl", cpu(c.q[..., :nope]), cpu(w_uk))
    query64 = torch.cat([qlat64, cpu(c.q[..., nope:])], -1)

    def attend64(query):  # [T, H, L+R] -> o_lat [T, H, L]
        p = torch.softmax(torch.einsum("thw,tkw->thk", query, ctx64) * size.softmax_scale, -1)
        return torch.einsum("thk,tkl->thl", p, ctx64[..., :L])

    def uv_gate64(o_lat):  # [T, H, L] -> [T, H*v]
        o = torch.einsum("thl,hvl->thv", o_lat, cpu(w_uv)).reshape(T, -1)
        return o * torch.sigmoid(cpu(c.gate))

    query = sb._absorb(c.q, w, nope)  # stock's absorbed query: the common input of the attention below
    o_stock = sb._attend(query, sb._gather_rows(cache, c.block_table.repeat_interleave(q_len, 0), sel.long()),
                         (sel < 0).unsqueeze(1), L, size.softmax_scale).to(BF16)  # [T, H, L], rounded as _project
    splits = _sparse_splits(T, size, device)
    for side in out:
        if side == "kimi_dep":
            absorbed = dep.absorb_query(c.q, w_uk)
            o_lat = dep.sparse_mla_decode_latent(query, cache, c.block_table, sel, c.slot_mapping, q_len, L,
                                                 size.softmax_scale, block_n=min(64, K), splits=splits)
            gated = dep.uv_gate(o_stock, w_uv, c.gate)
            whole = dep.uv_gate(dep.sparse_mla_decode_latent(absorbed, cache, c.block_table, sel, c.slot_mapping,
                                                             q_len, L, size.softmax_scale, block_n=min(64, K),
                                                             splits=splits), w_uv, c.gate)
        else:
            absorbed, o_lat = query, o_stock
            finish = lambda o: (o.float() * torch.sigmoid(c.gate.float())).to(BF16)  # noqa: E731 - the layer's
            live = c.slot_mapping >= 0
            gated = finish(sb._project(o_stock.float(), w, nope, live, BF16))
            whole = finish(sb._sparse_core(c.q, c.kv_b, cache.clone(), c.slot_mapping, c.block_table, sel, q_len,
                                           size.softmax_scale, nope))
        out[side]["dsa.absorb_query"] = errors(absorbed, query64)
        out[side]["dsa.sparse_attn"] = errors(o_lat, attend64(cpu(query)))
        out[side]["dsa.uv_gate"] = errors(gated, uv_gate64(cpu(o_stock)))
        out[side]["dsa.sparse_mla"] = errors(whole, uv_gate64(attend64(query64)))
    return out


STUDIES = {"kda": study_kda, "attn_res": study_attn_res, "router": study_router, "norm_situ": study_norm_situ,
           "dsa": study_dsa}


# ---------------------------------------------------------------------------------------------
# driver


def prepare(device) -> None:
    """CPU: Triton's interpreter, rounding FP32 -> BF16 / FP8 to nearest even as the GPU does."""
    if torch.device(device).type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("on CPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1 "
                               "before anything imports triton")
        tests = os.path.join(ROOT, "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from triton_device import _round_like_the_gpu  # noqa: PLC0415

        _round_like_the_gpu()


def run_study(device, size: Size, seeds, studies=None, deps=None) -> dict:
    """{output: {side: (rel-max, rel-rms)}}, the worst of each over ``seeds``; ``deps`` overrides the
    kimi_dep module of a study (mutant tests)."""
    prepare(device)
    deps = deps or {}
    worst: dict = {}
    for name in studies or STUDIES:
        for seed in seeds:
            for side, outs in STUDIES[name](size, seed, device, deps.get(name)).items():
                for op, (m, r) in outs.items():
                    pm, pr = worst.setdefault(op, {}).get(side, (-math.inf, -math.inf))
                    worst[op][side] = (max(pm, m) if not math.isnan(m) else m, max(pr, r))
    return worst


def ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (both exact) and x / 0 = inf."""
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def table(worst: dict) -> str:
    """The study as a text table: op, side, rel-max, rel-rms, ratios kimi_dep / stock."""
    head = f"{'op':<24} {'side':<9} {'rel-max':>10} {'rel-rms':>10} {'ratio rms':>10} {'ratio max':>10}"
    lines = [head, "-" * len(head)]
    for op, sides in worst.items():
        stock = sides["stock"]
        for side, (m, r) in sides.items():
            extra = ""
            if side == "kimi_dep":
                rm = "" if math.isnan(m) else f"{ratio(m, stock[0]):10.3f}"
                extra = f" {ratio(r, stock[1]):10.3f} {rm:>10}"
            lines.append(f"{op:<24} {side:<9} {m:10.3g} {r:10.3g}{extra}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="k3")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--q-len", type=int, default=1, help="tokens per request (1: decode; 2-8: verify)")
    ap.add_argument("--only", nargs="*", choices=sorted(STUDIES), help="run only these studies")
    ap.add_argument("--out", help="directory for precision.json")
    args = ap.parse_args()
    if torch.device(args.device).type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton
    size = dataclasses.replace(SIZES[args.size], q_len=args.q_len)
    worst = run_study(args.device, size, range(args.seeds), args.only)
    print(f"precision study: device {args.device}, size {args.size} ({size}), seeds {args.seeds}")
    print("errors against float64 (worst over seeds); picks: fraction unlike float64's (in rel-rms)")
    print(table(worst))
    if args.out:
        from benchmarks.common import write_json  # noqa: PLC0415

        path = write_json(os.path.join(args.out, "precision.json"),
                          {"device": args.device, "size": dataclasses.asdict(size), "seeds": args.seeds,
                           "errors": {op: {s: list(e) for s, e in sides.items()} for op, sides in worst.items()}})
        print("wrote", path)


if __name__ == "__main__":
    main()
