"""The whole decode step of a full-width K3.1 slice: stock under plain Inductor vs kimi_dep.

    python benchmarks/bench_decoder.py [--rows 1 64] [--context 4096] [--q 1] [--layers 4]
        [--experts 64 | --local-experts 56] [--modes hand ro] [--sides stock kimi_dep] [--no-parity]
        [--latent-cache float8_e4m3fn] [--decisive] [--profile] [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/bench_decoder.py ...   # DEP2: each GPU its own requests, half the experts

A full-depth DEP32 rank of K3.1 (all 93 layers, 28 local experts a MoE layer, MXFP4 experts, FP8 dense):
``--layers 93 --local-experts 28 --dense fp8_block --experts-layout tiles --sides kimi_dep --no-parity``; the
built model's bytes are printed beside ``dep_compile.memory``'s table for that DEP size.

The model: ``preset("k31", num_layers=--layers)`` with ``--experts`` routed experts (default the
slice of issue 17: [KDA + dense MLP, KDA, KDA, DSA], 3 MoE layers of 64 experts top-16, lm_head),
or with ``--local-experts N`` an EP16 rank's shape: a router over 896 experts and N local experts
(ids owned by other ranks add nothing). Random weights, drawn on the device: BF16 (``--dense fp8_block``: the
projections FP8 block-scaled, e4m3 codes and scales), and the routed experts in the preset's format (MXFP4 as
K3 ships them) or ``--experts-format``. MXFP4 experts stay in the checkpoint's layout (stock reads that; kimi_dep
makes its re-packed copy where memory allows) unless ``--experts-layout tiles`` re-packs them in place, as the
loaders do on CUDA (stock then reads the tiles).

Per point (``rows`` requests x ``q`` tokens, ``context`` tokens per request after the step), in
one process: eager stock, stock compiled by plain Inductor, and the ``kimi_dep``-compiled model,
each with ``fullgraph=True, dynamic=False`` (one graph per point, as serving captures one per
batch size). Timed two ways each: ``hand`` captures the compiled step in a CUDA graph by hand
(``common.time_graph``: CUDA events over replays, medians); ``ro`` compiles with
``mode="reduce-overhead"`` and times plain calls (cudagraph trees; events around each call, the
median), which is what a user gets. Weights are not rotated: a step reads GBs of weights (the
default slice holds ~23 GB and reads 8-23 GB a step), hundreds of times the 60 MB L2, so no launch finds them in L2.

Reported per point: µs per step for each side and way, stock / kimi_dep, the step's HBM floor
(``floor_bytes``) at 4.33 and 4.8 TB/s and each time over it, the roofline floor
(``roofline.step_roofline``: per kernel group the larger of its bytes at 4.33 TB/s and its FLOPs at the units'
peak, summed; it exceeds the bytes floor where verify steps make the dense GEMMs compute-bound) and kimi_dep
over it; parity: the logits' relative
Frobenius error against eager for each side, and routing agreement (the fraction of (token,
expert) picks equal to eager's, over every MoE layer; ``record_routing``). ``--profile`` adds a
per-kernel breakdown of one point, grouped by kernel family (``KERNEL_GROUPS``), from a profiled
CUDA-graph replay: GPU time summed over streams, and where the wall time went (each instant to the one
family running then, to two or more at once, or to no kernel: ``common.wall_attribution``). Writes ``decoder.json`` (after every point), ``decoder.png`` and
``decoder.md`` (the table) under ``--out``.

Under ``torchrun`` (more than one rank: DEP, ``dep_ranks.py``) every rank builds the same slice, keeps its
block of each MoE's routed experts (``--experts`` over the ranks; stock and kimi_dep alike), and decodes its
own ``rows`` requests; the parity reference is the unsharded model, eager, on the rank's requests. A point adds
the bytes the EP collectives bring to a rank (``link_bytes``) at the link's bandwidth measured at start
(``link_us``), which the floors include, and the step's collectives timed alone (``collectives_us``); its
numbers are the slowest rank's (``ranks`` keeps each rank's), tokens/s the host's. ``--profile`` names the
NCCL kernels' share (it includes a rank's wait for the other).

``--decisive`` puts the routers' correction biases 1 apart (``debug.parity.decisive_routing``): every side
picks the same experts, so the logits and caches compare with no near-tied expert flipping (the parity
yardstick); every token then takes the same 16 experts, so its timings read fewer expert bytes than a real
step's.

``--device cpu`` is a smoke run for CI (tiny configs; eager vs kimi_dep pattern-only, timed by
the wall clock, which measures nothing): every path but the GPU timing runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import traffic_bytes  # noqa: E402
from common import (floors_us, format_table, plot_panels, raise_recompile_limits, rel_err,  # noqa: E402
                    time_graph, write_json)
import dep_ranks  # noqa: E402
from roofline import local_ids, step_roofline  # noqa: E402

import dep_compile  # noqa: E402
from dep_compile import tactics  # noqa: E402
from dep_compile.debug.parity import decisive_routing, record_routing, routing_agreement  # noqa: E402
from dep_compile.stock import KimiCache, RequestBatch, preset, tile_experts_  # noqa: E402
from dep_compile.stock.cache import max_cache_difference  # noqa: E402
from dep_compile.stock.config import LATENT_CACHE_DTYPES  # noqa: E402
from dep_compile.stock.model import KimiK3ForCausalLM  # noqa: E402
from dep_compile.stock.moe import EXPERTS  # noqa: E402
from dep_compile.stock.mxfp4 import random_mxfp4  # noqa: E402

SIDES = ("stock", "kimi_dep")  # stock = the stock model compiled by plain Inductor
# Kernel families for --profile, first match wins (lower-case substrings of the kernel name). Inductor's
# kernels (triton_*) are named after the ops they fuse, so they go by that prefix (AttnRes first). ATen's
# grouped GEMM (torch._grouped_mm) is a CUTLASS 3.x kernel ("...at::cuda::detail::
# enable_3x_kernel_for_sm9x..."); the plain GEMMs here are cuBLAS's (nvjet, cublasLt).
KERNEL_GROUPS = (
    ("EP dispatch / combine (NCCL)", ("nccl",)),
    ("AttnRes", ("attn_res",)),
    ("Inductor glue (norms, router, SiTU, casts)", ("triton_",)),
    ("routed experts", ("grouped", "experts", "enable_3x_kernel_for_sm9x", "_gemm1_kernel", "_gemm2_kernel",
                        "_count_kernel")),
    ("router (kimi_dep)", ("_select_kernel", "router")),
    ("KDA core", ("kda", "recurrent", "_conv_kernel", "gated_norm")),
    ("DSA / MLA core", ("indexer", "index_logits", "key_insert", "sparse_mla", "topk", "radix", "mla",
                        "paged_insert", "latent", "absorb", "uv_gate")),
    ("split-K GEMMs (Triton or cuBLAS's)", ("splitk",)),
    ("FP8 activation quantize, stock block-FP8 GEMM", ("_quantize_kernel", "_block_fp8")),
    ("cuBLAS GEMMs", ("gemm", "nvjet", "cublas", "cutlass")),
    ("ATen elementwise (gathers, copies)", ("elementwise", "index", "copy", "cat")),
)


def build_model(cfg, device, seed: int = 0, local_experts: int | None = None) -> KimiK3ForCausalLM:
    """The stock decoder with random weights drawn on ``device``, frozen, in eval mode.

    The scales mirror ``dep_compile.stock.model.init_weights`` (which draws on the CPU: minutes for
    the GBs of a full-width slice). ``local_experts``: each MoE keeps that many experts (expert ids
    0..N-1 of the router's ``n_routed_experts``), run alone, as one EP rank's share.
    """
    with torch.device("meta"):
        model = KimiK3ForCausalLM(cfg)
        if local_experts:
            for layer in model.model.layers:
                if hasattr(layer.mlp, "experts"):
                    layer.mlp.experts = EXPERTS[cfg.experts_format](cfg, num_local=local_experts, ep_size=1)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    keep_fp32 = ("A_log", "dt_bias", "e_score_correction_bias")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("_weight_packed"):  # MXFP4 experts: random codes, scales for the BF16 RMS
                k = 2 * p.shape[-1]
                p.data, params[name.replace("_packed", "_scale")].data = random_mxfp4((*p.shape[:-1], k), g, k ** -0.5)
                continue
            if p.dtype == torch.float8_e4m3fn:  # FP8 block-scaled dense: e4m3 codes, block scales for the BF16 RMS
                scale = params[name + "_scale"]
                p.data = (torch.randn(p.shape, device=device, generator=g) * 64).clamp(-448, 448).to(p.dtype)
                scale.data = p.shape[1] ** -0.5 / 64 * torch.exp2(
                    torch.rand(scale.shape, device=device, generator=g) * 2 - 1)
                continue
            if p.dtype == torch.uint8 or (leaf == "weight_scale" and params[name[:-6]].dtype == torch.float8_e4m3fn):
                continue  # a scale, drawn with its codes
            val = torch.empty(p.shape, device=device)
            if name.endswith("norm.weight") or ".k_norm." in name:
                val.normal_(1.0 if leaf == "weight" else 0.0, 0.1, generator=g)
            elif leaf == "A_log":
                val.uniform_(1, 16, generator=g).log_()
            elif leaf in ("dt_bias", "e_score_correction_bias", "query"):
                val.normal_(0.0, {"dt_bias": 0.5, "e_score_correction_bias": 0.05, "query": 0.5}[leaf], generator=g)
            else:
                val.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() >= 2 else 1.0, generator=g)
            p.data = val.to(torch.float32 if leaf in keep_fp32 else torch.bfloat16)
    return model.eval().requires_grad_(False)


def memory_check(model: KimiK3ForCausalLM, args, device) -> dict:
    """The built model's bytes (parameters, and on CUDA what the allocator holds) beside ``dep_compile.memory``'s
    table for the same config: an EP rank's (``--local-experts``: DEP = routed experts / local; under torchrun
    the ranks) or the whole model's."""
    from dep_compile.memory import GB, rank_memory

    cfg = model.config
    dep = cfg.n_routed_experts // args.local_experts if args.local_experts else dep_ranks.world()[1]
    table = rank_memory(cfg, dep, max(args.context), cfg.dense_format)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out = dict(dep=dep, param_bytes=params, table_weight_bytes=table.weights,
               table_cache_bytes_per_request=table.cache_per_request,
               allocated_bytes=torch.cuda.memory_allocated(device) if device.type == "cuda" else None)
    print(f"memory: parameters {params / GB:.2f} GB, memory table (DEP{dep}) {table.weights / GB:.2f} GB"
          + (f", CUDA allocated {out['allocated_bytes'] / GB:.2f} GB" if out["allocated_bytes"] is not None else "")
          + f"; caches per request at {max(args.context)} tokens {table.cache_per_request / GB:.3f} GB", flush=True)
    return out


def floor_bytes(model: KimiK3ForCausalLM, rows: int, q: int, context: int, routing: list[torch.Tensor]) -> dict:
    """The bytes a step must move, by term: every weight read once (the embedding: only the rows
    it gathers), routed experts only where touched, KDA states, DSA keys and selected latents."""
    cfg = model.config
    T = rows * q
    weights = experts = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            weights += T * p.shape[1] * p.element_size()
        elif ".experts." not in name:
            weights += nbytes
    moe = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for experts_mod, ids in zip(moe, routing[:len(moe)]):
        per_expert = sum(p[0].numel() * p.element_size() for p in experts_mod.parameters())  # BF16, or MXFP4 codes + scales
        experts += local_ids(experts_mod, ids).unique().numel() * per_expert
    kinds = [layer.kind for layer in model.model.layers]
    states = kinds.count("kda") * traffic_bytes(cfg, "kda", rows, q)
    attention = sum(traffic_bytes(cfg, k, rows, q, context) for k in kinds if k in ("dsa", "mla"))
    total = weights + experts + states + attention
    return dict(weights=weights, experts=experts, kda_states=states, dsa_mla=attention, total=total)


class Point:
    """One grid point's inputs: token ids, the step's metadata and caches sized to it."""

    def __init__(self, cfg, rows: int, q: int, context: int, block_size: int, device, seed: int = 0):
        blocks = rows * math.ceil(context / block_size)
        self.cache = KimiCache.allocate(cfg, num_slots=rows, num_blocks=blocks, block_size=block_size,
                                        device=device, seed=None)
        g = torch.Generator(device=device).manual_seed(seed)
        for lc in self.cache.layers:  # random on the device (KimiCache.allocate's ranges), never zeros
            for name, t in lc.tensors().items():
                fp8 = t.dtype == torch.float8_e4m3fn  # index keys, FP8 latent rows: e4m3 values of std 4
                val = torch.empty(t.shape, device=device).normal_(0, 4 if fp8 else 0.5, generator=g)
                t.copy_(val.clamp_(-8, 8) if fp8 else
                        val.abs_().add_(0.01) if name == "index_scale" else
                        torch.exp2(val.round().clamp(-1, 1)) / 8 if name == "kv_scale" else val)  # latents of std ~0.5
        self.meta = RequestBatch(self.cache, rows, start_len=context - q, device=device, seed=seed).step(q)
        self.ids = torch.randint(0, cfg.vocab_size, (rows * q,), generator=g, device=device)

    def run(self, fn, cache=None):
        return fn(self.ids, self.meta, cache if cache is not None else self.cache)


def compile_side(model, side: str, ro: bool, options: dict | None = None):
    """``torch.compile`` of one side: plain Inductor on stock, or kimi_dep; ``ro``: reduce-overhead."""
    backend = "inductor" if side == "stock" else "kimi_dep"
    if side == "kimi_dep" and options is not None:  # options exclude mode=: patch Inductor's config instead
        cfg = {**options.get("inductor_config", {}), **({"triton.cudagraphs": True} if ro else {})}
        return torch.compile(model, backend=backend, fullgraph=True, dynamic=False,
                             options={**options, "inductor_config": cfg})
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False,
                         mode="reduce-overhead" if ro else None)


def cudagraph_nodes() -> int:
    """CUDA graphs recorded by cudagraph trees on the current device so far (0 when none)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    if manager is None:
        return 0
    return sum(1 + node.num_descendants() for node in manager.get_roots())


def time_calls(fn, calls: int = 20, warmup: int = 3) -> float:
    """Median µs of ``fn()`` called back to back, CUDA events around each call (reduce-overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)


def time_wall(fn, calls: int = 3) -> float:
    """Median wall-clock µs of ``fn()`` (the CPU smoke run's stand-in for a timing)."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def group_of(kernel: str) -> str:
    """The ``KERNEL_GROUPS`` family of a kernel name ("other" if none matches)."""
    name = kernel.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(key in name for key in keys)), "other")


def kernel_groups(step, replays: int = 3) -> tuple[list[dict], dict]:
    """One CUDA-graph-captured ``step()``, traced: GPU µs per step summed by ``KERNEL_GROUPS`` (over streams,
    largest first), and where its wall time went (``common.wall_attribution``)."""
    from common import kernel_trace, wall_attribution

    kernels = kernel_trace(step, replays)
    totals: dict[str, list] = {}
    for k in kernels:
        t = totals.setdefault(group_of(k["name"]), [0.0, 0, {}])
        t[0] += k["dur"]
        t[1] += 1
        t[2][k["name"][:70]] = t[2].get(k["name"][:70], 0.0) + k["dur"]
    rows = [dict(group=g, us=us, launches=n, top=sorted(ks.items(), key=lambda kv: -kv[1])[:3])
            for g, (us, n, ks) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"]), wall_attribution(kernels, group_of)


def measure_point(model, args, rows: int, q: int, context: int, device, full=None) -> dict:
    """Parity and timings of one point (see the module docstring); ``full``: at DEP, the unsharded model (the
    parity reference; None: ``model``)."""
    cfg = model.config
    rank, ranks = dep_ranks.world()
    pt = Point(cfg, rows, q, context, args.block_size, device, seed=rows + 7 * q + 1000 * rank)
    opts = {"inductor": False, **_cublas_only()} if device.type == "cpu" else None
    if args.attn_res_ahead:
        opts = {**(opts or {}), "attn_res_ahead": True}
    out: dict = dict(rows=rows, q=q, context=context,  # the caches as allocated (blocks rounded up), for the memory table
                     cache_bytes=sum(t.numel() * t.element_size() for lc in pt.cache.layers for t in lc.tensors().values()))
    t0 = time.perf_counter()

    def say(what: str) -> None:
        print(f"  [{time.perf_counter() - t0:6.1f} s] rows={rows} q={q} ctx={context}: {what}", flush=True)

    with torch.no_grad():
        start = None if args.no_parity else pt.cache.clone()
        ref_cache = None if args.no_parity else start.clone()
        with record_routing() as ref_ids:
            ref = pt.run(full if full is not None else model, ref_cache)
        step_ids = dep_ranks.gather_routing(ref_ids) if ranks > 1 else ref_ids  # what this rank's experts see
        floor = floor_bytes(model, rows, q, context, step_ids)
        fl = floors_us(floor["total"])
        roof = step_roofline(model, rows, q, context, step_ids, floor)
        out.update(floor_bytes=floor, floor_433_us=fl["practical"], floor_48_us=fl["spec"], roofline=roof,
                   roofline_us=roof["roofline_us"], flops_us=roof["flops_us"])
        if ranks > 1:
            moe = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
            out["link_bytes"] = dep_ranks.link_bytes(cfg, rows * q, ranks, moe)
            out["link_us"] = out["link_bytes"] / args.link_bps * 1e6 if args.link_bps else 0.0
            out["collectives_us"] = dep_ranks.collectives_alone_us(cfg, rows * q, moe, device)
        say(f"eager done; floor {fl['practical']:.0f} µs (bytes), roofline {roof['roofline_us']:.0f} µs "
            f"(FLOPs alone {roof['flops_us']:.0f})")
        for side in args.sides:
            if device.type == "cpu" and side == "stock":
                fn = model  # the smoke run: no Inductor (minutes on 2 cores)
            else:
                fn = compile_side(model, side, ro=False, options=opts)
            if args.no_parity:
                pt.run(fn)  # compiles, on the point's own caches (timing runs there too)
                say(f"{side} compiled")
            else:
                pt.run(fn, start.clone())  # compiles (kimi_dep's translation validation calls the MoE op too)
                side_cache = start.clone()
                with record_routing() as ids:
                    logits = pt.run(fn, side_cache)
                out[f"{side}_rel_err"] = rel_err(logits, ref)
                out[f"{side}_cache_err"] = max_cache_difference(side_cache, ref_cache)
                del side_cache
                out[f"{side}_routing"] = routing_agreement(ids, ref_ids)
                out[f"{side}_routing_by_layer"] = [routing_agreement([a], [b]) for a, b in zip(ids, ref_ids)]
                say(f"{side} compiled; rel err {out[f'{side}_rel_err']:.2e}, cache err {out[f'{side}_cache_err']:.2e}, "
                    f"routing {out[f'{side}_routing']:.4f}")
            if side == "kimi_dep":
                out["rewritten"] = [m.op for m in dep_compile.last_report().layers if m.rewritten]
            if device.type == "cpu":
                out[f"{side}_hand_us"] = time_wall(lambda: pt.run(fn))
                continue
            if "hand" in args.modes:
                out[f"{side}_hand_us"] = time_graph(lambda i: pt.run(fn), args.steps)["median_us"]
                out[f"{side}_tokens_per_s"] = rows * q * 1e6 / out[f"{side}_hand_us"]  # tokens the step decodes
                if args.profile and (rows, q, context) == tuple(args.profile_point):
                    out[f"{side}_kernels"], out[f"{side}_wall"] = kernel_groups(lambda: pt.run(fn))
                say(f"{side} hand {out[f'{side}_hand_us']:.0f} µs")
            if "ro" in args.modes:
                from torch._dynamo.utils import counters

                ro_fn = compile_side(model, side, ro=True, options=opts)
                skips, graphs = counters["inductor"]["cudagraph_skips"], cudagraph_nodes()
                us = time_calls(lambda: pt.run(ro_fn))
                out[f"{side}_ro_us"] = us
                out[f"{side}_ro_graphed"] = (counters["inductor"]["cudagraph_skips"] == skips
                                             and cudagraph_nodes() > graphs)
                say(f"{side} reduce-overhead {us:.0f} µs, graphed {out[f'{side}_ro_graphed']}")
            torch.cuda.synchronize()
    return out


def add_ratios(p: dict) -> dict:
    """stock / kimi_dep and each side over the floors (at DEP the floors include the link's ``link_us``)."""
    link = p.get("link_us", 0.0)
    for way in ("hand", "ro"):
        s, d = p.get(f"stock_{way}_us"), p.get(f"kimi_dep_{way}_us")
        if s and d:
            p[f"ratio_{way}"] = s / d
        if d:
            p[f"dep_{way}_over_floor"] = d / (p["floor_433_us"] + link)
            p[f"dep_{way}_over_roofline"] = d / (p["roofline_us"] + link)
        if s:
            p[f"stock_{way}_over_floor"] = s / (p["floor_433_us"] + link)
    return p


def _cublas_only() -> dict:
    from dep_compile.config import CUBLAS_ONLY

    return dict(CUBLAS_ONLY)


def table(points: list[dict]) -> str:
    """The results as a Markdown table."""
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    headers = ["rows", "q", "ctx", "stock hand", "dep hand", "ratio", "stock ro", "dep ro", "ratio ro",
               "floor@4.33", "floor@4.8", "dep/floor", "FLOPs µs", "roofline", "dep/roofline", "dep tok/s", "err stock",
               "err dep", "route stock", "route dep"]
    body = [[p["rows"], p["q"], p["context"], f(p.get("stock_hand_us"), ".0f"), f(p.get("kimi_dep_hand_us"), ".0f"),
             f(p.get("ratio_hand"), ".3f"), f(p.get("stock_ro_us"), ".0f"), f(p.get("kimi_dep_ro_us"), ".0f"),
             f(p.get("ratio_ro"), ".3f"), f(p.get("floor_433_us"), ".0f"), f(p.get("floor_48_us"), ".0f"),
             f(p.get("dep_hand_over_floor"), ".2f"), f(p.get("flops_us"), ".0f"), f(p.get("roofline_us"), ".0f"),
             f(p.get("dep_hand_over_roofline"), ".2f"), f(p.get("kimi_dep_tokens_per_s"), ".0f"), f(p.get("stock_rel_err"), ".1e"),
             f(p.get("kimi_dep_rel_err"), ".1e"),
             f(p.get("stock_routing"), ".4f"), f(p.get("kimi_dep_routing"), ".4f"),
             f(p.get("stock_cache_err"), ".1e"), f(p.get("kimi_dep_cache_err"), ".1e")]
            for p in points if "error" not in p]
    headers += ["cache err stock", "cache err dep"]
    if any("link_us" in p for p in points):  # DEP: the floors above include link µs
        headers += ["link µs", "collectives alone µs"]
        body = [row + [f(p.get("link_us"), ".1f"), f(p.get("collectives_us"), ".0f")]
                for row, p in zip(body, [p for p in points if "error" not in p])]
    return format_table(headers, body)


def plot(path: str, points: list[dict]) -> None:
    """µs per step vs requests, one panel per (q, context)."""
    panels = []
    for q, ctx in sorted({(p["q"], p["context"]) for p in points if "error" not in p}):
        pts = [p for p in points if (p["q"], p["context"]) == (q, ctx) and "error" not in p]
        series = {f"{s} {w}": [p.get(f"{s}_{w}_us") for p in pts] for s in SIDES for w in ("hand", "ro")}
        series["floor @4.33 TB/s"] = [p["floor_433_us"] for p in pts]
        series["roofline floor"] = [p["roofline_us"] for p in pts]
        panels.append({"title": f"decode step, q={q}, context {ctx}", "x": [p["rows"] for p in pts], "series": series})
    if panels:
        plot_panels(path, panels, xlabel="requests", ylabel="µs per step")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k31")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64, help="routed experts (router and local)")
    ap.add_argument("--experts-format", choices=["bf16", "mxfp4"], default=None,
                    help="the routed experts' weights (default: the preset's; k3 / k31 ship MXFP4)")
    ap.add_argument("--experts-layout", choices=["checkpoint", "tiles"], default="checkpoint",
                    help="MXFP4 experts: the checkpoint's layout, or tiles made in place as the loaders do on CUDA")
    ap.add_argument("--dense", choices=["bf16", "fp8_block"], default=None,
                    help="dense projections' format (default: the preset's)")
    ap.add_argument("--latent-cache", choices=LATENT_CACHE_DTYPES, default="bfloat16",
                    help="MLA / DSA latent cache dtype (float8_e4m3fn: 576 e4m3 values + an FP32 scale a row)")
    ap.add_argument("--local-experts", type=int, default=None,
                    help="EP-rank shape: a router over 896 experts, this many local (e.g. 56 for EP16)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--q", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, nargs="+", default=[4096])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["hand", "ro"], choices=["hand", "ro"])
    ap.add_argument("--steps", type=int, default=2, help="steps per hand-captured graph replay")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES,
                    help="which compiled sides to time (kimi_dep alone for a full-depth rank: stock's compile of 93 "
                         "layers takes most of a GPU call)")
    ap.add_argument("--no-parity", action="store_true",
                    help="no compiled-vs-eager check: it holds two more copies of the caches, which a full-depth rank "
                         "at tens of requests has no room for; eager runs once, on the point's caches, for the floor")
    ap.add_argument("--decisive", action="store_true",
                    help="the routers' correction biases 1 apart: no near-tied expert flips (the parity yardstick); "
                         "every token then takes the same experts")
    ap.add_argument("--attn-res-ahead", action="store_true",
                    help="kimi_dep option attn_res_ahead: each AttnRes point's bank part computed a point early, on a "
                         "side stream")
    ap.add_argument("--kda-split-from", type=int, default=None, metavar="Q",
                    help="tactic KDA_SPLIT_FROM_Q: kimi_dep's KDA core in two launches (prep + state) at steps of Q or "
                         "more tokens a request (default: the tactic table's)")
    ap.add_argument("--profile", action="store_true", help="per-kernel breakdown at --profile-point")
    ap.add_argument("--profile-point", type=int, nargs=3, default=[64, 1, 4096], metavar=("ROWS", "Q", "CTX"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    table = tactics.KDA_SPLIT_FROM_Q
    if args.kda_split_from is not None:  # this run's tactic, restored after it
        tactics.KDA_SPLIT_FROM_Q = args.kda_split_from
    try:
        return run(args, argv)
    finally:
        tactics.KDA_SPLIT_FROM_Q = table


def run(args: argparse.Namespace, argv=None) -> list[dict]:
    """The benchmark of ``main``'s parsed arguments (``argv``: the command line it records)."""
    device = torch.device(args.device)
    rank, ranks = dep_ranks.world()
    if ranks > 1:
        if args.local_experts:
            raise SystemExit("--local-experts is one EP rank's shape on one GPU; under torchrun the ranks shard "
                             "--experts themselves")
        device = dep_ranks.init(device)
    experts = 896 if args.local_experts else args.experts
    cfg = preset(args.preset, num_layers=args.layers, n_routed_experts=experts, latent_cache_dtype=args.latent_cache,
                 **({"experts_format": args.experts_format} if args.experts_format else {}),
                 **({"dense_format": args.dense} if args.dense else {}))
    raise_recompile_limits(4 * len(args.rows) * len(args.q) * len(args.context))
    t0 = time.perf_counter()
    model = build_model(cfg, device, local_experts=args.local_experts)
    if args.decisive:
        decisive_routing(model)
    local = f" ({args.local_experts} local)" if args.local_experts else ""
    full, args.link_bps = None, None  # link_bps: bytes/s into a rank over the EP link (DEP on CUDA)
    if ranks > 1:  # DEP: this rank's experts; the unsharded model stays as the parity reference
        full = None if args.no_parity else model
        model = dep_ranks.shard(model, keep_full=not args.no_parity)
        args.link_bps = dep_ranks.link_bandwidth(device)
        held = next(layer.mlp.experts.num_local for layer in model.model.layers if hasattr(layer.mlp, "experts"))
        local = f" (DEP{ranks}: rank {rank} holds {held}" + (
            f"; link {args.link_bps / 1e9:.0f} GB/s)" if args.link_bps else ")")
    if args.experts_layout == "tiles":  # after sharding: each rank re-packs its own experts in place
        untiled = {name: why for name, why in tile_experts_(model).items() if why}
        local += f"; MXFP4 tiles made in place ({len(untiled)} modules kept the checkpoint's layout)"
    print(f"model: {cfg.name}, {args.layers} layers {[l.kind for l in model.model.layers]}, {experts} "
          f"{cfg.experts_format} experts{local}, {cfg.dense_format} dense, {cfg.latent_cache_dtype} latent cache; "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    memory = memory_check(model, args, device)
    points: list[dict] = []
    meta = dict(memory=memory, preset=cfg.name, layers=args.layers, experts=experts, experts_format=cfg.experts_format,
                dense_format=cfg.dense_format, latent_cache=cfg.latent_cache_dtype, local_experts=args.local_experts,
                experts_layout=args.experts_layout, attn_res_ahead=args.attn_res_ahead,
                kda_split_from=tactics.KDA_SPLIT_FROM_Q,
                ep=ranks, decisive=args.decisive,
                link_bps=args.link_bps,
                command="python benchmarks/bench_decoder.py " + " ".join(sys.argv[1:] if argv is None else argv))
    for q in args.q:
        for ctx in args.context:
            for rows in args.rows:
                t0 = time.perf_counter()
                try:
                    p = measure_point(model, args, rows, q, ctx, device, full)
                except Exception as e:  # noqa: BLE001 - a failed point is recorded, the grid goes on
                    if ranks > 1:
                        raise  # the other ranks wait in this point's collectives: stop them all
                    traceback.print_exc()
                    p = dict(rows=rows, q=q, context=ctx, error=f"{type(e).__name__}: {e}")
                p["seconds"] = time.perf_counter() - t0
                p = add_ratios(dep_ranks.merge(p) if ranks > 1 else p)
                points.append(p)
                torch._dynamo.reset()
                if rank:
                    continue
                print({k: v for k, v in p.items() if not k.endswith(("_kernels", "_wall")) and k != "ranks"}, flush=True)
                write_json(os.path.join(args.out, "decoder.json"), {**meta, "points": points})
    if rank:
        return points
    text = table(points)
    print(text)
    for p in points:
        for side in SIDES:
            for g in p.get(f"{side}_kernels", []):
                print(f"{side} rows={p['rows']} q={p['q']} ctx={p['context']}: {g['group']:<42} {g['us']:8.1f} µs "
                      f"{g['launches']:5.0f} launches  {g['top'][:2]}")
            wall = p.get(f"{side}_wall")
            if wall:
                print(f"{side} rows={p['rows']} q={p['q']} ctx={p['context']}: wall {wall['span_us']:.1f} µs = "
                      f"{wall['overlapped_us']:.1f} two or more groups at once + {wall['idle_us']:.1f} no kernel "
                      f"({wall['idle_gaps']} gaps) + one group alone:")
                for g, us in wall["alone_us"].items():
                    print(f"    {g:<42} {us:8.1f} µs alone")
                for gap in wall["longest_idle"]:
                    print(f"    idle {gap['us']:6.1f} µs after {gap['after']} before {gap['before']}")
    with open(os.path.join(args.out, "decoder.md"), "w") as f:
        f.write(f"`{meta['command']}`\n\n{text}\n")
    plot(os.path.join(args.out, "decoder.png"), points)
    return points


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
