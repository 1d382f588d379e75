"""The DSA probe's top-k selection is decisive (issue #29): rounding cannot refuse a correct layer, a wrong
causal offset is still refused.

The probe compares outputs; on random latent rows the sparse MLA's output is a near-cancelling mean of the
top-k rows, so one position selected differently moves it by percents. With random index keys a BF16 ulp of
the index query (the H200's kernels round it apart from stock's) reorders near-tied index logits: a correct
rewrite stayed stock at 1 request x 4 tokens (H200: output max 0.0255, RMS 0.0133 against 2^-7). The probe's
index keys now rank every cached position by construction (``passes.dsa.decisive_index``).

CPU (k31-small, 1 request x 4 tokens): the replacement's indexer given its query and head weights one
BF16 ulp apart in every element is rewritten, bit-exact (the old probe refused it: output max 0.248, RMS
0.211); its indexer with ``seq_lens - 1`` (each verify token misses its own position) is refused. CUDA (full
K3.1 width, 1 request x 4 tokens, 4K context): the layer is rewritten on its Triton kernels, and the same
causal mutant in the Triton logits kernel is refused.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dep_compile
import dep_compile.ops.dsa as dsa_ops
from dep_compile.stock import preset

from helpers import run_pair, step_toward_zero

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_attention as ba  # noqa: E402

CFG = preset("k31-small", num_layers=4)


def _replacement_indexer(monkeypatch, change):
    """The DSA replacement's stock indexer (not the stock layer's) called with ``change(args)``."""
    real = dsa_ops.stock_ops
    monkeypatch.setattr(dsa_ops, "stock_ops", SimpleNamespace(
        dsa_indexer=lambda *args: real.dsa_indexer(*change(list(args))),
        sparse_mla_decode=real.sparse_mla_decode, sparse_mla_decode_fp8=real.sparse_mla_decode_fp8))


def _ulp_apart(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """BF16 ``t`` with every element one ulp up or down: another summation order's rounding, at its worst."""
    step = torch.randint(0, 2, t.shape, generator=g, dtype=torch.int16) * 2 - 1
    return (t.contiguous().view(torch.int16) + step).view(torch.bfloat16)


def test_index_query_rounding_does_not_refuse(monkeypatch):
    g = torch.Generator().manual_seed(0)
    _replacement_indexer(monkeypatch, lambda a: [_ulp_apart(a[0], g), _ulp_apart(a[1], g), *a[2:]])
    r = run_pair(CFG, steps=1, batch=1, q=4)
    dsa = r.report.rewritten("dsa")
    assert len(dsa) == 1 and "max 0.00e+00" in dsa[0].validation, r.report.table()


def test_wrong_causal_offset_is_refused(monkeypatch):
    _replacement_indexer(monkeypatch, lambda a: [*a[:7], a[7] - 1, *a[8:]])  # seq_lens - 1
    r = run_pair(CFG, steps=1, batch=1, q=4)
    bad = r.report.stock("dsa")
    assert len(bad) == 1 and bad[0].check == "semantic", r.report.table()


def _moved_toward_zero(index_cache: torch.Tensor, slots: torch.Tensor, codes: int | None) -> None:
    """Move the written index codes (of the rows in ``slots``) one e4m3 step toward zero: the first ``codes``
    nonzero ones, or all of them (None): a rounding flip, or a quantizer that truncates."""
    flat = index_cache.view(-1, index_cache.shape[-1])
    written = slots[slots >= 0].long()
    rows = flat[written]  # [T, Di]
    where = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    if codes is not None:
        nonzero = (rows.view(torch.uint8) & 0x7F) > 0
        where = nonzero.flatten().cumsum(0).view(nonzero.shape) <= codes
    flat[written] = step_toward_zero(rows, where)


def _written_codes_moved(monkeypatch, codes: int | None):
    """The replacement's indexer, its keys inserted, with ``codes`` written index codes moved a step."""
    real = dsa_ops.stock_ops

    def indexer(*args):
        out = real.dsa_indexer(*args)
        _moved_toward_zero(args[3], args[5], codes)
        return out
    monkeypatch.setattr(dsa_ops, "stock_ops", SimpleNamespace(
        dsa_indexer=indexer, sparse_mla_decode=real.sparse_mla_decode,
        sparse_mla_decode_fp8=real.sparse_mla_decode_fp8))


def test_one_index_code_a_step_off_is_rounding(monkeypatch):
    """A fused key insert whose LayerNorm is a BF16 ulp off stock's at an e4m3 rounding boundary moves a code
    one step (2^-3 of it): the H200's 64-token probe saw 0.0357 of the largest code and left the layer stock."""
    _written_codes_moved(monkeypatch, 1)
    r = run_pair(CFG, steps=1, batch=4, q=1)
    dsa = r.report.rewritten("dsa")
    moved = re.search(r"index_keys ([\d.]+) step at", dsa[0].validation) if len(dsa) == 1 else None
    assert moved and 0 < float(moved.group(1)) <= 1, r.report.table()  # a small code: below one step by the floor


def test_truncating_key_quantizer_is_refused(monkeypatch):
    """Every written code a step toward zero is no rounding, however small beside the cache's largest keys."""
    _written_codes_moved(monkeypatch, None)
    r = run_pair(CFG, steps=1, batch=4, q=1)
    bad = r.report.stock("dsa")
    assert len(bad) == 1 and bad[0].check == "semantic" and "index_keys max 1 steps" in bad[0].reason, \
        r.report.table()


def _compile_full_size_step(rows: int = 1, q: int = 4):
    """kimi_dep's report for a full-width K3.1 DSA layer compiled at ``rows`` requests x ``q`` tokens, 4K
    context."""
    torch._dynamo.reset()
    cfg = preset("k31")
    block = ba.build_block(cfg, "dsa", device="cuda", seed=0)
    step = ba.make_step(cfg, "dsa", rows, q, 4096, block_size=64, device="cuda", seed=1)
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False, options={"inductor": False})
    with torch.no_grad():
        ba.run_once(dep, step)
    return dep_compile.last_report()


@pytest.mark.cuda
def test_full_size_verify_step_rewritten_cuda():
    rep = _compile_full_size_step()
    dsa = rep.rewritten("dsa")
    print(dsa[0].validation if dsa else rep.table())
    assert len(dsa) == 1, rep.table()


@pytest.mark.cuda
@pytest.mark.parametrize("q", [1, 2, 4])
def test_full_size_64_requests_rewritten_cuda(q):
    """64 requests write 8192-32768 index codes; the fused key insert moves a few a step (the probe refused the
    layer at q = 1 when it bounded codes as values against the largest), and at q = 2 / 4 near-zero codes several
    fine steps (refused before codes had the row-ulp floor, 2026-12-03)."""
    rep = _compile_full_size_step(64, q)
    dsa = rep.rewritten("dsa")
    print(dsa[0].validation if dsa else rep.table())
    assert len(dsa) == 1, rep.table()


@pytest.mark.cuda
def test_full_size_wrong_causal_offset_refused_cuda(monkeypatch):
    from dep_compile.ops import dsa_triton  # noqa: PLC0415 - imports Triton

    real = dsa_triton.index_logits
    monkeypatch.setattr(dsa_triton, "index_logits",
                        lambda q, w, ic, isc, bt, seq, *rest, **kw: real(q, w, ic, isc, bt, seq - 1, *rest, **kw))
    rep = _compile_full_size_step()
    bad = rep.stock("dsa")
    print(bad[0].reason if bad else rep.table())
    assert len(bad) == 1 and bad[0].check == "semantic", rep.table()
