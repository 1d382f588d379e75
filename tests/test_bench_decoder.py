"""The decode-step benchmark on CPU: its smoke run end to end, the floor bytes by hand, the routing hook."""

from __future__ import annotations

import json
from collections import Counter
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decoder as bd  # noqa: E402

from dep_compile import tactics  # noqa: E402
from dep_compile.stock import preset  # noqa: E402


def test_smoke_run_writes_every_output(tmp_path):
    table = tactics.KDA_SPLIT_FROM_Q
    points = bd.main(["--device", "cpu", "--preset", "k31-small", "--layers", "4", "--rows", "2", "--q", "1", "2",
                      "--context", "24", "--block-size", "4", "--kda-split-from", "2", "--out", str(tmp_path)])
    assert [p.get("error") for p in points] == [None, None]
    data = json.loads((tmp_path / "decoder.json").read_text())
    assert data["layers"] == 4 and len(data["points"]) == 2 and "env" in data
    assert data["kda_split_from"] == 2 and tactics.KDA_SPLIT_FROM_Q == table  # recorded; the table's value restored
    for p in data["points"]:
        # on CPU kimi_dep (pattern-only, cuBLAS tactics) runs stock's references: exact, same routing
        assert p["kimi_dep_rel_err"] == 0.0 and p["kimi_dep_routing"] == 1.0, p
        n = Counter(p["rewritten"])
        assert (n["kimi_dep.kda_attention"], n["kimi_dep.dsa_attention"], n["kimi_dep.moe"]) == (3, 1, 3), n
        assert p["floor_433_us"] > 0 and p["floor_48_us"] < p["floor_433_us"]
    assert "| rows |" in (tmp_path / "decoder.md").read_text()


def test_fp8_latent_cache_run(tmp_path):
    """``--latent-cache float8_e4m3fn``: the DSA layer rewritten as its FP8-cache op, exact against eager on the CPU
    (the caches compared dequantized), and the floor counting a latent row as 32 + 16 e4m3 values + an FP32 scale."""
    points = bd.main(["--device", "cpu", "--preset", "k31-small", "--layers", "4", "--rows", "2", "--context", "24",
                      "--block-size", "4", "--sides", "kimi_dep", "--latent-cache", "float8_e4m3fn", "--out",
                      str(tmp_path)])
    (p,) = points
    assert p.get("error") is None and "kimi_dep.dsa_attention_fp8" in p["rewritten"], p
    assert p["kimi_dep_rel_err"] == 0.0 and p["kimi_dep_cache_err"] == 0.0, p
    row = 48 + 4
    assert p["floor_bytes"]["dsa_mla"] == 2 * 24 * (32 + 4) + 2 * 16 * row + 2 * (row + 32 + 4)  # keys, top-16, inserts
    assert json.loads((tmp_path / "decoder.json").read_text())["latent_cache"] == "float8_e4m3fn"


def test_floor_bytes_by_hand():
    cfg = preset("k31-small", num_layers=4)  # KDA+dense, KDA, KDA, DSA; 3 MoE layers of 64 experts
    model = bd.build_model(cfg, "cpu")
    ids = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[5, 5], [5, 5]]), torch.tensor([[63, 0], [7, 9]])]
    got = bd.floor_bytes(model, rows=2, q=1, context=40, routing=ids)
    per_expert = (2 * 64 * 128 + 128 * 64) * 2  # w13 [2I, Lat] + w2 [Lat, I], BF16
    assert got["experts"] == (3 + 1 + 4) * per_expert
    embed = 2 * cfg.hidden_size * 2  # two gathered rows, not the table
    others = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".experts." not in n and "embed_tokens" not in n)
    assert got["weights"] == others + embed
    # 3 KDA layers x 2 requests x (recurrent 4*32*32*4 + conv 3*384*2) read + written
    assert got["kda_states"] == 3 * 2 * 2 * (16384 + 2304)
    # DSA: keys 2*40*(32+4); top-16 latents 2 tokens * 16 * 48 * 2; inserts 2 * (96 + 32 + 4)
    assert got["dsa_mla"] == 2880 + 3072 + 264
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_routing_hook_and_agreement():
    cfg = preset("k31-small", num_layers=2)
    model = bd.build_model(cfg, "cpu")
    pt = bd.Point(cfg, rows=3, q=1, context=12, block_size=4, device=torch.device("cpu"))
    with torch.no_grad(), bd.record_routing() as ids:
        model(pt.ids, pt.meta, pt.cache)
    assert len(ids) == 1 and ids[0].shape == (3, 16)  # layer 0 is dense: one MoE call
    assert bd.routing_agreement(ids, ids) == 1.0
    flipped = ids[0].clone()
    flipped[1, 0] = next(e for e in range(64) if e not in flipped[1].tolist())  # one pick of 48 differs
    assert bd.routing_agreement([flipped], ids) == 47 / 48
    # the pick order within a token does not matter
    assert bd.routing_agreement([ids[0].flip(-1)], ids) == 1.0


def test_rank_run_matches_the_memory_table(tmp_path):
    """An EP rank's shape, kimi_dep alone, no parity copies (the full-depth rank's options): the built model's
    parameters and each point's caches are the bytes ``dep_compile.memory`` computes for that DEP size."""
    points = bd.main(["--device", "cpu", "--preset", "k31-small", "--layers", "4", "--local-experts", "16",
                      "--sides", "kimi_dep", "--no-parity", "--rows", "3", "--context", "24", "--block-size", "4",
                      "--out", str(tmp_path)])
    assert [p.get("error") for p in points] == [None], points
    data = json.loads((tmp_path / "decoder.json").read_text())
    mem = data["memory"]
    assert mem["dep"] == 896 // 16 and mem["param_bytes"] == mem["table_weight_bytes"], mem
    p = data["points"][0]
    assert p["cache_bytes"] == 3 * mem["table_cache_bytes_per_request"], (p["cache_bytes"], mem)
    assert "stock_hand_us" not in p and "kimi_dep_rel_err" not in p and p["kimi_dep_hand_us"] > 0


def test_roofline_by_hand():
    """The roofline floor's FLOP terms on the small preset, counted by hand, and each group's floor the larger
    of its two terms."""
    import roofline as rl

    cfg = preset("k31-small", num_layers=4)  # KDA+dense, KDA, KDA, DSA; 3 MoE layers of 64 experts
    model = bd.build_model(cfg, "cpu")
    rows, q, ctx = 2, 3, 40
    ids = [torch.tensor([[0, 1]] * 6), torch.tensor([[5, 5]] * 6), torch.tensor([[63, 0]] * 6)]  # 12 rows a layer
    nbytes = bd.floor_bytes(model, rows, q, ctx, ids)
    got = rl.step_roofline(model, rows, q, ctx, ids, nbytes)
    T = rows * q
    mats = sum(p.numel() for n, p in model.named_parameters()
               if p.dim() >= 2 and ".experts." not in n and "embed_tokens" not in n)
    expect = {
        "weights": 2 * T * mats / rl.PEAK_FLOPS["bf16"],
        "experts": 2 * 36 * 3 * cfg.moe_intermediate * cfg.moe_latent_size / rl.PEAK_FLOPS["bf16"],
        "kda_states": 3 * T * cfg.kda_heads * cfg.kda_head_dim ** 2 * 8 / rl.PEAK_FLOPS["fp32"],
        # DSA: top-k (16 here) of 40 attended, QK over the latent and PV over kv_lora; the indexer over all 40
        "dsa_mla": (2 * T * cfg.mla_heads * min(ctx, cfg.index_topk) * (cfg.latent_dim + cfg.kv_lora_rank)
                    + 2 * T * ctx * cfg.index_heads * cfg.index_head_dim) / rl.PEAK_FLOPS["bf16"],
    }
    for g, seconds in expect.items():
        v = got["groups"][g]
        assert abs(v["flops_us"] - seconds * 1e6) <= 1e-9 * max(1.0, seconds * 1e6), (g, v, seconds)
        assert v["floor_us"] == max(v["bytes_us"], v["flops_us"])
        assert abs(v["bytes_us"] - nbytes[g] / 4.33e12 * 1e6) < 1e-9
    assert abs(got["roofline_us"] - sum(v["floor_us"] for v in got["groups"].values())) < 1e-9
    assert got["roofline_us"] >= got["bytes_us"] - 1e-9


def test_roofline_terms_of_a_big_verify_step():
    """Full-width slice, 64 requests x q = 4 x 4K: the dense GEMMs' FLOPs are ~2.6 ms at 790 TFLOP/s (issue #29's
    count), 70 % of their bytes' 3.7 ms; the DSA core (2048 rows attended by each of 256 tokens) is compute-bound."""
    import roofline as rl

    cfg = preset("k31", num_layers=4, n_routed_experts=16)
    with torch.device("meta"):
        model = bd.KimiK3ForCausalLM(cfg)
    secs = rl.weight_flop_seconds(model, 64 * 4)
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".experts." not in n and "embed_tokens" not in n)
    assert 2.4e-3 < secs < 2.8e-3 and 0.6 < secs / (nbytes / 4.33e12) < 0.8, (secs, nbytes / 4.33e12)
    dsa = rl.attention_flop_seconds(cfg, "dsa", 64, 4, 4096)
    assert dsa > bd.traffic_bytes(cfg, "dsa", 64, 4, 4096) / 4.33e12, dsa


def test_dep2_run_across_two_ranks(tmp_path):
    """The benchmark under torchrun's env at DEP2 (gloo on the CPU, the CPU smoke run): each rank holds half of each
    MoE's experts and decodes its own requests, every MoE layer is ``kimi_dep.moe[ep2]``, the logits and caches
    of both sides equal the unsharded model's on each rank's requests up to the cross-rank FP32 sum order (decisive
    routing: the same experts everywhere), the floors count each rank's own share of the experts touched, the
    link bytes are the dispatch's and combine's, and every rank returns the same merged points."""
    import dep_workers

    argv = ["--device", "cpu", "--preset", "k31-small", "--layers", "4", "--rows", "2", "--q", "2", "--context", "24",
            "--block-size", "4", "--decisive"]
    dep_workers.run_ranks(dep_workers.bench_decoder_worker, 2, str(tmp_path), argv)
    data = json.loads((tmp_path / "decoder.json").read_text())
    assert data["ep"] == 2 and data["decisive"] and data["memory"]["dep"] == 2, data
    (p,) = data["points"]
    assert p.get("error") is None, p
    assert json.loads((tmp_path / "rank1.json").read_text())[0]["kimi_dep_hand_us"] == p["kimi_dep_hand_us"]
    n = Counter(p["rewritten"])
    assert (n["kimi_dep.kda_attention"], n["kimi_dep.dsa_attention"], n["kimi_dep.moe[ep2]"]) == (3, 1, 3), n
    assert [(r["rows"], r["q"]) for r in p["ranks"]] == [(2, 2), (2, 2)]
    for side in ("stock", "kimi_dep"):  # stock: eager on the CPU; only the cross-rank FP32 sum order differs
        assert p[f"{side}_routing"] == 1.0 and p[f"{side}_rel_err"] < 1e-2 and p[f"{side}_cache_err"] < 0.05, p
    per_expert = (2 * 64 * 128 + 128 * 64) * 2  # BF16 w13 [2I, Lat] + w2 [Lat, I]
    assert sum(r["floor_bytes"]["experts"] for r in p["ranks"]) == 3 * 16 * per_expert  # 3 layers, the same 16
    assert p["link_bytes"] == 3 * 1 * 4 * (2 * 128 + 4 * 16 + 8 * 16 + 4 * 128)  # 3 MoE layers, 1 peer, 4 rows
    assert p["link_us"] == 0.0 and p["collectives_us"] is None  # the CPU: no link bandwidth, collectives untimed
    assert p["kimi_dep_hand_us"] == max(r["kimi_dep_hand_us"] for r in p["ranks"])
    assert "| link µs |" in (tmp_path / "decoder.md").read_text()


def test_wall_attribution_by_hand():
    """A traced step's wall time split by hand: the GEMM alone 0-4 and 6-10, the GEMM with the router 4-6 (on
    another stream), nothing 10-12 (a launch gap), AttnRes alone 12-15; the four sum to the 15 µs span."""
    from common import wall_attribution  # noqa: PLC0415 - benchmarks/ is on the path above

    kernels = [dict(name="_fp8_splitk_kernel", ts=0.0, dur=10.0), dict(name="_select_kernel", ts=4.0, dur=2.0),
               dict(name="_attn_res_kernel", ts=12.0, dur=3.0)]
    w = wall_attribution(kernels, bd.group_of)
    assert w["span_us"] == 15.0 and w["overlapped_us"] == 2.0 and w["idle_us"] == 2.0 and w["idle_gaps"] == 1
    assert w["alone_us"] == {"split-K GEMMs (Triton or cuBLAS's)": 8.0, "AttnRes": 3.0}
    assert w["longest_idle"] == [dict(us=2.0, after="_fp8_splitk_kernel", before="_attn_res_kernel")]
