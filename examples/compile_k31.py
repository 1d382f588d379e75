"""The main job: compile a small K3.1 decoder with kimi_dep, print the match report, check it against stock.

    python examples/compile_k31.py [--preset k31-small] [--steps 8] [--batch 4] [--q 1]
                                   [--inductor] [--tables auto|cublas|measured] [--device cpu|cuda]
                                   [--experts bf16|mxfp4 | --checkpoint DIR] [--dense bf16|fp8_block]

``--experts mxfp4`` builds the routed experts as K3 ships them (MXFP4, random codes); ``--dense fp8_block`` the
dense projections in FP8 with 128 x 128 block scales (docs/fp8_dense.md: kimi_dep leaves those layers stock for
now, and says so); ``--checkpoint DIR`` loads a checkpoint in K3's format (``python -m dep_compile
make-checkpoint``) instead of random weights.

Two checks, on every device:

1. Stock eager vs kimi_dep on the same steps from identical caches: the largest difference in logits and
   in every cache. With cuBLAS tactics (the default on a CPU) the rewritten ops compute exactly what stock
   computes, so the rewritten graph matches stock eager to the bit: 0 and 0. Anything else (the measured
   split-K tables, the default on CUDA; Inductor; CUDA kernels) rounds a BF16 value differently now and
   then, and on this random model a near-tied top-16 router turns one ulp into O(1) in logits over a few
   steps, for plain Inductor as much as for kimi_dep: then these numbers say nothing about correctness.
2. The yardstick (dep_compile.debug.parity, as the tests use it): the same model with decisive routing
   (router biases 1 apart, so no rounding flips an expert), each side's logits one step at a time from
   the caches of the FP32 truth (the model upcast to FP32, eager on the CPU), as a relative error against
   the truth's logits: eager BF16, plain Inductor, kimi_dep (the rewritten graph; with --inductor also
   kimi_dep + Inductor); routing agreement with eager BF16 on the same inputs; and one line saying
   whether kimi_dep is within the tests' bound: max(1.5 x the worse of eager's and plain Inductor's
   error, 2e-2). On a CPU plain Inductor runs only with --inductor (its C++ compile of the 8 layers
   takes minutes on 2 cores, and this is the README's first command); the bound then uses eager's error.
"""

from __future__ import annotations

import argparse
import time

import torch

import dep_compile
from dep_compile.config import CUBLAS_ONLY
from dep_compile.debug import parity
from dep_compile.integrations.checkpoint import load_stock_model
from dep_compile.tactics import DEP_OPROJ, DEP_PROJECTION
from dep_compile.stock import KimiCache, RequestBatch, build_model, preset, tile_experts_
from dep_compile.stock.cache import cache_differences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k31-small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--q", type=int, default=1, help="tokens per request (1 = decode, >1 = verify)")
    ap.add_argument("--inductor", action="store_true", help="also compile kimi_dep with Inductor")
    ap.add_argument("--tables", choices=["auto", "cublas", "measured"], default="auto",
                    help="projection tactics: the H200-measured tables, or cuBLAS everywhere (auto: measured on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    weights = ap.add_mutually_exclusive_group()
    weights.add_argument("--experts", choices=["bf16", "mxfp4"], default=None,
                         help="routed experts' format (default: the preset's)")
    weights.add_argument("--checkpoint", default=None, help="load this checkpoint (its config sets the model)")
    ap.add_argument("--dense", choices=["bf16", "fp8_block"], default=None,
                    help="dense projections' format (default: bf16; fp8_block layers stay stock for now)")
    args = ap.parse_args()
    if args.checkpoint and args.dense:
        ap.error("--dense: the checkpoint's config sets the format")
    t_start = time.perf_counter()

    torch.manual_seed(0)
    if args.checkpoint:
        model = load_stock_model(args.checkpoint).to(args.device)
        cfg = model.config
    else:
        cfg = preset(args.preset, **({"experts_format": args.experts} if args.experts else {}),
                     **({"dense_format": args.dense} if args.dense else {}))
        model = build_model(cfg, seed=0, device=args.device)
    if args.device != "cpu":  # MXFP4 experts: the tiles kimi_dep's kernels read, made in place (as vLLM loads them)
        tile_experts_(model)
    cache = KimiCache.allocate(cfg, num_slots=2 * args.batch, num_blocks=16 * args.batch, block_size=8,
                               device=args.device)
    measured = args.tables == "measured" or (args.tables == "auto" and args.device != "cpu")
    tables = {"projection_tables": DEP_PROJECTION, "oproj_table": DEP_OPROJ} if measured else CUBLAS_ONLY
    g = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, cfg.vocab_size, (args.batch * args.q,), generator=g).to(args.device)
             for _ in range(args.steps)]

    def run(fn):
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

    # one graph per side (dynamic=False): the checks below run the same shapes
    sides = {"kimi_dep (rewritten graph)": torch.compile(model, backend="kimi_dep", fullgraph=True, dynamic=False,
                                                         options={"inductor": False, **tables})}
    ref = run(model)
    rewritten = run(sides["kimi_dep (rewritten graph)"])
    print(dep_compile.last_report().table())
    exact = not measured and args.device == "cpu"
    print(f"\n1. Against stock eager: {args.steps} steps of {args.batch} requests x q={args.q} on {args.device}, "
          f"{'measured split-K' if measured else 'cuBLAS'} tactics"
          f"{' (exact contract: both must be 0)' if exact else ' (not exact: no yardstick on this random model)'}:")
    compare("kimi_dep (rewritten graph)", rewritten)
    stock_inductor = torch.compile(model, backend="inductor", fullgraph=True, dynamic=False)  # compiles on first use
    if args.inductor:
        sides["kimi_dep + Inductor"] = torch.compile(model, backend="kimi_dep", fullgraph=True, dynamic=False,
                                                     options={"inductor": True, **tables})
        compare("plain Inductor on stock", run(stock_inductor))
        compare("kimi_dep + Inductor", run(sides["kimi_dep + Inductor"]))
    if exact:
        diff = max((a - r).abs().max().item() for a, r in zip(rewritten[0], ref[0]))
        caches = max(cache_differences(rewritten[1], ref[1]).values())
        print(f"  exact: {'yes' if diff == 0 and caches == 0 else 'NO'}")

    # 2. The yardstick: decisive routing (in place: the compiled graphs read the biases as inputs),
    # one step at a time from the FP32 truth's caches.
    parity.decisive_routing(model)
    sched = dict(rows=args.batch, steps=args.steps, verify=0) if args.q == 1 else \
        dict(rows=args.batch, steps=0, verify=args.steps, q=args.q)
    truth, states = parity.fp32_truth(model, cache, **sched)

    def one_step(fn):
        with parity.record_routing() as ids:
            logits = parity.one_step_logits(model, fn, cache, states, **sched)
        return parity.rel_err(logits, truth), ids

    err, ids = {}, {}
    with_inductor = args.inductor or args.device != "cpu"
    yardsticks = [("eager BF16 (stock)", None)] + ([("plain Inductor (stock)", stock_inductor)] if with_inductor else [])
    for name, fn in [*yardsticks, *sides.items()]:  # kimi_dep compiled above (its validation runs the MoE op)
        err[name], ids[name] = one_step(fn)
    print(f"\n2. One-step logits error against the FP32 truth (relative Frobenius; decisive routing; each of the "
          f"{args.steps} steps from the truth's caches; the truth runs on the CPU):")
    for name in err:
        agree = parity.routing_agreement(ids[name], ids["eager BF16 (stock)"])
        print(f"  {name:34s} {err[name]:.4g}   routing agreement with eager {agree:.4f}")
        if name == "eager BF16 (stock)" and not with_inductor:
            print(f"  {'plain Inductor (stock)':34s} not run on a CPU without --inductor (a C++ compile of minutes)")
    worst = max((n for n in sides), key=err.get)
    ok, bound = parity.within_bound(err[worst], *(err[n] for n, _ in yardsticks))
    print(f"kimi_dep within the tests' bound: {'yes' if ok else 'NO'} ({err[worst]:.4g} {'<=' if ok else '>'} "
          f"{bound:.4g} = max({parity.BOUND_FACTOR} x the worse of {' and '.join(n for n, _ in yardsticks)}, "
          f"{parity.LOGIT_REL}); {worst})")
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
