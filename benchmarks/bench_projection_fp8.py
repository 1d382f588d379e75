#!/usr/bin/env python3
"""Op-level benchmark of the FP8 block-scaled DepProjection GEMMs: kimi_dep's FP8 split-K against stock's FP8 path.

``y[M, N] = x[M, K] @ W[N, K]^T``, ``W`` e4m3 with one FP32 scale per 128 x 128 block of each row segment,
``x`` BF16 quantized per row and group of 128 (``dep_compile/stock/fp8_block.py``), at K3.1's four packed
decode projections and M = 1..64 rows. For every (shape, rows) it

1. checks stock's CUDA path (``kimi_k3::fp8_block_linear``: ``stock/fp8_block_cuda.py``) and every kimi_dep tactic against the FP32
   reference on the same codes (``fp8_block.fp8_block_linear`` computed in FP64 on the GPU): max error /
   max |ref| and the relative Frobenius error;
2. times stock and a sweep of ``SplitK`` tactics (block_k 128-512, PDL or not) over CUDA-graph replays, weights rotated
   past L2, medians (``benchmarks/common.py``);

then prints a table (µs, TB/s of weight + scale bytes, fraction of the 4.33 TB/s floor, stock / kimi_dep, the
best tactic) and writes ``projection_fp8.json`` and ``projection_fp8.png`` to ``--out`` (``--replot JSON`` redraws
a saved run).
It first prints which blockwise ``torch._scaled_mm`` scale layouts this torch takes on this GPU, and times the
first that works as a second stock candidate (one ``_scaled_mm`` per row segment, ``scaled_mm_linear``).

Run from the repository root on a CUDA machine::

    python3 benchmarks/bench_projection_fp8.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from dep_compile.stock import fp8_block  # noqa: E402
from dep_compile.stock.config import preset  # noqa: E402
from dep_compile.tactics import SplitK  # noqa: E402


def shapes() -> dict[str, tuple[list[int], int]]:
    """name -> (row segments, K) of K3.1's FP8 projections, from the config: the packed ones, then those the
    rewritten ops run one at a time (``tactics.DEP_DENSE_FP8``)."""
    c = preset("k31")
    return {
        "dsa_qkv_a_g_index": (c.mla_fused_segments + [c.index_head_dim, c.index_heads], c.hidden_size),
        "kda_in_proj": (c.kda_in_segments, c.hidden_size),
        "moe_front": ([c.shared_intermediate] * 2 + [c.moe_latent_size], c.hidden_size),
        "o_proj": ([c.hidden_size], c.mla_heads * c.v_head_dim),
        "q_b": ([c.mla_heads * c.qk_head_dim], c.q_lora_rank),
        "wq_b": ([c.index_heads * c.index_head_dim], c.q_lora_rank),
        "f_b": ([c.kda_heads * c.kda_head_dim], c.kda_f_rank),
        "shared_down": ([c.hidden_size], c.shared_intermediate),
        "latent_up": ([c.hidden_size], c.moe_latent_size),
    }


ROWS = (1, 2, 4, 8, 16, 32, 64)
# (split_k, block_n, num_warps, num_stages[, block_k[, pdl: 1 launches the GEMM as the quantizer's PDL dependent]])
CONFIGS = ((1, 64, 4, 6, 128, 1), (1, 64, 4, 6, 128, 0), (1, 64, 4, 3, 256, 1), (1, 64, 4, 3, 256, 0),
           (1, 64, 4, 4, 256, 1), (2, 64, 4, 4, 256, 1), (2, 128, 4, 4, 128, 1), (1, 128, 4, 3, 256, 1),
           (1, 64, 4, 3, 512, 1), (4, 64, 4, 4, 128, 1), (1, 32, 4, 6, 128, 1))


def config(c: tuple) -> tuple[SplitK, bool]:
    """A sweep entry -> (its tactic, whether the GEMM is a PDL launch; the default is the op's, PDL)."""
    sk, bn, nw, st, bk, pdl = (*c, *(128, 1)[len(c) - 4:])  # block_k 128 and PDL unless given
    return SplitK(sk, bn, bk, nw, st), bool(pdl)


def label(tactic: SplitK, pdl: bool) -> str:
    """A tactic's name in the results, marked where its GEMM waits for the quantizer without PDL."""
    return str(tactic) if pdl else f"{tactic}/nopdl"


def weight_bytes(segments: list[int], k: int) -> int:
    rows, cols = fp8_block.scale_shape(segments, k)
    return sum(segments) * k + rows * cols * 4


def reference(x, w, s, segments) -> torch.Tensor:
    """The module doc's arithmetic in FP64 (FP8 products exact; block scales applied per block)."""
    xq, xs = fp8_block.quantize_activations(x)
    ws = s[fp8_block.scale_rows(segments, w.device)].double()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64, device=x.device)
    for g in range(xs.shape[1]):
        k = slice(g * fp8_block.BLOCK, (g + 1) * fp8_block.BLOCK)
        out += (xq[:, k].double() @ w[:, k].double().t()) * xs[:, g, None].double() * ws[None, :, g]
    return out


def errors(got, ref) -> tuple[float, float]:
    d = got.double() - ref
    return (d.abs().max() / ref.abs().max()).item(), (d.norm() / ref.norm()).item()


LAYOUTS = {  # name -> (activation scales [M, K/128], weight scales [N/128, K/128]) as handed to _scaled_mm
    "a row-major, b [N/128,K/128] row-major": (lambda a: a, lambda b: b),
    "a col-major, b [N/128,K/128] row-major": (lambda a: a.t().contiguous().t(), lambda b: b),
    "a col-major, b [K/128,N/128] row-major": (lambda a: a.t().contiguous().t(), lambda b: b.t().contiguous()),
    "a col-major, b [N/128,K/128] col-major": (lambda a: a.t().contiguous().t(), lambda b: b.t().contiguous().t()),
    "a row-major, b [K/128,N/128] view": (lambda a: a, lambda b: b.t()),
    "a col-major, b [K/128,N/128] view": (lambda a: a.t().contiguous().t(), lambda b: b.t()),
}


def _torch_scaled_mm(xq, wt, sa, sb):
    return torch._scaled_mm(xq, wt, sa, sb, out_dtype=torch.bfloat16)


def _f_scaled_mm(xq, wt, sa, sb):
    F = torch.nn.functional
    return F.scaled_mm(xq, wt, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


APIS = {"torch._scaled_mm": _torch_scaled_mm, "F.scaled_mm": _f_scaled_mm}


def scaled_mm_linear(x, w, s, segments, choice):
    """Stock candidate: stock's activation quantizer, then one blockwise scaled matmul per row segment (a 128-row
    block may not span two segments), concatenated. ``choice``: (API name, layout name) from the probe."""
    from dep_compile.stock.fp8_block_cuda import quantize_activations  # noqa: PLC0415 - CUDA only

    api, (fa, fb) = APIS[choice[0]], LAYOUTS[choice[1]]
    xq, xs = quantize_activations(x)
    sa, outs, r0, b0 = fa(xs), [], 0, 0
    for n in segments:
        nb = fp8_block.blocks(n)
        outs.append(api(xq, w[r0:r0 + n].t(), sa, fb(s[b0:b0 + nb])))
        r0, b0 = r0 + n, b0 + nb
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def probe_scaled_mm() -> tuple[list[str], str | None]:
    """Which blockwise ``torch._scaled_mm`` scale layouts this torch takes here (1x128 activations, 128x128
    weights), each with its error against the reference or the error it raised; and the first that works."""
    g = torch.Generator().manual_seed(0)
    M, N, K = 16, 512, 1024
    w, s = fp8_block.random_fp8_block(N, K, [N], g, K ** -0.5)
    w, s = w.cuda(), s.cuda()
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    xq, xs = fp8_block.quantize_activations(x)
    ref = reference(x, w, s, [N])
    lines, good = [f"torch {torch.__version__}, CUDA {torch.version.cuda}"], None
    for api_name, api in APIS.items():
        for name, (fa, fb) in LAYOUTS.items():
            try:
                err = errors(api(xq, w.t(), fa(xs), fb(s)), ref)[0]
                lines.append(f"  ok   {api_name} {name}: max err {err:.2e}")
                if good is None and err < 1e-2:
                    good = (api_name, name)
            except Exception as e:  # noqa: BLE001 - the probe reports every failure
                lines.append(f"  fail {api_name} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return lines, good


def measure(name: str, segments: list[int], k: int, rows: int, configs, args) -> dict:
    from dep_compile.ops.splitk_fp8_triton import fp8_splitk_linear  # noqa: PLC0415 - CUDA only
    from dep_compile.ops.splitk_triton import splitk_workspace  # noqa: PLC0415

    n = sum(segments)
    g = torch.Generator().manual_seed(rows)
    nbytes = weight_bytes(segments, k)
    copies = common.rotation_copies(nbytes)
    ws = [fp8_block.random_fp8_block(n, k, segments, g, k ** -0.5) for _ in range(min(copies, 2))]
    ws = [(w.cuda(), s.cuda()) for w, s in ws]
    while len(ws) < copies:  # further copies: the same values in new memory (rotation only needs new addresses)
        ws.append((ws[len(ws) % 2][0].clone(), ws[len(ws) % 2][1].clone()))
    srow = fp8_block.scale_rows(segments, "cuda").int()
    x = torch.randn(rows, k, generator=g).bfloat16().cuda()
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    ref = reference(x, *ws[0], segments)
    res = {"name": name, "rows": rows, "n": n, "k": k, "bytes": nbytes, "floor_us": common.floor_us(nbytes)}

    def stock(i):
        return torch.ops.kimi_k3.fp8_block_linear(x, *ws[i % copies], segments)

    res["stock_err"] = errors(stock(0), ref)
    est = common.floor_us(nbytes) * 1.5
    steps = common.steps_per_replay(est, copies, args.replay_us)
    res["stock_us"] = common.time_graph(stock, steps, replays=args.replays)["median_us"]
    if args.layout is not None:
        def smm(i):
            return scaled_mm_linear(x, *ws[i % copies], segments, args.layout)

        try:
            res["scaled_mm_err"] = errors(smm(0), ref)
            res["scaled_mm_us"] = common.time_graph(smm, steps, replays=args.replays)["median_us"]
        except Exception as e:  # noqa: BLE001 - reported, not fatal: a segment width cuBLAS refuses
            res["scaled_mm_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    best = None
    res["tactics"] = {}
    for c in configs:
        tactic, pdl = config(c)
        kw = {"pdl": pdl}
        name_t = label(tactic, pdl)
        wsp = splitk_workspace(rows, n, tactic, "cuda") if tactic.split_k > 1 else None
        out.fill_(float("nan"))
        fp8_splitk_linear(x, *ws[0], srow, out, tactic, wsp, **kw)
        err = errors(out, ref)
        if not (err[0] <= args.max_err and torch.isfinite(out).all()):
            res["tactics"][name_t] = {"err": err, "us": None}
            continue
        t = common.time_graph(lambda i: fp8_splitk_linear(x, *ws[i % copies], srow, out, tactic, wsp, **kw), steps,
                              replays=args.replays)["median_us"]
        res["tactics"][name_t] = {"err": err, "us": t}
        if best is None or t < best[1]:
            best = (name_t, t, err)
    if best is not None:
        res["best"], res["best_us"], res["best_err"] = best
    return res


def plot(results: list[dict], path: str) -> str | None:
    """TB/s of weight + scale bytes against rows, per shape: kimi_dep's best tactic and stock, with the floor."""
    panels = []
    for name in dict.fromkeys(r["name"] for r in results):
        rs = [r for r in results if r["name"] == name]
        panels.append({"title": f"{name} ({rs[0]['n']} x {rs[0]['k']}, FP8 blocks)", "x": [r["rows"] for r in rs],
                       "series": {"kimi_dep FP8 split-K": [common.tbps(r["bytes"], r["best_us"]) if r.get("best_us")
                                                           else None for r in rs],
                                  "stock FP8 (cuBLAS blockwise / Triton)": [common.tbps(r["bytes"], r["stock_us"])
                                                                           for r in rs]},
                       "hlines": {"4.33 TB/s floor": common.HBM_PRACTICAL_BPS / 1e12}})
    return common.plot_panels(path, panels, xlabel="rows (tokens)", ylabel="TB/s of weight + scale bytes",
                              suptitle="FP8 block-scaled projections, H200")


def table(results: list[dict]) -> str:
    """The printed table: per (shape, rows) stock and kimi_dep µs, TB/s, fraction of the floor, ratio, tactic."""
    rows_out = []
    for r in results:
        b, smm = r.get("best_us"), r.get("scaled_mm_us")
        rows_out.append([r["name"], r["rows"], f"{r['stock_us']:.1f}", f"{smm:.1f}" if smm else "-",
                         f"{b:.1f}" if b else "-", f"{common.tbps(r['bytes'], b):.2f}" if b else "-",
                         f"{r['floor_us'] / b:.2f}" if b else "-", f"{r['stock_us'] / b:.2f}" if b else "-",
                         r.get("best", "-")])
    return common.format_table(["shape", "rows", "stock us", "scaled_mm us", "kimi_dep us", "TB/s", "floor / time",
                                "stock / kimi_dep", "tactic"], rows_out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shapes", default=",".join(shapes()))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--configs", default=None, help="split/bn/warps/stages[/block_k[/pdl 0|1]],... (default: the built-in sweep)")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--replay-us", type=float, default=1500.0)
    p.add_argument("--max-err", type=float, default=2e-2, help="largest max error / max |ref| a tactic may have")
    p.add_argument("--replot", default=None, help="a projection_fp8.json: print its table, redraw its plot, exit")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)["results"]
        print(table(results))
        print(plot(results, os.path.join(args.out, "projection_fp8.png")))
        return 0
    import dep_compile  # noqa: F401,PLC0415 - registers the kimi_k3 ops

    lines, args.layout = probe_scaled_mm()
    print("\n".join(lines), flush=True)
    configs = CONFIGS if args.configs is None else [tuple(int(v) for v in c.split("/"))
                                                    for c in args.configs.split(",")]
    by_name = shapes()
    results = []
    t0 = time.time()
    for name in args.shapes.split(","):
        segments, k = by_name[name]
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(name, segments, k, rows, configs, args)
            results.append(r)
            print(f"{name} rows {rows}: stock {r['stock_us']:.1f} us (err {r['stock_err'][0]:.1e}), scaled_mm "
                  f"{r.get('scaled_mm_us', float('nan')):.1f} us {r.get('scaled_mm_error', '')}, best "
                  f"{r.get('best')} {r.get('best_us', float('nan')):.1f} us (err "
                  f"{r.get('best_err', (float('nan'),))[0]:.1e}), floor {r['floor_us']:.1f} us  "
                  f"[{time.time() - t0:.0f} s]", flush=True)
    print(table(results))
    path = common.write_json(os.path.join(args.out, "projection_fp8.json"), {"results": results})
    print(f"wrote {path}, {plot(results, os.path.join(args.out, 'projection_fp8.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
