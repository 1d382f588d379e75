"""Compile cost: the kimi_dep passes' time against the whole compile, at several decoder depths.

    python benchmarks/compile_cost.py [--layers 4 16 64] [--inductor]

Without ``--inductor`` the "whole compile" is Dynamo tracing plus the passes (pattern-only
mode); with it, Inductor's codegen is included too (minutes on a CPU at 64 layers).
"""

from __future__ import annotations

import argparse
import time

import torch

import dep_compile
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset


def measure(layers: int, inductor: bool) -> tuple[float, float, int]:
    """(pass seconds, whole compile seconds, subgraphs rewritten) for one decode step."""
    torch._dynamo.reset()
    cfg = preset("k31-small", num_layers=layers)
    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=4, num_blocks=16, block_size=4)
    meta = RequestBatch(cache, 2, start_len=5).step(1)
    ids = torch.randint(0, cfg.vocab_size, (2,))
    fn = torch.compile(model, backend="kimi_dep", options={"inductor": inductor}, fullgraph=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(ids, meta, cache)
    total = time.perf_counter() - t0
    rep = dep_compile.last_report()
    return rep.pass_seconds, total, rep.num_rewritten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--inductor", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, inductor={args.inductor}")
    print(f"{'layers':>6} {'rewritten':>9} {'pass ms':>8} {'compile s':>9} {'pass %':>7} {'pass ms/layer':>13}")
    for n in args.layers:
        p, t, k = measure(n, args.inductor)
        print(f"{n:>6} {k:>9} {p * 1e3:>8.1f} {t:>9.2f} {100 * p / t:>6.2f}% {p * 1e3 / n:>13.2f}")


if __name__ == "__main__":
    main()
