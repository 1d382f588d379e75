"""The DSA sparse-MLA seam (``dep_compile.ops.sparse_mla``): which kernel it picks and why, and
how it hands a step to FlashInfer.

FlashInfer's sparse MLA runs on SM 10.x only and is not installed here, so the FlashInfer path is
checked against a stand-in module that implements the contract FlashInfer documents for
``trtllm_batch_decode_with_kv_cache_mla`` with ``sparse_mla_top_k > 0`` and refuses any argument
outside it. The stand-in is exact FP32 softmax attention, so the adapter's output (heads padded
to 128 and dropped, selected cache rows, valid counts, padding tokens zeroed) must match the
reference latent attention to BF16 output rounding: max abs <= 1e-2 on outputs of O(0.1).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from dep_compile.config import DepOptions
from dep_compile.ops import registry
from dep_compile.ops import sparse_mla as sm
from dep_compile.ops.dsa import PreparedDsa
from dep_compile.stock import preset
from dep_compile.stock.reference.mla import attend_latent, gather_context, token_positions

from helpers import run_pair

H, L, R, NOPE, BS, TOPK = 96, 512, 64, 128, 64, 256  # K3 heads and dims; a smaller top-k (any works)


def _stand_in(calls: list):
    """A ``flashinfer`` package whose ``mla.trtllm_batch_decode_with_kv_cache_mla`` checks the
    documented sparse contract and computes it in FP32 (NaN for a token with no valid row: what
    the real kernel does there is not documented)."""

    def decode(*, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
               block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
               **rest):
        calls.append(dict(heads=query.shape[2], top_k=sparse_mla_top_k, rest=rest))
        B, q, heads, D = query.shape
        assert (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) in ((128, 512, 64), (192, 512, 64))
        assert D == kv_lora_rank + qk_rope_head_dim and query.dtype == torch.bfloat16 and heads == 128
        assert kv_cache.dim() == 4 and kv_cache.shape[1] == 1 and kv_cache.shape[3] == D
        assert kv_cache.shape[2] in (32, 64) and kv_cache.dtype == torch.bfloat16
        assert sparse_mla_top_k > 0 and block_tables.shape == (B, q, sparse_mla_top_k)
        assert block_tables.dtype == torch.int32 and seq_lens.shape == (B,) and seq_lens.dtype == torch.int32
        assert max_seq_len >= int(seq_lens.max()) and bmm2_scale == 1.0
        assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() >= 128 << 20
        flat = kv_cache.reshape(-1, D).float()  # cache rows, page * page_size + offset
        o = torch.full((B, q, heads, kv_lora_rank), float("nan"))
        for b in range(B):
            n = int(seq_lens[b])
            rows = block_tables[b, 0, :n].long()
            assert (rows >= 0).all() and (rows < flat.shape[0]).all(), "a valid entry is not a cache row"
            if n:
                p = torch.softmax(query[b, 0].float() @ flat[rows].t() * bmm1_scale, -1)
                o[b, 0] = p @ flat[rows, :kv_lora_rank] * bmm2_scale
        return o.to(torch.bfloat16)

    pkg = types.ModuleType("flashinfer")
    pkg.mla = types.ModuleType("flashinfer.mla")
    pkg.mla.trtllm_batch_decode_with_kv_cache_mla = decode
    return pkg


@pytest.fixture
def flashinfer(monkeypatch):
    """The stand-in installed as ``flashinfer``; yields the list of its calls."""
    calls: list = []
    pkg = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", pkg.mla)
    monkeypatch.setattr(sm, "_CHOSEN", {})
    monkeypatch.setattr(sm, "_WORKSPACE", {})
    yield calls


def _cache(block_size=BS, dtype=torch.bfloat16, dims=(L, R)):
    return torch.randn(8, block_size, sum(dims)).to(dtype)


def test_reasons_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    monkeypatch.setitem(sys.modules, "flashinfer.mla", None)  # also where an earlier import (vLLM's) left it loaded
    why = sm.flashinfer_unsupported(_cache(), heads=H, kv_lora=L, nope=NOPE, capability=(10, 0))
    assert why.startswith("flashinfer does not import"), why


@pytest.mark.parametrize("capability, cache, heads, nope, want", [
    ((10, 0), _cache(), H, NOPE, None),
    ((10, 3), _cache(32), 128, 192, None),
    ((9, 0), _cache(), H, NOPE, "SM90"),
    ((12, 0), _cache(), H, NOPE, "SM120"),
    ((10, 0), _cache(dims=(L, 128)), H, NOPE, "rope 128"),
    ((10, 0), _cache(), H, 64, "q_nope 64"),
    ((10, 0), _cache(), 192, NOPE, "192 heads"),
    ((10, 0), _cache(16), H, NOPE, "pages of 16"),
    ((10, 0), _cache(dtype=torch.float16), H, NOPE, "contiguous BF16"),
    ((10, 0), torch.randn(8, BS, 2, L + R).to(torch.bfloat16)[:, :, 1], H, NOPE, "contiguous BF16"),
])
def test_reasons_with_flashinfer(flashinfer, capability, cache, heads, nope, want):
    why = sm.flashinfer_unsupported(cache, heads=heads, kv_lora=L, nope=nope, capability=capability)
    assert (why is None) if want is None else (want in why), why


def test_choice_is_logged_and_forced_flashinfer_fails_clearly(flashinfer, caplog):
    cache = _cache()  # on CPU: FlashInfer cannot run
    with caplog.at_level(logging.INFO, logger=sm.__name__):
        assert sm.choose_sparse_mla("auto", cache, heads=H, kv_lora=L, nope=NOPE) == "triton"
        assert sm.choose_sparse_mla("triton", cache, heads=H, kv_lora=L, nope=NOPE) == "triton"
    assert "triton kernel (FlashInfer: not on CUDA)" in caplog.text
    with pytest.raises(RuntimeError, match="sparse_mla='flashinfer' cannot run on cpu: not on CUDA"):
        sm.choose_sparse_mla("flashinfer", cache, heads=H, kv_lora=L, nope=NOPE)


def test_auto_picks_flashinfer_where_it_runs(flashinfer, monkeypatch):
    real = sm.flashinfer_unsupported
    monkeypatch.setattr(sm, "flashinfer_unsupported", lambda c, **k: real(c, capability=(10, 0), **k))
    assert sm.choose_sparse_mla("auto", _cache(), heads=H, kv_lora=L, nope=NOPE) == "flashinfer"
    assert sm.choose_sparse_mla("triton", _cache(), heads=H, kv_lora=L, nope=NOPE) == "triton"


@pytest.mark.parametrize("q_len", [1, 3])
def test_flashinfer_adapter_matches_reference(flashinfer, q_len):
    """Three requests (context shorter than top-k, longer, much longer), one padding token, and
    tokens with fewer selected rows than they see; the output [T, 96, 512] vs the reference."""
    g = torch.Generator().manual_seed(q_len)
    seq = [TOPK // 2 + q_len, TOPK + 3 * BS + q_len, 3 * TOPK]
    B, MB = len(seq), max(-(-s // BS) for s in seq)
    block_table = torch.randperm(B * MB + 2, generator=g)[: B * MB].view(B, MB).to(torch.int32)
    kv_cache = (torch.randn(B * MB + 2, BS, L + R, generator=g) * 0.5).to(torch.bfloat16)
    T = B * q_len
    pos = token_positions(torch.tensor(seq), q_len)
    slots = block_table.long()[torch.arange(T) // q_len, pos // BS] * BS + pos % BS
    slots[T - 1] = -1  # a padding token
    query = (torch.randn(T, H, L + R, generator=g) * 0.2).to(torch.bfloat16)
    selected = torch.full((T, TOPK), -1, dtype=torch.int32)  # positions, ascending, -1 padded
    for t in range(T - 1):
        n = int(pos[t]) + 1
        k = min(n, TOPK) - (t % 2) * 5
        selected[t, :k] = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    req = torch.arange(T)[:, None] // q_len
    sel = selected.clamp_min(0).long()
    rows = torch.where(selected >= 0, block_table.long()[req, sel // BS] * BS + sel % BS, -1).to(torch.int32)

    got = sm.flashinfer_sparse_mla(query, kv_cache, rows, slots, kv_lora=L, nope=NOPE, scale=192 ** -0.5)

    assert flashinfer == [dict(heads=128, top_k=TOPK, rest={})]
    assert got.shape == (T, H, L) and got.dtype == torch.bfloat16
    assert (got[T - 1] == 0).all(), "the padding token's output must be 0"
    for t in range(T - 1):
        s = selected[t][selected[t] >= 0].long()
        ref = attend_latent(query[t], gather_context(kv_cache, block_table, t // q_len, s), L, 192 ** -0.5)
        err = float((got[t].float() - ref).abs().max())
        assert err <= 1e-2, f"token {t}: max abs {err:.2e}"


def test_empty_step_calls_nothing(flashinfer):
    q = torch.empty(0, H, L + R, dtype=torch.bfloat16)
    rows = torch.empty(0, TOPK, dtype=torch.int32)
    got = sm.flashinfer_sparse_mla(q, _cache(), rows, torch.empty(0, dtype=torch.int64), kv_lora=L, nope=NOPE,
                                   scale=0.1)
    assert got.shape == (0, H, L) and flashinfer == []


def _compiled_step(option: str):
    return run_pair(preset("k31-small"), options={"sparse_mla": option}, steps=1, batch=2)


def test_option_reaches_the_prepared_layer(monkeypatch):
    """``options={"sparse_mla": ...}`` is checked, and lands on every rewritten DSA layer."""
    assert DepOptions.from_dict({}).sparse_mla == "auto"
    with pytest.raises(ValueError, match="sparse_mla"):
        DepOptions.from_dict({"sparse_mla": "flashmla"})
    monkeypatch.setattr(registry, "_PREPARED", {})
    r = _compiled_step("triton")
    dsa = [p for p in registry._PREPARED.values() if isinstance(p, PreparedDsa)]
    assert dsa and all(p.sparse_mla == "triton" for p in dsa), dsa
    assert r.logits_err == 0


def test_pass_chooses_and_reserves_the_workspace(flashinfer, monkeypatch):
    """The rewrite picks the kernel and allocates FlashInfer's workspace then (never inside a
    step, which may be a CUDA-graph warm-up or capture); forcing FlashInfer where it cannot run
    fails the compile with the reason."""
    real = sm.flashinfer_unsupported
    monkeypatch.setattr(sm, "flashinfer_unsupported", lambda c, **k: None)  # as on an SM100 at full size
    _compiled_step("auto")  # on CPU the step itself runs the stock ops' torch code
    assert set(sm._CHOSEN.values()) == {"flashinfer"}
    ws = sm._WORKSPACE[torch.device("cpu")]
    assert ws.dtype == torch.uint8 and ws.numel() == sm.FLASHINFER_WORKSPACE_BYTES and not ws.any()
    monkeypatch.setattr(sm, "flashinfer_unsupported", real)
    monkeypatch.setattr(sm, "_CHOSEN", {})
    with pytest.raises(Exception) as e:
        _compiled_step("flashinfer")
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(c, RuntimeError) and "cannot run on cpu: not on CUDA" in str(c) for c in chain), chain


@pytest.mark.cuda
def test_this_gpu_picks_by_its_capability(flashinfer):
    """On a real GPU (with the stand-in importable): FlashInfer on SM 10.x, Triton elsewhere (the
    H200), with the capability as the logged reason."""
    cache = _cache().cuda()
    major, minor = torch.cuda.get_device_capability()
    kernel = sm.choose_sparse_mla("auto", cache, heads=H, kv_lora=L, nope=NOPE)
    assert kernel == ("flashinfer" if major == 10 else "triton")
    if major != 10:
        assert f"SM{major}{minor}" in sm.flashinfer_unsupported(cache, heads=H, kv_lora=L, nope=NOPE)
