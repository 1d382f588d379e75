"""Tests of the Triton DSA kernels (``dep_compile.ops.dsa_triton``) against the readable references.

Each case builds one DSA step on random data (never zeros): paged latent and FP8 index caches
as strided views into pools (a spare layer interleaved in every block), requests whose context
is shorter than top-k (select everything) and longer (select a subset), q_len 1, 3 or 6 (3 to
18 tokens: both sides of the kernels' 16-token tile switch), one padding token (slot -1). The
references in ``dep_compile.stock.reference.dsa`` run on CPU copies.

Checks and tolerances:

* key insert (LayerNorm -> BF16 -> FP8 with a power-of-two scale): index cache and scales
  bit-identical to the reference everywhere (the spare layer and unused blocks untouched);
* logits: ``-inf`` exactly where a token sees no position; elsewhere within ``1e-5 * max|logit|``
  of the reference (FP8 products are exact; only the FP32 summation order differs);
* top-k on the reference logits: exactly ``select_topk`` of the reference (ascending, -1 padded,
  short contexts select all), for every row; as latent-cache rows, exactly ``physical_rows`` of it;
* sparse MLA latent output, over positions or cache rows: relative Frobenius error <= 1e-2 and
  max abs <= 2e-2 against the FP32 reference (the kernel feeds the softmax weights to the value
  dot in BF16, as flash attention does; outputs are O(0.1)), padding tokens exactly 0.
* FP8 latent cache (e4m3 rows, per-token power-of-two scales): the insert bit-identical to the
  reference quantizer of the BF16 insert's rows; the sparse MLA within the tolerances above of the
  reference over the dequantized rows, and a mutant with the scales ignored far outside them.

Full size (96 heads, latent 512 + 64, 32 index heads x 128, top-2048) runs on CUDA only
(marked ``cuda``); ``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs the small size in
Triton's CPU interpreter.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dep_compile.stock.reference.common import fp8_pow2_quantize
from dep_compile.stock.reference.dsa import index_logits as ref_index_logits
from dep_compile.stock.reference.dsa import insert_index_keys, select_topk
from dep_compile.stock.reference.mla import attend_latent, gather_context, token_positions

from helpers import same_bits
from triton_device import DEVICE_MARKS, TRITON_DEV as _DEV, ulps, use_triton

pytestmark = DEVICE_MARKS

# heads, kv_lora, rope, index heads, index dim, topk, block size
SIZES = {"full": (96, 512, 64, 32, 128, 2048, 64), "small": (4, 32, 16, 4, 32, 16, 4),
         "small64": (4, 32, 16, 4, 32, 64, 4)}  # top-64: room for several 16-entry splits
FP8 = torch.float8_e4m3fn


def _dt():
    use_triton()
    from dep_compile.ops import dsa_triton  # noqa: PLC0415 - CUDA / interpreter only

    return dsa_triton


def make_case(size: str, q_len: int, seed: int, device: str) -> dict:
    """Random caches (pool views), metadata and step inputs for 3 requests (+1 padding token)."""
    H, L, R, Hi, Di, topk, BS = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    seq = [topk // 2 + q_len, topk + 3 * BS + q_len, 2 * topk + 5]  # short, a bit longer, long
    B = len(seq)
    MB = max(-(-s // BS) for s in seq)
    NB = B * MB + 2
    perm = torch.randperm(NB, generator=g)
    block_table = perm[: B * MB].view(B, MB).to(torch.int32)
    kv_pool = (torch.randn(NB, BS, 2, L + R, generator=g) * 0.5).to(torch.bfloat16)
    idx_pool = (torch.randn(NB, BS, 2, Di, generator=g) * 4).clamp(-8, 8).to(FP8)
    scl_pool = torch.rand(NB, BS, 2, generator=g) + 0.01
    T = B * q_len
    pos = token_positions(torch.tensor(seq), q_len)
    slots = block_table.long()[torch.arange(T) // q_len, pos // BS] * BS + pos % BS
    slots[T - 1 if q_len > 1 else 1] = -1  # one padding token
    c = dict(
        q_idx=torch.randn(T, Hi, Di, generator=g).to(torch.bfloat16),
        weights=torch.randn(T, Hi, generator=g).to(torch.bfloat16),
        k=(torch.randn(T, Di, generator=g) * 2 + 0.3).to(torch.bfloat16),
        k_norm_w=(1 + 0.1 * torch.randn(Di, generator=g)).to(torch.bfloat16),
        k_norm_b=(0.1 * torch.randn(Di, generator=g)).to(torch.bfloat16),
        query=(torch.randn(T, H, L + R, generator=g) * 0.2).to(torch.bfloat16),
        kv_pool=kv_pool, idx_pool=idx_pool, scl_pool=scl_pool, block_table=block_table,
        seq_lens=torch.tensor(seq, dtype=torch.int32), slot_mapping=slots.to(torch.int64),
    )
    c = {n: t.to(device) for n, t in c.items()}
    c.update(kv_cache=c["kv_pool"][:, :, 1], index_cache=c["idx_pool"][:, :, 1], index_scale=c["scl_pool"][:, :, 1],
             q_len=q_len, L=L, topk=topk, scale=(192 ** -0.5))
    return c


def cpu(c: dict) -> dict:
    """CPU copies of a case (pool views rebuilt on the copies)."""
    d = {n: (t.detach().cpu().clone() if torch.is_tensor(t) else t) for n, t in c.items()}
    d.update(kv_cache=d["kv_pool"][:, :, 1], index_cache=d["idx_pool"][:, :, 1], index_scale=d["scl_pool"][:, :, 1])
    return d


def ref_logits(c: dict) -> torch.Tensor:
    """The reference logits of every token over all block-table positions (``-inf`` = not seen)."""
    q_len = c["q_len"]
    T, Hi, Di = c["q_idx"].shape
    N = c["block_table"].shape[1] * c["index_cache"].shape[1]
    q_fp8, q_scale = fp8_pow2_quantize(c["q_idx"])
    w_fold = c["weights"].float() * q_scale * (Di ** -0.5) * (Hi ** -0.5)
    pos = token_positions(c["seq_lens"], q_len)
    out = torch.full((T, N), float("-inf"))
    for t in range(T):
        if int(c["slot_mapping"][t]) < 0:
            continue
        ctx = torch.arange(int(pos[t]) + 1)
        keys = gather_context(c["index_cache"], c["block_table"], t // q_len, ctx)
        scales = gather_context(c["index_scale"].unsqueeze(-1), c["block_table"], t // q_len, ctx).squeeze(-1)
        out[t, : ctx.numel()] = ref_index_logits(q_fp8[t], w_fold[t], keys, scales)
    return out


CASES = [(size, q) for size in ("full", "small") for q in (1, 3, 6)]  # q 6: 18 tokens, the >= 16 defaults
if _DEV == "cpu":
    CASES = [(s, q) for (s, q) in CASES if s == "small"]


@pytest.mark.parametrize("size,q_len", CASES)
def test_index_key_insert_bit_exact(size, q_len):
    dt = _dt()
    c = make_case(size, q_len, seed=1, device=_DEV)
    r = cpu(c)
    dt.index_key_insert(c["k"], c["k_norm_w"], c["k_norm_b"], 1e-6, c["index_cache"], c["index_scale"],
                        c["slot_mapping"])
    Di = r["k"].shape[1]
    k = F.layer_norm(r["k"].float(), (Di,), r["k_norm_w"].float(), r["k_norm_b"].float(), 1e-6).to(torch.bfloat16)
    insert_index_keys(k, r["index_cache"], r["index_scale"], r["slot_mapping"])
    got = c["idx_pool"].cpu()
    assert torch.equal(got.view(torch.uint8), r["idx_pool"].view(torch.uint8)), "index cache differs"
    assert torch.equal(c["scl_pool"].cpu(), r["scl_pool"]), "index scales differ"


@pytest.mark.parametrize("size,q_len", CASES)
def test_index_logits_and_topk(size, q_len):
    dt = _dt()
    c = make_case(size, q_len, seed=2, device=_DEV)
    r = cpu(c)
    tiles = dict(block_n=16, steps=2) if size == "small" else {}  # small: several programs of several steps
    got = dt.index_logits(c["q_idx"], c["weights"], c["index_cache"], c["index_scale"], c["block_table"],
                          c["seq_lens"], c["slot_mapping"], q_len, **tiles).cpu()
    ref = ref_logits(r)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "-inf pattern (visibility) differs"
    fin = torch.isfinite(ref)
    tol = 1e-5 * float(ref[fin].abs().max())
    err = float((got[fin] - ref[fin]).abs().max())
    assert err <= tol, f"logits max err {err:.3e} > {tol:.3e}"
    sel = dt.select_topk_positions(ref.to(_DEV), c["topk"]).cpu()
    pos = token_positions(r["seq_lens"], q_len)
    for t in range(ref.shape[0]):
        if int(r["slot_mapping"][t]) < 0:
            assert (sel[t] == -1).all(), "padding token selects nothing"
            continue
        want = select_topk(ref[t, : int(pos[t]) + 1], c["topk"])
        assert torch.equal(sel[t], want), f"token {t}: top-k differs"


@pytest.mark.parametrize("size,q_len", CASES)
def test_sparse_mla_latent(size, q_len):
    dt = _dt()
    c = make_case(size, q_len, seed=3, device=_DEV)
    r = cpu(c)
    topk = select_topk_like(r)
    got = dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], topk.to(_DEV),
                                      c["slot_mapping"], q_len, c["L"], c["scale"],
                                      block_n=min(64, c["topk"])).float().cpu()
    ref = ref_sparse_latent(r, topk)
    pad = r["slot_mapping"] < 0
    assert (got[pad] == 0).all(), "padding tokens must be 0"
    rel = float((got - ref).norm() / ref.norm())
    mx = float((got - ref).abs().max())
    assert rel <= 1e-2 and mx <= 2e-2, f"rel {rel:.2e} max {mx:.2e}"


def ref_sparse_latent(r: dict, topk: torch.Tensor) -> torch.Tensor:
    """The reference latent output of every token over its selected rows (0: padding or none): [T, H, L]."""
    T, H, _ = r["query"].shape
    ref = torch.zeros(T, H, r["L"])
    for t in range(T):
        s = topk[t][topk[t] >= 0].long()
        if int(r["slot_mapping"][t]) >= 0 and s.numel():
            ctx = gather_context(r["kv_cache"], r["block_table"], t // r["q_len"], s)
            ref[t] = attend_latent(r["query"][t], ctx, r["L"], r["scale"])
    return ref


def select_topk_like(r: dict) -> torch.Tensor:
    """A selection shaped like the indexer's: random positions each token sees, ascending, -1 padded."""
    q_len, topk = r["q_len"], r["topk"]
    pos = token_positions(r["seq_lens"], q_len)
    g = torch.Generator().manual_seed(4)
    out = torch.full((pos.numel(), topk), -1, dtype=torch.int32)
    for t in range(pos.numel()):
        n = int(pos[t]) + 1
        k = min(n, topk) - (t % 2) * 3  # some rows with fewer than min(n, topk) entries
        out[t, :k] = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    return out


@pytest.mark.parametrize("block_v", [None, 16])  # the default, and 16 value columns a program (several a head)
@pytest.mark.parametrize("size,T", [(s, t) for s in ("full", "small") for t in (1, 5, 40)
                                    if _DEV != "cpu" or s == "small"])
def test_uv_gate(size, T, block_v):
    """W_UV + sigmoid(gate) in one launch vs the reference's project_out then the FP32 gate: every
    element within 2^-6 relative (2-4 BF16 ulps: the W_UV rounding and the gate rounding of each
    side may each flip by one ulp; only the FP32 summation order differs)."""
    dt = _dt()
    H, L = SIZES[size][:2]
    V = 128 if size == "full" else 32
    g = torch.Generator().manual_seed(5)
    o_lat = (torch.randn(T, H, L, generator=g) * 0.3).to(torch.bfloat16)
    kv_b = (torch.randn(H * (V + V), L, generator=g) * L ** -0.5).to(torch.bfloat16)  # nope = V here
    gate = torch.randn(T, H * V, generator=g).to(torch.bfloat16)
    from dep_compile.stock.reference.mla import project_out, split_kv_b  # noqa: PLC0415

    _, w_uv = split_kv_b(kv_b, H, V)
    ref = (project_out(o_lat.float(), w_uv, torch.bfloat16).float() * torch.sigmoid(gate.float())).to(torch.bfloat16)
    got = dt.uv_gate(o_lat.to(_DEV), w_uv.to(_DEV), gate.to(_DEV), **({"block_v": block_v} if block_v else {})).cpu()
    diff = (got.float() - ref.float()).abs()
    worst = float((diff - 2 ** -6 * ref.float().abs()).max())
    assert worst <= 1e-6, f"an element is {worst:.3e} beyond two BF16 ulps"


@pytest.mark.parametrize("size,q_len", CASES)
def test_latent_insert(size, q_len):
    """RMSNorm(c_kv) | k_rope into the paged cache: written rows within one BF16 ulp of the
    reference (the FP32 sum of squares runs in another order), k_rope and every other entry
    (other blocks, the interleaved spare layer) bit-identical."""
    dt = _dt()
    c = make_case(size, q_len, seed=6, device=_DEV)
    r = cpu(c)
    L, LR = c["L"], r["kv_pool"].shape[-1]
    g = torch.Generator().manual_seed(7)
    kv_a = torch.randn(r["slot_mapping"].shape[0], LR, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(torch.bfloat16)
    dt.latent_insert(kv_a.to(_DEV), w.to(_DEV), 1e-6, c["kv_cache"], c["slot_mapping"])
    latent = torch.cat([F.rms_norm(kv_a[:, :L].float(), (L,), w.float(), 1e-6).to(torch.bfloat16), kv_a[:, L:]], -1)
    from dep_compile.stock.reference.mla import insert_rows  # noqa: PLC0415

    insert_rows(r["kv_cache"], r["slot_mapping"], latent)
    got = c["kv_pool"].cpu()
    off = float(ulps(got, r["kv_pool"]).max())
    assert off <= 1, f"an entry is {off:.2f} ulps off"
    assert torch.equal(got[..., L:], r["kv_pool"][..., L:]), "k_rope or a spare entry differs"
    assert torch.equal(got[:, :, 0], r["kv_pool"][:, :, 0]), "the spare layer was written"


@pytest.mark.parametrize("block_l", [None, 16])  # the default, and 16 latent columns a program (several a head)
@pytest.mark.parametrize("size,T", [(s, t) for s in ("full", "small") for t in (1, 5, 40)
                                    if _DEV != "cpu" or s == "small"])
def test_absorb_query(size, T, block_l):
    """[q_nope @ W_UK | q_rope] in one launch vs the reference's absorb_query: the latent part
    within one BF16 ulp plus 1e-5 of its largest magnitude (only the FP32 summation order
    differs; a sum that cancels to near 0 can be many of its own ulps off), q_rope bit-exact."""
    dt = _dt()
    H, L, R = SIZES[size][:3]
    nope = 128 if size == "full" else 32
    g = torch.Generator().manual_seed(8)
    q = torch.randn(T, H, nope + R, generator=g).to(torch.bfloat16)
    kv_b = (torch.randn(H * 2 * nope, L, generator=g) * nope ** -0.5).to(torch.bfloat16)  # v = nope here
    from dep_compile.stock.reference.mla import absorb_query, split_kv_b  # noqa: PLC0415

    w_uk, _ = split_kv_b(kv_b, H, nope)
    ref = absorb_query(q, w_uk, nope)
    got = dt.absorb_query(q.to(_DEV), w_uk.to(_DEV), **({"block_l": block_l} if block_l else {})).cpu()
    lat, ref_lat = got[..., :L].float(), ref[..., :L].float()
    ulp = torch.exp2(torch.floor(torch.log2(ref_lat.abs().clamp_min(2 ** -126))) - 7)
    excess = float(((lat - ref_lat).abs() - ulp - 1e-5 * ref_lat.abs().max()).max())
    assert excess <= 0, f"an element is {excess:.3e} beyond one ulp + 1e-5 max"
    assert torch.equal(got[..., L:], ref[..., L:]), "q_rope not copied exactly"


def topk_rows(N: int, topk: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of logits [6, N] with every visibility (none, fewer than topk, more: the visible counts), and a row
    of massive exact ties with zeros of both signs (the last)."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(6, N, generator=g) * 3
    vis = [0, topk // 2, topk, min(N, topk + 5), N, N]
    for t, v in enumerate(vis):
        x[t, v:] = float("-inf")
    x[5, :] = torch.randint(-3, 4, (N,), generator=g).float()  # massive ties
    x[5, ::3] *= -1  # exact zeros of both signs: -0.0 ties with +0.0, as in torch
    return x, vis


def check_topk(x: torch.Tensor, vis: list[int], topk: int, got: torch.Tensor) -> None:
    """``got`` [T, topk] is the reference's select_topk of every row of ``topk_rows``; on the ties row the set
    {> thr} plus the lowest positions == thr, ascending."""
    N = x.shape[1]
    for t, v in enumerate(vis):
        if t == 5:
            vals = x[t]
            thr = vals.sort(descending=True).values[min(topk, N) - 1]
            above = (vals > thr).nonzero().flatten()
            eq = (vals == thr).nonzero().flatten()[: topk - above.numel()]
            want = torch.full((topk,), -1, dtype=torch.int32)
            want[: above.numel() + eq.numel()] = torch.cat([above, eq]).sort().values.to(torch.int32)
        else:
            want = select_topk(x[t, :v], topk)
        assert torch.equal(got[t], want), f"row {t} (visible {v})"


@pytest.mark.parametrize("bits", [2, 4, 8])  # radix digit width: 16, 8 or 4 passes
@pytest.mark.parametrize("block", [64, 4096])  # 64: many chunks a row
@pytest.mark.parametrize("N,topk", [(40, 16), (300, 16), (5000, 2048), (2000, 2048)]
                         if _DEV != "cpu" else [(40, 16), (300, 16), (700, 64), (50, 64)])
def test_select_topk_triton(N, topk, block, bits):
    """The one-launch radix top-k vs the reference's select_topk row by row, on rows with every
    visibility: none (padding), fewer than topk, more; plus exact ties at the threshold (which
    must be taken from the lowest positions) and negative, zero and positive logits; at every
    digit width."""
    dt = _dt()
    x, vis = topk_rows(N, topk)
    check_topk(x, vis, topk, dt.select_topk_triton(x.to(_DEV), topk, block=block, bits=bits).cpu())


def _tk():
    use_triton()
    from dep_compile.ops import topk_triton  # noqa: PLC0415 - CUDA / interpreter only

    return topk_triton


# (N, topk, chunk, bits); chunk 16 / 64: tens of chunks a row, 4096: one (on the CPU). The interpreter runs a
# sample of the GPU's grid (seconds a case).
TOPK_CHUNKED = ([(N, k, c, b) for N, k in [(40, 16), (131072, 2048), (70000, 2048), (5000, 2048)]
                 for c in ((16, 64, 4096) if N <= 5000 else (64, 4096)) for b in (4, 8)] if _DEV != "cpu" else
                [(300, 16, 16, 8), (300, 16, 64, 4), (50, 64, 16, 8), (40, 16, 4096, 4), (700, 64, 64, 8),
                 (700, 64, 4096, 8)])


@pytest.mark.parametrize("N,topk,chunk,bits", TOPK_CHUNKED)
def test_select_topk_chunked(N, topk, chunk, bits):
    """The many-programs-a-row top-k: the same rows and checks as the one-launch kernel's, the threshold's ties
    spread over chunks (their lowest positions taken first across chunks); at full size up to 128K positions.
    As latent-cache rows too (``rows_of``: a shuffled block table shared by q_len = 2 tokens a request)."""
    tk = _tk()
    x, vis = topk_rows(N, topk)
    got = tk.select_topk_chunked(x.to(_DEV), topk, chunk=chunk, bits=bits).cpu()
    check_topk(x, vis, topk, got)
    BS = 16
    mb = -(-N // BS)
    block_table = torch.randperm(3 * mb + 1, generator=torch.Generator().manual_seed(1))[: 3 * mb].view(3, mb)
    rows = tk.select_topk_chunked(x.to(_DEV), topk, chunk=chunk, bits=bits,
                                  rows_of=(block_table.to(torch.int32).to(_DEV), 2, BS)).cpu()
    assert torch.equal(rows, _dt().physical_rows(got, block_table, 2, BS))


def test_select_topk_chunked_mutant_fails():
    """A broken kernel the check must catch: the count launch skipped (its counts zeroed), so every chunk
    compacts at offset 0, as if no chunk came before it."""
    tk = _tk()

    class Skipped:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    x, vis = topk_rows(300, 16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tk, "_chunk_count_kernel", Skipped())
        mp.setattr(tk.torch, "empty", torch.zeros)  # the skipped counts read as 0, not as garbage
        got = tk.select_topk_chunked(x.to(_DEV), 16, chunk=16).cpu()
    with pytest.raises(AssertionError, match="row"):
        check_topk(x, vis, 16, got)


def test_select_topk_chunked_rejects_bad_shapes():
    """Digit widths other than 4 or 8 and chunks that are not powers of two are refused before launch."""
    tk = _tk()
    with pytest.raises(ValueError, match="digit width 2"):
        tk.select_topk_chunked(torch.zeros(1, 8, device=_DEV), 2, bits=2)
    with pytest.raises(ValueError, match="chunk 100"):
        tk.select_topk_chunked(torch.zeros(1, 8, device=_DEV), 2, chunk=100)


def test_select_topk_triton_rejects_partial_digits():
    """A digit width that does not divide 32 would leave low key bits unresolved (more than
    topk entries taken): refused before launch."""
    dt = _dt()
    with pytest.raises(ValueError, match="digit width 3"):
        dt.select_topk_triton(torch.zeros(1, 8, device=_DEV), 2, bits=3)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_sparse_mla_latent_splits(splits):
    """The split-KV path: top-64 over 16-entry blocks in 1, 2 or 4 splits (the combine merges
    them), one live token with no selected entry (output 0); tolerances as test_sparse_mla_latent."""
    dt = _dt()
    c = make_case("small64", 2, seed=9, device=_DEV)
    r = cpu(c)
    topk = select_topk_like(r)
    topk[2] = -1  # a live token that selects nothing
    got = dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], topk.to(_DEV),
                                      c["slot_mapping"], 2, c["L"], c["scale"], block_n=16,
                                      splits=splits).float().cpu()
    ref = ref_sparse_latent(r, topk)
    assert (got[2] == 0).all(), "a token with no selected entry must be 0"
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= 1e-2 and float((got - ref).abs().max()) <= 2e-2, f"splits {splits}: rel {rel:.2e}"
    with pytest.raises(ValueError, match="multiple"):
        dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], topk.to(_DEV), c["slot_mapping"], 2,
                                    c["L"], c["scale"], block_n=16, splits=3)


@pytest.mark.parametrize("extra", [0, 1])
def test_select_rows_dispatch(extra, monkeypatch):
    """select_rows at TOPK_TRITON_MAX_N positions (the one-program kernel) and one more (the
    many-programs kernel): latent-cache rows through a shuffled block table shared by q_len = 2
    tokens a request, the reference's select_topk on every row (random logits: no ties), rows with
    -inf tails."""
    dt = _dt()
    N, BS = dt.TOPK_TRITON_MAX_N + extra, 64
    g = torch.Generator().manual_seed(N)
    x = torch.randn(4, N, generator=g)
    vis = [N, 5000, 100, N - 7]
    for t, v in enumerate(vis):
        x[t, v:] = float("-inf")
    mb = -(-N // BS)
    block_table = torch.randperm(2 * mb + 3, generator=g)[: 2 * mb].view(2, mb).to(torch.int32)
    chunked, real = [], dt.select_topk_chunked
    monkeypatch.setattr(dt, "select_topk_chunked", lambda *a, **k: chunked.append(k) or real(*a, **k))
    got = dt.select_rows(x.to(_DEV), 2048, block_table.to(_DEV), 2, BS)
    assert len(chunked) == extra, "the many-programs kernel takes rows past TOPK_TRITON_MAX_N, and only those"
    for t, v in enumerate(vis):
        want = dt.physical_rows(select_topk(x[t, :v], 2048)[None], block_table[t // 2 : t // 2 + 1], 1, BS)[0]
        assert torch.equal(got[t].cpu(), want), f"row {t}"


def test_select_rows_chunk():
    """The many-programs top-k's chunk: 2048 entries a program up to four programs an SM (an H200's 132),
    4096 beyond (measured faster at 64 x 32K-128K, slower at 1 x 32K-128K)."""
    assert _dt()._chunk(1, 131072, 132) == 2048 and _dt()._chunk(8, 131072, 132) == 2048
    assert _dt()._chunk(9, 131072, 132) == 4096 and _dt()._chunk(64, 32768, 132) == 4096


@pytest.mark.parametrize("splits", [None, 1])  # 1: the normalized BF16 output written directly (no combine)
@pytest.mark.parametrize("q_len", [2, 6])  # 6 and 18 tokens: both sides of the 16-token tile switch
def test_sparse_mla_latent_rows(q_len, splits):
    """Cache rows (``physical_rows``) given instead of positions: the same output as the
    reference, with the default splits and with one split (the path taken from ~60 tokens at
    full size: two 64-head tiles, the second half masked); tolerances as test_sparse_mla_latent."""
    dt = _dt()
    size = "full" if _DEV != "cpu" else "small64"
    c = make_case(size, q_len, seed=11, device=_DEV)
    r = cpu(c)
    topk = select_topk_like(r)
    rows = dt.physical_rows(topk.to(_DEV), c["block_table"], q_len, c["kv_cache"].shape[1])
    got = dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], rows, c["slot_mapping"], q_len,
                                      c["L"], c["scale"], block_n=min(64, c["topk"] // 2), physical=True,
                                      splits=splits).float().cpu()
    ref = ref_sparse_latent(r, topk)
    assert (got[r["slot_mapping"] < 0] == 0).all(), "padding tokens must be 0"
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= 1e-2 and float((got - ref).abs().max()) <= 2e-2, f"rel {rel:.2e}"


def fp8_latent(c: dict) -> dict:
    """The case's latent pool as FP8 e4m3 rows with per-token power-of-two scales (the reference
    quantizer), and its layer-1 views: ``kv8_pool``, ``ks_pool``, ``kv8``, ``ks``."""
    v, s = fp8_pow2_quantize(c["kv_pool"])  # [NB, BS, 2, L+R] FP8, [NB, BS, 2] FP32
    return dict(kv8_pool=v, ks_pool=s, kv8=v[:, :, 1], ks=s[:, :, 1])


@pytest.mark.parametrize("q_len", [1, 3])
def test_latent_insert_fp8(q_len):
    """FP8 latent insert: each written row is bit-identical to the reference quantizer
    (``fp8_pow2_quantize``) of the row the BF16 insert writes (itself within one BF16 ulp of the
    reference, test_latent_insert), scale included; every other entry (other rows, the spare
    layer) untouched."""
    dt = _dt()
    size = "full" if _DEV != "cpu" else "small"
    c = make_case(size, q_len, seed=12, device=_DEV)
    f = fp8_latent(c)
    L, LR = c["L"], c["kv_pool"].shape[-1]
    g = torch.Generator().manual_seed(13)
    kv_a = (torch.randn(c["slot_mapping"].shape[0], LR, generator=g) * 1.5).to(torch.bfloat16).to(_DEV)
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(torch.bfloat16).to(_DEV)
    before8, before_s = f["kv8_pool"].cpu().clone(), f["ks_pool"].cpu().clone()
    dt.latent_insert(kv_a, w, 1e-6, f["kv8"], c["slot_mapping"], kv_scale=f["ks"])
    dt.latent_insert(kv_a, w, 1e-6, c["kv_cache"], c["slot_mapping"])  # the BF16 rows it quantizes
    slots = c["slot_mapping"].cpu()
    live = slots >= 0
    blk, off = slots[live] // c["kv_cache"].shape[1], slots[live] % c["kv_cache"].shape[1]
    want_v, want_s = fp8_pow2_quantize(c["kv_cache"].cpu()[blk, off])
    got8, got_s = f["kv8_pool"].cpu(), f["ks_pool"].cpu()
    assert same_bits(got8[blk, off, 1], want_v), "FP8 latent rows differ from the quantized BF16 rows"
    assert torch.equal(got_s[blk, off, 1], want_s), "latent scales differ"
    written = torch.zeros(got_s.shape, dtype=torch.bool)
    written[blk, off, 1] = True
    assert same_bits(got8[~written], before8[~written]) and torch.equal(got_s[~written], before_s[~written]), \
        "an entry that is not this step's row was written"


@pytest.mark.parametrize("physical", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
def test_sparse_mla_latent_fp8(q_len, physical):
    """The sparse MLA on an FP8 latent cache against the reference over the dequantized rows
    (``gather_latent``): tolerances as test_sparse_mla_latent (the dequantized rows are exact in
    BF16, so the FP8 format adds no kernel error); padding tokens 0. Mutant: the same kernel
    with the scales ignored (all ones) misses the reference by far."""
    from dep_compile.stock.reference.mla import gather_latent  # noqa: PLC0415

    dt = _dt()
    size = "full" if _DEV != "cpu" else "small64"
    c = make_case(size, q_len, seed=14, device=_DEV)
    r = cpu(c)
    f = fp8_latent(c)
    fr = {n: t.cpu() for n, t in fp8_latent(r).items()}
    topk = select_topk_like(r)
    sel = dt.physical_rows(topk.to(_DEV), c["block_table"], q_len, c["kv_cache"].shape[1]) if physical \
        else topk.to(_DEV)

    def run(ks):
        return dt.sparse_mla_decode_latent(c["query"], f["kv8"], c["block_table"], sel, c["slot_mapping"], q_len,
                                           c["L"], c["scale"], block_n=min(64, c["topk"] // 2), physical=physical,
                                           kv_scale=ks).float().cpu()

    T, H, _ = r["query"].shape
    ref = torch.zeros(T, H, r["L"])
    for t in range(T):
        s = topk[t][topk[t] >= 0].long()
        if int(r["slot_mapping"][t]) >= 0 and s.numel():
            ctx = gather_latent(fr["kv8"], fr["ks"], r["block_table"], t // q_len, s, torch.bfloat16)
            ref[t] = attend_latent(r["query"][t], ctx, r["L"], r["scale"])
    got = run(f["ks"])
    assert (got[r["slot_mapping"] < 0] == 0).all(), "padding tokens must be 0"
    rel = float((got - ref).norm() / ref.norm())
    mx = float((got - ref).abs().max())
    assert rel <= 1e-2 and mx <= 2e-2, f"rel {rel:.2e} max {mx:.2e}"
    mutant = run(torch.ones_like(f["ks"]))
    assert float((mutant - ref).norm() / ref.norm()) > 0.1, "the check does not see ignored scales"
