"""The K3 MoE layer on the GPU: stock compiled by plain Inductor vs kimi_dep (EpMoeLayer schedule).

    python benchmarks/bench_moe.py [--rows 1 2 4 8 16 32 64] [--experts mxfp4 bf16] [--out DIR] [--trace]

One full-size layer as one EP16 rank holds it: router over 896 experts, the 56 local experts
(ids owned by other ranks add nothing), latent 3584, shared expert 6144, hidden 7168, BF16; the
routed experts in each ``--experts`` format (MXFP4 as K3 ships them, and BF16), each its own model.
Both sides are compiled with ``fullgraph=True, dynamic=False`` (one graph per batch, as serving
captures one per batch size) and CUDA-graph captured, on the same inputs, in one process. The layer reads
>400 MB of weights per step (7x the 60 MB L2), so weights are not rotated. For each batch it
prints the layer's median µs both ways and their ratio, each side's experts call alone (the stock op;
kimi_dep's Triton experts on the same weights), and the non-expert part (layer - that side's experts); the
floor counts the non-expert weights plus the touched experts' stored bytes (MXFP4: codes and scales). With
both formats, ``vs BF16`` is the BF16 kimi_dep layer's time over the MXFP4 kimi_dep layer's, per batch: the
router's weights and each batch's input are drawn from their own seeds, so both formats route alike (the table
says how many local experts a batch touches).
``--trace`` writes a profiler trace of one step each way at ``--trace-rows`` (CUDA-graph replays; router and
shared expert on the side stream) and prints how much side-stream kernel time overlaps main-stream kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (capture_graph, floors_us, format_table, plot_panels, raise_recompile_limits,  # noqa: E402
                    rel_err, time_graph, write_json)

import dep_compile  # noqa: E402
from dep_compile.stock import preset  # noqa: E402
from dep_compile.stock.model import init_weights  # noqa: E402
from dep_compile.ops.experts_triton import routed_experts_dep  # noqa: E402
from dep_compile.stock.moe import KimiMoE, Mxfp4Experts  # noqa: E402
from dep_compile.stock.mxfp4 import Mxfp4Weight  # noqa: E402


class MoeBlock(torch.nn.Module):
    """One MoE layer as its own graph: x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg, num_local: int):
        super().__init__()
        self.mlp = KimiMoE(cfg, num_local=num_local, ep_size=1)  # one rank's share, run alone: no dispatch

    def forward(self, x):
        return self.mlp(x)


def touched_experts(ids: torch.Tensor, experts: torch.nn.Module) -> int:
    """How many local experts some id picks."""
    return ids[(ids >= 0) & (ids < experts.num_local)].unique().numel()


def expert_bytes(experts: torch.nn.Module) -> int:
    """Stored bytes of one expert (every parameter of the experts module)."""
    return sum(p[0].numel() * p.element_size() for p in experts.parameters())


def dep_experts(experts: torch.nn.Module, latent, topk_w, topk_ids) -> torch.Tensor:
    """kimi_dep's routed experts (the call the rewritten layer makes) on ``experts``' weights."""
    if isinstance(experts, Mxfp4Experts):
        w13 = Mxfp4Weight(experts.w13_weight_packed, experts.w13_weight_scale)
        w2 = Mxfp4Weight(experts.w2_weight_packed, experts.w2_weight_scale)
    else:
        w13, w2 = experts.w13_weight, experts.w2_weight
    return routed_experts_dep(latent, w13, w2, topk_w, topk_ids, experts.expert_start, experts.ep_size,
                              experts.beta, experts.beta_lin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--local-experts", type=int, default=56)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--trace-rows", type=int, default=16)
    ap.add_argument("--experts", nargs="+", choices=["mxfp4", "bf16"], default=["mxfp4", "bf16"])
    args = ap.parse_args()
    torch.manual_seed(0)
    raise_recompile_limits(2 * len(args.rows) * len(args.experts))
    rows_out = []
    for fmt in args.experts:
        cfg = preset("k3", experts_format=fmt)
        rows_out += run_format(cfg, args.rows, args.local_experts, args.out if args.trace else None, args.trace_rows)
    by = {(r["experts"], r["rows"]): r for r in rows_out}
    for r in rows_out:
        bf16 = by.get(("bf16", r["rows"]))
        r["vs_bf16"] = bf16["dep_us"] / r["dep_us"] if bf16 else float("nan")
    headers = ["experts", "rows", "touched", "stock µs", "kimi_dep µs", "ratio", "vs BF16", "experts stock", "experts dep",
               "non-exp stock", "non-exp dep", "non-exp ratio", "floor@4.33", "floor@4.8", "dep/floor", "rel err"]
    table = [[r["experts"], r["rows"], r["touched"], f"{r['stock_us']:.1f}", f"{r['dep_us']:.1f}", f"{r['ratio']:.3f}", f"{r['vs_bf16']:.2f}",
              f"{r['experts_stock_us']:.1f}", f"{r['experts_dep_us']:.1f}",
              f"{r['nonexpert_stock_us']:.1f}", f"{r['nonexpert_dep_us']:.1f}", f"{r['nonexpert_ratio']:.2f}",
              f"{r['floor_433_us']:.1f}", f"{r['floor_48_us']:.1f}", f"{r['dep_us'] / r['floor_433_us']:.2f}", f"{r['max_err']:.1e}"]
             for r in rows_out]
    print(format_table(headers, table))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "moe.json"), {"rows": rows_out})
    panels = []
    for fmt in args.experts:
        rs = [r for r in rows_out if r["experts"] == fmt]
        panels.append({"title": f"K3 MoE layer, {fmt} experts (EP16 rank: 56 local)", "x": [r["rows"] for r in rs],
                       "series": {"stock (Inductor)": [r["stock_us"] for r in rs],
                                  "kimi_dep": [r["dep_us"] for r in rs],
                                  "experts alone (stock op)": [r["experts_stock_us"] for r in rs],
                                  "experts alone (kimi_dep)": [r["experts_dep_us"] for r in rs],
                                  "floor @4.33 TB/s": [r["floor_433_us"] for r in rs]}})
    plot_panels(os.path.join(args.out, "moe.png"), panels, xlabel="rows", ylabel="µs")


def run_format(cfg, batches: list[int], num_local: int, trace_dir: str | None, trace_rows: int) -> list[dict]:
    """Stock (Inductor) and kimi_dep MoE layers of ``cfg``'s experts format at each batch: the result rows
    (and, with ``trace_dir``, both ways' profiler traces at ``trace_rows``)."""
    block = init_weights(MoeBlock(cfg, num_local), seed=0)
    init_weights(block.mlp.gate, seed=1)  # the same router in every format (the experts' draws shift the stream)
    block = block.cuda().eval().requires_grad_(False)
    stock = torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False)
    mlp = block.mlp
    non_expert_bytes = 2 * sum(p.numel() for n, p in mlp.named_parameters() if not n.startswith("experts."))
    out = []
    with torch.no_grad():
        for T in batches:
            x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to("cuda", torch.bfloat16)
            ref = block(x)
            got_dep, got_stock = dep(x), stock(x)
            # relative Frobenius error: BF16 rounding and the split-K / FP32-router summation order
            # (a near-tie in the top-16 may flip one expert of one token) stay well under 2e-2
            err, err_stock = rel_err(got_dep, ref), rel_err(got_stock, ref)
            assert err < 2e-2 and err_stock < 2e-2, \
                f"{cfg.experts_format} rows {T}: rel err kimi_dep {err}, stock {err_stock}"
            rep = dep_compile.last_report()
            # the experts call alone, on this batch's routing
            topk_w, topk_ids = mlp.gate(x)
            latent = mlp.routed_expert_down_proj(x)
            t_exp = time_graph(lambda i: mlp.experts(latent, topk_w, topk_ids), 8)["median_us"]
            t_exp_dep = time_graph(lambda i: dep_experts(mlp.experts, latent, topk_w, topk_ids), 8)["median_us"]
            t_stock = time_graph(lambda i: stock(x), 8)["median_us"]
            t_dep = time_graph(lambda i: dep(x), 8)["median_us"]
            touched = touched_experts(topk_ids, mlp.experts)
            nbytes = non_expert_bytes + touched * expert_bytes(mlp.experts)
            fl = floors_us(nbytes)
            ne_stock, ne_dep = t_stock - t_exp, t_dep - t_exp_dep
            out.append(dict(experts=cfg.experts_format, rows=T, touched=touched, stock_us=t_stock, dep_us=t_dep, ratio=t_stock / t_dep,
                            experts_stock_us=t_exp, experts_dep_us=t_exp_dep, nonexpert_stock_us=ne_stock,
                            nonexpert_dep_us=ne_dep,
                            nonexpert_ratio=ne_stock / ne_dep if ne_dep > 0 else float("nan"),
                            floor_433_us=fl["practical"], floor_48_us=fl["spec"], bytes=nbytes, max_err=err,
                            rewritten=[m.op for m in rep.layers]))
            print(f"{cfg.experts_format} rows {T}: stock {t_stock:.1f} µs, kimi_dep {t_dep:.1f} µs, floor "
                  f"{fl['practical']:.1f} ({', '.join(m.op for m in rep.layers)})", flush=True)
        if trace_dir:
            overlap_report(dep, cfg, trace_dir, trace_rows)
            overlap_report(stock, cfg, trace_dir, trace_rows, name="stock")
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def overlap_report(fn, cfg, out_dir: str, rows: int = 16, name: str = "kimi_dep") -> None:
    """Profile CUDA-graph replays of one step; print the last replay's kernel timeline (stream, start,
    duration) and how much side-stream kernel time overlaps main-stream kernels."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph = capture_graph(lambda: fn(x))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
    path = os.path.join(out_dir, f"moe_trace_{name}_{rows}.json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    streams: dict = {}
    for e in events:
        streams.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    per_step = len(events) // 3
    last = sorted(events, key=lambda e: e["ts"])[-per_step:]
    t0 = last[0]["ts"]
    print(f"{name}, {rows} rows: kernel timeline of one replay (µs from its first kernel)")
    for e in last:
        print(f"  stream {e['args'].get('stream')!s:>3} {e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e['name'][:80]}")
    if len(streams) < 2:
        print(f"trace: kernels on {len(streams)} stream(s): no side-stream overlap")
        return
    main_s = max(streams, key=lambda s: sum(b - a for a, b, _ in streams[s]))
    overlap = side_total = 0.0
    for s, ks in streams.items():
        if s == main_s:
            continue
        for a, b, _ in ks:
            side_total += b - a
            for c, d, _ in streams[main_s]:
                overlap += max(0.0, min(b, d) - max(a, c))
    print(f"{name} trace ({rows} rows, 3 graph replays): {len(streams)} streams; side-stream kernels {side_total:.1f} µs, "
          f"{overlap:.1f} µs of it overlapping main-stream kernels; trace in {path}")


if __name__ == "__main__":
    main()
