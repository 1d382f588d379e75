"""The main job: compile a small K3.1 decoder with kimi_dep, print the match report, check it against stock.

    python examples/compile_k31.py [--preset k31-small] [--steps 8] [--batch 4] [--q 1]
                                   [--inductor] [--tables auto|cublas|measured]
                                   [--experts bf16|mxfp4 | --checkpoint DIR]

``--experts mxfp4`` builds the routed experts as K3 ships them (MXFP4, random codes); ``--checkpoint DIR``
loads a checkpoint in K3's format (``python -m dep_compile make-checkpoint``) instead of random weights.

The check runs the same steps from identical caches through stock eager and through kimi_dep
(the rewritten graph; with --inductor, compiled by Inductor too, and plain Inductor on stock for
comparison), and prints the largest difference in logits and in every cache. With cuBLAS
tactics the rewritten ops compute exactly what stock computes: the rewritten graph matches
stock eager to the bit. Anything that changes a BF16 rounding upstream of a router (the
measured split-K tables, the default on CUDA, sum the projections in another order; Inductor
fuses the norms, AttnRes and the router) can flip a near-tied top-16 expert and move that
token's logits by O(1); --inductor prints plain Inductor on stock next to kimi_dep + Inductor.
"""

from __future__ import annotations

import argparse

import torch

import dep_compile
from dep_compile.config import CUBLAS_ONLY
from dep_compile.integrations.checkpoint import load_stock_model
from dep_compile.tactics import DEP_OPROJ, DEP_PROJECTION
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset
from dep_compile.stock.cache import cache_differences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k31-small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q", type=int, default=1, help="tokens per request (1 = decode, >1 = verify)")
    ap.add_argument("--inductor", action="store_true", help="also compile with Inductor (and plain Inductor on stock)")
    ap.add_argument("--tables", choices=["auto", "cublas", "measured"], default="auto",
                    help="projection tactics: the H200-measured tables, or cuBLAS everywhere (auto: measured on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    weights = ap.add_mutually_exclusive_group()
    weights.add_argument("--experts", choices=["bf16", "mxfp4"], default=None,
                         help="routed experts' format (default: the preset's)")
    weights.add_argument("--checkpoint", default=None, help="load this checkpoint (its config sets the model)")
    args = ap.parse_args()

    torch.manual_seed(0)
    if args.checkpoint:
        model = load_stock_model(args.checkpoint).to(args.device)
        cfg = model.config
    else:
        cfg = preset(args.preset, **({"experts_format": args.experts} if args.experts else {}))
        model = build_model(cfg, seed=0, device=args.device)
    cache = KimiCache.allocate(cfg, num_slots=2 * args.batch, num_blocks=16 * args.batch, block_size=8,
                               device=args.device)
    measured = args.tables == "measured" or (args.tables == "auto" and args.device != "cpu")
    tables = {"projection_tables": DEP_PROJECTION, "oproj_table": DEP_OPROJ} if measured else CUBLAS_ONLY
    g = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, cfg.vocab_size, (args.batch * args.q,), generator=g).to(args.device)
             for _ in range(args.steps)]

    def run(fn, options=None):
        """Run the steps through ``fn`` from a copy of the initial caches: (logits per step, caches)."""
        c = cache.clone()
        b = RequestBatch(c, args.batch, start_len=12, device=args.device)
        with torch.no_grad():
            return [model.step(ids, b.step(args.q), c, fn=fn) for ids in steps], c.snapshot()

    def compare(name, got):
        logits = max((a - r).abs().max().item() for a, r in zip(got[0], ref[0]))
        caches = cache_differences(got[1], ref[1])  # FP8 keys: dequantized, / amax
        print(f"  {name:34s} max |logits - stock eager| = {logits:.4g}, "
              f"max |cache - stock eager| = {max(caches.values()):.4g} ({len(caches)} cache tensors)")

    ref = run(model)
    rewritten = run(torch.compile(model, backend="kimi_dep", fullgraph=True, options={"inductor": False, **tables}))
    print(dep_compile.last_report().table())
    print(f"\n{args.steps} steps of {args.batch} requests x q={args.q} on {args.device}, "
          f"{'measured split-K' if measured else 'cuBLAS'} tactics:")
    compare("kimi_dep (rewritten graph)", rewritten)
    if args.inductor:
        compare("plain Inductor on stock", run(torch.compile(model, backend="inductor", fullgraph=True)))
        compare("kimi_dep + Inductor", run(torch.compile(model, backend="kimi_dep", fullgraph=True,
                                                         options={"inductor": True, **tables})))

if __name__ == "__main__":
    main()
