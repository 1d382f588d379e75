"""Test helpers: run a stock decoder eagerly and through kimi_dep on the same steps, compare everything."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import dep_compile
from dep_compile.config import CUBLAS_ONLY  # noqa: F401  (re-exported to the tests)
from dep_compile.stock import KimiCache, RequestBatch, build_model
from dep_compile.stock.cache import FP8_REL, cache_differences
from dep_compile.stock.moe import KimiMoE

# BF16 tolerances. Pattern-only mode runs the same references in the same order as stock, so
# with cuBLAS tactics it is exact; split-K tactics change only the summation order of one
# projection (FP32 partials), which moves BF16 outputs by a few ulps. Through Inductor the
# glue (norms, AttnRes, residuals) is fused, again moving BF16 results by a few ulps.
LOGIT_ATOL = 0.1  # logits are O(1); a wrong slice or lost cache write moves them by O(1)
STATE_ATOL = 0.05


class MoeBlock(torch.nn.Module):
    """One MoE layer as its own graph: x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg):
        super().__init__()
        self.mlp = KimiMoE(cfg)

    def forward(self, x):
        return self.mlp(x)


@contextlib.contextmanager
def fallback_log():
    """Yields the set of ``"layer: reason"`` fallbacks the kimi_dep ops log inside the block, filled
    on exit; reasons logged earlier in the process are logged (and caught) again inside it."""
    from dep_compile.ops.fallbacks import LOGGED

    saved = set(LOGGED)
    LOGGED.clear()
    logged: set[str] = set()
    try:
        yield logged
    finally:
        logged.update(LOGGED)
        LOGGED.update(saved)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two tensors of one dtype and shape, on any device (FP8 too, which
    CPU torch cannot compare as values)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().cpu().contiguous().view(torch.uint8),
                                              b.detach().cpu().contiguous().view(torch.uint8))


@dataclasses.dataclass
class PairResult:
    logits_err: float
    cache_err: float
    cache_errs: dict
    report: object
    steps: int
    caches: dict  # KimiCache.snapshot() after the steps: through fn
    ref_caches: dict  # and eager


def compare_steps(cfg, model, fn, *, steps=8, batch=3, q=1, pooled=False, dynamic=False, accepted=None,
                  start_len=10, block_size=4, padding=0, batches=None, seed=2) -> PairResult:
    """``steps`` steps of ``batch`` requests x ``q`` tokens through ``fn`` and through the eager
    ``model``, from identical caches and requests; the largest differences in logits and caches.

    ``fn`` is the compiled model (it compiles on its first step: call this inside any config
    patch its compile needs). ``batches`` (one batch size per step) exercises one compiled graph
    at several sizes; with ``dynamic`` the batch dim is marked dynamic. The report is the last
    one kimi_dep made.
    """
    max_b = max(batches or [batch])
    cache = KimiCache.allocate(cfg, num_slots=2 * max_b + 1, num_blocks=8 * max_b + 8, block_size=block_size,
                               pooled=pooled, seed=seed)
    ref_cache = cache.clone()
    g = torch.Generator().manual_seed(3)
    logits_err = 0.0
    sizes = batches or [batch] * steps
    req = {b: (RequestBatch(cache, b, start_len=start_len, seed=b, padding=padding),
               RequestBatch(ref_cache, b, start_len=start_len, seed=b, padding=padding)) for b in set(sizes)}
    with torch.no_grad():
        for i, b in enumerate(sizes):
            acc = None if accepted is None else accepted(i, b)
            meta = req[b][0].step(q, acc)
            ref_meta = req[b][1].step(q, acc)
            ids = torch.randint(0, cfg.vocab_size, (b * q,), generator=g)
            if dynamic:
                for t in (ids, meta.slot_mapping, meta.block_table, meta.seq_lens, meta.state_indices, meta.accepted):
                    torch._dynamo.mark_dynamic(t, 0)
            out = model.step(ids, meta, cache, fn=fn)
            ref = model.step(ids, ref_meta, ref_cache)
            assert torch.isfinite(out).all()
            logits_err = max(logits_err, (out - ref).abs().max().item())
    got, ref = cache.snapshot(), ref_cache.snapshot()
    errs = cache_differences(got, ref, fp8_scale=STATE_ATOL / FP8_REL)
    return PairResult(logits_err, max(errs.values()), errs, dep_compile.last_report(), len(sizes), got, ref)


def run_pair(cfg, *, options=None, dynamic=False, model=None, **steps) -> PairResult:
    """Eager stock vs the ``kimi_dep`` backend (:func:`compare_steps` takes ``steps``).

    Options default to dep_compile.config.CUBLAS_ONLY (exact pattern-only parity) unless they
    name tables.
    """
    model = model or build_model(cfg, seed=1)
    opts = {"inductor": False, **CUBLAS_ONLY, **(options or {})}
    compiled = torch.compile(model, backend="kimi_dep", options=opts, fullgraph=True, dynamic=False if not dynamic else None)
    return compare_steps(cfg, model, compiled, dynamic=dynamic, **steps)


def kinds_rewritten(report) -> dict:
    out: dict = {}
    for m in report.layers:
        out.setdefault(m.kind, []).append(m.rewritten)
    return out
