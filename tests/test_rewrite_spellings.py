"""Spelling variants: the same layers with their glue written other ways still match; packing is zero-copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dep_compile.stock import KimiCache, RequestBatch, build_model, preset

from helpers import CUBLAS_ONLY, assert_agrees, run_pair


class MatmulT(nn.Module):
    """``x @ W.t()`` in place of F.linear."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight.t()


class MmTranspose(MatmulT):
    """``torch.mm(x, W.transpose(0, 1))``."""

    def forward(self, x):
        return torch.mm(x, self.weight.transpose(0, 1))


class MatmulPermute(MatmulT):
    """``torch.matmul(x, W.permute(1, 0))``."""

    def forward(self, x):
        return torch.matmul(x, self.weight.permute(1, 0))


def respell(model, cls):
    """Replace every nn.Linear (keeping its parameter name ``weight``) by ``cls``."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child_name != "lm_head":
                setattr(mod, child_name, cls(child.weight))
    return model


@pytest.mark.parametrize("cls", [MatmulT, MmTranspose, MatmulPermute])
def test_linear_spellings_match(cls):
    cfg = preset("mixed-small", num_layers=4)
    model = respell(build_model(cfg, seed=1), cls)
    # the respelled stock GEMMs (matmul of a transpose, mm, permute) need not round as the rewrite's
    # F.linear does: decisive routing and multi-step agreement (tests/helpers.agreement_failures)
    r = run_pair(cfg, steps=4, batch=2, q=2, model=model, decisive=True)
    assert len(r.report.rewritten()) == 3 + 1 + 3, r.report.table()
    assert_agrees(r, f"linear spelled {cls.__name__}")


def test_merged_indexer_projection_matches():
    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg, seed=1, merged_indexer=True)
    assert hasattr(model.model.layers[3].self_attn.indexer, "wk_weights_proj")
    r = run_pair(cfg, steps=4, batch=2, model=model)
    assert len(r.report.rewritten("dsa")) == 1
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def _storage_bytes(model):
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_packing_is_zero_copy_and_sees_weight_updates():
    cfg = preset("k31-small", num_layers=4)
    model = build_model(cfg, seed=1)
    before = _storage_bytes(model)
    attn = model.model.layers[3].self_attn
    r = run_pair(cfg, steps=2, batch=2, model=model)
    assert len(r.report.rewritten("dsa")) == 1
    # the fused a-proj and the indexer's wk / weights_proj are now row slices of one packed tensor
    fused, wk, wp = attn.fused_qkv_a_g_proj.weight, attn.indexer.wk.weight, attn.indexer.weights_proj.weight
    assert fused.untyped_storage().data_ptr() == wk.untyped_storage().data_ptr() == wp.untyped_storage().data_ptr()
    assert wk.storage_offset() == fused.numel() and wp.storage_offset() == fused.numel() + wk.numel()
    mlp = model.model.layers[1].mlp
    assert mlp.shared_experts.gate_up_proj.weight.untyped_storage().data_ptr() == \
        mlp.routed_expert_down_proj.weight.untyped_storage().data_ptr()
    # no second copy of any weight: parameter storage bytes unchanged
    assert _storage_bytes(model) == before
    # an in-place weight update is seen by the compiled graph (same storage), with no recompile
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    compiled = torch.compile(model, backend="kimi_dep", options={"inductor": False, **CUBLAS_ONLY}, fullgraph=True)
    ids = torch.randint(0, cfg.vocab_size, (2,))
    with torch.no_grad():
        c1, c2 = cache.clone(), cache.clone()
        meta = RequestBatch(c1, 2, start_len=5).step(1)
        out0 = compiled(ids, meta, c1)
        fused.mul_(-1.0)  # (wk alone would not move logits: short contexts select every token)
        out1 = compiled(ids, meta, c2)
        ref1 = model(ids, meta, cache.clone())
    assert not torch.equal(out0, out1)
    torch.testing.assert_close(out1, ref1, atol=0, rtol=0)
