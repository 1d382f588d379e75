"""The main job: compile a small K3.1 decoder with kimi_dep, print the match report, check it against stock.

    python examples/compile_k31.py [--preset k31-small] [--steps 8] [--batch 4] [--q 1] [--no-inductor]
"""

from __future__ import annotations

import argparse

import torch

import dep_compile
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset
from dep_compile.stock.cache import cache_differences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k31-small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q", type=int, default=1, help="tokens per request (1 = decode, >1 = verify)")
    ap.add_argument("--no-inductor", action="store_true", help="pattern-only mode: rewrite, skip Inductor")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = preset(args.preset)
    model = build_model(cfg, seed=0)
    cache = KimiCache.allocate(cfg, num_slots=2 * args.batch, num_blocks=16 * args.batch, block_size=8)
    stock_cache = cache.clone()
    batch = RequestBatch(cache, args.batch, start_len=12)
    compiled = torch.compile(model, backend="kimi_dep", fullgraph=True,
                             options={"inductor": not args.no_inductor})
    worst = 0.0
    with torch.no_grad():
        for step in range(args.steps):
            meta = batch.step(args.q)
            ids = torch.randint(0, cfg.vocab_size, (args.batch * args.q,))
            ref = model.step(ids, meta, stock_cache)
            out = model.step(ids, meta, cache, fn=compiled)
            worst = max(worst, (out - ref).abs().max().item())
    print(dep_compile.last_report().table())
    diffs = cache_differences(cache.snapshot(), stock_cache.snapshot())  # FP8 keys: dequantized, / amax
    cache_err = max(diffs.values())
    print(f"\n{args.steps} steps of {args.batch} x q={args.q}: max |logits - stock| = {worst:.4g}, "
          f"max |cache - stock| = {cache_err:.4g} over {len(diffs)} cache tensors")


if __name__ == "__main__":
    main()
