"""Near misses: a layer written another way is either left stock (with the failed check as its reason) or
rewritten and then exactly equal to eager stock; never rewritten into something that computes another thing.

Each variant of tests/near_miss_variants.py swaps one module of a ``k31-small`` decoder at 4 layers
(KDA 0-2, DSA 3, MoE 1-3) and runs the stock decoder eagerly and through ``kimi_dep`` in
pattern-only mode with cuBLAS tactics, where a correct rewrite is bit-exact on CPU: 3 steps of 2
requests, decode steps (q = 1), the KDA family verify steps (q = 2, some tokens rejected).
By default the core set (near_miss_variants.CORE, ~90 s on 2 cores); ``NEAR_MISS_ALL=1`` runs every
variant (and the KDA family on decode steps too).

Failure messages name the failure mode: ``crash`` (an exception escaped torch.compile), ``silent
wrong`` (rewritten, not exact), ``refused although expect rewrite``, ``stock but not exact``,
``no reason``, ``other layer`` (a layer the variant did not touch was not rewritten), ``catalogue``
(the variant is not what it claims: a re-spelling whose eager output differs from stock, or a
meaning change whose eager output does not).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from dep_compile.stock import build_model, preset

from near_miss_variants import (BASE_RUN, CATALOGUE, CORE, check_report, compile_and_compare, crash_message,
                                eager_outputs, same_outputs)

CFG = preset("k31-small", num_layers=4)
# the core set by default (one variant per item of the brief, < 90 s on 2 cores); NEAR_MISS_ALL=1: every variant
SELECTED = CATALOGUE if os.environ.get("NEAR_MISS_ALL") else CORE
IDS = lambda v: v.name  # noqa: E731
VERIFY = dict(q=2, accepted=lambda i, b: [1 + (i + r) % 2 for r in range(b)])  # verify steps, some tokens rejected
VERIFY_KINDS = ("kda",)  # the family that runs verify steps (q = 2) instead of decode steps (q = 1)


def _run_params(v, q: int | None = None) -> dict:
    """compare_steps' arguments for ``v``: decode steps, verify steps for the VERIFY_KINDS family (or as ``q`` says)."""
    verify = v.kind in VERIFY_KINDS if q is None else q == 2
    return {**BASE_RUN, **v.run, **(VERIFY if verify else {})}


def _key(run: dict) -> tuple:
    return tuple(sorted(run.items(), key=lambda kv: kv[0]))  # (the accepted function is one object: hashable)


@functools.lru_cache(maxsize=None)
def _stock_eager(cfg, key):
    return eager_outputs(cfg, build_model(cfg, seed=1), **dict(key))


class EagerRecorder:
    """Records the eager steps compare_steps runs on ``model`` (``model.step`` without ``fn``): their logits and
    the last eager cache, so the catalogue check needs no eager run of its own."""

    def __init__(self, model):
        self.logits, self.cache, step = [], None, model.step

        def recording_step(ids, meta, cache, fn=None):
            out = step(ids, meta, cache, fn=fn)
            if fn is None:
                self.logits.append(out)
                self.cache = cache
            return out

        model.step = recording_step  # an instance attribute: torch.compile traces forward, not step

    def outputs(self):
        return self.logits, self.cache.snapshot()


def check_catalogue_entry(v, cfg, recorded, run) -> None:
    """A "rewrite" variant is a pure re-spelling (eager bit-identical to stock); an "either" variant
    (not marked neutral) changes the eager output, else it tests nothing."""
    same = same_outputs(recorded.outputs(), _stock_eager(cfg, _key(run)))
    if v.expect == "rewrite":
        assert same, f"catalogue: {v.name} is not a pure re-spelling (its eager output differs from stock)"
    elif v.expect == "either" and not v.neutral:
        assert not same, f"catalogue: {v.name} does not change the eager output (mark it neutral or strengthen it)"


def _variant_model(v, device="cpu"):
    cfg = v.config(CFG)
    model = build_model(cfg, seed=1, device=device)
    layer = v.apply(model, cfg)
    return model, (layer, v.row_kind)


def _check_variant(v, q=None):
    model, row = _variant_model(v)
    run = _run_params(v, q)
    recorded = EagerRecorder(model)
    cfg = v.config(CFG)
    r = compile_and_compare(v.name, cfg, model, run)
    check_catalogue_entry(v, cfg, recorded, run)
    check_report(v.name, {row: v.expect}, r)


@pytest.mark.parametrize("v", SELECTED, ids=IDS)
def test_near_miss(v):
    """3 steps of 2 requests: decode steps (q = 1); the KDA family on verify steps (q = 2, tokens rejected)."""
    _check_variant(v)


@pytest.mark.skipif(not os.environ.get("NEAR_MISS_ALL"), reason="NEAR_MISS_ALL=1: the verify family on decode steps")
@pytest.mark.parametrize("v", [v for v in CATALOGUE if v.kind in VERIFY_KINDS], ids=IDS)
def test_near_miss_decode_steps_of_the_verify_family(v):
    _check_variant(v, q=1)


def test_catalogue_covers_the_brief():
    names = {v.name for v in CATALOGUE}
    assert len(CATALOGUE) >= 45
    for kind in ("dsa", "kda", "moe", "router"):
        for expect in ("either", "rewrite"):
            assert any(v.kind == kind and v.expect == expect for v in CATALOGUE), (kind, expect)
    assert {"router_sorted_false", "moe_norm_by_hand", "dsa_separate_gate_proj", "kda_einsum_in_proj"} <= names


# ---------------------------------------------------------------------------------------------
# CUDA: default options (kernels on). Whole-model logits cannot tell a dropped parameter from a
# flipped near-tied expert (the unmodified model's own kimi_dep-vs-eager logits differ by ~0.45 on
# the H200: a routing flip downstream of BF16 kernel rounding), so the GPU checks are per layer:
# 1. each layer's decision (rewritten / stock) is the one the same variant gets on CPU, where a
#    rewrite is checked bit-exact against eager (so no CUDA-only matching path exists);
# 2. each rewritten layer passed its translation-validation probe on CUDA: the stock subgraph's CUDA
#    ops and the kimi_dep kernels on the same random input and caches, within the CUDA bound
#    (passes/validate.py), so a parameter the kernels drop shows there, with no routing downstream;
# 3. no crash, finite logits, and logits within 4x max(the unmodified model's own difference, 0.5): a
#    gross-error net only. Measured on the H200 (2026-12-01): the unmodified model 0.09 (batch 16) to
#    0.46; variants whose own layer stayed stock up to 1.34 (router_topk_dim0: routing flips alone).


def cuda_pair(model, *, steps=3, batch=2, q=1, start_len=24, accepted=None, block_size=4, seed=2):
    """(max |logits - eager|, report): kimi_dep with default options (pattern-only) vs eager, on CUDA."""
    import dep_compile
    from dep_compile.stock import KimiCache, RequestBatch

    cfg = model.config
    cache = KimiCache.allocate(cfg, num_slots=2 * batch + 1, num_blocks=8 * batch + 8, block_size=block_size,
                               seed=seed, device="cuda")
    ref_cache = cache.clone()
    reqs = [RequestBatch(c, batch, start_len=start_len, seed=batch, device="cuda") for c in (cache, ref_cache)]
    fn = torch.compile(model, backend="kimi_dep", options={"inductor": False}, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(3)
    err = 0.0
    with torch.no_grad():
        for i in range(steps):
            acc = None if accepted is None else accepted(i, batch)
            meta, ref_meta = (rb.step(q, acc) for rb in reqs)
            ids = torch.randint(0, cfg.vocab_size, (batch * q,), generator=g).cuda()
            out = model.step(ids, meta, cache, fn=fn)
            ref = model.step(ids, ref_meta, ref_cache)
            assert torch.isfinite(out).all()
            err = max(err, (out - ref).abs().max().item())
    return err, dep_compile.last_report()


_CUDA_BASELINE: dict = {}


def cuda_baseline(run: dict, cfg=CFG) -> float:
    """The unmodified model's kimi_dep-vs-eager logits difference on ``run``'s steps (same seeds), once per session."""
    key = (cfg.experts_format, cfg.dense_format, *sorted((k, v) for k, v in run.items() if k != "accepted"))
    if key not in _CUDA_BASELINE:
        torch._dynamo.reset()
        err, report = cuda_pair(build_model(cfg, seed=1, device="cuda"), **run)
        assert report.num_rewritten == len([m for m in report.layers if m.kind != "mla"]), report.table()
        _CUDA_BASELINE[key] = err
        torch._dynamo.reset()
    return _CUDA_BASELINE[key]


def _decisions(report) -> dict:
    return {(m.layer, m.kind): m.rewritten for m in report.layers if m.kind != "mla"}


@pytest.mark.cuda
@pytest.mark.parametrize("v", SELECTED, ids=IDS)
def test_near_miss_cuda(v):
    run = _run_params(v)
    base = cuda_baseline(run, v.config(CFG))
    cpu_model, row = _variant_model(v)
    cpu = compile_and_compare(v.name, v.config(CFG), cpu_model, run)  # exact on CPU (test_near_miss checks it)
    torch._dynamo.reset()
    model, _ = _variant_model(v, device="cuda")
    try:
        err, report = cuda_pair(model, **run)
    except Exception as e:  # noqa: BLE001
        msg = f"crash: {v.name}: {crash_message(e)}"
    else:
        msg = None
    assert msg is None, msg
    rows = {(m.layer, m.kind): m for m in report.layers}
    assert row in rows, f"no report row for {row} ({v.name})\n{report.table()}"
    assert _decisions(report) == _decisions(cpu.report), \
        f"decision: {v.name} differs on CUDA\nCUDA:\n{report.table()}\nCPU:\n{cpu.report.table()}"
    for m in report.rewritten():
        assert m.validation.startswith("probe"), f"unvalidated: {v.name}: {m.module}: {m.validation}"
    m = rows[row]
    if not m.rewritten:
        assert m.reason.strip() and not m.reason.startswith("policy:"), f"no reason: {v.name}: {m.reason!r}"
    bound = 4 * max(base, 0.5)
    assert err <= bound, f"gross error: {v.name}: logits differ by {err} > {bound} (unmodified: {base})\n{report.table()}"
