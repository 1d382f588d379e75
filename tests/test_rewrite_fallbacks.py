"""Fallbacks: layers the rewrite cannot prove it understands stay stock, with the reason, and stay correct."""

from __future__ import annotations

import pytest
import torch

from dep_compile.stock import build_model, preset

from helpers import LOGIT_ATOL, STATE_ATOL, fallback_log, run_pair


def _moe_reasons(report):
    return {m.reason for m in report.stock("moe")}


@pytest.mark.parametrize("change, reason", [
    ({"scoring_func": "softmax"}, "router scoring is softmax, not sigmoid"),
    ({"num_experts_per_tok": 8}, "top-k is 8, expected 16"),
    ({"shared_intermediate": 0}, "no shared expert"),
    ({"n_group": 4, "topk_group": 2}, "grouped top-k"),
])
def test_unsupported_moe_stays_stock(change, reason):
    cfg = preset("k31-small", num_layers=4, **change)
    r = run_pair(cfg, steps=4, batch=2)
    assert r.report.rewritten("moe") == []
    assert len(r.report.stock("moe")) == 3
    assert all(reason in m for m in _moe_reasons(r.report)), _moe_reasons(r.report)
    assert r.report.near_misses()  # reported as near misses, not policy skips
    assert len(r.report.rewritten("kda")) == 3 and len(r.report.rewritten("dsa")) == 1  # the rest still rewritten
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_fp32_model_stays_stock():
    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg, dtype=torch.float32)
    r = run_pair(cfg, steps=3, batch=2, model=model)
    assert r.report.num_rewritten == 0
    assert all("bfloat16" in m.reason for m in r.report.near_misses()), r.report.table()
    assert r.logits_err < LOGIT_ATOL and r.cache_err < STATE_ATOL


def test_prefill_shaped_step_stays_stock():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, steps=2, batch=2, q=12, start_len=0, block_size=8)
    assert r.report.rewritten("kda") == [] and r.report.rewritten("dsa") == []
    assert all("prefill-shaped step: q_len=12 > max_q=8" in m.reason
               for m in r.report.stock("kda") + r.report.stock("dsa"))
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_intermediate_with_outside_user_stays_stock():
    """A KDA whose f_a is also read elsewhere: removing the subgraph would drop that value."""
    from dep_compile.stock.attention import KimiDeltaAttention

    class Leaky(KimiDeltaAttention):
        def forward(self, x, meta, cache):
            HD = self.heads * self.head_dim
            y = self.in_proj_qkvgfab(x)
            q, k, v, g, f_a, beta = y.split([HD, HD, HD, HD, self.f_rank, self.heads], dim=-1)
            o = torch.ops.kimi_k3.kda_core(
                q, k, v, self.f_b_proj(f_a), beta, g, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias,
                self.o_norm.weight, cache.conv_state, cache.recurrent_state, meta.state_indices, meta.accepted,
                meta.q_len, self.lower_bound, self.o_norm.eps)
            return self.o_proj(o) + f_a.sum(-1, keepdim=True)  # f_a leaks out of the layer

    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg)
    layer = model.model.layers[1]
    leaky = Leaky(cfg)
    leaky.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = leaky.to(torch.bfloat16).requires_grad_(False)
    r = run_pair(cfg, steps=3, batch=2, model=model)
    bad = [m for m in r.report.stock("kda")]
    assert len(bad) == 1 and bad[0].layer == 1
    assert "outside the layer" in bad[0].reason, bad[0].reason
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_op_fallback_logged_once_per_layer_kind_and_reason(caplog):
    """A rewritten op that runs stock code says why, once per (layer kind, reason) per process."""
    from dep_compile.ops.fallbacks import log_fallback  # noqa: PLC0415

    with fallback_log() as logged, caplog.at_level("WARNING", logger="dep_compile.ops.fallbacks"):
        for layer, why in [("KDA", "q_len 9"), ("KDA", "q_len 9"), ("DSA", "q_len 9"), ("KDA", "odd strides")]:
            log_fallback(layer, why, "the stock op")
    messages = [r.getMessage() for r in caplog.records]
    assert logged == {"KDA: q_len 9", "DSA: q_len 9", "KDA: odd strides"}
    assert messages == ["kimi_dep KDA layer: Triton kernels not used (q_len 9); running the stock op",
                        "kimi_dep DSA layer: Triton kernels not used (q_len 9); running the stock op",
                        "kimi_dep KDA layer: Triton kernels not used (odd strides); running the stock op"]
