"""Test helpers: run a stock decoder eagerly and through kimi_dep on the same steps, compare everything."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import dep_compile
from dep_compile.config import CUBLAS_ONLY  # noqa: F401  (re-exported to the tests)
from dep_compile.debug.parity import decisive_routing, rel_err
from dep_compile.stock import KimiCache, RequestBatch, build_model
from dep_compile.stock.cache import FP8_REL, cache_differences
from dep_compile.stock.moe import KimiMoE

# BF16 tolerances. Pattern-only mode runs the same references in the same order as stock, so
# with cuBLAS tactics it is exact (those tests assert 0). Split-K tactics change the summation order
# of one projection (FP32 partials) and Inductor fuses the glue (norms, AttnRes, residuals): each
# moves a BF16 result by an ulp now and then, and on a random model with near-tied routers one ulp
# can flip an expert and move logits by O(1) over a few steps (0.11-1.18 measured under
# ATEN_CPU_CAPABILITY=default). So every non-exact comparison runs on the decisive-routing model
# (dep_compile.debug.parity.decisive_routing: no rounding flips a pick) and is judged by
# ``agreement_failures`` (docs/design.md §7.4).
LOGIT_ATOL = 0.1  # logits are O(1); a wrong slice or lost cache write moves them by O(1)
STATE_ATOL = 0.05
# Multi-step agreement with eager on the decisive-routing model: (logits relative Frobenius error over
# every step, logits max abs or None, every cache max abs). Measured with ATEN_CPU_CAPABILITY unset, default
# and avx2 and OMP_NUM_THREADS 1 and 2 (docs/design.md §7.4): the split-K contract in pattern-only mode, a step at a
# time from eager's caches (compare_steps(forced=True)), moves logits by at most 2.2e-3 rel (0.034 abs) and caches by
# 0.027 (one e4m3 step of an index key); through Inductor the fused glue moves logits by
# up to 1.7e-2 rel from the first step on (not an amplification: 1.6e-2 after one step) and KDA states
# by up to 0.13.
AGREE_SPLITK = (1e-2, LOGIT_ATOL, STATE_ATOL)
AGREE_INDUCTOR = (5e-2, None, 0.5)


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


def step_toward_zero(codes: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 ``codes`` with the nonzero ones at ``where`` one code step closer to zero."""
    bits = codes.view(torch.uint8)
    move = where & ((bits & 0x7F) > 0)
    return (bits - move.to(torch.uint8)).view(codes.dtype)


@dataclasses.dataclass
class PairResult:
    logits_err: float
    cache_err: float
    cache_errs: dict
    report: object
    steps: int
    caches: dict  # KimiCache.snapshot() after the steps: through fn
    ref_caches: dict  # and eager
    logits_rel: float = 0.0  # relative Frobenius error of the logits over every step


def compare_steps(cfg, model, fn, *, steps=8, batch=3, q=1, pooled=False, dynamic=False, accepted=None,
                  start_len=10, block_size=4, padding=0, batches=None, seed=2, forced=False) -> PairResult:
    """``steps`` steps of ``batch`` requests x ``q`` tokens through ``fn`` and through the eager
    ``model``, from identical caches and requests; the largest differences in logits and caches.

    ``forced``: every step of ``fn`` starts from eager's caches (copied in after each step, whose cache
    differences count), so a rounding difference is measured where it is made and not compounded over
    the steps (the caches' errors are then the largest of any one step).

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
    outs, refs, worst = [], [], {}
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
            outs.append(out.flatten())
            refs.append(ref.flatten())
            if forced:
                step_errs = cache_differences(cache.snapshot(), ref_cache.snapshot(), fp8_scale=STATE_ATOL / FP8_REL)
                worst = {k: max(v, worst.get(k, 0.0)) for k, v in step_errs.items()}
                for lc, rc in zip(cache.layers, ref_cache.layers):
                    for name, t in lc.tensors().items():
                        t.copy_(getattr(rc, name))
    got, ref = cache.snapshot(), ref_cache.snapshot()
    errs = worst if forced else cache_differences(got, ref, fp8_scale=STATE_ATOL / FP8_REL)
    logits_rel = rel_err(torch.cat(outs), torch.cat(refs))
    return PairResult(logits_err, max(errs.values()), errs, dep_compile.last_report(), len(sizes), got, ref, logits_rel)


def agreement_failures(r: PairResult, name: str = "", inductor: bool = False) -> list[str]:
    """Multi-step agreement with stock eager on the decisive-routing model, for a contract that is not
    exact: what is out of bounds (empty: it agrees). Bounds ``AGREE_SPLITK`` (pattern-only, split-K
    tables) or, with ``inductor``, ``AGREE_INDUCTOR`` (Inductor's fused glue). The numbers are printed
    (``pytest -s``)."""
    rel, abs_, cache = AGREE_INDUCTOR if inductor else AGREE_SPLITK
    print(f"PARITY {name}: logits rel {r.logits_rel:.3g} abs {r.logits_err:.3g}, caches {r.cache_err:.3g} "
          f"({max(r.cache_errs, key=r.cache_errs.get)})")
    bad = []
    if not r.logits_rel <= rel:
        bad.append(f"logits rel {r.logits_rel:.3g} > {rel}")
    if abs_ is not None and not r.logits_err < abs_:
        bad.append(f"logits abs {r.logits_err:.3g} >= {abs_}")
    bad += [f"{k} {v:.3g} >= {cache}" for k, v in r.cache_errs.items() if not v < cache]
    return bad


def assert_agrees(r: PairResult, name: str = "", inductor: bool = False) -> None:
    assert r.report.num_rewritten > 0
    bad = agreement_failures(r, name, inductor)
    assert not bad, bad


def run_pair(cfg, *, options=None, dynamic=False, model=None, decisive=False, **steps) -> PairResult:
    """Eager stock vs the ``kimi_dep`` backend (:func:`compare_steps` takes ``steps``).

    Options default to dep_compile.config.CUBLAS_ONLY (exact pattern-only parity) unless they
    name tables. ``decisive``: the model's routers get decisive_routing (for a non-exact contract).
    """
    model = model or build_model(cfg, seed=1)
    if decisive:
        decisive_routing(model)
    opts = {"inductor": False, **CUBLAS_ONLY, **(options or {})}
    compiled = torch.compile(model, backend="kimi_dep", options=opts, fullgraph=True, dynamic=False if not dynamic else None)
    return compare_steps(cfg, model, compiled, dynamic=dynamic, **steps)


def kinds_rewritten(report) -> dict:
    out: dict = {}
    for m in report.layers:
        out.setdefault(m.kind, []).append(m.rewritten)
    return out


# ---- mutants of the kimi_dep ops, for showing that a yardstick can fail (compile with validate=False,
# so translation validation does not leave the mutated layer stock first) --------------------------

def _scaled(real, factor=1.01):
    def forward(self, *args, **kwargs):
        return real(self, *args, **kwargs) * factor
    return forward


def _state_write_dropped(real, arg: int):
    """``forward`` with its cache argument ``arg`` restored after the call (the write lost), for the
    first layer object it sees only."""
    first = []

    def forward(self, *args, **kwargs):
        if not first:
            first.append(self)
        if self is not first[0]:
            return real(self, *args, **kwargs)
        saved = args[arg].clone()
        out = real(self, *args, **kwargs)
        args[arg].copy_(saved)
        return out
    return forward


def mutants():
    """{name: (class, method, wrapper)}: each a bug a parity yardstick must catch (``kda output x0.9`` is
    for the one-step yardstick, which cannot see 1 %: tests/test_parity.py)."""
    from dep_compile.ops.dsa import PreparedDsa
    from dep_compile.ops.kda import PreparedKda
    from dep_compile.ops.moe import EpMoeLayer

    return {
        "moe output x1.01": (EpMoeLayer, "forward", _scaled),
        "kda output x1.01": (PreparedKda, "forward", _scaled),
        "kda output x0.9": (PreparedKda, "forward", lambda real: _scaled(real, 0.9)),
        # forward(x, in_proj_w, f_b_w, conv_w, A_log, dt_bias, o_norm_w, o_proj_w, conv_state, rec_state, ...)
        "kda recurrent-state write dropped": (PreparedKda, "forward", lambda real: _state_write_dropped(real, 9)),
        # forward(x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b, o_proj_w, kv_cache, ...)
        "dsa latent-cache write dropped": (PreparedDsa, "forward", lambda real: _state_write_dropped(real, 10)),
    }


@contextlib.contextmanager
def mutant(name: str):
    cls, method, wrap = mutants()[name]
    real = getattr(cls, method)
    setattr(cls, method, wrap(real))
    try:
        yield
    finally:
        setattr(cls, method, real)
