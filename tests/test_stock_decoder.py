"""The stock decoder as a whole: it traces without graph breaks, compiles through kimi_dep +
Inductor to eager's results, prefill equals decode steps, pooled caches equal plain ones, vLLM
K3 parameter names load, and malformed steps are refused before any cache is touched."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import dep_compile
from dep_compile.stock import KimiCache, KimiK3ForCausalLM, RequestBatch, StepError, build_model, preset

from helpers import CUBLAS_ONLY, same_bits

FP8 = torch.float8_e4m3fn


def _assert_snapshots_equal(a: dict, b: dict, what: str = ""):
    """Bit-exact equality of every cache tensor (FP8 compared as bytes)."""
    assert a.keys() == b.keys()
    bad = [k for k in a if not same_bits(a[k], b[k])]
    assert not bad, f"{what}: caches differ: " + ", ".join(
        f"{k} (max |diff| {(a[k].float() - b[k].float()).abs().max().item():.3g})" for k in bad)


def _assert_caches_close(a: dict, b: dict, what: str):
    """Every cache tensor within rounding: BF16/FP32 caches to 0.1 abs + 2e-2 rel (a few BF16
    ulps at their O(1-8) magnitudes, compounded through the recurrent state over the steps; a
    missed or misplaced write is off by O(1)); FP8 index keys to one e4m3 ulp (2^-3 relative,
    2^-9 absolute for subnormals)."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].float(), b[k].float()
        if a[k].dtype == FP8:
            bound = 2 ** -3 * torch.maximum(x.abs(), y.abs()) + 2 ** -9
            assert bool(((x - y).abs() <= bound).all()), f"{what}: {k} differs by more than one e4m3 ulp"
        else:
            torch.testing.assert_close(x, y, atol=0.1, rtol=2e-2, msg=lambda m, k=k: f"{what}: {k}: {m}")


WRITTEN_REL, WRITTEN_ABS = 5e-2, 0.5


def _written_disagreement(a: dict, b: dict, init: dict) -> list[str]:
    """Caches that do not agree within rounding, for two runs of one computation whose FP32 GEMMs round
    differently (prefill over B*L rows vs decode over B): each BF16 / FP32 cache's difference relative to
    what the steps wrote into it (b - init; Frobenius) at most WRITTEN_REL, and no element off by more
    than WRITTEN_ABS; FP8 index keys within one e4m3 ulp. Not an elementwise atol: the ulps compound through
    the KDA states over the layers, and under ATEN_CPU_CAPABILITY=default a few conv-state elements of 3.9
    move by 0.19 (written part 0.014 relative; unset: 0.016 and 0.002); a missed write misses by O(1)."""
    bad = []
    for k in a:
        x, y = a[k].float(), b[k].float()
        if a[k].dtype == FP8:
            if not bool(((x - y).abs() <= 2 ** -3 * torch.maximum(x.abs(), y.abs()) + 2 ** -9).all()):
                bad.append(f"{k}: more than one e4m3 ulp")
            continue
        wrote = (y - init[k].float()).norm().item()
        rel = (x - y).norm().item() / wrote if wrote else (x - y).norm().item()
        worst = (x - y).abs().max().item()
        if rel > WRITTEN_REL or worst > WRITTEN_ABS:
            bad.append(f"{k}: {rel:.3g} of what was written, max {worst:.3g}")
    return bad


def _ids(cfg, n, g):
    return torch.randint(0, cfg.vocab_size, (n,), generator=g)


# ---------------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k3-small", "k31-small", "mixed-small"])
def test_decoder_traces_whole_without_graph_breaks(name):
    cfg = preset(name)
    model = build_model(cfg, seed=0)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=12, block_size=4, seed=1)
    meta = RequestBatch(cache, 2, start_len=5, seed=2).step()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(_ids(cfg, 2, torch.Generator().manual_seed(3)), meta, cache)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    # Every attention core, the routed experts and AttnRes are opaque kimi_k3 ops in the graph.
    calls = collections.Counter(
        str(n.target).split(".")[1] for gm in ex.graphs for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("kimi_k3."))
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert calls["kda_core"] == kinds.count("kda")
    assert calls["mla_decode"] == kinds.count("mla")
    assert calls["dsa_indexer"] == calls["sparse_mla_decode"] == kinds.count("dsa")
    assert calls["routed_experts"] == sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert calls["attn_res"] == 2 * cfg.num_layers


# ---------------------------------------------------------------------------------------------
# kimi_dep + Inductor against eager
# ---------------------------------------------------------------------------------------------


def test_kimi_dep_inductor_equals_eager_decode_and_verify():
    # KDA x3 (layer 0 dense, 1-2 MoE) + DSA/MoE. 16 experts, all routed (top-16 of 16): with 64,
    # a BF16-ulp difference from Inductor's fused glue can flip a near-tied expert choice in a
    # random model, which moves logits by O(1) legitimately; the structure is unchanged.
    cfg = preset("k31-small", num_layers=4, n_routed_experts=16)
    model = build_model(cfg, seed=1)
    cache = KimiCache.allocate(cfg, num_slots=7, num_blocks=24, block_size=4, seed=2)
    ref_cache = cache.clone()
    run, ref = RequestBatch(cache, 3, start_len=6, seed=3), RequestBatch(ref_cache, 3, start_len=6, seed=3)
    # dynamic=False: each q_len gets its own static graph, so the verify graph is rewritten too
    # (with Dynamo's automatic dynamic, q_len turns symbolic and KDA/DSA stay stock; see
    # test_verify_after_decode_keeps_rewrite_with_default_dynamic).
    compiled = torch.compile(model, backend="kimi_dep", dynamic=False)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for q, acc in [(1, None), (1, None), (1, None), (2, [1, 2, 2]), (1, None)]:
            ids = _ids(cfg, 3 * q, g)
            out = model.step(ids, run.step(q, acc), cache, fn=compiled)
            exp = model.step(ids, ref.step(q, acc), ref_cache)
            assert out.shape == (3 * q, cfg.vocab_size) and out.dtype == torch.float32
            # Logits are BF16 values (|x| <= 4) cast to FP32. Inductor fuses the glue (norms,
            # AttnRes, residuals), which moves BF16 results by an ulp here and there; over the
            # steps that compounds to a few ulps (1/64 each at 2-4): 0.1 abs + 2e-2 rel. A lost
            # cache write or a wrong slice moves logits by O(1).
            torch.testing.assert_close(out, exp, atol=0.1, rtol=2e-2)
            report = dep_compile.last_report()
            assert report.num_rewritten == 7 and not report.near_misses(), report.table()
    _assert_caches_close(cache.snapshot(), ref_cache.snapshot(), "kimi_dep+Inductor vs eager")


def test_verify_after_decode_keeps_rewrite_with_default_dynamic():
    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg, seed=1)
    cache = KimiCache.allocate(cfg, num_slots=7, num_blocks=24, block_size=4, seed=2)
    batch = RequestBatch(cache, 3, start_len=6, seed=3)
    compiled = torch.compile(model, backend="kimi_dep", options={"inductor": False, **CUBLAS_ONLY})
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        model.step(_ids(cfg, 3, g), batch.step(1), cache, fn=compiled)
        assert dep_compile.last_report().num_rewritten == 7
        model.step(_ids(cfg, 6, g), batch.step(2, [2, 1, 2]), cache, fn=compiled)
        report = dep_compile.last_report()
        assert report.num_rewritten == 7, report.table()  # q_len is now a SymInt in this graph
        # the same dynamic graph then serves q = 3 (no recompile needed for correctness)
        ref_cache = cache.clone()
        ref_batch = RequestBatch(ref_cache, 3, start_len=6, seed=3)
        ref_batch.lens = batch.lens.clone()
        ids = _ids(cfg, 9, g)
        out = model.step(ids, batch.step(3, [3, 1, 2]), cache, fn=compiled)
        ref = model.step(ids, ref_batch.step(3, [3, 1, 2]), ref_cache)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # pattern-only with CUBLAS_ONLY: exact
    _assert_caches_close(cache.snapshot(), ref_cache.snapshot(), "dynamic q")


# ---------------------------------------------------------------------------------------------
# Prefill, pooled caches
# ---------------------------------------------------------------------------------------------


def test_prefill_equals_decode_steps():
    # KDA, MLA, DSA, dense and MoE layers; all 16 experts routed (see the Inductor test).
    cfg = preset("mixed-small", n_routed_experts=16)
    model = build_model(cfg, seed=5)
    cache = KimiCache.allocate(cfg, num_slots=5, num_blocks=20, block_size=4, seed=6)
    step_cache = cache.clone()
    B, L = 3, 5
    prompts = torch.randint(0, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(7))
    pre_batch, step_batch = RequestBatch(cache, B, seed=8), RequestBatch(step_cache, B, seed=8)
    last = model.prefill(prompts, pre_batch, cache)
    with torch.no_grad():
        for i in range(L):
            before_last = step_cache.snapshot()
            logits = model.step(prompts[:, i].contiguous(), step_batch.step(1), step_cache)
    assert torch.equal(pre_batch.lens, step_batch.lens)
    assert last.shape == (B, cfg.vocab_size)
    # Prefill runs the same per-token math as L decode steps, but FP32 GEMMs over B*L rows
    # instead of B (router, experts, absorbed query) round differently by an ulp now and then,
    # which BF16 rounding can expose: logits to 0.1 abs + 2e-2 rel (a few BF16 ulps at |x| <= 4).
    torch.testing.assert_close(last, logits, atol=0.1, rtol=2e-2)
    after = cache.snapshot()
    init = KimiCache.allocate(cfg, num_slots=5, num_blocks=20, block_size=4, seed=6).snapshot()
    bad = _written_disagreement(after, step_cache.snapshot(), init)
    assert not bad, f"prefill vs decode steps: {bad}"
    # The prefill really wrote the prompt: every cache moved from its initial values.
    assert all(not same_bits(after[k], init[k]) for k in after)
    # The bound can fail: the caches before the last decode step lack one token's writes.
    missed = _written_disagreement(after, before_last, init)
    print("prefill vs decode, the last token's writes missing:", missed)
    assert len(missed) == len(after), missed  # every cache tensor


def test_pooled_caches_equal_plain():
    # One layer of each attention kind (KDA, DSA, MLA) in three layers, to keep compiles short.
    cfg = preset("mixed-small", num_layers=3, n_routed_experts=16).replace(kda_layers=(1,), dsa_layers=(1,))
    assert [cfg.layer_kind(i) for i in range(3)] == ["kda", "dsa", "mla"]
    model = build_model(cfg, seed=9)
    kw = dict(num_slots=5, num_blocks=20, block_size=4, seed=10)
    caches = {"plain": KimiCache.allocate(cfg, **kw), "pooled": KimiCache.allocate(cfg, pooled=True, **kw),
              "compiled plain": KimiCache.allocate(cfg, **kw),
              "compiled pooled": KimiCache.allocate(cfg, pooled=True, **kw)}
    _assert_snapshots_equal(caches["plain"].snapshot(), caches["pooled"].snapshot(), "initial")
    # The pooled caches really are strided views of shared pools, with a spare layer slice.
    conv = caches["pooled"].layers[0].conv_state
    assert conv._base is not None and not conv.is_contiguous()
    pools = {id(t._base): t._base for lc in caches["compiled pooled"].layers for t in lc.tensors().values()}
    assert len(pools) == 5  # conv, recurrent, kv, index keys, index scales
    spare = {k: p.select(1, 0).clone() for k, p in pools.items()}

    batches = {n: RequestBatch(c, 3, start_len=4, seed=11) for n, c in caches.items()}
    compiled = torch.compile(model, backend="kimi_dep", dynamic=False)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for q, acc in [(1, None), (2, [2, 1, 2]), (1, None)]:
            ids = _ids(cfg, 3 * q, g)
            out = {n: model.step(ids, batches[n].step(q, acc), c, fn=compiled if n.startswith("compiled") else None)
                   for n, c in caches.items()}
            # Views change nothing: the same kernels on the same values, bit-exact (eager with
            # eager, and one compiled graph with its recompile for the views' strides).
            assert torch.equal(out["plain"], out["pooled"])
            assert torch.equal(out["compiled plain"], out["compiled pooled"])
            assert dep_compile.last_report().num_rewritten == 4  # KDA, DSA, 2 MoE; MLA stays stock
    snaps = {n: c.snapshot() for n, c in caches.items()}
    _assert_snapshots_equal(snaps["plain"], snaps["pooled"], "eager: pooled vs plain")
    _assert_snapshots_equal(snaps["compiled plain"], snaps["compiled pooled"], "kimi_dep+Inductor: pooled vs plain")
    # Writes went through the views into the pools; the spare slice nobody owns is untouched.
    for k, p in pools.items():
        assert same_bits(p.select(1, 0), spare[k])
    assert not same_bits(snaps["pooled"]["layer.0.recurrent_state"],
                         KimiCache.allocate(cfg, **kw).layers[0].recurrent_state)


# ---------------------------------------------------------------------------------------------
# vLLM parameter names
# ---------------------------------------------------------------------------------------------


def _expected_names(c, layer: int, kind: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """vLLM K3 names and shapes of one layer, from docs/design.md §2 (with the config's sizes)."""
    p = f"model.layers.{layer}."
    H, D, F_ = c.kda_heads, c.kda_head_dim, c.kda_f_rank
    Hm, hid = c.mla_heads, c.hidden_size
    t: dict[str, tuple[int, ...]] = {}
    if kind == "kda":
        t.update({
            "self_attn.in_proj_qkvgfab.weight": (4 * H * D + F_ + H, hid),  # q,k,v,g | f_a | beta
            "self_attn.f_b_proj.weight": (H * D, F_),
            "self_attn.conv1d.weight": (3 * H * D, 1, c.kda_conv_width),  # depthwise over q,k,v
            "self_attn.A_log": (H,),
            "self_attn.dt_bias": (H * D,),
            "self_attn.o_norm.weight": (D,),
            "self_attn.o_proj.weight": (hid, H * D),
        })
    else:
        t.update({
            # q_a | kv_a (kv_lora + rope) | gate (H * v)
            "self_attn.fused_qkv_a_g_proj.weight": (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_dim + Hm * c.v_head_dim,
                                                    hid),
            "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
            "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
            "self_attn.q_b_proj.weight": (Hm * (c.qk_nope_dim + c.qk_rope_dim), c.q_lora_rank),
            "self_attn.kv_b_proj.weight": (Hm * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank),
            "self_attn.o_proj.weight": (hid, Hm * c.v_head_dim),
        })
        if kind == "dsa":
            t.update({
                "self_attn.indexer.wq_b.weight": (c.index_heads * c.index_head_dim, c.q_lora_rank),
                "self_attn.indexer.wk.weight": (c.index_head_dim, hid),
                "self_attn.indexer.weights_proj.weight": (c.index_heads, hid),
                "self_attn.indexer.k_norm.weight": (c.index_head_dim,),
                "self_attn.indexer.k_norm.bias": (c.index_head_dim,),
            })
    if moe:
        E, Lat, I, SI = c.n_routed_experts, c.moe_latent_size, c.moe_intermediate, c.shared_intermediate
        t.update({
            "mlp.gate.weight": (E, hid),
            "mlp.gate.e_score_correction_bias": (E,),
            "mlp.routed_expert_down_proj.weight": (Lat, hid),
            **({"mlp.experts.w13_weight_packed": (E, 2 * I, Lat // 2), "mlp.experts.w13_weight_scale": (E, 2 * I, Lat // 32),
                "mlp.experts.w2_weight_packed": (E, Lat, I // 2), "mlp.experts.w2_weight_scale": (E, Lat, I // 32)}
               if c.experts_format == "mxfp4" else {"mlp.experts.w13_weight": (E, 2 * I, Lat),
                                                    "mlp.experts.w2_weight": (E, Lat, I)}),
            "mlp.routed_expert_norm.weight": (Lat,),
            "mlp.routed_expert_up_proj.weight": (hid, Lat),
            "mlp.shared_experts.gate_up_proj.weight": (2 * SI, hid),
            "mlp.shared_experts.down_proj.weight": (hid, SI),
        })
    else:
        t.update({"mlp.gate_up_proj.weight": (2 * c.dense_intermediate, hid),
                  "mlp.down_proj.weight": (hid, c.dense_intermediate)})
    t.update({"input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,)})
    return {p + k: v for k, v in t.items()}


def _model_names(c) -> dict[str, tuple[int, ...]]:
    names = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,),
             "lm_head.weight": (c.vocab_size, c.hidden_size)}
    kinds_seen = set()
    for i in range(c.num_layers):  # one layer of each (kind, MoE) combination
        key = (c.layer_kind(i), c.is_moe(i))
        if key not in kinds_seen:
            kinds_seen.add(key)
            names.update(_expected_names(c, i, *key))
    return names


def test_full_size_vllm_names_and_shapes():
    """At full size (on the meta device), the literal numbers of docs/design.md §2."""
    for name, full_layer in (("k3", "mla"), ("k31", "dsa")):
        c = preset(name)
        assert c.layer_kind(3) == full_layer and c.layer_kind(0) == c.layer_kind(1) == "kda"
        with torch.device("meta"):
            sd = {k: tuple(v.shape) for k, v in KimiK3ForCausalLM(c).state_dict().items()}
        L0, L3 = "model.layers.0.", "model.layers.3."
        assert sd[L0 + "self_attn.in_proj_qkvgfab.weight"] == (49376, 7168)
        assert sd[L0 + "self_attn.f_b_proj.weight"] == (12288, 128)
        assert sd[L0 + "self_attn.o_proj.weight"] == (7168, 12288)
        assert sd[L0 + "mlp.gate_up_proj.weight"] == (2 * 33792, 7168)  # layer 0: dense MLP
        assert sd[L3 + "self_attn.fused_qkv_a_g_proj.weight"] == (14400, 7168)
        assert sd[L3 + "self_attn.q_b_proj.weight"] == (96 * 192, 1536)
        assert sd[L3 + "self_attn.o_proj.weight"] == (7168, 12288)
        # the experts as K3 ships them: MXFP4 codes two a byte, one E8M0 scale per 32 inputs
        assert sd[L3 + "mlp.experts.w13_weight_packed"] == (896, 2 * 3072, 3584 // 2)
        assert sd[L3 + "mlp.experts.w13_weight_scale"] == (896, 2 * 3072, 3584 // 32)
        assert sd[L3 + "mlp.experts.w2_weight_packed"] == (896, 3584, 3072 // 2)
        assert sd[L3 + "mlp.experts.w2_weight_scale"] == (896, 3584, 3072 // 32)
        assert sd[L3 + "mlp.gate.e_score_correction_bias"] == (896,)
        assert sd[L3 + "mlp.routed_expert_down_proj.weight"] == (3584, 7168)
        assert sd[L3 + "mlp.shared_experts.gate_up_proj.weight"] == (12288, 7168)
        assert sd[L3 + "mlp.shared_experts.down_proj.weight"] == (7168, 6144)
        if full_layer == "dsa":
            assert sd[L3 + "self_attn.indexer.wq_b.weight"] == (32 * 128, 1536)
            assert sd[L3 + "self_attn.indexer.wk.weight"] == (128, 7168)
            assert sd[L3 + "self_attn.indexer.weights_proj.weight"] == (32, 7168)
            assert c.dsa_packed_rows == 14560
        else:
            assert not any(".indexer." in k for k in sd)
        for k, shape in _model_names(c).items():
            assert sd.get(k) == shape, (k, sd.get(k), shape)
        assert sum(".mlp.gate_up_proj." in k for k in sd) == 1  # only layer 0 is dense
        assert sum(k.endswith(".experts.w13_weight_packed") for k in sd) == 92
        with torch.device("meta"):
            bf16 = KimiK3ForCausalLM(c.replace(experts_format="bf16")).state_dict()
        assert tuple(bf16[L3 + "mlp.experts.w13_weight"].shape) == (896, 2 * 3072, 3584)
        assert tuple(bf16[L3 + "mlp.experts.w2_weight"].shape) == (896, 3584, 3072)


def test_synthetic_vllm_state_dict_loads_strict():
    cfg = preset("mixed-small")  # layer 3 DSA, layer 7 MLA, KDA elsewhere; layer 0 dense
    assert {cfg.layer_kind(i) for i in range(cfg.num_layers)} == {"kda", "mla", "dsa"}
    model = build_model(cfg, seed=13)
    table = _model_names(cfg)
    assert {k.split(".")[2] for k in table if k.startswith("model.layers.")} >= {"0", "1", "3", "7"}
    own = model.state_dict()
    for k, shape in table.items():
        assert k in own and tuple(own[k].shape) == shape, (k, tuple(own[k].shape) if k in own else None, shape)
    # Dtypes: BF16 weights; FP32 A_log, dt_bias and router bias (docs/design.md §2 numerics).
    fp32 = {k for k, v in own.items() if v.dtype == torch.float32}
    assert fp32 == {k for k in own if k.endswith(("A_log", "dt_bias", "e_score_correction_bias"))}

    # A checkpoint with exactly these names and shapes (values from a different seed) loads
    # strictly, and every tensor lands where its name says.
    g = torch.Generator().manual_seed(14)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.1 + 0.5).to(v.dtype) for k, v in own.items()}
    model.load_state_dict(sd, strict=True)
    after = model.state_dict()
    assert all(torch.equal(after[k], sd[k]) for k in sd)
    # Strictness is real: a missing or a renamed key is refused.
    missing = dict(sd)
    missing.pop("model.layers.1.mlp.experts.w13_weight")
    with pytest.raises(RuntimeError, match="w13_weight"):
        model.load_state_dict(missing, strict=True)
    renamed = dict(sd)
    old_name = "model.layers.0.self_attn.in_proj_qkvgfab.weight"
    renamed["model.layers.0.self_attn.in_proj_qkvgf.weight"] = renamed.pop(old_name)
    with pytest.raises(RuntimeError, match="in_proj_qkvgf"):
        model.load_state_dict(renamed, strict=True)


# ---------------------------------------------------------------------------------------------
# Malformed steps
# ---------------------------------------------------------------------------------------------


def _bad_cases(cfg, ids, meta, cache):
    B, q = meta.num_requests, meta.q_len
    r = dataclasses.replace
    n_slots = cache.num_blocks * cache.block_size
    bad_slots = meta.slot_mapping.clone()
    bad_slots[1] = n_slots
    neg_slots = meta.slot_mapping.clone()
    neg_slots[0] = -2
    bad_state = meta.state_indices.clone()
    bad_state[2] = cache.num_slots
    neg_state = meta.state_indices.clone()
    neg_state[0] = -2
    bt = meta.block_table.clone()
    bt[0, 0] = cache.num_blocks
    vocab = ids.clone()
    vocab[0] = cfg.vocab_size
    return {
        "input_ids float": (ids.float(), meta, "input_ids"),
        "input_ids shape": (torch.cat([ids, ids[:1]]), meta, "input_ids"),
        "input_ids 2-d": (ids.view(B, q), meta, "input_ids"),
        "input_ids vocab": (vocab, meta, "input_ids"),
        "q_len not int": (ids, r(meta, q_len=float(q)), "q_len"),
        "slot out of range": (ids, r(meta, slot_mapping=bad_slots), "slot_mapping"),
        "slot below -1": (ids, r(meta, slot_mapping=neg_slots), "slot_mapping"),
        "slot dtype": (ids, r(meta, slot_mapping=meta.slot_mapping.float()), "slot_mapping"),
        "state out of range": (ids, r(meta, state_indices=bad_state), "state_indices"),
        "state below -1": (ids, r(meta, state_indices=neg_state), "state_indices"),
        "state shape": (ids, r(meta, state_indices=meta.state_indices[:-1]), "state_indices"),
        "accepted > q_len": (ids, r(meta, accepted=meta.accepted + 1), "accepted"),
        "accepted 0": (ids, r(meta, accepted=meta.accepted * 0), "accepted"),
        "seq_lens < q_len": (ids, r(meta, seq_lens=meta.seq_lens * 0 + q - 1), "seq_lens"),
        "block_table range": (ids, r(meta, block_table=bt), "block_table"),
        "block_table 1-d": (ids, r(meta, block_table=meta.block_table[:, 0]), "block_table"),
    }


@pytest.mark.parametrize("q", [1, 2])
def test_bad_step_inputs_raise_before_any_cache_is_touched(q):
    cfg = preset("mixed-small", num_layers=4)
    model = build_model(cfg, seed=15)
    cache = KimiCache.allocate(cfg, num_slots=5, num_blocks=16, block_size=4, seed=16)
    meta = RequestBatch(cache, 3, start_len=3, seed=17).step(q, [q] * 3)
    ids = _ids(cfg, 3 * q, torch.Generator().manual_seed(18))
    before = cache.snapshot()
    with torch.no_grad():
        for case, (bad_ids, bad_meta, field) in _bad_cases(cfg, ids, meta, cache).items():
            with pytest.raises(StepError, match=field):
                model.step(bad_ids, bad_meta, cache)
            _assert_snapshots_equal(before, cache.snapshot(), f"after refused step {case!r}")
        assert issubclass(StepError, ValueError)
        # The unmodified step is accepted and does write the caches.
        model.step(ids, meta, cache)
    assert any(not same_bits(v, before[k]) for k, v in cache.snapshot().items())
