"""The FP8 latent cache option (``K3Config.latent_cache_dtype="float8_e4m3fn"``), on CPU.

Format: MLA / DSA latent rows ``[NB, BS, kv_lora + rope]`` in FP8 e4m3, one FP32 power-of-two scale
per token in ``kv_scale [NB, BS]`` (``fp8_pow2_quantize``, as the index keys). Checks:

* config and cache: the option is validated; ``KimiCache.allocate`` makes FP8 rows and their
  scales (powers of two, the quantized BF16 seeds), ``tensors()`` / ``mark_static`` include them;
  ``check_step`` rejects a cache in another format than the config's;
* references, FP8 against a BF16 cache seeded from the same rows: each stored row within
  ``2^-4 x`` its amax of the BF16 row (e4m3 round-to-nearest); MLA and sparse-MLA outputs within
  ``FP8_OUT_REL = 2^-3`` of the largest BF16 output (each latent element, key and value alike,
  moves by up to 2^-4 of its row's amax; the output is a softmax mix of value rows, plus the shift
  of the weights the keys' error makes; measured 0.032-0.073 over 8 seeds, q = 1 and 2). Mutant:
  a gather that ignores the scales misses by far;
* the rewritten graph (``kimi_dep``, cuBLAS tactics, pattern-only) against stock eager on the same
  FP8 caches, several decode (q = 1) and verify (q = 2) steps: logits and every cache bit-identical
  (FP8 latent codes and their scales, index keys, KDA states); the report shows the DSA layer
  rewritten into ``kimi_dep.dsa_attention_fp8`` and its probe observed; with split-K tactics,
  within the BF16 tolerances of test_rewrite_parity (FP8 caches compared dequantized);
* mutant: a rewritten layer whose sparse MLA ignores the latent scales is caught by the probe
  (the layer stays stock, "semantic check failed"), and without the probe by the parity check;
* the two FP8 stock ops pass ``torch.library.opcheck`` and mutate exactly what they declare;
* the post-grad route (Inductor hook, pooled views, q = 2) rewrites the FP8 layer too.

The Triton kernels' FP8 path is tested in tests/test_dsa_triton.py (Triton's CPU interpreter);
nothing here ran on the H200.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.ops import dsa as dsa_ops
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset
from dep_compile.stock.cache import StepError, cache_differences
from dep_compile.stock.reference import mla as ref_mla
from dep_compile.stock.reference.common import fp8_pow2_quantize
from dep_compile.stock.reference.dsa import sparse_mla_decode_ref
from dep_compile.stock.reference.mla import mla_decode_ref, token_positions

from helpers import LOGIT_ATOL, assert_agrees, run_pair, same_bits
from test_rewrite_parity import SPLITK_TABLES

FP8 = torch.float8_e4m3fn
FP8_OUT_REL = 2.0 ** -3  # FP8 vs BF16 cache: max |out - ref| / max |ref| (module docstring)
ops = torch.ops.kimi_k3


def fp8_config(name: str = "mixed-small", **changes):
    return preset(name, latent_cache_dtype="float8_e4m3fn", **changes)


# ---- config and cache ---------------------------------------------------------------------

def test_config_option_validated():
    assert preset("k31-small").latent_cache_dtype == "bfloat16" and not preset("k31-small").latent_fp8
    assert fp8_config().latent_fp8
    with pytest.raises(ValueError, match="latent_cache_dtype"):
        preset("k31-small", latent_cache_dtype="float16")


@pytest.mark.parametrize("pooled", [False, True])
def test_allocate_fp8_latent_cache(pooled):
    cfg, bf = fp8_config(), preset("mixed-small")
    cache = KimiCache.allocate(cfg, num_slots=3, num_blocks=6, block_size=4, pooled=pooled, seed=5)
    ref = KimiCache.allocate(bf, num_slots=3, num_blocks=6, block_size=4, pooled=pooled, seed=5)
    for i, (lc, rc) in enumerate(zip(cache.layers, ref.layers)):
        if cfg.layer_kind(i) == "kda":
            assert lc.kv_cache is None and lc.kv_scale is None
            continue
        assert lc.kv_cache.dtype == FP8 and lc.kv_cache.shape == (6, 4, cfg.latent_dim)
        assert lc.kv_scale.dtype == torch.float32 and lc.kv_scale.shape == (6, 4)
        assert "kv_scale" in lc.tensors() and rc.kv_scale is None
        assert torch.equal(lc.kv_scale, torch.exp2(torch.log2(lc.kv_scale).round())), "scales are powers of two"
        v, s = fp8_pow2_quantize(rc.kv_cache)  # the same random BF16 rows, quantized
        assert same_bits(lc.kv_cache.contiguous(), v) and torch.equal(lc.kv_scale, s)
        assert lc.kv_cache._dynamo_static_input_type == "unguarded"  # noqa: SLF001  (mark_static)
        assert lc.kv_scale._dynamo_static_input_type == "unguarded"  # noqa: SLF001
        if cfg.layer_kind(i) == "dsa":  # the other caches draw the same random numbers as the BF16 cache
            assert same_bits(lc.index_cache, rc.index_cache) and torch.equal(lc.index_scale, rc.index_scale)
    errs = cache_differences(cache.snapshot(), cache.clone().snapshot())
    assert "layer.3.kv_cache" in errs and "layer.3.kv_scale" not in errs and max(errs.values()) == 0.0


def test_check_step_rejects_a_cache_of_another_format():
    cfg = fp8_config(num_layers=4)
    model = build_model(preset("mixed-small", num_layers=4), seed=1)
    cache = KimiCache.allocate(preset("mixed-small", num_layers=4), num_slots=3, num_blocks=8, block_size=4)
    meta = RequestBatch(cache, 2, start_len=3).step(1)
    ids = torch.zeros(2, dtype=torch.int64)
    from dep_compile.stock.cache import check_step

    with pytest.raises(StepError, match="latent cache"):
        check_step(cfg, ids, meta, cache)
    model.step(ids, meta, cache)  # the BF16 config takes it


# ---- references: FP8 against BF16 ----------------------------------------------------------

def _ref_case(q_len: int, seed: int):
    """Small MLA inputs and one BF16 latent cache with every row written (random, never zero)."""
    g = torch.Generator().manual_seed(seed)
    H, nope, R, L, v, BS = 4, 16, 8, 32, 16, 4
    seq = torch.tensor([5, 23, 40], dtype=torch.int32)
    B, MB = 3, 11
    NB = B * MB + 1
    table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).to(torch.int32)
    pos = token_positions(seq, q_len)
    req = torch.arange(B).repeat_interleave(q_len)
    slots = table[req, pos // BS].long() * BS + pos % BS
    T = B * q_len
    return dict(
        q=(torch.randn(T, H, nope + R, generator=g) * 2).to(torch.bfloat16),
        latent=torch.randn(T, L + R, generator=g).to(torch.bfloat16),
        kv_b=(torch.randn(H * (nope + v), L, generator=g) * L ** -0.5).to(torch.bfloat16),
        kv=torch.randn(NB, BS, L + R, generator=g).to(torch.bfloat16),
        table=table, seq=seq, slots=slots, pos=pos, q_len=q_len, scale=(nope + R) ** -0.5, nope=nope, topk=8,
    )


def _selection(c) -> torch.Tensor:
    """Each token's last ``topk`` positions with every other one dropped (ascending, -1 padded)."""
    K = c["topk"]
    out = torch.full((len(c["pos"]), K), -1, dtype=torch.int32)
    for t, p in enumerate(c["pos"].tolist()):
        keep = torch.arange(p, max(-1, p - 2 * K), -2).flip(0)  # p, p-2, ... ascending
        out[t, : keep.numel()] = keep.to(torch.int32)
    return out


def _fp8_vs_bf16(c) -> dict:
    """MLA and sparse-MLA reference outputs and caches on a BF16 cache and on its FP8 quantization."""
    kv8, ks = fp8_pow2_quantize(c["kv"])
    kv, kv8 = c["kv"].clone(), kv8.clone()
    args = (c["slots"], c["table"], c["seq"], c["q_len"], c["scale"], c["nope"])
    out = {"mla": (mla_decode_ref(c["q"], c["latent"], c["kv_b"], kv, *args),
                   mla_decode_ref(c["q"], c["latent"], c["kv_b"], kv8, *args, kv_scale=ks))}
    sel = _selection(c)
    sargs = (c["slots"], c["table"], sel, c["q_len"], c["scale"], c["nope"])
    out["sparse"] = (sparse_mla_decode_ref(c["q"], c["latent"], c["kv_b"], kv.clone(), *sargs),
                     sparse_mla_decode_ref(c["q"], c["latent"], c["kv_b"], kv8.clone(), *sargs, kv_scale=ks.clone()))
    out["caches"] = (kv, kv8, ks)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("q_len", [1, 2])
def test_reference_fp8_within_fp8_tolerance_of_bf16(q_len):
    c = _ref_case(q_len, seed=30 + q_len)
    r = _fp8_vs_bf16(c)
    kv, kv8, ks = r["caches"]
    deq = kv8.float() * ks.unsqueeze(-1)
    amax = kv.float().abs().amax(-1, keepdim=True)
    assert ((deq - kv.float()).abs() <= amax * 2.0 ** -4).all(), "a stored row is off by more than e4m3 rounding"
    live = c["slots"]
    bs = kv.shape[1]
    assert not same_bits(kv8[live // bs, live % bs], torch.zeros_like(kv8[live // bs, live % bs]))
    for name in ("mla", "sparse"):
        bf, f8 = r[name]
        assert torch.isfinite(f8.float()).all()
        assert _rel(f8, bf) <= FP8_OUT_REL, f"{name}: {_rel(f8, bf):.3e}"
        assert _rel(f8, bf) > 0, f"{name}: the FP8 cache changed nothing (not exercised)"


def test_reference_mutant_scale_ignored_fails(monkeypatch):
    """A gather that drops the scales (FP8 codes read as values) fails the FP8 tolerance."""
    def no_scale(kv_cache, kv_scale, block_table, b, positions, dtype):
        return ref_mla.gather_context(kv_cache, block_table, b, positions).to(dtype)

    monkeypatch.setattr(ref_mla, "gather_latent", no_scale)
    c = _ref_case(1, seed=40)
    r = _fp8_vs_bf16(c)
    assert _rel(*reversed(r["mla"])) > FP8_OUT_REL


# ---- the rewrite ------------------------------------------------------------------------

@pytest.mark.parametrize("q", [1, 2])
def test_rewrite_exact_against_stock_eager(q):
    cfg = fp8_config()
    r = run_pair(cfg, steps=5, q=q, accepted=None if q == 1 else (lambda i, b: [1 + i % 2, 2, 1]))
    report, diff, got, ref = r.report, r.logits_err, r.caches, r.ref_caches
    dsa = report.rewritten("dsa")
    assert len(dsa) == 1 and dsa[0].op == "kimi_dep.dsa_attention_fp8" and dsa[0].validation.startswith("probe")
    assert len(report.rewritten()) == 1 + 6 + 7  # DSA, KDA, MoE; the MLA layer (FP8 too) stays stock
    assert len(report.stock("mla")) == 1 and report.stock("mla")[0].reason.startswith("policy")
    assert diff == 0.0
    assert any(k.endswith("kv_scale") for k in ref) and got.keys() == ref.keys()
    for k in ref:
        assert same_bits(got[k], ref[k]), f"{k} differs"
    start = KimiCache.allocate(cfg, num_slots=7, num_blocks=32, block_size=4, seed=2).snapshot()
    for i in (3, 7):  # the steps wrote FP8 rows and scales (the test is not vacuous)
        assert not torch.equal(ref[f"layer.{i}.kv_scale"], start[f"layer.{i}.kv_scale"])


def test_rewrite_split_k_within_bf16_tolerance():
    r = run_pair(fp8_config("k31-small", num_layers=4), steps=4, q=2, options=SPLITK_TABLES, decisive=True)
    assert r.report.rewritten("dsa")[0].op == "kimi_dep.dsa_attention_fp8"
    assert "layer.3.kv_cache" in r.cache_errs
    assert_agrees(r, "FP8 latent cache, split-K tables")  # decisive routing: tests/test_rewrite_parity.py


def _scale_ignored(real):
    """The stock FP8 sparse MLA with the caches written as stock writes them, but attending with the
    cached scales ignored (all 1; only this step's own rows keep theirs)."""
    def op(q, latent, kv_b_w, kv_cache, kv_scale, *rest):
        real(q, latent, kv_b_w, kv_cache, kv_scale, *rest)  # the inserts, as stock
        return real(q, latent, kv_b_w, kv_cache.clone(), torch.ones_like(kv_scale), *rest)
    return op


def test_mutant_scale_ignored_is_caught(monkeypatch):
    real = dsa_ops.stock_ops.sparse_mla_decode_fp8
    monkeypatch.setattr(dsa_ops.stock_ops, "sparse_mla_decode_fp8", _scale_ignored(real))
    cfg = fp8_config("k31-small", num_layers=4)
    report = run_pair(cfg, steps=1, q=1).report
    dsa = report.layers[[m.kind for m in report.layers].index("dsa")]
    assert not dsa.rewritten and dsa.reason.startswith("semantic check failed"), dsa.reason
    torch._dynamo.reset()
    r = run_pair(cfg, steps=2, q=1, options={"validate": False})
    assert r.report.rewritten("dsa") and r.logits_err > LOGIT_ATOL


def test_prepared_layer_checks_the_cache_format():
    cfg = fp8_config("k31-small", num_layers=4)
    report = run_pair(cfg, steps=1, q=1).report
    from dep_compile.ops.registry import _PREPARED, lookup

    module = report.rewritten("dsa")[0].module
    keys = [k for k in _PREPARED if k.startswith(module + "#") and '"latent_cache":"float8_e4m3fn"' in k]
    assert keys, "the layer string carries the cache format (a compile-cache hit rebuilds it)"
    prepared = lookup(keys[-1])
    assert prepared.latent_cache == "float8_e4m3fn"
    kv = torch.zeros(4, 4, cfg.latent_dim, dtype=FP8)
    prepared.check_latent_cache(kv, torch.ones(4, 4))
    for bad in ((kv, None), (kv.view(torch.uint8), torch.ones(4, 4)), (kv, torch.ones(4, 5))):
        with pytest.raises(ValueError, match="latent cache"):
            prepared.check_latent_cache(*bad)


# ---- the FP8 stock ops ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mla_decode_fp8", "sparse_mla_decode_fp8"])
def test_opcheck_fp8_stock_ops(name):
    c = _ref_case(2, seed=50)
    kv8, ks = fp8_pow2_quantize(c["kv"])
    last = c["seq"] if name == "mla_decode_fp8" else _selection(c)
    op = getattr(ops, name)
    args = (c["q"], c["latent"], c["kv_b"], kv8, ks, c["slots"], c["table"], last, c["q_len"], c["scale"], c["nope"])
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))  # no allclose on FP8 on CPU
    cloned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in cloned]
    op(*cloned)
    changed = [i for i, (a, b) in enumerate(zip(cloned, before)) if b is not None and not same_bits(a, b)]
    assert changed == [3, 4], changed  # kv_cache, kv_scale


def test_post_grad_route_pooled_views():
    """Inductor's post-grad hook (auto_functionalized_v2, pooled cache views, q = 2): the DSA layer
    becomes ``dsa_attention_fp8`` there too, within the multi-step agreement bound of test_postgrad_pass
    (decisive routing; FP8 latent caches compared dequantized)."""
    from test_postgrad_pass import run_postgrad

    cfg = fp8_config()
    report, res = run_postgrad(cfg, steps=3, batch=3, q=2, pooled=True,
                               accepted=lambda i, b: [1 + (i + r) % 2 for r in range(b)])
    assert report.ops_after["kimi_dep.dsa_attention_fp8"] == 1 and report.ops_after["kimi_k3.mla_decode_fp8"] == 1
    assert "kimi_k3.sparse_mla_decode_fp8" not in report.ops_after, report.ops_after
    assert_agrees(res, "FP8 latent cache, post-grad", inductor=True)
