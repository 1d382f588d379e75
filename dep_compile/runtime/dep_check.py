"""DEP self-check: run a small decoder at DEP (this rank's requests, experts sharded over the
EP group) through kimi_dep and compare it with the unsharded model, compiled by kimi_dep on
this one device, on the same requests."""

from __future__ import annotations

import copy

import torch

from ..stock import KimiCache, RequestBatch, build_model, preset
from ..stock.cache import max_cache_difference
from . import ep


def run_dep_check(rank: int, world: int, device: str = "cpu", steps: int = 4, preset_name: str = "k31-small",
                  num_layers: int = 4, batch: int = 2, q: int = 1, inductor: bool = False) -> dict:
    """Call on every rank after ``torch.distributed.init_process_group``.

    Returns {"logits_err", "cache_err", "ops"}: the largest differences between the DEP run and
    the single-device model on this rank's requests, and the MoE ops in the DEP run's match report.

    The single-device side runs the same backend, so the two differ only by expert parallelism
    (each rank's FP32 expert partials summed across ranks). Against stock eager on a GPU the
    rewritten router's FP32 summation order would also differ, and a near-tied top-k expert that
    flips moves the logits by far more than any rounding.
    """
    import dep_compile

    cfg = preset(preset_name, num_layers=num_layers)
    ep.init_ep(cfg)
    full = build_model(cfg, seed=1, device=device)  # every rank builds the same weights
    sharded = ep.shard_experts(copy.deepcopy(full), rank, world)
    cache = KimiCache.allocate(cfg, num_slots=2 * batch, num_blocks=8 * batch, block_size=4, device=device, seed=10 + rank)
    ref_cache = cache.clone()
    reqs = RequestBatch(cache, batch, start_len=6, seed=rank, device=device)  # the same layout serves ref_cache
    fn = torch.compile(sharded, backend="kimi_dep", fullgraph=True, options={"inductor": inductor})
    fn_ref = torch.compile(full, backend="kimi_dep", fullgraph=True, options={"inductor": inductor})
    ops = None
    g = torch.Generator().manual_seed(100 + rank)  # each rank decodes its own requests
    logits_err = 0.0
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.randint(0, cfg.vocab_size, (batch * q,), generator=g).to(device)
            meta = reqs.step(q)
            out = sharded.step(ids, meta, cache, fn=fn)
            if ops is None:  # the DEP graph's report, before the single-device model compiles
                ops = [m.op for m in dep_compile.last_report().layers if m.kind == "moe"]
            ref = full.step(ids, meta, ref_cache, fn=fn_ref)
            logits_err = max(logits_err, (out - ref).abs().max().item())
    cache_err = max_cache_difference(cache, ref_cache)  # FP8 index keys dequantized, relative to amax
    return {"logits_err": logits_err, "cache_err": cache_err, "ops": ops}
