"""Routed experts on the GPU: kimi_dep's Triton kernels vs stock's two ``torch._grouped_mm`` calls.

    python benchmarks/bench_experts.py [--format bf16|mxfp4] [--out DIR] [--sweep] [--tokens 1 2 4 ...] [--ep-rows ...]

K3 widths (latent 3584, intermediate 3072, top-16; BF16 experts, or ``--format mxfp4`` as K3 ships them:
E2M1 codes two a byte and an E8M0 scale per 32 inputs). Two settings, one process, same inputs:

* **slice**: 64 local experts (the full-width slice), 1..64 tokens, each picking 16 distinct
  experts of the 64;
* **EP16**: one rank's 56 local experts of 896 (rank 3), ``R`` tokens each picking 16 distinct of
  896, so about ``R`` routed rows land on the rank (the actual count is reported).

Beside the default tactic, ``1 slice`` is the same without split-K (``split_k=1``): at 1-4 EP rows, where
1-4 local experts are touched, the default cuts each program's K range into slices (``experts_triton``).

Each point is first checked against the CPU reference's function (``routed_experts_partial``,
run on the GPU, on the dequantized weights for MXFP4): relative Frobenius error of both sides;
MXFP4 kimi_dep must also be bit-equal to its BF16 kernels on the dequantized weights. Then each is
timed with CUDA events over CUDA-graph replays (``benchmarks/common.py``), the expert weights
rotated past L2 (copies of w13 / w2, launch ``i`` reads copy ``i % copies``); medians. Stock is
the grouped GEMMs (MXFP4: the touched experts dequantized to BF16 first, ``stock/mxfp4_cuda.py``).
MXFP4 also times kimi_dep's BF16 kernels on the same logical weights (``bf16 µs``). TB/s counts the
touched experts' stored bytes (w13 + w2 of every local expert with at least one row; MXFP4: codes
and scales), the floor is those bytes at 4.33 TB/s (measured read ceiling) and 4.8 TB/s (spec).
``--sweep`` also times a few tile tactics. Writes ``experts[_mxfp4].json`` and ``.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (HBM_PRACTICAL_BPS, floors_us, format_table, kernel_profile, plot_panels, rel_err,  # noqa: E402
                    rotation_copies, steps_per_replay, tbps, time_graph, write_json)

from dep_compile.ops.experts_triton import (DEFAULT_MXFP4_TACTIC, DEFAULT_TACTIC, ExpertsTactic,  # noqa: E402
                                            routed_experts_triton)
from dep_compile.stock.grouped_experts import routed_experts_grouped  # noqa: E402
from dep_compile.stock.mxfp4 import GROUP, Mxfp4Weight, random_mxfp4  # noqa: E402
from dep_compile.stock.mxfp4_cuda import routed_experts_mxfp4_grouped  # noqa: E402
from dep_compile.stock.reference.moe import routed_experts_partial  # noqa: E402

LAT, INTER, TOP_K, BETA, BETA_LIN = 3584, 3072, 16, 4.0, 25.0
EXPERT_BYTES = {"bf16": 3 * INTER * LAT * 2, "mxfp4": 3 * INTER * (LAT // 2 + LAT // GROUP)}  # stored bytes


def _local(w, E):
    """The first ``E`` experts of a stacked weight (BF16 tensor or Mxfp4Weight)."""
    return Mxfp4Weight(w.packed[:E], w.scale[:E]) if isinstance(w, Mxfp4Weight) else w[:E]
SWEEP = [  # run 1 (docs/perf_experts.md) also timed w8 and k256 variants: slower everywhere
    ExpertsTactic(32, 64, 128, 4, 4),  # half-width GEMM1 tiles: twice the programs
    ExpertsTactic(64, 64, 128, 4, 4, block_m=16),  # 16-row passes at every batch
    ExpertsTactic(64, 128, 128, 8, 4),  # wider GEMM2 tiles
]


MXFP4_TACTICS = [  # beside the default (DEFAULT_MXFP4_TACTIC: the re-packed copy, 128-input steps, 168 registers)
    ExpertsTactic(block_k=256, num_stages=3, ptx_dequant=True),  # the checkpoint's layout (the fallback)
    ExpertsTactic(block_k=256, num_stages=3, ptx_dequant=True, tiles=True),
    ExpertsTactic(block_k=128, num_stages=4, ptx_dequant=True, tiles=True, maxnreg=128),
    # measured on the H200: the checkpoint's layout (2026-12-02): Triton integer dequant, 128-input steps 0.67-0.77
    # TB/s; PTX, 128-input steps 0.88-1.11; PTX, 512-input steps 0.80-1.02; 8 warps 0.52-0.64; an even/odd tiling
    # 0.2-0.6; a register double buffer slower than Triton's pipeliner (GEMM1 at 1 token 195-1572 µs against 161).
    # The re-packed copy (2026-12-03): 256-input steps with 2 stages and 128 registers 1.64-2.17 TB/s
]


def routing(tokens: int, total: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, 16] FP32 renormalized x 2.5, ids [T, 16] int64): 16 distinct random experts a token."""
    ids = torch.stack([torch.randperm(total, generator=gen)[:TOP_K] for _ in range(tokens)])
    w = torch.rand(tokens, TOP_K, generator=gen) + 0.05
    return (w / w.sum(-1, keepdim=True) * 2.5).cuda(), ids.cuda()


def run_point(setting, tokens, E, start, total, w13s, w2s, gen, tactics, profile):
    """Check, then time stock and each tactic at one point; returns the result row."""
    x = torch.randn(tokens, LAT, generator=gen).to(torch.bfloat16).cuda()
    tw, ids = routing(tokens, total, gen)
    if not ((ids >= start) & (ids < start + E)).any():  # a point with no local pick would time nothing
        ids[0, 0] = start + int(torch.randint(E, (1,), generator=gen))
    local = ids[(ids >= start) & (ids < start + E)]
    rows, touched = int(local.numel()), int(local.unique().numel())
    mxfp4 = isinstance(w13s[0], Mxfp4Weight)
    nbytes = touched * EXPERT_BYTES["mxfp4" if mxfp4 else "bf16"]
    w13, w2 = _local(w13s[0], E), _local(w2s[0], E)
    dense = (w13.dequantize(), w2.dequantize()) if mxfp4 else (w13, w2)
    ref = routed_experts_partial(x, *dense, tw, ids, start, BETA, BETA_LIN)
    grouped = routed_experts_mxfp4_grouped if mxfp4 else routed_experts_grouped
    stock = lambda i: grouped(x, _local(w13s[i % len(w13s)], E), _local(w2s[i % len(w2s)], E), tw, ids,  # noqa: E731
                              start, BETA, BETA_LIN)
    row = dict(setting=setting, tokens=tokens, experts=E, rows=rows, touched=touched, bytes=nbytes,
               err_stock=rel_err(stock(0), ref))
    n_steps = steps_per_replay(nbytes / HBM_PRACTICAL_BPS * 1e6 * 1.3, len(w13s))
    row["stock_us"] = time_graph(stock, n_steps)["median_us"]
    for name, tac in tactics.items():
        def fn(i, tac=tac):
            return routed_experts_triton(x, _local(w13s[i % len(w13s)], E), _local(w2s[i % len(w2s)], E), tw, ids,
                                         start, BETA, BETA_LIN, tactic=tac)

        err = rel_err(fn(0), ref)
        assert err < 4e-3, f"{setting} {tokens} tokens, {name}: rel err {err}"
        if mxfp4:  # the same tiles as the BF16 kernels: the same bits
            assert torch.equal(fn(0), routed_experts_triton(x, *dense, tw, ids, start, BETA, BETA_LIN, tactic=tac)), \
                f"{setting} {tokens} tokens, {name}: MXFP4 kernels differ from the BF16 ones on the dequantized weights"
        row[f"err_{name}"] = err
        row[f"{name}_us"] = time_graph(fn, n_steps)["median_us"]
    if mxfp4:  # kimi_dep's BF16 kernels on the same logical weights (4x the bytes)
        bf16 = lambda i: routed_experts_triton(x, *dense, tw, ids, start, BETA, BETA_LIN)  # noqa: E731
        row["bf16_us"] = time_graph(bf16, steps_per_replay(4 * nbytes / HBM_PRACTICAL_BPS * 1e6 * 1.3, 1))["median_us"]
    if profile:
        row["profile"] = kernel_profile(lambda: routed_experts_triton(x, w13, w2, tw, ids, start, BETA, BETA_LIN))
    fl = floors_us(nbytes)
    row.update(floor_433_us=fl["practical"], floor_48_us=fl["spec"], stock_tbps=tbps(nbytes, row["stock_us"]),
               dep_tbps=tbps(nbytes, row["dep_us"]), ratio=row["stock_us"] / row["dep_us"])
    print(f"{setting} T={tokens}: rows {rows} touched {touched} stock {row['stock_us']:.1f} µs, "
          + ", ".join(f"{n} {row[n + '_us']:.1f}" for n in tactics)
          + (f", BF16 kernels {row['bf16_us']:.1f}" if mxfp4 else ""), flush=True)
    return row


def launch_once(setting, tokens, E, start, total, w13s, w2s, gen, tactics) -> None:
    """Each tactic's kernels launched once at one point, nothing checked or timed (``--ncu``: the kernels for
    Nsight Compute, outside CUDA graphs)."""
    x = torch.randn(tokens, LAT, generator=gen).to(torch.bfloat16).cuda()
    tw, ids = routing(tokens, total, gen)
    for name, tac in tactics.items():
        torch.cuda.nvtx.range_push(f"{setting} T={tokens} {name}")
        routed_experts_triton(x, _local(w13s[0], E), _local(w2s[0], E), tw, ids, start, BETA, BETA_LIN, tactic=tac)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"{setting} T={tokens}: launched " + ", ".join(tactics), flush=True)


def expert_weights(fmt: str, E: int, copies: int, seed: int = 0):
    """``copies`` sets of ``E`` experts' (w13, w2) on the GPU, in ``fmt`` (random, drawn there)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "mxfp4":
        return ([Mxfp4Weight(*random_mxfp4((E, 2 * INTER, LAT), g, 2 * LAT ** -0.5)) for _ in range(copies)],
                [Mxfp4Weight(*random_mxfp4((E, LAT, INTER), g, INTER ** -0.5)) for _ in range(copies)])
    return ([(torch.randn(E, 2 * INTER, LAT, device="cuda", generator=g) * LAT ** -0.5 * 2).to(torch.bfloat16)
             for _ in range(copies)],
            [(torch.randn(E, LAT, INTER, device="cuda", generator=g) * INTER ** -0.5).to(torch.bfloat16)
             for _ in range(copies)])


# the default's tiles, the compiler's registers, crowded passes held to the one-pass loop's shared memory, a crowded
# expert's last rows in another crowded pass (MXFP4's default until 2026-12-07)
_NO_CAP = dataclasses.replace(DEFAULT_MXFP4_TACTIC, maxnreg=None, big_stages=None, small_tail=False)
CROWDED_TACTICS = [  # MXFP4 where experts hold ~64 rows (verify steps: 64 requests x q = 4 on 64 experts)
    dataclasses.replace(_NO_CAP, block_m=64, big_m=128),  # one pass up to 64 rows, 128-row passes above
    dataclasses.replace(_NO_CAP, block_m=64, maxnreg=168),  # one pass up to 64 rows, the full pipeline
    dataclasses.replace(_NO_CAP, block_m=128, big_m=128),  # one 128-row pass
    dataclasses.replace(_NO_CAP, block_n1=128, block_n2=128, num_warps=8),  # 128 weight rows a program: half the
                                                                             # activation re-reads
    dataclasses.replace(_NO_CAP, block_n1=128, block_n2=128, num_warps=8, block_m=64, big_m=128),
    dataclasses.replace(DEFAULT_MXFP4_TACTIC, small_tail=False),  # a crowded expert's last <= 32 rows in another
                                                                  # 64-row pass (the default until 2026-12-07, 22:0x)
    dataclasses.replace(DEFAULT_MXFP4_TACTIC, big_stages=2, small_tail=False),  # the crowded passes 2 deep too (the
                                                                                # default until 2026-12-07, 21:0x)
    # measured on an H100 (2026-12-07, docs/perf.md): 128 weight rows with the crowded passes 3 deep, and one pass up
    # to 64 rows with 128-row passes 3 deep (one program an SM), 11-32 % behind the default at 256 tokens
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--ep-rows", type=int, nargs="+", default=[1, 2, 4, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true", help="also time the tactics in SWEEP")
    ap.add_argument("--format", choices=["bf16", "mxfp4"], default="bf16", help="the experts' weights")
    ap.add_argument("--crowded", action="store_true",
                    help="MXFP4: time CROWDED_TACTICS (pass sizes and tile widths for ~64 rows an expert) instead of "
                         "MXFP4_TACTICS")
    ap.add_argument("--ncu", action="store_true", help="launch each tactic once a point, time nothing (under ncu)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    default = DEFAULT_MXFP4_TACTIC if args.format == "mxfp4" else DEFAULT_TACTIC
    tactics = {"dep": default, "1 slice": dataclasses.replace(default, split_k=1)}
    if args.format == "mxfp4":  # the two dequantizers: Triton integer ops (default) and PTX (two values an op)
        tactics.update({str(t): t for t in (CROWDED_TACTICS if args.crowded else MXFP4_TACTICS)})
    if args.sweep:
        tactics.update({str(t): t for t in SWEEP})
    E_SLICE, E_EP, EP_START, EP_TOTAL = 64, 56, 3 * 56, 896
    copies = 1 if args.ncu else rotation_copies(E_EP * EXPERT_BYTES[args.format])
    # one set of 64 experts per copy; the EP rank uses the first 56 of them
    w13s, w2s = expert_weights(args.format, E_SLICE, copies)
    if args.ncu:
        with torch.no_grad():
            for T in args.tokens:
                launch_once("slice", T, E_SLICE, 0, E_SLICE, w13s, w2s, gen, tactics)
        return
    results = []
    with torch.no_grad():
        for T in args.tokens:
            results.append(run_point("slice", T, E_SLICE, 0, E_SLICE, w13s, w2s, gen, tactics, profile=T in (1, 64)))
        for R in args.ep_rows:
            results.append(run_point("ep16", R, E_EP, EP_START, EP_TOTAL, w13s, w2s, gen, tactics,
                                     profile=R in (1, 16, 1024)))
    mx = args.format == "mxfp4"
    headers = ["setting", "tokens", "rows", "experts", "GB", "stock µs", "dep µs", "ratio", *(["BF16 dep µs", "vs BF16"]
               if mx else []), "stock TB/s", "dep TB/s", "dep/4.33", "floor@4.33", "floor@4.8", "err stock", "err dep"]
    table = [[r["setting"], r["tokens"], r["rows"], r["touched"], f"{r['bytes'] / 1e9:.3f}", f"{r['stock_us']:.1f}",
              f"{r['dep_us']:.1f}", f"{r['ratio']:.2f}",
              *([f"{r['bf16_us']:.1f}", f"{r['bf16_us'] / r['dep_us']:.2f}"] if mx else []),
              f"{r['stock_tbps']:.2f}", f"{r['dep_tbps']:.2f}",
              f"{r['dep_tbps'] * 1e12 / HBM_PRACTICAL_BPS:.2f}", f"{r['floor_433_us']:.1f}",
              f"{r['floor_48_us']:.1f}", f"{r['err_stock']:.1e}", f"{r['err_dep']:.1e}"] for r in results]
    if args.sweep:
        print(format_table(["setting", "tokens"] + list(tactics),
                           [[r["setting"], r["tokens"]] + [f"{tbps(r['bytes'], r[n + '_us']):.2f}" for n in tactics]
                            for r in results]))
    for r in results:
        for k in r.get("profile", []):
            print(f"  {r['setting']} {r['tokens']}: {k['us']:8.1f} µs x{k['launches']:.0f} {k['kernel']}")
    print(format_table(headers, table))
    os.makedirs(args.out, exist_ok=True)
    stem = "experts_mxfp4" if mx else "experts"
    write_json(os.path.join(args.out, f"{stem}.json"),
               {"tactic": str(default), "format": args.format, "copies": copies, "rows": results})
    panels = []
    for setting, title in (("slice", "slice: 64 local experts"), ("ep16", "EP16 rank: 56 local of 896")):
        rs = [r for r in results if r["setting"] == setting]
        if rs:
            panels.append({"title": title + " (TB/s of touched experts)", "x": [r["tokens"] for r in rs],
                           "series": {"stock " + ("dequant + " if mx else "") + "_grouped_mm": [r["stock_tbps"] for r in rs],
                                      "kimi_dep Triton": [r["dep_tbps"] for r in rs]},
                           "hlines": {"4.33 TB/s read ceiling": 4.33, "4.8 TB/s spec": 4.8}})
    plot_panels(os.path.join(args.out, f"{stem}.png"), panels, xlabel="tokens (EP16: ~routed rows)", ylabel="TB/s")


if __name__ == "__main__":
    main()
