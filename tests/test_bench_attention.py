"""The attention-layer benchmark's builders on CPU: small KDA and DSA layers, eager vs kimi_dep, and the floor bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_attention as ba  # noqa: E402
from helpers import CUBLAS_ONLY, fallback_log  # noqa: E402

from dep_compile.stock import preset  # noqa: E402

CFG = preset("k31-small")  # KDA 4 heads x 32, conv width 4; latent 32 + 16; index keys 32 wide, top-16


@pytest.mark.parametrize("kind,rows,q,context", [("kda", 3, 1, None), ("kda", 2, 4, None),
                                                 ("dsa", 3, 1, 40), ("dsa", 2, 4, 10)])
def test_layer_eager_vs_kimi_dep(kind, rows, q, context):
    block = ba.build_block(CFG, kind, seed=0)
    step = ba.make_step(CFG, kind, rows, q, context, block_size=4, seed=1)
    # the step writes its own entries of every cache (state slots / token slots), and nothing else
    with torch.no_grad():
        _, after = ba.run_once(block, step)
    assert all(e > 0 for e in ba.cache_errors(after, step.caches, step.meta).values())
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False,
                        options={"inductor": False, **CUBLAS_ONLY})
    with torch.no_grad():
        errs = ba.parity(block, {"kimi_dep": dep}, step)["kimi_dep"]
    assert ba.rewritten_op(kind) == f"kimi_dep.{kind}_attention"
    assert ba.parity_violations({"kimi_dep": errs}) == []
    # pattern-only with cuBLAS tactics runs stock's kernels: the cache inserts are bit-identical
    copies = [n for n in errs if n in ("conv_state", "kv_cache", "index_cache")]
    assert copies and all(errs[n] == 0.0 for n in copies), errs


@pytest.mark.parametrize("name", ["kv_cache", "index_cache", "index_scale"])
def test_cache_errors_catch_a_write_outside_the_step(name):
    step = ba.make_step(CFG, "dsa", 2, 1, 40, block_size=4, seed=1)
    got = {n: t.clone() for n, t in step.caches.items()}
    unwritten = next(s for s in range(40) if s not in step.meta.slot_mapping.tolist())
    entry = got[name].flatten(0, 1)[unwritten]
    entry.copy_((entry.float() * 2 + 1).to(entry.dtype))  # a token slot this step does not write
    with pytest.raises(AssertionError, match=name):
        ba.cache_errors(got, step.caches, step.meta)


def test_traffic_bytes_by_hand():
    # KDA, per request: recurrent 4*32*32*4 = 16384 B and conv 3 taps * 384 * 2 = 2304 B, each read + written
    assert ba.traffic_bytes(CFG, "kda", 2, 4) == 2 * 2 * (16384 + 2304) == 74752
    # DSA, 2 requests x 2 tokens, context 40 (> top-16): keys 2*40*(32+4) = 2880; selected latents
    # 4 tokens * 16 * 48 * 2 = 6144; inserts 4 * (48*2 + 32 + 4) = 528
    assert ba.traffic_bytes(CFG, "dsa", 2, 2, 40) == 2880 + 6144 + 528
    # context 10 (< top-16): every token selected: keys 720, latents 4 * 10 * 96 = 3840, inserts 528
    assert ba.traffic_bytes(CFG, "dsa", 2, 2, 10) == 720 + 3840 + 528
    # full size: 6 MiB of recurrent state per request, read and written
    k31 = preset("k31")
    assert ba.traffic_bytes(k31, "kda", 1, 1) == 2 * (96 * 128 * 128 * 4 + 3 * 36864 * 2)
    assert ba.traffic_bytes(k31, "dsa", 1, 1, 4096) == 4096 * 132 + 2048 * 576 * 2 + 576 * 2 + 132
    # an FP8 latent cache: a row is 576 e4m3 values + the token's FP32 scale, read and inserted
    k31_fp8 = k31.replace(latent_cache_dtype="float8_e4m3fn")
    assert ba.traffic_bytes(k31_fp8, "dsa", 1, 1, 4096) == 4096 * 132 + 2048 * 580 + 580 + 132
    # MLA (K3): the request's whole context read once for its q = 2 tokens, and 2 inserts; no index keys
    assert ba.traffic_bytes(preset("k3"), "mla", 3, 2, 4096) == 3 * 4096 * 1152 + 3 * 2 * 1152
    assert ba.traffic_bytes(preset("k3").replace(latent_cache_dtype="float8_e4m3fn"), "mla", 1, 1, 100) == 101 * 580


def test_full_size_weight_bytes():
    with torch.device("meta"):
        kda, dsa = (ba.AttentionBlock(preset("k31"), k).to(torch.bfloat16) for k in ("kda", "dsa"))
    assert round(ba.weight_bytes(kda) / 1e6) == 887  # in_proj 49376 x 7168 + o_proj 7168 x 12288 + small
    assert round(ba.weight_bytes(dsa) / 1e6) == 479  # fused 14400 + wk 128 + wv 32 rows, q_b, kv_b, wq_b, o_proj


def test_layer_roofline_at_full_size():
    """The DSA layer at 64 requests x q = 4 x 4K is compute-bound: its core (256 tokens x 96 heads x 2048 rows x
    (576 + 512) x 2 FLOPs ~ 110 GFLOP, and the indexer 8.6: 150 µs at 790 TFLOP/s, against ~43 µs of bytes) and its
    projections; a decode step (1 x 1) is bytes-bound."""
    import roofline as rl

    k31 = preset("k31")
    with torch.device("meta"):
        dsa = ba.AttentionBlock(k31, "dsa").to(torch.bfloat16)
    core = ba.traffic_bytes(k31, "dsa", 64, 4, 4096)
    r = rl.layer_roofline(dsa, k31, "dsa", 64, 4, 4096, core)
    flops = 2 * 256 * 96 * 2048 * (576 + 512) + 2 * 256 * 4096 * 32 * 128  # sparse MLA + the 32-head indexer
    assert r["groups"]["core"]["flops_us"] == pytest.approx(flops / 790e12 * 1e6)
    assert r["groups"]["core"]["floor_us"] == r["groups"]["core"]["flops_us"] > r["groups"]["core"]["bytes_us"]
    w = r["groups"]["weights"]  # 2 x 256 tokens x ~240M weights: 155 µs of FLOPs, 111 µs of bytes
    assert w["bytes_us"] == pytest.approx(479e6 / 4.33e12 * 1e6, rel=1e-3)
    assert w["floor_us"] == w["flops_us"] > w["bytes_us"]
    assert r["roofline_us"] == pytest.approx(w["flops_us"] + r["groups"]["core"]["flops_us"])
    one = rl.layer_roofline(dsa, k31, "dsa", 1, 1, 4096, ba.traffic_bytes(k31, "dsa", 1, 1, 4096))  # decode: bytes
    assert one["roofline_us"] == pytest.approx(one["bytes_us"])


@pytest.mark.cuda
@pytest.mark.parametrize("kind,rows,q,context", [("kda", 3, 1, None), ("kda", 2, 4, None),
                                                 ("dsa", 3, 1, 40), ("dsa", 2, 4, 10), ("dsa", 5, 2, 300)])
def test_layer_on_cuda_eager_vs_kimi_dep(kind, rows, q, context):
    """The rewritten layer's CUDA path (Triton cores; the DSA indexer on a side stream) against the
    stock layer eager on CUDA (the stock ops' CUDA code): one step from identical caches, the
    harness's parity tolerances (outputs 2e-2; caches as its docstring says)."""
    block = ba.build_block(CFG, kind, device="cuda", seed=0)
    step = ba.make_step(CFG, kind, rows, q, context, block_size=4, device="cuda", seed=1)
    with fallback_log() as fell_back:  # reasons a layer ran stock code instead of its kernels
        dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False, options={"inductor": False})
        with torch.no_grad():
            errs = ba.parity(block, {"kimi_dep": dep}, step)["kimi_dep"]
    assert ba.parity_violations({"kimi_dep": errs}) == [], errs
    assert not fell_back, f"a layer fell back to stock code: {fell_back}"
