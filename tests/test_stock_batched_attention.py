"""The stock CUDA path of the MLA / DSA ops (``batched_attention``, ``paged_insert``) against the references.

Every case runs the function under test and the readable reference (``reference.mla`` /
``reference.dsa``, on the CPU) on copies of the same random inputs (never zeros) and caches.
Caches are strided views into pools (a spare layer interleaved in every block); rows past each
request's length, and every row of the padding request (last request, slots -1), are NaN, so a
read of an unwritten row shows up. Requests have different lengths: some shorter than top-k,
one exactly at it, some longer; q_len 1 and 3.

Tolerances:

* attention outputs (BF16, O(0.1-1)): ``max |out - ref| <= 2^-6 * max |ref|`` (about two BF16
  ulps of the largest output). The batched path differs from the reference by the FP32
  summation order and one BF16 rounding of the softmax probabilities before the value product;
  a wrong mask, slot or block moves outputs by O(max |ref|). Padding rows exactly 0;
* caches: bit-identical to the reference's after the call;
* indexer: logits differ from the reference's only in FP32 summation order, so selections may
  differ only at near-ties: every row is ascending with -1 only at the end, a token with at most
  top-k context positions selects exactly all of them, every selected position's reference logit
  is >= the top-k-th largest minus ``1e-5 * max |logit|``, and tokens whose top-k boundary gap
  exceeds that select exactly the reference's positions (on the CPU cases, every token).

CPU tests call the batched torch functions directly (the ops keep the references on CPU). The
Triton insert runs on CUDA (``@pytest.mark.cuda``), or in Triton's CPU interpreter with
``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1``. The CUDA tests run the stock ops at full K3.1
size on the GPU against the references on CPU copies, and capture + replay the three ops in a
CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dep_compile.stock  # noqa: F401  (registers the kimi_k3 ops)
from dep_compile.stock import batched_attention
from dep_compile.stock.batched_attention import dsa_indexer_batched, mla_decode_batched, sparse_mla_decode_batched
from dep_compile.stock.reference.common import FP8, fp8_pow2_quantize
from dep_compile.stock.reference.dsa import dsa_indexer_ref, index_logits, sparse_mla_decode_ref
from dep_compile.stock.reference.mla import gather_context, insert_rows, mla_decode_ref, token_positions
from helpers import same_bits
from triton_device import TRITON_DEV as _TRITON_DEV, device_test, use_triton

ops = torch.ops.kimi_k3
BF16 = torch.bfloat16
OUT_REL = 2.0 ** -6  # max |out - ref| / max |ref|
LOGIT_REL = 1e-5  # near-tie tolerance of index logits, relative to the token's max |logit|
POOLS = ("kv_pool", "idx_pool", "scl_pool")


@dataclasses.dataclass(frozen=True)
class Sizes:
    heads: int
    nope: int
    rope: int
    kv_lora: int
    v: int
    index_heads: int
    index_dim: int
    topk: int
    block_size: int


SMALL = Sizes(heads=4, nope=8, rope=4, kv_lora=16, v=8, index_heads=4, index_dim=16, topk=12, block_size=4)
FULL = Sizes(heads=96, nope=128, rope=64, kv_lora=512, v=128, index_heads=32, index_dim=128, topk=2048,
             block_size=64)


def make_case(sz: Sizes, seq_lens: list[int], q_len: int, seed: int, padding: int = 1) -> dict:
    """Random CPU inputs of one step (the last ``padding`` requests are padding) and pooled caches with NaN
    in unwritten rows."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    B, T, bs = len(seq_lens), len(seq_lens) * q_len, sz.block_size
    MB = math.ceil(max(seq_lens) / bs) + 1  # one block past the longest request
    NB, W = B * MB + 2, sz.kv_lora + sz.rope
    block_table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    pos = token_positions(seq, q_len)
    req = torch.arange(B).repeat_interleave(q_len)
    slots = block_table[req, pos // bs].long() * bs + pos % bs
    slots.view(B, q_len)[-padding:] = -1
    c = dict(
        sz=sz, q_len=q_len, seq_lens=seq, block_table=block_table, slots=slots, pos=pos,
        scale=(sz.nope + sz.rope) ** -0.5,
        q=rn(T, sz.heads, sz.nope + sz.rope, scale=2.0).to(BF16),  # scores of std ~2
        latent=rn(T, W).to(BF16),
        kv_b=rn(sz.heads * (sz.nope + sz.v), sz.kv_lora, scale=sz.kv_lora ** -0.5).to(BF16),
        q_idx=rn(T, sz.index_heads, sz.index_dim).to(BF16),
        weights=rn(T, sz.index_heads).to(BF16),
        k=rn(T, sz.index_dim).to(BF16),
        kv_pool=rn(NB, 2, bs, W).to(BF16),
        idx_pool=rn(NB, 2, bs, sz.index_dim, scale=4.0).clamp(-8, 8).to(FP8),
        scl_pool=rn(NB, 2, bs).abs() + 0.01,
    )
    unwritten = torch.arange(MB * bs) >= seq.view(-1, 1).long()  # [B, C]
    unwritten[-padding:] = True
    p = unwritten.nonzero()
    blk, off = block_table[p[:, 0], p[:, 1] // bs].long(), p[:, 1] % bs
    for name in POOLS:
        c[name][blk, 1, off] = float("nan")
    return c


def _views(pools: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer-1 caches: kv [NB, BS, L+R], index keys [NB, BS, Di], index scales [NB, BS]."""
    return pools["kv_pool"][:, 1], pools["idx_pool"][:, 1], pools["scl_pool"][:, 1]


def _copy(c: dict, device: str) -> dict:
    """The case's tensors cloned onto ``device``."""
    return {n: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v) for n, v in c.items()}


def _check_out(out: torch.Tensor, ref: torch.Tensor, dead: torch.Tensor) -> float:
    """Assert the attention tolerance and exact zeros for ``dead`` tokens; returns max |out - ref| / max |ref|."""
    out, ref = out.cpu().float(), ref.float()
    assert torch.isfinite(out).all()
    assert (out[dead] == 0).all(), "padding / empty rows must be exactly 0"
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel <= OUT_REL, f"max |out - ref| / max |ref| = {rel:.2e}"
    return rel


def _reference_logits(c: dict, index_cache: torch.Tensor, index_scale: torch.Tensor) -> list[torch.Tensor]:
    """The reference indexer's logits of each token over its positions 0..pos (caches after the insert)."""
    Hi, Di = c["q_idx"].shape[1:]
    q_fp8, q_scale = fp8_pow2_quantize(c["q_idx"])
    w_fold = c["weights"].float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)
    out = []
    for t, p in enumerate(c["pos"].tolist()):
        ctx = torch.arange(p + 1)
        b = t // c["q_len"]
        keys = gather_context(index_cache, c["block_table"], b, ctx)
        scales = gather_context(index_scale.unsqueeze(-1), c["block_table"], b, ctx).squeeze(-1)
        out.append(index_logits(q_fp8[t], w_fold[t], keys, scales))
    return out


def _check_selection(sel: torch.Tensor, ref: torch.Tensor, logits: list[torch.Tensor], c: dict) -> tuple[int, int]:
    """Assert the indexer properties of the module docstring; returns (tokens with > top-k positions, untied ones)."""
    topk, long, untied = c["sz"].topk, 0, 0
    for t, lg in enumerate(logits):
        row = sel[t].long()
        if c["slots"][t] < 0:
            assert (row == -1).all(), f"padding token {t} selects {row.tolist()}"
            continue
        n = lg.shape[0]
        m = min(n, topk)
        assert (row[m:] == -1).all() and (row[:m] >= 0).all(), f"token {t}: -1 only at the end, {row.tolist()}"
        assert (row[1:m] > row[: m - 1]).all() and row[m - 1] < n, f"token {t}: not ascending / in range"
        if n <= topk:
            assert torch.equal(row[:m], torch.arange(n)), f"token {t} must select all {n} positions"
            continue
        long += 1
        top = lg.topk(topk + 1).values
        tol = LOGIT_REL * float(lg.abs().max())
        assert (lg[row] >= top[topk - 1] - tol).all(), f"token {t} selects a position below the top-k"
        if top[topk - 1] - top[topk] > tol:
            untied += 1
            assert torch.equal(row, ref[t].long()), f"token {t}: no near-tie, yet the selection differs"
    return long, untied


def compare_to_references(c: dict, device: str, mla_fn, indexer_fn, sparse_fn) -> dict:
    """Run the three functions on ``device`` copies and the references on CPU copies; assert everything.

    The sparse decode gets the indexer's selection with one live token emptied (all -1) and
    holes punched into another, the same on both sides. Returns measured errors.
    """
    dead = c["slots"] < 0
    d, r = _copy(c, device), _copy(c, "cpu")
    a = (d["slots"], d["block_table"])
    dk, di, ds = _views(d)
    rk, ri, rs = _views(r)

    out = mla_fn(d["q"], d["latent"], d["kv_b"], dk, *a, d["seq_lens"], c["q_len"], c["scale"], c["sz"].nope)
    ref = mla_decode_ref(r["q"], r["latent"], r["kv_b"], rk, r["slots"], r["block_table"], r["seq_lens"],
                         c["q_len"], c["scale"], c["sz"].nope)
    errs = {"mla": _check_out(out, ref, dead)}
    assert same_bits(d["kv_pool"], r["kv_pool"])

    sel = indexer_fn(d["q_idx"], d["weights"], d["k"], di, ds, *a, d["seq_lens"], c["q_len"], c["sz"].topk)
    sel_ref = dsa_indexer_ref(r["q_idx"], r["weights"], r["k"], ri, rs, r["slots"], r["block_table"], r["seq_lens"],
                              c["q_len"], c["sz"].topk)
    assert sel.dtype == torch.int32 and sel.shape == sel_ref.shape
    assert same_bits(d["idx_pool"], r["idx_pool"]) and same_bits(d["scl_pool"], r["scl_pool"])
    errs["long"], errs["untied"] = _check_selection(sel.cpu(), sel_ref, _reference_logits(c, ri, rs), c)

    picked = sel.cpu()
    picked[0] = -1  # a live token with nothing selected: output 0
    picked[c["q_len"], ::3] = -1  # holes
    dead = dead.clone()
    dead[0] = True
    for t in (d, r):  # the sparse decode inserts again into fresh caches
        t["kv_pool"] = c["kv_pool"].to(t["kv_pool"].device, copy=True)
    out = sparse_fn(d["q"], d["latent"], d["kv_b"], _views(d)[0], *a, picked.to(device), c["q_len"], c["scale"],
                    c["sz"].nope)
    ref = sparse_mla_decode_ref(r["q"], r["latent"], r["kv_b"], _views(r)[0], r["slots"], r["block_table"], picked,
                                c["q_len"], c["scale"], c["sz"].nope)
    errs["sparse"] = _check_out(out, ref, dead)
    assert same_bits(d["kv_pool"], r["kv_pool"])
    return errs


@pytest.fixture(params=["one_chunk", "chunk_per_item"])
def chunking(request, monkeypatch):
    """Run with the default chunk budget, and with one request / token per chunk."""
    if request.param == "chunk_per_item":
        monkeypatch.setattr(batched_attention, "CHUNK_BYTES", 1)


# seq_lens: shorter than top-k (3; q_len when larger), one token exactly at top-k with q_len 3 (14), longer (20, 32),
# padding (9)
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_batched_ops_match_references_cpu(q_len, chunking):
    c = make_case(SMALL, [max(3, q_len), 14, 20, 32, 9], q_len, seed=100 + q_len)
    errs = compare_to_references(c, "cpu", mla_decode_batched, dsa_indexer_batched, sparse_mla_decode_batched)
    assert errs["long"] > 0 and errs["untied"] == errs["long"], errs  # no near-ties here: identical selections


@pytest.mark.parametrize("q_len", [1, 4])
def test_two_padding_requests_between_lengths_cpu(q_len):
    """Two padding requests (one longer than any live one), a request of q_len tokens, one just past top-k."""
    c = make_case(SMALL, [13, q_len, 30, 40, 25], q_len, seed=40 + q_len, padding=2)
    errs = compare_to_references(c, "cpu", mla_decode_batched, dsa_indexer_batched, sparse_mla_decode_batched)
    assert errs["long"] > 0


def test_odd_row_widths_cpu():
    """Latent rows of 19 elements (38 bytes) and index keys of 12 bytes."""
    c = make_case(dataclasses.replace(SMALL, rope=3, index_dim=12), [3, 14, 20, 9], 2, seed=11)
    compare_to_references(c, "cpu", mla_decode_batched, dsa_indexer_batched, sparse_mla_decode_batched)


def test_indexer_table_narrower_than_topk_cpu():
    """MB * BS < top-k: every token selects all its positions, the rest of the row is -1."""
    c = make_case(dataclasses.replace(SMALL, topk=40), [3, 14, 20, 9], 3, seed=7)
    assert c["block_table"].shape[1] * SMALL.block_size < 40
    compare_to_references(c, "cpu", mla_decode_batched, dsa_indexer_batched, sparse_mla_decode_batched)


@device_test
@pytest.mark.parametrize("kind", ["kv", "index", "scale"])
def test_insert_rows_triton_matches_reference(kind):
    """The Triton insert into pooled (strided) caches from strided rows: bit-identical to insert_rows."""
    use_triton()
    from dep_compile.stock.paged_insert import insert_rows_triton  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    NB, bs, T = 6, 4, 7
    W = {"kv": 576, "index": 128, "scale": 1}[kind]
    pool = torch.randn(NB, 3, bs, W, generator=g)
    wide = torch.randn(T, W + 5, generator=g)[:, 2:W + 2]  # rows with a row stride > W
    if kind == "kv":
        pool, rows = pool.to(BF16), wide.to(BF16)
    elif kind == "index":
        pool, rows = pool.clamp(-8, 8).to(FP8), fp8_pow2_quantize(wide)[0]
    else:
        pool, rows = pool.abs() + 0.01, wide.abs()
    slots = torch.randperm(NB * bs, generator=g)[:T]
    slots[[1, 4]] = -1
    ref = pool.clone()
    insert_rows(ref[:, 1], slots, rows)
    got = pool.to(_TRITON_DEV, copy=True)
    insert_rows_triton(got[:, 1], slots.to(_TRITON_DEV), rows.to(_TRITON_DEV))
    assert same_bits(got, ref)
    assert not same_bits(ref, pool)  # something was written


def _fp8_pools(c: dict) -> dict:
    """The case's latent pool as FP8 e4m3 rows (``kv8_pool``) with per-token power-of-two scales
    (``ks_pool``); unwritten rows stay NaN (NaN codes, NaN scales)."""
    v, s = fp8_pow2_quantize(c["kv_pool"])  # [NB, 2, BS, W] FP8, [NB, 2, BS] FP32
    return {**c, "kv8_pool": v, "ks_pool": s}


def compare_fp8_latent(c: dict, device: str, mla_fn, sparse_fn) -> dict:
    """The MLA and sparse-MLA functions on an FP8 latent cache (pool views) on ``device`` against
    the references on CPU copies: outputs within ``OUT_REL``, caches (FP8 codes and scales) bit-identical.
    The sparse decode selects each token's last ``topk`` positions, one live token none."""
    c = _fp8_pools(c)
    dead = c["slots"] < 0
    d, r = _copy(c, device), _copy(c, "cpu")
    a = (d["slots"], d["block_table"])
    out = mla_fn(d["q"], d["latent"], d["kv_b"], d["kv8_pool"][:, 1], *a, d["seq_lens"], c["q_len"], c["scale"],
                 c["sz"].nope, kv_scale=d["ks_pool"][:, 1])
    ref = mla_decode_ref(r["q"], r["latent"], r["kv_b"], r["kv8_pool"][:, 1], r["slots"], r["block_table"],
                         r["seq_lens"], c["q_len"], c["scale"], c["sz"].nope, kv_scale=r["ks_pool"][:, 1])
    errs = {"mla": _check_out(out, ref, dead)}
    assert same_bits(d["kv8_pool"], r["kv8_pool"]) and same_bits(d["ks_pool"], r["ks_pool"])
    K = c["sz"].topk
    picked = torch.full((len(c["pos"]), K), -1, dtype=torch.int32)
    for t, p in enumerate(c["pos"].tolist()):
        n = min(p + 1, K)
        picked[t, :n] = torch.arange(p + 1 - n, p + 1, dtype=torch.int32)
    picked[0] = -1
    dead = dead.clone()
    dead[0] = True
    for t in (d, r):  # fresh caches: the sparse decode inserts again
        t["kv8_pool"], t["ks_pool"] = (c[n].to(t["kv8_pool"].device, copy=True) for n in ("kv8_pool", "ks_pool"))
    out = sparse_fn(d["q"], d["latent"], d["kv_b"], d["kv8_pool"][:, 1], *a, picked.to(device), c["q_len"],
                    c["scale"], c["sz"].nope, kv_scale=d["ks_pool"][:, 1])
    ref = sparse_mla_decode_ref(r["q"], r["latent"], r["kv_b"], r["kv8_pool"][:, 1], r["slots"], r["block_table"],
                                picked, c["q_len"], c["scale"], c["sz"].nope, kv_scale=r["ks_pool"][:, 1])
    errs["sparse"] = _check_out(out, ref, dead)
    assert same_bits(d["kv8_pool"], r["kv8_pool"]) and same_bits(d["ks_pool"], r["ks_pool"])
    return errs


@pytest.mark.parametrize("q_len", [1, 2])
def test_batched_fp8_latent_cache_matches_references_cpu(q_len, chunking):
    """The FP8 latent cache (e4m3 rows, per-token power-of-two scales) on the batched path."""
    c = make_case(SMALL, [max(3, q_len), 14, 20, 32, 9], q_len, seed=120 + q_len)
    compare_fp8_latent(c, "cpu", mla_decode_batched, sparse_mla_decode_batched)


@pytest.mark.cuda
@pytest.mark.parametrize("q_len", [1, 2])
def test_stock_fp8_ops_cuda_full_size_match_references(q_len):
    """The FP8-latent stock ops at full K3.1 size on the GPU (not yet run on the H200)."""
    c = make_case(FULL, [3001, 1203, 2950, 700], q_len, seed=220 + q_len)

    def mla(q, latent, kv_b, kv, slots, bt, seq, ql, scale, nope, kv_scale):
        return ops.mla_decode_fp8(q, latent, kv_b, kv, kv_scale, slots, bt, seq, ql, scale, nope)

    def sparse(q, latent, kv_b, kv, slots, bt, sel, ql, scale, nope, kv_scale):
        return ops.sparse_mla_decode_fp8(q, latent, kv_b, kv, kv_scale, slots, bt, sel, ql, scale, nope)

    print(compare_fp8_latent(c, "cuda", mla, sparse))


@pytest.mark.cuda
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_stock_ops_cuda_full_size_match_references(q_len):
    """Full K3.1 sizes, ~3000 context (top-2048 selects a subset), one request shorter than top-k."""
    c = make_case(FULL, [3001, 1203, 2950, 700], q_len, seed=200 + q_len)
    errs = compare_to_references(c, "cuda", ops.mla_decode, ops.dsa_indexer, ops.sparse_mla_decode)
    print(errs)
    assert errs["long"] > 0


@pytest.mark.cuda
def test_stock_ops_cuda_graph_capture():
    """The three stock ops captured in one CUDA graph and replayed on new inputs: same as eager."""
    c = _copy(make_case(FULL, [1500, 2600, 900], 2, seed=300), "cuda")
    sz, q_len = c["sz"], c["q_len"]

    def step():
        kv, idx, scl = _views(c)
        a = (c["slots"], c["block_table"])
        sel = ops.dsa_indexer(c["q_idx"], c["weights"], c["k"], idx, scl, *a, c["seq_lens"], q_len, sz.topk)
        sparse = ops.sparse_mla_decode(c["q"], c["latent"], c["kv_b"], kv, *a, sel, q_len, c["scale"], sz.nope)
        dense = ops.mla_decode(c["q"], c["latent"], c["kv_b"], kv, *a, c["seq_lens"], q_len, c["scale"], sz.nope)
        return sel, sparse, dense

    start = {n: c[n].clone() for n in POOLS}

    def restore():
        for n in POOLS:
            c[n].copy_(start[n])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: Triton compile, cuBLAS handles
    torch.cuda.current_stream().wait_stream(side)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for n in ("q", "latent", "q_idx", "weights", "k"):
        c[n].copy_(torch.randn(c[n].shape, device="cuda").to(BF16))
    restore()
    graph.replay()
    replayed = [t.clone() for t in captured]
    after_replay = {n: c[n].clone() for n in POOLS}
    restore()
    eager = step()
    for got, want in zip(replayed, eager):
        assert torch.equal(got, want)
    assert all(same_bits(after_replay[n], c[n]) for n in POOLS)
