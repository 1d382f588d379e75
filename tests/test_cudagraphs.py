"""mode="reduce-overhead" graphs the decode step: static cache addresses, the backend's one message, and
(CUDA) steps with new metadata replayed through cudagraph trees against eager."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters, get_static_address_type

from dep_compile.backend import cudagraph_blockers, mutated_inputs
from dep_compile.debug.parity import LOGIT_REL, rel_err, run_steps
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset
from dep_compile.stock.cache import FP8_REL, LayerCache, cache_differences
from helpers import CUBLAS_ONLY, STATE_ATOL

CFG = preset("k31-small", num_layers=4)  # KDA + dense MLP, KDA, KDA, DSA; 3 MoE layers


def _tensors(cache: KimiCache) -> list[torch.Tensor]:
    return [t for lc in cache.layers for t in lc.tensors().values()]


@pytest.mark.parametrize("pooled", [False, True])
def test_caches_have_static_addresses(pooled):
    cache = KimiCache.allocate(CFG, num_slots=4, num_blocks=8, block_size=4, pooled=pooled)
    for c in (cache, cache.clone()):
        assert len(_tensors(c)) == 3 * 2 + 3  # KDA: conv + recurrent; DSA: latents, index keys, scales
        assert all(get_static_address_type(t) == "unguarded" for t in _tensors(c))


def _unmarked(cache: KimiCache) -> KimiCache:
    """The same caches as tensors no one marked (as a user's own allocation would be)."""
    layers = [LayerCache(**{n: t.detach().clone() for n, t in lc.tensors().items()}) for lc in cache.layers]
    return KimiCache(layers, cache.num_slots, cache.num_blocks, cache.block_size)


def _dynamo_graph(model, cache):
    """The Dynamo graph of one decode step and its example inputs, as a backend receives them."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    batch = RequestBatch(cache, 2, start_len=5)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(torch.tensor([1, 2]), batch.step(1), cache)
    return seen[0]


def test_blockers_name_each_mutated_cache_without_a_static_address():
    model = build_model(CFG, seed=1)
    cache = KimiCache.allocate(CFG, num_slots=4, num_blocks=8, block_size=4)
    gm, inputs = _dynamo_graph(model, cache)
    # every cache tensor the ops write is a mutated graph input; nothing else is
    assert len(mutated_inputs(gm)) == len(_tensors(cache))
    reasons = cudagraph_blockers(gm, inputs)
    assert len(reasons) == 1 and reasons[0].startswith("inputs on cpu"), reasons  # marked: only the device
    torch._dynamo.reset()
    gm, inputs = _dynamo_graph(model, _unmarked(cache))
    reasons = cudagraph_blockers(gm, inputs)
    assert len(reasons) == 2 and "9 input(s) written in place without a static address" in reasons[1], reasons
    assert "cache.mark_static()" in reasons[1]


def test_reduce_overhead_on_cpu_logs_one_message(caplog):
    model = build_model(CFG, seed=1)
    cache = KimiCache.allocate(CFG, num_slots=4, num_blocks=8, block_size=4)
    batch = RequestBatch(cache, 2, start_len=5)
    with mock.patch("torch._inductor.compile_fx.compile_fx", side_effect=lambda gm, *a, **k: gm.forward), \
            caplog.at_level(logging.WARNING, logger="dep_compile"), torch.no_grad():
        torch.compile(model, backend="kimi_dep", mode="reduce-overhead", fullgraph=True)(
            torch.tensor([1, 2]), batch.step(1), cache)
    msgs = [r.getMessage() for r in caplog.records if r.name == "dep_compile" and "CUDA graphs" in r.getMessage()]
    assert len(msgs) == 1 and "inputs on cpu" in msgs[0] and "static address" not in msgs[0], msgs
    caplog.clear()
    torch._dynamo.reset()
    with mock.patch("torch._inductor.compile_fx.compile_fx", side_effect=lambda gm, *a, **k: gm.forward), \
            caplog.at_level(logging.WARNING, logger="dep_compile"), torch.no_grad():
        torch.compile(model, backend="kimi_dep", fullgraph=True)(torch.tensor([1, 2]), batch.step(1), cache)
    assert not [r for r in caplog.records if "CUDA graphs" in r.getMessage()]  # no mode, no message


# ------------------------------------------------------------------------------------------------
# CUDA: cudagraph trees over decode steps with changing metadata, and a verify step
# ------------------------------------------------------------------------------------------------


def _cudagraphs_recorded() -> int:
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    return 0 if manager is None else sum(1 + n.num_descendants() for n in manager.get_roots())


CACHE_ABS = 4 * STATE_ATOL  # caches hold N(0, 0.5) values: a stale-metadata write misses by ~0.7


def errors(got, ref, cache, ref_cache) -> tuple[float, float]:
    """Relative Frobenius error of the logits over every step, and the largest cache difference
    (FP8 keys dequantized, as in cache_differences, scaled to the state bound)."""
    logits = rel_err(torch.cat(got), torch.cat(ref))
    caches = cache_differences(cache.snapshot(), ref_cache.snapshot(), fp8_scale=STATE_ATOL / FP8_REL)
    return logits, max(caches.values())


def bounds(yardstick: tuple[float, float]) -> tuple[float, float]:
    """Twice a yardstick's errors against eager, and never tighter than LOGIT_REL / CACHE_ABS."""
    return max(2 * yardstick[0], LOGIT_REL), max(2 * yardstick[1], CACHE_ABS)


def compile_backend(model, backend: str, cudagraphs: bool = False, options: dict | None = None):
    """``torch.compile`` through ``backend`` ("inductor" or "kimi_dep" with ``options``), with CUDA graphs
    as ``mode="reduce-overhead"`` sets them (kimi_dep with options: the same Inductor config patch)."""
    if backend == "inductor" or options is None:
        return torch.compile(model, backend=backend, fullgraph=True, dynamic=False,
                             mode="reduce-overhead" if cudagraphs else None)
    patch = {"triton.cudagraphs": True} if cudagraphs else {}
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False,
                         options={**options, "inductor_config": {**options.get("inductor_config", {}), **patch}})


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "kimi_dep"])
def test_reduce_overhead_replays_new_metadata(backend, caplog):
    """reduce-overhead records CUDA graphs (no skip, no dep_compile message) for the decode and the
    verify graph; its steps match the same backend without CUDA graphs (same kernels: equal on the
    H200, 2026-12-01) and eager as closely as that one does. A replay with stale metadata writes the
    wrong cache slots: a cache entry then misses by ~0.7 (N(0, 0.5) values)."""
    torch.manual_seed(0)
    model = build_model(CFG, seed=1, device="cuda")
    start = KimiCache.allocate(CFG, num_slots=8, num_blocks=32, block_size=4, device="cuda")
    ref_cache = start.clone()
    ref = run_steps(model, None, ref_cache)
    opts = None if backend == "inductor" else dict(CUBLAS_ONLY)
    skips, graphs = counters["inductor"]["cudagraph_skips"], _cudagraphs_recorded()
    cache = start.clone()
    with caplog.at_level(logging.WARNING, logger="dep_compile"):
        got = run_steps(model, compile_backend(model, backend, True, opts), cache)
    assert counters["inductor"]["cudagraph_skips"] == skips, "cudagraph trees skipped a graph"
    assert _cudagraphs_recorded() >= graphs + 2, "no CUDA graph recorded for the decode and verify graphs"
    assert not [r for r in caplog.records if "CUDA graphs" in r.getMessage()]
    err = errors(got, ref, cache, ref_cache)
    plain_cache = start.clone()
    plain_logits = run_steps(model, compile_backend(model, backend, False, opts), plain_cache)
    plain = errors(plain_logits, ref, plain_cache, ref_cache)
    same = errors(got, plain_logits, cache, plain_cache)  # the same kernels, graphed or not
    bound = bounds(plain)
    print(f"{backend}: reduce-overhead vs eager: logits rel {err[0]:.3g}, caches {err[1]:.3g}; without CUDA graphs "
          f"{plain[0]:.3g}, {plain[1]:.3g}; bounds {bound[0]:.3g}, {bound[1]:.3g}; graphed vs not {same[0]:.3g}, "
          f"{same[1]:.3g}")
    assert err[0] <= bound[0] and err[1] <= bound[1]
    assert same[0] <= 1e-2 and same[1] <= CACHE_ABS
