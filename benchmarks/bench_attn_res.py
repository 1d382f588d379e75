#!/usr/bin/env python3
"""Op-level benchmark of AttnRes and the fused AttnRes -> RMSNorm (Kimi K3 hidden 7168, 16 bank slots).

For each T (rows of a decode step) and ``num_blocks`` (sources before the prefix; a K3 point has
1-16, 8.5 on average) it times, in one process on the same inputs:

* ``ref``: the PyTorch reference (``attn_res_ref``) run eagerly on CUDA, what the stock op ran before;
* ``ref_inductor``: the same reference compiled by plain Inductor (a plainly written layer);
* ``kernel``: the stock op's one-launch Triton kernel (``kimi_k3::attn_res`` on CUDA; ``UNROLL`` = 2
  bank rows per load), and ``kernel_u<rows>`` other tunings of it;
* ``stock_pair``: the stock AttnRes op then stock's RMSNorm, compiled by plain Inductor (the op is
  opaque, the norm one Inductor kernel): what a stock decoder runs at each point;
* ``fused``: ``kimi_dep::attn_res_norm`` (one launch), what kimi_dep runs there;
* with option ``attn_res_ahead``, the fused point split in two: ``bank_part``, the bank rows' softmax part
  (``attn_res_bank_part_cuda``), which runs a point early beside the sublayer, and ``fused_part``, the point
  merging that part with its prefix (``attn_res_norm_cuda(..., part=)``), which is what stays on the step's path.

Method (docs/design.md §7.2, ``benchmarks/common.py``): CUDA events over CUDA-graph replays, medians;
inputs random, rotated over enough copies (prefix, bank, delta, query, norm weight) to exceed
twice the L2. Each variant is checked once against the reference on the same inputs (prefix and
bank exact, outputs by relative error). Bytes moved per call: prefix read + write, delta, the
``num_blocks`` bank rows read, query; the output written; the fused op also reads the norm weight,
the stock pair also writes and re-reads the mix. Reported: µs, the ratio of each to ``stock_pair``
(the fused op's speedup) and to ``ref``, TB/s, and the multiple of the floor at 4.33 TB/s (measured
read ceiling) and 4.8 TB/s (spec). Writes ``attn_res.json`` and ``attn_res.png`` to ``--out`` (default
``docs/``).

Run from the repository root on a CUDA machine::

    python3 benchmarks/bench_attn_res.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import common  # noqa: E402
import dep_compile.ops.attn_res  # noqa: E402,F401  (registers kimi_dep::attn_res_norm)
import dep_compile.stock.ops  # noqa: E402,F401  (registers kimi_k3::attn_res)
from dep_compile.stock.attn_res_cuda import (PART_EXTRA, UNROLL, attn_res_bank_part_cuda,  # noqa: E402
                                             attn_res_cuda, attn_res_norm_cuda)
from dep_compile.stock.reference.attn_res import attn_res_ref, bank_part_ref  # noqa: E402

D, NB, EPS = 7168, 16, 1e-5
ROWS = (1, 2, 4, 8, 16, 32, 64)
NUM_BLOCKS = (1, 8, 16)
KERNEL_VARIANTS = (1, 4)  # bank rows per load besides the default UNROLL
BF16 = torch.bfloat16


def make_copy(T: int, seed: int) -> dict:
    """One point's random inputs: prefix [T, D], bank [NB, T, D], delta [T, D], query and norm weight [D]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(BF16).cuda()  # noqa: E731
    return dict(prefix=r(T, D), bank=r(NB, T, D), delta=r(T, D), query=r(D, scale=0.05),
                norm_w=(1 + r(D, scale=0.1).float()).to(BF16))


def nbytes(T: int, num_blocks: int, variant: str) -> int:
    """Bytes a call must move (write_slot = -1): prefix r/w, delta, bank rows, query, output (+ norm weight); the
    bank part: the bank rows and query read, the FP32 part written; the point merging it reads that instead."""
    row, part = T * D * 2, T * (D + PART_EXTRA) * 4
    if variant == "bank_part":
        return num_blocks * row + D * 2 + part
    n = 2 * row + row + (part if variant == "fused_part" else num_blocks * row) + D * 2 + row
    if variant in ("fused", "fused_part", "stock_pair"):
        n += D * 2
    if variant == "stock_pair":
        n += 2 * row  # the mix written by the AttnRes op and read back by the norm
    return n


def with_parts(c: dict, blocks) -> dict:
    """A copy with the bank part of each ``num_blocks`` in ``blocks`` (``part<nb>``), as the point before makes it."""
    return {**c, **{f"part{nb}": attn_res_bank_part_cuda(c["bank"], c["query"], EPS, nb, -1) for nb in blocks}}


def ref_mix(c, nb):
    return attn_res_ref(c["prefix"], c["bank"], c["delta"], c["query"], EPS, nb, -1)


def ref_pair(c, nb):
    return F.rms_norm(ref_mix(c, nb).float(), (D,), c["norm_w"].float(), EPS).to(BF16)


def stock_pair(c, nb):
    h = torch.ops.kimi_k3.attn_res(c["prefix"], c["bank"], c["delta"], c["query"], EPS, nb, -1)
    return F.rms_norm(h.float(), (D,), c["norm_w"].float(), EPS).to(BF16)


def tuned_kernel(unroll: int):
    """The stock kernel with another tuning (bank rows per load)."""
    return lambda c, nb: attn_res_cuda(c["prefix"], c["bank"], c["delta"], c["query"], EPS, nb, -1, unroll=unroll)


def variants() -> dict:
    """name -> fn(copy, num_blocks) -> output ([T, D]: the mix, or the normed mix for the pairs)."""
    return {
        "ref": ref_mix,
        "ref_inductor": torch.compile(ref_mix, dynamic=False),
        "kernel": lambda c, nb: torch.ops.kimi_k3.attn_res(c["prefix"], c["bank"], c["delta"], c["query"], EPS, nb, -1),
        **{f"kernel_u{u}": tuned_kernel(u) for u in KERNEL_VARIANTS},
        "stock_pair": torch.compile(stock_pair, dynamic=False),
        "fused": lambda c, nb: torch.ops.kimi_dep.attn_res_norm(c["prefix"], c["bank"], c["delta"], c["query"],
                                                                c["norm_w"], EPS, nb, -1, EPS),
        "bank_part": lambda c, nb: attn_res_bank_part_cuda(c["bank"], c["query"], EPS, nb, -1),
        "fused_part": lambda c, nb: attn_res_norm_cuda(c["prefix"], c["bank"], c["delta"], c["query"], c["norm_w"],
                                                       EPS, nb, -1, EPS, part=c[f"part{nb}"]),
    }


PAIRED = ("stock_pair", "fused", "fused_part")  # variants whose output is the normalized mix


def check(fns: dict, T: int, nb: int) -> dict:
    """Each variant against the eager reference on one copy: prefix / bank exact, output relative error (the bank
    part: its mix against the reference's, ``bank_part_ref``)."""
    base = with_parts(make_copy(T, 7), [nb])
    want = {}
    for paired in (False, True):
        c = {k: v.clone() for k, v in base.items()}
        want[paired] = ((ref_pair if paired else ref_mix)(c, nb), c["prefix"], c["bank"])
    out = {}
    for name, fn in fns.items():
        c = {k: v.clone() for k, v in base.items()}
        got = fn(c, nb)
        ref, prefix, bank = want[name in PAIRED]
        if name == "bank_part":  # writes neither prefix nor bank
            got, ref = got[:, :D], bank_part_ref(c["bank"], c["query"], EPS, nb, -1)[:, :D]
            prefix, bank = base["prefix"], base["bank"]
        out[name] = dict(rel_err=common.rel_err(got, ref), state_exact=bool(torch.equal(c["prefix"], prefix)
                                                                             and torch.equal(c["bank"], bank)))
    return out


def plot(results: list[dict], path: str) -> str | None:
    """A PNG of µs against bank rows, a panel per T: the kernels, the fused op, stock's pair, Inductor's reference."""
    shown = ("kernel", "fused", "fused_part", "stock_pair", "ref_inductor")
    panels = [{"title": f"T = {T}", "x": [r["num_blocks"] for r in results if r["T"] == T],
               "series": {k: [r["variants"][k]["median_us"] for r in results if r["T"] == T] for k in shown}}
              for T in sorted({r["T"] for r in results})]
    return common.plot_panels(path, panels, xlabel="bank rows (num_blocks)", ylabel="µs", logx=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--num-blocks", default=",".join(map(str, NUM_BLOCKS)))
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    blocks = [int(x) for x in args.num_blocks.split(",")]
    common.raise_recompile_limits(4 * len(rows) * len(blocks))
    fns = variants()
    results = []
    for T in rows:
        per_copy = sum(t.numel() * t.element_size() for t in make_copy(T, 0).values())
        n = common.rotation_copies(per_copy)
        copies = [with_parts(make_copy(T, s), blocks) for s in range(n)]
        for nb in blocks:
            parity = check(fns, T, nb)
            row = dict(T=T, num_blocks=nb, copies=n, parity=parity, variants={})
            for name, fn in fns.items():
                steps = common.steps_per_replay(10.0, n)
                stats = common.time_graph(lambda i: fn(copies[i % n], nb), steps)
                b = nbytes(T, nb, name if name in (*PAIRED, "bank_part") else "attn_res")
                floors = common.floors_us(b)
                row["variants"][name] = dict(**stats, bytes=b, tbps=common.tbps(b, stats["median_us"]),
                                             x_floor_practical=stats["median_us"] / floors["practical"],
                                             x_floor_spec=stats["median_us"] / floors["spec"])
            v = row["variants"]
            row["fused_speedup_vs_stock_pair"] = v["stock_pair"]["median_us"] / v["fused"]["median_us"]
            row["kernel_speedup_vs_ref"] = v["ref"]["median_us"] / v["kernel"]["median_us"]
            row["kernel_speedup_vs_ref_inductor"] = v["ref_inductor"]["median_us"] / v["kernel"]["median_us"]
            results.append(row)
            print(f"T={T:3d} nb={nb:2d}  " + "  ".join(
                f"{k} {x['median_us']:7.2f}us ({x['x_floor_practical']:.2f}x fl)" for k, x in v.items())
                  + f"  fused/stock_pair {row['fused_speedup_vs_stock_pair']:.2f}x", flush=True)
    headers = ("T", "nb", "ref us", "ref_inductor us", "kernel us", "stock_pair us", "fused us", "bank_part us",
               "fused_part us", "fused vs stock_pair", "kernel x floor", "fused x floor")
    table = [(r["T"], r["num_blocks"], *(f"{r['variants'][k]['median_us']:.2f}" for k in
                                         ("ref", "ref_inductor", "kernel", "stock_pair", "fused", "bank_part",
                                          "fused_part")),
              f"{r['fused_speedup_vs_stock_pair']:.2f}x", f"{r['variants']['kernel']['x_floor_practical']:.2f}",
              f"{r['variants']['fused']['x_floor_practical']:.2f}") for r in results]
    print(common.format_table(headers, table))
    path = common.write_json(os.path.join(args.out, "attn_res.json"), {
        "D": D, "bank_slots": NB, "write_slot": -1, "unroll": UNROLL, "results": results,
        "kernels": {"kimi_k3::attn_res": "stock.attn_res_cuda.attn_res_cuda (one Triton launch)",
                    "kimi_dep::attn_res_norm": "stock.attn_res_cuda.attn_res_norm_cuda (one Triton launch)",
                    "bank_part / fused_part": "attn_res_bank_part_cuda, then attn_res_norm_cuda(part=) (option "
                                              "attn_res_ahead: the first off the step's path)"},
    })
    print(f"wrote {path}, {plot(results, os.path.join(args.out, 'attn_res.png'))}")


if __name__ == "__main__":
    main()
