"""The K3 MoE router on the GPU: stock compiled by plain Inductor vs kimi_dep's two launches.

    python benchmarks/bench_router.py [--rows 1 8 64] [--select-warps 1 2 4 8] [--out DIR]

K3's router (896 experts, hidden 7168, sigmoid scores, bias for selection, top-16, renormalized, scaled) on
random BF16 inputs and weights: the stock ``Router`` module under ``torch.compile`` (Inductor), kimi_dep's
``route_sigmoid_topk`` (split-K logit partials, then the pick), and the pick alone (``select_experts`` on
the partials) at each ``--select-warps``. The router reads 12.8 MB of BF16 weight a call, under the 60 MB L2,
so each launch of a graph reads its own copy (rotated). Both sides' picks are checked to be a top-k of the FP32
keys (within 1e-5: summation order) and their weights those keys' scores, renormalized and scaled. Floor: the weight's bytes at 4.33 TB/s.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (floors_us, format_table, plot_panels, rotation_copies, time_graph, write_json)  # noqa: E402

from dep_compile.stock import preset  # noqa: E402
from dep_compile.stock.layers import Router  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--select-warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from dep_compile.ops.router_triton import ROUTER_TACTIC, route_sigmoid_topk, select_experts  # noqa: PLC0415
    from dep_compile.ops.splitk_triton import splitk_partials  # noqa: PLC0415

    cfg = preset("k31")
    E, H = cfg.n_routed_experts, cfg.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    weight_bytes = E * H * 2
    copies = rotation_copies(weight_bytes)
    routers = []
    for _ in range(copies):
        r = Router(cfg).cuda().to(torch.bfloat16)
        with torch.no_grad():
            r.weight.copy_(torch.randn(E, H, generator=g, device="cuda") * H ** -0.5)
            r.e_score_correction_bias.data = 0.05 * torch.randn(E, generator=g, device="cuda")
        routers.append(r.eval())
    stock = [torch.compile(r, dynamic=False) for r in routers]
    floor = floors_us(weight_bytes)["practical"]
    rows_out = []
    for T in args.rows:
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            r0 = routers[0]
            scores = torch.sigmoid(x.float() @ r0.weight.float().t())
            keyed = scores + r0.e_score_correction_bias
            for side, (w, ids) in (("stock", stock[0](x)), ("kimi_dep", route_sigmoid_topk(
                    x, r0.weight, r0.e_score_correction_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor))):
                torch.testing.assert_close(keyed.gather(1, ids), keyed.topk(cfg.num_experts_per_tok).values, rtol=0,
                                           atol=1e-5, msg=f"{side}, {T} rows: the picks are not a top-k")
                picked = scores.gather(1, ids)
                torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True) * cfg.routed_scaling_factor,
                                           rtol=1e-5, atol=1e-6, msg=f"{side}, {T} rows: weights")

        def dep(i):
            r = routers[i % copies]
            return route_sigmoid_topk(x, r.weight, r.e_score_correction_bias, cfg.num_experts_per_tok,
                                      cfg.routed_scaling_factor)

        row = dict(rows=T, floor_us=floor,
                   stock_us=time_graph(lambda i: stock[i % copies](x), copies)["median_us"],
                   kimi_dep_us=time_graph(dep, copies)["median_us"])
        parts = [splitk_partials(x, r.weight, ROUTER_TACTIC) for r in routers]
        for w in args.select_warps:
            bias = routers[0].e_score_correction_bias
            row[f"select_w{w}_us"] = time_graph(
                lambda i, w=w: select_experts(parts[i % copies], bias, cfg.num_experts_per_tok,
                                              cfg.routed_scaling_factor, num_warps=w), copies)["median_us"]
        rows_out.append(row)
        print(row, flush=True)
    heads = ["rows", "stock µs", "kimi_dep µs", "vs stock", "floor µs", "kimi_dep / floor"] + [
        f"pick alone, {w} warps µs" for w in args.select_warps]
    text = format_table(heads, [[r["rows"], f"{r['stock_us']:.1f}", f"{r['kimi_dep_us']:.1f}",
                                 f"{r['stock_us'] / r['kimi_dep_us']:.2f}x", f"{r['floor_us']:.1f}",
                                 f"{r['kimi_dep_us'] / r['floor_us']:.2f}"]
                                + [f"{r[f'select_w{w}_us']:.1f}" for w in args.select_warps] for r in rows_out])
    print(text)
    write_json(os.path.join(args.out, "router.json"), {"command": " ".join(sys.argv), "points": rows_out})
    xs = [r["rows"] for r in rows_out]
    plot_panels(os.path.join(args.out, "router.png"), [
        dict(title="K3 router, 896 experts top-16", x=xs,
             series={"stock (Inductor)": [r["stock_us"] for r in rows_out],
                     "kimi_dep": [r["kimi_dep_us"] for r in rows_out],
                     **{f"pick alone, {w} warps": [r[f"select_w{w}_us"] for r in rows_out] for w in args.select_warps}},
             hlines={"floor (weight bytes)": floor})], xlabel="rows", ylabel="µs")


if __name__ == "__main__":
    main()
