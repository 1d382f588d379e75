"""Keyword spellings: the whole stock decoder with every call in DSA / KDA / MoE / router written with keyword
arguments (``F.linear(input=, weight=)``, ``F.layer_norm(input=, normalized_shape=, weight=, bias=, eps=)``,
``F.rms_norm(input=, ...)``, ``torch.cat(tensors=, dim=)``, ``torch.split(tensor=, split_size_or_sections=,
dim=)``, ``torch.sigmoid(input=)``, ``torch.topk(input=, k=, dim=)``, ``torch.gather(input=, dim=, index=)``,
the ``kimi_k3`` ops with keywords too): the same math, so every DSA / KDA / MoE layer must be rewritten and
exact, and nothing may raise.

The keyword modules are near_miss_variants.KwKDA / KwDSA / KwRouter / KwMoE (+ KwExperts) / KwShared.
"""

from __future__ import annotations

import pytest

from dep_compile.stock import build_model, preset

from near_miss_variants import (BASE_RUN, KEYWORD_SPELLINGS, check_report, compile_and_compare, eager_outputs,
                                same_outputs)

# which slots get their keyword spelling: one kind at a time (to name the culprit), then all at once
GROUPS = {
    "kda": ("attn_kda",),
    "dsa": ("attn_dsa",),
    "router": ("gate",),
    "moe": ("mlp", "shared"),
    "all": ("attn_kda", "attn_dsa", "gate", "mlp", "shared"),
}


def keyword_model(cfg, slots):
    """A stock decoder (seed 1) with the keyword spelling on every layer of each slot; returns (model, rows)."""
    model = build_model(cfg, seed=1)
    rows = {}
    for slot in slots:
        v = KEYWORD_SPELLINGS[slot]
        for layer in v.layers(cfg):
            v.apply(model, cfg, layer)
            rows[(layer, v.row_kind)] = "rewrite"
    return model, rows


@pytest.mark.parametrize("group", list(GROUPS))
def test_keyword_spellings_rewritten_and_exact(group):
    cfg = preset("k31-small", num_layers=4)
    model, rows = keyword_model(cfg, GROUPS[group])
    # the catalogue's claim: the keyword decoder computes exactly what stock does
    assert same_outputs(eager_outputs(cfg, model, steps=1, batch=2, start_len=24),
                        eager_outputs(cfg, build_model(cfg, seed=1), steps=1, batch=2, start_len=24))
    r = compile_and_compare(f"keyword spellings ({group})", cfg, model, BASE_RUN)
    check_report(f"keyword spellings ({group})", rows, r)
    assert len(r.report.rewritten()) == 3 + 1 + 3, r.report.table()


@pytest.mark.parametrize("name", ["k31-small", "mixed-small"])
def test_keyword_decoder_verify_steps(name):
    """Every kind at once on verify steps (q = 2, some tokens rejected); mixed-small at 8 layers keeps an MLA layer."""
    cfg = preset(name, num_layers=4 if name == "k31-small" else 8)
    model, rows = keyword_model(cfg, GROUPS["all"])
    r = compile_and_compare(f"keyword decoder {name} q=2", cfg, model,
                            {**BASE_RUN, "q": 2, "accepted": lambda i, b: [1 + (i + j) % 2 for j in range(b)]})
    check_report(f"keyword decoder {name} q=2", rows, r)
    assert r.report.rewritten("mla") == []
