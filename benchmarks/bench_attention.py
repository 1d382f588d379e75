"""One K3.1 attention layer (KDA or DSA) on the GPU: stock compiled by plain Inductor vs kimi_dep.

    python benchmarks/bench_attention.py --kind kda|dsa [--rows 1 2 4 8 16 32 64] [--q 1 2 4]
        [--context 4096 32768] [--block-size 64] [--profile] [--out DIR]

One full-size ``preset("k31")`` layer with random BF16 weights: ``--kind kda`` is a
KimiDeltaAttention, ``--kind dsa`` a KimiDSAAttention, wrapped in :class:`AttentionBlock` (x,
the step's metadata tensors and its caches in; the caches mutated in place). Each point of the
grid (``rows`` requests x ``q`` tokens each: a decode step at q = 1, a verify step with every
token accepted above; for DSA also each request's ``context``, the tokens in its cache after the
step) runs both ways in one process, compiled with ``fullgraph=True, dynamic=False`` (one graph
per point, as serving captures one per batch size): (a) plain Inductor, (b) ``kimi_dep``, whose
report must show the layer rewritten.

Caches are sized to exactly what the point needs (KDA: one conv and one recurrent state per
request; DSA: ceil(context / block size) blocks per request of the paged latent cache [NB, BS,
576] BF16, the FP8 index-key cache and its FP32 scales), filled with random data (never
zeros), and freed after the point.

Parity, before timing: eager, (a) and (b) each run one step from identical copies of the
caches; (a) and (b) are compared with eager (relative Frobenius errors, printed):

* output: < 2e-2 (BF16 rounding, split-K summation order; for DSA a near-tie in the top-2048
  may select another token, which this tolerance covers);
* every cache entry the step must not write (other blocks / slots): bit-identical;
* entries it writes: recurrent state < 1e-3; conv state and latent cache < 2e-2; index keys
  (compared dequantized, keys x scale) < 0.13, one FP8 e4m3 step. They are copies of BF16
  projections, so they are bit-identical whenever the projections are (the CPU test checks that
  with cuBLAS tactics); with split-K tactics or Inductor's fused norms a projection moves by an
  ulp, and an FP8 key by one step when that ulp crosses a rounding boundary.

A write outside the step's entries fails the point (a corrupted cache is a bug, not rounding);
a tolerance violation is printed and flagged in the table, and the point is still timed.

Timing: ``common.time_graph`` (CUDA events over CUDA-graph replays, medians). A KDA layer reads
~887 MB of weights and a DSA layer ~479 MB, 8-15x the 60 MB L2, so weights are not rotated.
The caches mutate on every replay (KDA states evolve; DSA rewrites the same slots), which moves
the same bytes each time.

HBM floor per point (``common.floors_us``: 4.33 TB/s practical, 4.8 TB/s spec), bytes =
all layer weights +

* KDA, per request: recurrent state read + write (2 x 96 x 128 x 128 x 4 B = 2 x 6 MiB) and conv
  state read + write (2 x 3 taps x 36864 x 2 B);
* DSA: index keys read once per request (context x (128 B FP8 + 4 B scale)); the selected
  latents counted per token (min(context, 2048) x 576 x 2 B; the q tokens of one request may
  share them, so this over-counts verify steps at most q-fold on that term); this step's
  inserts (576 x 2 B latent + 128 B key + 4 B scale per token). With an FP8 latent cache a latent row is
  576 + 4 B (e4m3 values and the token's FP32 scale);
* MLA (the whole-step floor's K3 layers): each request's whole context of latent rows, read once for its
  q tokens, and the inserts.

Activations ([T, 7168] in and out) are left out: about 7 MB at 256 tokens. The roofline floor
(``roofline.layer_roofline``) takes, for the projections and for the core apart, the larger of the bytes
at 4.33 TB/s and the FLOPs at the units' peak (the core's verify steps are compute-bound: 256 tokens each
attending 2048 latent rows).

Printed per point: kind, rows, q, context, stock µs, kimi_dep µs, stock / kimi_dep,
kimi_dep / floor@4.33, both floors, output and cache errors. Writes ``attention_<kind>.json``
(after every point) and ``attention_<kind>.png`` (µs vs rows per (q, context)) under ``--out``.
``--profile`` also prints each side's top kernels (µs per step) from a profiled CUDA-graph
replay (``common.kernel_profile``). A point that fails (compile, OOM, a stray cache write) is printed and recorded, and the run goes
on; a version whose timing fails (an op that still syncs the host under CUDA-graph capture) is
recorded as missing with its error, and the other version is still timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import traceback
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    floors_us, format_table, kernel_profile, plot_panels, raise_recompile_limits, rel_err, steps_per_replay,
    time_graph, write_json)
from roofline import layer_roofline  # noqa: E402

import dep_compile  # noqa: E402
from dep_compile.stock import KimiCache, LayerCache, RequestBatch, StepMeta, preset  # noqa: E402
from dep_compile.stock.attention import KimiDeltaAttention, KimiDSAAttention  # noqa: E402
from dep_compile.stock.cache import FP8, FP8_REL  # noqa: E402
from dep_compile.stock.model import init_weights  # noqa: E402

ATTENTION = {"kda": KimiDeltaAttention, "dsa": KimiDSAAttention}
STATES = ("conv_state", "recurrent_state")  # KDA: one entry per request slot; the rest are paged
OUT_TOL = 2e-2
CACHE_TOL = {"recurrent_state": 1e-3, "conv_state": OUT_TOL, "kv_cache": OUT_TOL, "index_cache": FP8_REL}
SHORT = {"conv_state": "conv", "recurrent_state": "rec", "kv_cache": "kv", "index_cache": "idx"}


class AttentionBlock(nn.Module):
    """One attention layer as its own graph: (x [T, hidden], slot_mapping, block_table, seq_lens,
    state_indices, accepted, caches {LayerCache field: tensor}) -> [T, hidden]; T = requests x q."""

    def __init__(self, cfg, kind: str):
        super().__init__()
        self.self_attn = ATTENTION[kind](cfg)

    def forward(self, x, slot_mapping, block_table, seq_lens, state_indices, accepted, caches):
        meta = StepMeta(x.shape[0] // seq_lens.shape[0], slot_mapping, block_table, seq_lens, state_indices, accepted)
        return self.self_attn(x, meta, LayerCache(**caches))


@dataclasses.dataclass
class Step:
    """One step's inputs: the layer input, its metadata and the layer's caches."""

    x: torch.Tensor
    meta: StepMeta
    caches: dict[str, torch.Tensor]

    def args(self, caches: dict[str, torch.Tensor] | None = None) -> tuple:
        """AttentionBlock's arguments, on ``caches`` (default: the step's own)."""
        m = self.meta
        return (self.x, m.slot_mapping, m.block_table, m.seq_lens, m.state_indices, m.accepted,
                self.caches if caches is None else caches)


def build_block(cfg, kind: str, device="cpu", seed: int = 0) -> AttentionBlock:
    """The layer with random weights (BF16 except KDA's FP32 A_log, dt_bias), frozen, in eval mode."""
    return init_weights(AttentionBlock(cfg, kind), seed=seed).to(device).eval().requires_grad_(False)


def weight_bytes(block: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in block.parameters())


def random_caches(cfg, kind: str, num_slots: int, num_blocks: int, block_size: int, device,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's caches, random on ``device`` (the value ranges of ``KimiCache.allocate``)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16, scale=0.5):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, scale, generator=g)

    if kind == "kda":
        H, D = cfg.kda_heads, cfg.kda_head_dim
        return {"conv_state": randn(num_slots, cfg.kda_conv_width - 1, cfg.kda_conv_dim),
                "recurrent_state": randn(num_slots, H, D, D, dtype=torch.float32)}
    return {"kv_cache": randn(num_blocks, block_size, cfg.latent_dim),
            "index_cache": randn(num_blocks, block_size, cfg.index_head_dim, scale=4.0).clamp_(-8, 8).to(FP8),
            "index_scale": randn(num_blocks, block_size, dtype=torch.float32).abs_().add_(0.01)}


def make_step(cfg, kind: str, rows: int, q: int, context: int | None = None, block_size: int = 64,
              device="cpu", seed: int = 0) -> Step:
    """A step of ``rows`` requests x ``q`` tokens (all accepted) with caches sized to exactly it.

    KDA: ``rows`` state slots (context plays no part). DSA: each request owns
    ceil(context / block_size) shuffled blocks, holds ``context - q`` tokens before the step and
    ``context`` after it.
    """
    if kind == "kda":
        num_blocks, block_size, start = rows, q, 0  # one block per request, for valid slot_mapping
    else:
        num_blocks, start = rows * math.ceil(context / block_size), context - q
    caches = random_caches(cfg, kind, rows, num_blocks, block_size, device, seed)
    cache = KimiCache([LayerCache(**caches)], num_slots=rows, num_blocks=num_blocks, block_size=block_size)
    meta = RequestBatch(cache, rows, start_len=start, device=device, seed=seed).step(q)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(rows * q, cfg.hidden_size, generator=g, device=device).to(torch.bfloat16)
    return Step(x, meta, caches)


def traffic_bytes(cfg, kind: str, rows: int, q: int, context: int | None = None) -> int:
    """HBM bytes of a step besides the weights (the module docstring's floor terms)."""
    if kind == "kda":
        H, D = cfg.kda_heads, cfg.kda_head_dim
        recurrent = H * D * D * 4
        conv = (cfg.kda_conv_width - 1) * cfg.kda_conv_dim * 2
        return rows * 2 * (recurrent + conv)
    row = cfg.latent_row_bytes
    if kind == "mla":  # dense: a request's whole context, read once for its q tokens, and the inserts
        return rows * context * row + rows * q * row
    keys = rows * context * (cfg.index_head_dim + 4)
    selected = rows * q * min(context, cfg.index_topk) * row
    inserts = rows * q * (row + cfg.index_head_dim + 4)
    return keys + selected + inserts


def _entries(name: str, t: torch.Tensor) -> torch.Tensor:
    """A cache as [entries, ...]: KDA states per request slot, paged caches per token slot."""
    return t if name in STATES else t.flatten(0, 1)


def _written(name: str, meta: StepMeta) -> torch.Tensor:
    """The entries a step writes: its requests' state slots, or its tokens' cache slots."""
    idx = meta.state_indices if name in STATES else meta.slot_mapping
    return idx[idx >= 0].long()


def cache_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], meta: StepMeta) -> dict[str, float]:
    """Per cache: the relative Frobenius error of the entries this step wrote (index keys
    dequantized, so their scales are covered); raises if any entry it must not write differs."""
    errs = {}
    for name, t in got.items():
        a, b = _entries(name, t), _entries(name, ref[name])
        idx = _written(name, meta)
        flat = lambda e: e.reshape(e.shape[0], -1).view(torch.uint8)  # noqa: E731 - bit patterns per entry
        stray = (flat(a) != flat(b)).any(-1)
        stray[idx] = False
        n_stray = int(stray.sum())
        if n_stray:
            raise AssertionError(f"{name}: {n_stray} entries the step must not write differ from eager")
        if name == "index_scale":
            continue
        wa, wb = a[idx].float(), b[idx].float()
        if name == "index_cache":
            wa = wa * _entries("index_scale", got["index_scale"])[idx].unsqueeze(-1)
            wb = wb * _entries("index_scale", ref["index_scale"])[idx].unsqueeze(-1)
        errs[name] = rel_err(wa, wb)
    return errs


def run_once(fn: Callable, step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step of ``fn`` on fresh copies of the step's caches: (output, caches after it)."""
    caches = {n: t.clone() for n, t in step.caches.items()}
    return fn(*step.args(caches)), caches


def parity(block: nn.Module, compiled: dict[str, Callable], step: Step) -> dict[str, dict[str, float]]:
    """Errors of each compiled version against eager, after one step from identical caches:
    ``{name: {"out": err, <cache>: err, ...}}``."""
    ref_out, ref_caches = run_once(block, step)
    errs = {}
    for name, fn in compiled.items():
        out, caches = run_once(fn, step)
        errs[name] = {"out": rel_err(out, ref_out), **cache_errors(caches, ref_caches, step.meta)}
        del out, caches
    return errs


def parity_violations(errs: dict[str, dict[str, float]]) -> list[str]:
    """Each error above its tolerance, as ``"<version> <what> <err> > <tol>"``."""
    tol = {"out": OUT_TOL, **CACHE_TOL}
    return [f"{name} {what} {e:.2e} > {tol[what]:.0e}" for name, es in errs.items() for what, e in es.items()
            if not e <= tol[what]]


def rewritten_op(kind: str) -> str:
    """The op kimi_dep's last report put in place of the ``kind`` layer; raises if it stayed stock."""
    rep = dep_compile.last_report()
    hit = rep.rewritten(kind) if rep is not None else []
    if not hit:
        raise RuntimeError(f"kimi_dep left the {kind} layer stock:\n{rep.table() if rep else 'no report'}")
    return hit[0].op


def time_us(fn: Callable, step: Step, n_steps: int) -> float:
    """Median µs per launch of ``fn`` on the step, CUDA-graph replays (the caches mutate each launch)."""
    args = step.args()
    return time_graph(lambda i: fn(*args), n_steps)["median_us"]


def run_point(kind: str, cfg, block: AttentionBlock, stock: Callable, dep: Callable, rows: int, q: int,
              context: int | None, block_size: int, profile: bool = False) -> dict:
    """Parity, then the timing of both versions and the floors, for one point of the grid."""
    step = make_step(cfg, kind, rows, q, context, block_size, device="cuda")
    point = dict(kind=kind, rows=rows, q=q, context=context)
    with torch.no_grad():
        errs = parity(block, {"stock": stock, "kimi_dep": dep}, step)
        point["op"] = rewritten_op(kind)
        bad = parity_violations(errs)
        core = traffic_bytes(cfg, kind, rows, q, context)
        nbytes = weight_bytes(block) + core
        fl = floors_us(nbytes)
        roof = layer_roofline(block, cfg, kind, rows, q, context, core)
        n_steps = steps_per_replay(fl["practical"], copies=1)
        for name, fn in (("stock", stock), ("dep", dep)):
            try:
                point[f"{name}_us"] = time_us(fn, step, n_steps)
            except Exception as e:  # noqa: BLE001 - e.g. a host sync under capture: keep the other side
                point[f"{name}_us"] = None
                point[f"{name}_error"] = f"{type(e).__name__}: {e}"
        if profile:
            args = step.args()
            for name, fn in (("stock", stock), ("dep", dep)):
                point[f"{name}_kernels"] = kernel_profile(lambda fn=fn: fn(*args))
                print(format_table([f"{name} kernel", "µs", "launches"],
                                   [[k["kernel"], f"{k['us']:.1f}", f"{k['launches']:g}"]
                                    for k in point[f"{name}_kernels"]]), flush=True)
    s, d = point["stock_us"], point["dep_us"]
    point.update(ratio=s / d if s and d else None, dep_over_floor=d / fl["practical"] if d else None,
                 floor_433_us=fl["practical"], floor_48_us=fl["spec"], bytes=nbytes, n_steps=n_steps, roofline=roof,
                 roofline_us=roof["roofline_us"], dep_over_roofline=d / roof["roofline_us"] if d else None,
                 errors=errs, parity="ok" if not bad else "; ".join(bad))
    return point


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _errs(es: dict[str, float]) -> str:
    return f"{es['out']:.1e}; " + " ".join(f"{SHORT[k]} {v:.0e}" if v else f"{SHORT[k]} 0"
                                             for k, v in es.items() if k != "out")


def table(points: list[dict]) -> str:
    headers = ["kind", "rows", "q", "context", "stock µs", "kimi_dep µs", "stock/dep", "dep/floor@4.33",
               "floor@4.33 µs", "floor@4.8 µs", "FLOPs µs", "roofline µs", "dep/roofline", "err kimi_dep (out; caches)",
               "err stock (out; caches)", "parity"]
    body = [[p["kind"], p["rows"], p["q"], _fmt(p["context"], "d"), _fmt(p["stock_us"], ".1f"),
             _fmt(p["dep_us"], ".1f"), _fmt(p["ratio"], ".3f"), _fmt(p["dep_over_floor"], ".2f"),
             f"{p['floor_433_us']:.1f}", f"{p['floor_48_us']:.1f}", f"{p['roofline']['flops_us']:.1f}",
             f"{p['roofline_us']:.1f}", _fmt(p["dep_over_roofline"], ".2f"), _errs(p["errors"]["kimi_dep"]),
             _errs(p["errors"]["stock"]), "ok" if p["parity"] == "ok" else "FAIL"] for p in points]
    return format_table(headers, body)


def panels(kind: str, points: list[dict]) -> list[dict]:
    """One panel per (q, context): µs vs rows, stock vs kimi_dep, with the floor."""
    out = []
    for q, ctx in dict.fromkeys((p["q"], p["context"]) for p in points):
        ps = [p for p in points if p["q"] == q and p["context"] == ctx]
        title = f"K3.1 {kind.upper()} layer, q={q}" + (f", context {ctx}" if ctx else "")
        out.append({"title": title, "x": [p["rows"] for p in ps],
                    "series": {"stock (Inductor)": [p["stock_us"] for p in ps],
                               "kimi_dep": [p["dep_us"] for p in ps],
                               "floor @4.33 TB/s": [p["floor_433_us"] for p in ps],
                               "roofline floor": [p["roofline_us"] for p in ps]}})
    return out


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=sorted(ATTENTION), required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--q", type=int, nargs="+", default=[1, 2, 4], help="tokens per request")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768], help="DSA only: tokens per request")
    ap.add_argument("--block-size", type=int, default=64, help="DSA paged-cache block size")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true", help="print each side's top kernels per point")
    args = ap.parse_args()
    kind = args.kind
    contexts = args.context if kind == "dsa" else [None]
    grid = [(r, q, c) for q in args.q for c in contexts for r in args.rows]
    raise_recompile_limits(2 * len(grid))
    cfg = preset("k31")
    block = build_block(cfg, kind, device="cuda")
    stock = torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True, dynamic=False)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"attention_{kind}.json")
    print(f"K3.1 {kind} layer: {weight_bytes(block) / 1e6:.0f} MB of weights; {len(grid)} points", flush=True)
    points, failures = [], []
    for rows, q, ctx in grid:
        where = f"{kind} rows={rows} q={q}" + (f" context={ctx}" if ctx else "")
        try:
            p = run_point(kind, cfg, block, stock, dep, rows, q, ctx, args.block_size, args.profile)
            points.append(p)
            print(f"{where}: stock {_fmt(p['stock_us'], '.1f')} µs, kimi_dep {_fmt(p['dep_us'], '.1f')} µs, "
                  f"floor {p['floor_433_us']:.1f} µs; parity {p['parity']}", flush=True)
            for side in ("stock", "dep"):
                if f"{side}_error" in p:
                    print(f"  {side} timing failed: {p[side + '_error']}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing point must not lose the run
            failures.append(dict(kind=kind, rows=rows, q=q, context=ctx, error=f"{type(e).__name__}: {e}"))
            print(f"{where}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}", flush=True)
        free_cuda()
        write_json(json_path, {"kind": kind, "preset": cfg.name, "weight_bytes": weight_bytes(block),
                               "block_size": args.block_size, "points": points, "failures": failures})
    if points:
        print(table(points))
        plot_panels(os.path.join(args.out, f"attention_{kind}.png"), panels(kind, points), xlabel="rows (requests)",
                    ylabel="µs per layer", suptitle=f"K3.1 {kind.upper()} attention layer: stock Inductor vs kimi_dep")
    print(f"{len(points)} points, {len(failures)} failed; {json_path}")


if __name__ == "__main__":
    main()
