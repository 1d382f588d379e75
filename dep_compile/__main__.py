"""``python -m dep_compile explain``: compile a stock decoder with kimi_dep and show what changed."""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch


def _op_counts(gm) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes
                               if n.op == "call_function" and str(n.target).startswith(("kimi_k3.", "kimi_dep.")))


def explain(preset_name: str, kinds: tuple[str, ...], dump: str | None, q_len: int, batch: int) -> int:
    from dep_compile.backend import kimi_dep
    from dep_compile.stock import KimiCache, RequestBatch, build_model, preset

    cfg = preset(preset_name)
    model = build_model(cfg)
    cache = KimiCache.allocate(cfg, num_slots=2 * batch, num_blocks=8 * batch, block_size=8)
    meta = RequestBatch(cache, batch, start_len=8).step(q_len)
    before, after = [], []

    def backend(gm, example_inputs):
        before.append(_op_counts(gm))
        fn = kimi_dep(gm, example_inputs, options={"inductor": False, "kinds": kinds, "dump_dir": dump})
        after.append(_op_counts(gm))
        return fn

    debug = contextlib.nullcontext()
    if dump:
        try:
            import depyf

            debug = depyf.prepare_debug(dump)
        except ImportError:
            print("(depyf not installed: no decompiled bytecode in the dump)")
    with debug, torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, cfg.vocab_size, (batch * q_len,)),
                                                              meta, cache)
    import dep_compile

    print(dep_compile.last_report().table())
    print("\nops before -> after:")
    for op in sorted(set(before[0]) | set(after[0])):
        print(f"  {op:40s} {before[0][op]:3d} -> {after[0][op]:3d}")
    if dump:
        print(f"\ndumps written to {dump}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dep_compile")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("explain", help="compile a stock decoder, print the match table and what changed")
    ex.add_argument("--preset", default="k31-small", help="k3-small | k31-small | mixed-small")
    ex.add_argument("--kinds", default="dsa,kda,moe", help="comma-separated subset of dsa,kda,moe")
    ex.add_argument("--dump", default=None, help="dump directory")
    ex.add_argument("--q", type=int, default=1, help="tokens per request")
    ex.add_argument("--batch", type=int, default=2)
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    return explain(args.preset, kinds, args.dump, args.q, args.batch)


if __name__ == "__main__":
    raise SystemExit(main())
