"""Compile cost: the kimi_dep passes' time, and their translation validation's, against the whole compile.

    python benchmarks/compile_cost.py [--layers 4 16 64] [--inductor]      # small decoders, CPU
    python benchmarks/compile_cost.py --blocks [--rows 1 64]                # full-size K3.1 layers, CUDA

Without ``--inductor`` the "whole compile" is Dynamo tracing plus the passes (pattern-only
mode); with it, Inductor's codegen is included too (minutes on a CPU at 64 layers). ``--blocks``
compiles one full-size DSA, KDA and MoE layer each (as ``bench_attention.py`` / ``bench_moe.py``
build them) through kimi_dep + Inductor and prints each layer's probe numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any

import torch

import dep_compile
from dep_compile.config import DepOptions
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset


def trace(layers: int) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The Dynamo graph of one decode step of a small decoder and its example inputs, as a backend gets them."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    cfg = preset("k31-small", num_layers=layers)
    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    meta = RequestBatch(cache, 2, start_len=5).step(1)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(
            torch.randint(0, cfg.vocab_size, (2,)), meta, cache)
    return seen[0]


def run_passes(gm, example_inputs, validate: bool = False) -> tuple[float, Any]:
    """The kimi_dep passes alone on a copy of ``gm``: (CPU seconds of this process, the report).

    CPU time (``time.process_time``), not the wall clock: on a loaded machine another process's
    work stretches the wall clock of ours (2 cores shared: 0.46 s wall for 0.10 s CPU at 16 layers)."""
    from dep_compile.passes.manager import DepPassManager  # noqa: PLC0415

    gm = copy.deepcopy(gm)
    manager = DepPassManager(DepOptions.from_dict({"validate": validate}))
    t0 = time.process_time()
    manager.run(gm, example_inputs)
    return time.process_time() - t0, dep_compile.last_report()


def pass_cpu_seconds(gm, example_inputs, repeats: int = 3) -> float:
    """The passes' CPU time on ``gm`` without translation validation, the least of ``repeats`` runs."""
    return min(run_passes(gm, example_inputs)[0] for _ in range(repeats))


def whole_graph_visits(gm, example_inputs) -> int:
    """Nodes yielded by whole-graph walks (``graph.nodes``, either direction) in one pass run over ``gm``.

    Deterministic where CPU time is not: a pass that walks the graph once per rewrite visits O(layers^2)
    nodes, one that walks it a fixed number of times O(layers)."""
    node_list = torch.fx.graph._node_list
    forward, backward, visits = node_list.__iter__, node_list.__reversed__, [0]

    def counted(walk):
        def walk_counting(self):
            for node in walk(self):
                visits[0] += 1
                yield node
        return walk_counting

    node_list.__iter__, node_list.__reversed__ = counted(forward), counted(backward)
    try:
        run_passes(gm, example_inputs)
    finally:
        node_list.__iter__, node_list.__reversed__ = forward, backward
    return visits[0]


def probes(gm, example_inputs) -> tuple[dict, Any]:
    """(translation-validation probes run, by "layers" (DSA / KDA / MoE) and "attn_res" points; the report) for
    one pass run over ``gm`` with validation on."""
    from dep_compile.passes import validate  # noqa: PLC0415

    real, calls = validate.check, {"layers": 0, "attn_res": 0}

    def counting(probe, *args, **kwargs):
        calls["attn_res" if probe.prepared is None else "layers"] += 1  # an AttnRes point has no prepared layer
        return real(probe, *args, **kwargs)

    validate.check = counting
    try:
        report = run_passes(gm, example_inputs, validate=True)[1]
    finally:
        validate.check = real
    return calls, report


def measure(layers: int, inductor: bool, validate: bool) -> tuple[float, float, float, int]:
    """(pass s, validation s, whole compile s, subgraphs rewritten) for one decode step of a small decoder."""
    torch._dynamo.reset()
    cfg = preset("k31-small", num_layers=layers)
    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    meta = RequestBatch(cache, 2, start_len=5).step(1)
    ids = torch.randint(0, cfg.vocab_size, (2,))
    fn = torch.compile(model, backend="kimi_dep", options={"inductor": inductor, "validate": validate},
                       fullgraph=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(ids, meta, cache)
    total = time.perf_counter() - t0
    rep = dep_compile.last_report()
    return rep.pass_seconds, rep.validate_seconds, total, rep.num_rewritten


def blocks(rows_list: list[int]) -> None:
    """Full-size DSA / KDA / MoE layers on CUDA: compile time without and with validation, probe numbers.

    Each point compiles first with ``validate=False`` (its first call JIT-compiles the Triton kernels),
    then with validation: the probe then runs warm kernels, so "valid. ms" is the probe's own cost.
    """
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_attention import build_block, make_step  # noqa: PLC0415
    from bench_moe import MoeBlock  # noqa: PLC0415

    from dep_compile.stock.model import init_weights  # noqa: PLC0415

    cfg = preset("k31")
    print(f"{'layer':>5} {'rows':>4} {'off s':>6} {'on s':>6} {'valid. ms':>9} {'valid. %':>8}  probe")
    for kind in ("dsa", "kda", "moe"):
        if kind == "moe":  # 16 of the 896 experts, as one rank's share run alone
            block = init_weights(MoeBlock(cfg, 16), seed=0).cuda().eval().requires_grad_(False)
        else:
            block = build_block(cfg, kind, device="cuda")
        for rows in rows_list:
            if kind == "moe":
                args = (torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16),)
            else:
                args = make_step(cfg, kind, rows, 1, 4096 if kind == "dsa" else None, device="cuda").args()
            seconds = {}
            for validate in (False, True):
                torch._dynamo.reset()
                fn = torch.compile(block, backend="kimi_dep", options={"validate": validate}, fullgraph=True,
                                   dynamic=False)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn(*args)
                torch.cuda.synchronize()
                seconds[validate] = time.perf_counter() - t0
            rep = dep_compile.last_report()
            for m in rep.layers:
                what = m.validation if m.rewritten else f"STOCK: {m.reason}"
                print(f"{kind:>5} {rows:>4} {seconds[False]:>6.2f} {seconds[True]:>6.2f} "
                      f"{rep.validate_seconds * 1e3:>9.1f} {100 * rep.validate_seconds / seconds[True]:>7.2f}%  {what}",
                      flush=True)
        del block
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--blocks", action="store_true", help="full-size DSA / KDA / MoE layers on CUDA")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64], help="--blocks: tokens per step")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, inductor={args.inductor or args.blocks}")
    if args.blocks:
        blocks(args.rows)
        return
    print(f"{'layers':>6} {'rewritten':>9} {'pass ms':>8} {'valid. ms':>9} {'compile s':>9} {'pass %':>7} "
          f"{'valid. %':>8} {'no-validate s':>13}")
    for n in args.layers:
        p, v, t, k = measure(n, args.inductor, True)
        _, _, t_off, _ = measure(n, args.inductor, False)
        print(f"{n:>6} {k:>9} {p * 1e3:>8.1f} {v * 1e3:>9.1f} {t:>9.2f} {100 * p / t:>6.2f}% {100 * v / t:>7.2f}% "
              f"{t_off:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
