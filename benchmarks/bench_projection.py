#!/usr/bin/env python3
"""Op-level benchmark of the DepProjection GEMMs: cuBLAS against the Triton split-K kernel.

``y[M, N] = x[M, K] @ W[N, K]^T`` (BF16 in, FP32 accumulate, BF16 out) for the four decode
projections of Kimi K3 at M = 1..64 rows. For every (shape, rows) it

1. times cuBLAS (``torch.mm(x, w.t(), out=out)``) and a sweep of :class:`SplitK` tactics
   (CUDA-graph replays, weights rotated past L2, medians: ``benchmarks/common.py``), each
   tactic first checked against an FP32 reference on fresh random inputs with the output
   NaN-poisoned (rel. Frobenius error <= 1e-2, every element finite), and checked again
   after its timing (the arrival counters must be back to zero);
2. re-times cuBLAS and the best few tactics in interleaved rounds: the spread between rounds
   is the noise, and split-K wins a bin only by more than that margin;
3. times the winner as a programmatic dependent launch (PDL), chained and behind a small
   predecessor kernel (information only: the tables are chosen without PDL);
4. checks the proposed tables at in-between batches (3, 6, 12, 24, 48 rows);

then prints a table (µs, TB/s of weight bytes, fractions of the 4.33 / 4.8 TB/s floors) and
the proposed ``DEP_PROJECTION`` / ``DEP_OPROJ`` tables as Python literals, and writes
``projection.json`` and ``projection.png`` to ``--out`` (default ``$OUT``).

Run from the repository root on a CUDA machine::

    python3 benchmarks/bench_projection.py --out $OUT
    python3 benchmarks/bench_projection.py --dry-run      # print the sweep plan, no GPU
    python3 benchmarks/bench_projection.py --validate --out $OUT   # the tables in tactics.py vs cuBLAS
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from dep_compile.tactics import CUBLAS, SplitK, lookup  # noqa: E402

# name -> (N, K, table it fills)
SHAPES: dict[str, tuple[int, int, str]] = {
    "dsa_qkv_a_g_index": (14560, 7168, "DEP_PROJECTION"),
    "kda_in_proj": (49376, 7168, "DEP_PROJECTION"),
    "moe_front": (15872, 7168, "DEP_PROJECTION"),
    "o_proj": (7168, 12288, "DEP_OPROJ"),
}
ROWS = (1, 2, 4, 8, 16, 32, 64)
BETWEEN_ROWS = (3, 6, 12, 24, 40, 48, 56)
SPLITS = (1, 2, 3, 4, 6, 8)
# (block_n, block_k, num_warps, num_stages); "tma" variants load w through a TMA descriptor.
# Run 1 (2026-11-30, uncoalesced partial stores) also swept splits 7/12/14/16 (best 8-21 %
# behind the winner at every (shape, rows)) and the configs 32/256/4/4 and 32/512/4/3 (best
# 1.3 % and 2.5 % behind).
BASE_CONFIGS = (
    (64, 256, 4, 4),
    (64, 256, 4, 3),
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (128, 128, 4, 4),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
    (256, 64, 8, 4),
    (256, 128, 8, 3),
)
TMA_CONFIGS = ((64, 256, 4, 4), (128, 128, 4, 4))
FULL_SWEEP_ROWS = (1, 16, 32, 64)  # other rows time only the best tactics of these (same block_m)
SEEDS = 8
SMEM_LIMIT = 225 * 1024
SMS = 132
REL_TOL = 1e-2


def block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def smem_bytes(bn: int, bk: int, stages: int, bm: int) -> int:
    return stages * (bn + bm) * bk * 2


def splits_for(n: int, k: int, bn: int, bk: int, splits=SPLITS) -> list[int]:
    """Split counts that keep every K-slice non-empty, within 5 % of balanced, and the grid
    between about one and twelve waves of one CTA per SM."""
    chunks = math.ceil(k / bk)
    tiles = math.ceil(n / bn)
    out = []
    for s in splits:
        if s > chunks:
            continue
        per = math.ceil(chunks / s)
        if (s - 1) * per >= chunks or per * s - chunks > 0.05 * chunks:
            continue
        ctas = tiles * s
        if s > 1 and not (SMS * 0.9 <= ctas <= SMS * 8):
            continue
        out.append(s)
    return out


def candidates(n: int, k: int, rows: int, configs=BASE_CONFIGS, tma_configs=TMA_CONFIGS) -> list[tuple[SplitK, dict]]:
    bm = block_m(rows)
    out: list[tuple[SplitK, dict]] = []
    for variant, cfgs in (({}, configs), ({"use_tma": True}, tma_configs)):
        for bn, bk, warps, stages in cfgs:
            if smem_bytes(bn, bk, stages, bm) > SMEM_LIMIT:
                continue
            for s in splits_for(n, k, bn, bk):
                out.append((SplitK(s, bn, bk, warps, stages), dict(variant)))
    return out


def label(tactic, variant: dict | None = None) -> str:
    if tactic == CUBLAS:
        return "cublas"
    extra = "".join(f"+{key}" if val is True else f"+{key}={val}" for key, val in sorted((variant or {}).items()) if val)
    return f"{tactic}{extra}"


def literal(tactic) -> str:
    if tactic == CUBLAS:
        return "CUBLAS"
    return f"SplitK({tactic.split_k}, {tactic.block_n}, {tactic.block_k}, {tactic.num_warps}, {tactic.num_stages})"


# ----------------------------------------------------------------------------- compile


def _compile_worker(job):
    """Spawned process: compile (and run once, small) one kernel specialization."""
    k, rows, fields, variant = job
    try:
        import torch as _torch  # noqa: PLC0415

        from dep_compile.ops.splitk_triton import splitk_linear, splitk_workspace  # noqa: PLC0415

        tactic = SplitK(*fields)
        n = 256  # the kernel does not specialize on N or M; out's row stride stays a multiple of 16
        x = _torch.randn(rows, k, dtype=_torch.bfloat16, device="cuda")
        w = _torch.randn(n, k, dtype=_torch.bfloat16, device="cuda")
        out = _torch.empty(rows, n, dtype=_torch.bfloat16, device="cuda")
        ws = splitk_workspace(rows, n, tactic, "cuda")
        splitk_linear(x, w, out, tactic, ws, **dict(variant))
        _torch.cuda.synchronize()
        return job, None
    except Exception as e:  # noqa: BLE001 - reported, the tactic is dropped
        return job, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(jobs: list, workers: int) -> dict:
    """Compile every specialization in parallel processes (fills Triton's on-disk cache)."""
    failures = {}
    if not jobs:
        return failures
    import concurrent.futures as cf  # noqa: PLC0415
    import multiprocessing as mp  # noqa: PLC0415

    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for job, err in pool.map(_compile_worker, jobs, chunksize=2):
            if err:
                failures[job] = err
    print(f"precompiled {len(jobs)} specializations on {workers} processes in {time.time() - t0:.1f}s, "
          f"{len(failures)} failed", flush=True)
    for job, err in list(failures.items())[:8]:
        print(f"  compile failure {job}: {err}", flush=True)
    return failures


def _job(k: int, rows: int, tactic: SplitK, variant: dict):
    return (k, block_m(rows), (tactic.split_k, tactic.block_n, tactic.block_k, tactic.num_warps, tactic.num_stages),
            tuple(sorted(variant.items())))


# ----------------------------------------------------------------------------- measuring


class Bench:
    def __init__(self, name: str, n: int, k: int, args):
        from dep_compile.ops.splitk_triton import splitk_linear, splitk_workspace  # noqa: PLC0415

        self.splitk_linear = splitk_linear
        self.name, self.n, self.k, self.args = name, n, k, args
        self.wbytes = n * k * 2
        self.copies = common.rotation_copies(self.wbytes)
        gen = torch.Generator(device="cuda").manual_seed(hash(name) % 2**31)
        self.ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(self.copies)]
        self.w32 = self.ws[0].float()
        self.est_us = common.floor_us(self.wbytes)
        self.n_steps = common.steps_per_replay(self.est_us, self.copies, target_us=args.replay_us)
        all_tactics = [SplitK(s, bn, 64, 4, 1) for bn in (32, 64, 128, 256) for s in SPLITS]
        self.workspace = splitk_workspace(max(max(ROWS), max(BETWEEN_ROWS)), n, all_tactics, "cuda")
        self.pred_src = {}

    def run(self, tactic, variant, x, out):
        if tactic == CUBLAS:
            return lambda i: torch.mm(x, self.ws[i % self.copies].t(), out=out)
        fn = self.splitk_linear
        ws = self.workspace
        return lambda i: fn(x, self.ws[i % self.copies], out, tactic, ws, **variant)

    def check(self, tactic, variant, rows) -> tuple[bool, float, str]:
        x = torch.randn(rows, self.k, dtype=torch.bfloat16, device="cuda")
        out = torch.full((rows, self.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        if tactic == CUBLAS:
            torch.mm(x, self.ws[0].t(), out=out)
        else:
            self.splitk_linear(x, self.ws[0], out, tactic, self.workspace, **variant)
        ref = torch.mm(x.float(), self.w32.t())
        finite = bool(torch.isfinite(out).all())
        rel = common.rel_err(out, ref)
        why = ""
        if not finite:
            why = f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
        elif not rel <= REL_TOL:
            why = f"rel err {rel:.2e} > {REL_TOL}"
        if tactic != CUBLAS and tactic.split_k > 1:
            from dep_compile.ops.splitk_triton import _counter_numel  # noqa: PLC0415

            n_cnt = _counter_numel(rows, self.n, tactic)
            stuck = int((self.workspace.view(torch.int32)[-n_cnt:] != 0).sum())
            if stuck:
                why = (why + "; " if why else "") + f"{stuck} arrival counters not reset"
        return not why, rel, why

    def time(self, tactic, variant, x, out, pdl_pred: bool = False) -> dict:
        step = self.run(tactic, variant, x, out)
        if pdl_pred:  # a small elementwise kernel before every projection, as a norm would be
            src = self.pred_src.setdefault(tuple(x.shape), torch.randn_like(x))
            inner = step

            def step(i, inner=inner, src=src, x=x):  # noqa: E306
                x.copy_(src)
                inner(i)

        return common.time_graph(step, self.n_steps, replays=self.args.replays)

    def free(self):
        del self.ws, self.w32, self.workspace


def rows_order(args) -> list[int]:
    """Full-sweep rows first, so that the other rows can be seeded from them."""
    full = [r for r in args.rows if args.full or r in FULL_SWEEP_ROWS]
    return full + [r for r in args.rows if r not in full]


def seeded(rows: int, ranked: dict, args) -> list:
    """For a row count outside the full sweep: the best tactics of the swept rows of the same block_m."""
    if args.full or rows in FULL_SWEEP_ROWS:
        return []
    out, seen = [], set()
    for r, lst in ranked.items():
        if block_m(r) != block_m(rows):
            continue
        for _, t, v in lst[:SEEDS]:
            key = label(t, v)
            if key not in seen:
                seen.add(key)
                out.append((t, v))
    return out


def measure_shape(name: str, args, budget_end: float, failures: dict) -> dict:
    n, k, table = SHAPES[name]
    bench = Bench(name, n, k, args)
    print(f"\n== {name}: N={n} K={k} weight {bench.wbytes / 1e6:.1f} MB, {bench.copies} copies rotated, "
          f"{bench.n_steps} launches/replay, floor {bench.est_us:.1f} us @4.33", flush=True)
    result = {"n": n, "k": k, "table": table, "weight_bytes": bench.wbytes, "copies": bench.copies,
              "n_steps": bench.n_steps, "rows": {}}
    # A reference read of these very bytes: torch.sum streams each weight copy once (it is not
    # a ceiling: run 1 measured it at 3.2-4.0 TB/s, below the GEMMs).
    read = common.time_graph(lambda i: torch.sum(bench.ws[i % bench.copies], dtype=torch.float32),
                             bench.n_steps, replays=args.replays)
    result["read_us"] = read["median_us"]
    print(f"   torch.sum of the weight: {read['median_us']:.2f} us = "
          f"{common.tbps(bench.wbytes, read['median_us']):.3f} TB/s", flush=True)
    ranked: dict[int, list] = {}
    for rows in rows_order(args):
        t_rows = time.time()
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        ok, rel, why = bench.check(CUBLAS, {}, rows)
        cub = bench.time(CUBLAS, {}, x, out)
        entry = {"cublas": {"rel_err": rel, **cub}, "sweep": []}
        sweep = []
        seeds = seeded(rows, ranked, args)
        cands = seeds or candidates(n, k, rows, args.configs, args.tma_configs)
        entry["seeded"] = bool(seeds)
        for tactic, variant in cands:
            job = _job(k, rows, tactic, variant)
            if job in failures:
                entry["sweep"].append({"tactic": label(tactic, variant), "error": failures[job]})
                continue
            if time.time() > budget_end:
                entry["sweep"].append({"tactic": label(tactic, variant), "error": "skipped: time budget"})
                continue
            try:
                ok, rel, why = bench.check(tactic, variant, rows)
                if not ok:
                    entry["sweep"].append({"tactic": label(tactic, variant), "error": f"check failed: {why}"})
                    print(f"   FAIL {label(tactic, variant)} rows={rows}: {why}", flush=True)
                    continue
                t = bench.time(tactic, variant, x, out)
                ok2, rel2, why2 = bench.check(tactic, variant, rows)
                rec = {"tactic": label(tactic, variant), "rel_err": max(rel, rel2), **t}
                if not ok2:
                    rec["error"] = f"check after timing failed: {why2}"
                    print(f"   FAIL after timing {label(tactic, variant)} rows={rows}: {why2}", flush=True)
                else:
                    sweep.append((t["median_us"], tactic, variant))
                entry["sweep"].append(rec)
            except Exception as e:  # noqa: BLE001 - keep sweeping
                entry["sweep"].append({"tactic": label(tactic, variant), "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"   ERROR {label(tactic, variant)} rows={rows}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        sweep.sort(key=lambda r: r[0])
        ranked[rows] = sweep
        # Confirmation: interleaved rounds of cuBLAS and the best few tactics.
        finalists = [(CUBLAS, {})] + [(t, v) for _, t, v in sweep[: args.finalists]]
        rounds = {label(t, v): [] for t, v in finalists}
        for _ in range(args.rounds):
            for t, v in finalists:
                rounds[label(t, v)].append(bench.time(t, v, x, out)["median_us"])
        conf = {}
        for t, v in finalists:
            vals = rounds[label(t, v)]
            med = sorted(vals)[len(vals) // 2]
            conf[label(t, v)] = {"median_us": med, "rounds_us": vals, "spread": (max(vals) - min(vals)) / med}
        cub_us = conf["cublas"]["median_us"]
        best = None
        for t, v in finalists[1:]:
            c = conf[label(t, v)]
            if best is None or c["median_us"] < best[0]:
                best = (c["median_us"], t, v, c["spread"])
        margin = max(args.min_margin, conf["cublas"]["spread"], best[3] if best else 0.0)
        wins = best is not None and best[0] < cub_us * (1 - margin)
        entry["confirm"] = conf
        entry["cublas_us"] = cub_us
        entry["margin"] = margin
        if best is not None:
            entry["best"] = {"tactic": label(best[1], best[2]), "literal": literal(best[1]), "variant": best[2],
                             "median_us": best[0], "spread": best[3]}
        entry["choice"] = literal(best[1]) if wins and not best[2] else "CUBLAS"
        entry["choice_us"] = best[0] if wins and not best[2] else cub_us
        if wins and best[2]:
            entry["note"] = f"best is a variant ({label(best[1], best[2])}); table keeps CUBLAS unless a plain tactic wins"
            plain = [(conf[label(t, v)]["median_us"], t) for t, v in finalists[1:] if not v]
            if plain and min(plain, key=lambda p: p[0])[0] < cub_us * (1 - margin):
                pu, pt = min(plain, key=lambda p: p[0])
                entry["choice"], entry["choice_us"] = literal(pt), pu
        # PDL (information only): the best plain tactic chained with PDL, and behind a small kernel.
        if best is not None and args.pdl and time.time() < budget_end:
            t_pdl = best[1]
            pdl_rows = {}
            try:
                variants = {"plain": {}, "pdl": {"pdl": True}}  # run 1: L2 prefetch before the wait lost 1-3 us
                for tag, var in variants.items():
                    var = {**best[2], **var}
                    ok, rel, why = bench.check(t_pdl, var, rows)
                    if not ok:
                        pdl_rows[tag] = {"error": why}
                        continue
                    pdl_rows[tag] = {"chained_us": bench.time(t_pdl, var, x, out)["median_us"],
                                     "after_small_kernel_us": bench.time(t_pdl, var, x, out, pdl_pred=True)["median_us"]}
                pdl_rows["cublas"] = {"chained_us": cub_us,
                                      "after_small_kernel_us": bench.time(CUBLAS, {}, x, out, pdl_pred=True)["median_us"]}
            except Exception as e:  # noqa: BLE001
                pdl_rows["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            entry["pdl"] = pdl_rows
        result["rows"][rows] = entry
        b = entry.get("best", {})
        print(f"   rows={rows:3d} cublas {cub_us:8.2f} us ({common.tbps(bench.wbytes, cub_us):.2f} TB/s) | best "
              f"{b.get('median_us', float('nan')):8.2f} us ({common.tbps(bench.wbytes, b['median_us']) if b else 0:.2f} TB/s) "
              f"{b.get('tactic', '-')} | margin {margin * 100:.1f}% -> {entry['choice']} [{len(sweep)} ok, "
              f"{time.time() - t_rows:.0f}s]", flush=True)
        if "pdl" in entry:
            print("      pdl: " + ", ".join(
                f"{tag}: " + "/".join(f"{v:.2f}" for v in d.values() if isinstance(v, float)) for tag, d in entry["pdl"].items()
                if isinstance(d, dict)) + "  (chained / after a small kernel, us)", flush=True)
        del x, out
    result["rows"] = {r: result["rows"][r] for r in sorted(result["rows"])}
    # Check the proposed table at in-between batches.
    table_for_shape = {}
    for rows in args.rows:
        e = result["rows"][rows]
        table_for_shape[rows] = _parse_literal(e["choice"])
    result["between"] = {}
    if args.between and time.time() < budget_end:
        for rows in BETWEEN_ROWS:
            tactic = lookup(table_for_shape, rows)
            if tactic == CUBLAS:
                continue
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            ok, rel, why = bench.check(tactic, {}, rows)
            cub = [bench.time(CUBLAS, {}, x, out)["median_us"] for _ in range(2)]
            sk = [bench.time(tactic, {}, x, out)["median_us"] for _ in range(2)]
            result["between"][rows] = {"tactic": literal(tactic), "ok": ok, "rel_err": rel, "cublas_us": min(cub),
                                       "splitk_us": min(sk)}
            print(f"   between rows={rows:3d}: {literal(tactic)} {min(sk):.2f} us vs cublas {min(cub):.2f} us "
                  f"({'ok' if ok else 'FAIL ' + why})", flush=True)
    # The table, refined: where split-K was slower than cuBLAS at an in-between batch, a finer
    # bin sends the batches up to it to cuBLAS.
    final = {r: literal(t) for r, t in table_for_shape.items()}
    for rows, b in result["between"].items():
        if not b["ok"] or b["splitk_us"] > b["cublas_us"]:
            final[rows] = "CUBLAS"
    result["final_table"] = {r: final[r] for r in sorted(final)}
    bench.free()
    torch.cuda.empty_cache()
    return result


def _parse_literal(text: str):
    if text == "CUBLAS":
        return CUBLAS
    return eval(text, {"SplitK": SplitK})  # noqa: S307 - our own literal


# ----------------------------------------------------------------------------- report


def report(results: dict) -> str:
    headers = ["shape", "rows", "cuBLAS us", "cuBLAS TB/s", "best split-K us", "tactic", "ratio cuBLAS/sk",
               "sk TB/s", "sk/4.33", "sk/4.8", "chosen", "chosen TB/s", "PDL chained us"]
    lines = []
    for name, res in results.items():
        wb = res["weight_bytes"]
        for rows, e in res["rows"].items():
            b = e.get("best")
            pdl = e.get("pdl", {}).get("pdl", {}).get("chained_us")
            sk_us = b["median_us"] if b else None
            lines.append([
                name, rows, f"{e['cublas_us']:.2f}", f"{common.tbps(wb, e['cublas_us']):.3f}",
                f"{sk_us:.2f}" if sk_us else "-", b["tactic"] if b else "-",
                f"{e['cublas_us'] / sk_us:.3f}" if sk_us else "-",
                f"{common.tbps(wb, sk_us):.3f}" if sk_us else "-",
                f"{common.tbps(wb, sk_us) * 1e12 / common.HBM_PRACTICAL_BPS:.3f}" if sk_us else "-",
                f"{common.tbps(wb, sk_us) * 1e12 / common.HBM_SPEC_BPS:.3f}" if sk_us else "-",
                e["choice"], f"{common.tbps(wb, e['choice_us']):.3f}",
                f"{pdl:.2f}" if pdl else "-",
            ])
    return common.format_table(headers, lines)


def table_literals(results: dict) -> str:
    proj, oproj = [], []
    for name, res in results.items():
        body = ", ".join(f"{rows}: {choice}" for rows, choice in res["final_table"].items())
        if res["table"] == "DEP_OPROJ":
            oproj.append(f"DEP_OPROJ: dict[int, Tactic] = {{{body}}}  # {name} {res['n']} x {res['k']}")
        else:
            proj.append(f'    "{name}": {{{body}}},  # {res["n"]} x {res["k"]}')
    return "DEP_PROJECTION: dict[str, dict[int, Tactic]] = {\n" + "\n".join(proj) + "\n}\n" + "\n".join(oproj)


HLINES = {"4.8 TB/s spec": 4.8, "4.33 TB/s read ceiling": 4.33, "4.2 TB/s target": 4.2}


def _plot_tbps(results: dict, path: str, series_of, suptitle: str) -> str | None:
    """One TB/s-vs-rows panel per shape; ``series_of(wb, entries) -> {label: [TB/s | None]}``."""
    panels = []
    for name, res in results.items():
        rows = list(res["rows"])
        series = series_of(res["weight_bytes"], [res["rows"][r] for r in rows])
        panels.append({"title": f"{name} ({res['n']} x {res['k']})", "x": rows, "series": series, "hlines": HLINES})
    return common.plot_panels(path, panels, xlabel="rows (M)", ylabel="effective TB/s (weight bytes / time)",
                              suptitle=suptitle)


def plot(results: dict, path: str) -> str | None:
    def series_of(wb, es):
        series = {
            "cuBLAS": [common.tbps(wb, e["cublas_us"]) for e in es],
            "split-K (best)": [common.tbps(wb, e["best"]["median_us"]) if e.get("best") else None for e in es],
        }
        pdl = [e.get("pdl", {}).get("pdl", {}).get("chained_us") for e in es]
        if any(pdl):
            series["split-K + PDL (chained)"] = [common.tbps(wb, p) if p else None for p in pdl]
        return series

    return _plot_tbps(results, path, series_of,
                      "DepProjection: cuBLAS vs Triton split-K (H200, CUDA graphs, weights rotated past L2)")

VALIDATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64)


def validate(args) -> dict:
    """Time the tables in ``dep_compile.tactics`` against cuBLAS at many batches.

    For every shape and batch: the table's tactic (checked against the FP32 reference, output
    poisoned) and cuBLAS, in ``--rounds`` interleaved rounds; the median of the round medians.
    """
    from dep_compile import tactics  # noqa: PLC0415

    results = {}
    for name in args.shapes:
        n, k, table_name = SHAPES[name]
        table = tactics.DEP_OPROJ if table_name == "DEP_OPROJ" else tactics.DEP_PROJECTION[name]
        bench = Bench(name, n, k, args)
        print(f"\n== {name}: N={n} K={k} weight {bench.wbytes / 1e6:.1f} MB, table {table_name}"
              f"{'' if table_name == 'DEP_OPROJ' else '[' + repr(name) + ']'} = {{"
              + ", ".join(f"{b}: {literal(t)}" for b, t in sorted(table.items())) + "}", flush=True)
        res = {"n": n, "k": k, "table": table_name, "weight_bytes": bench.wbytes, "rows": {}}
        for rows in args.validate_rows:
            tactic = lookup(table, rows)
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            ok, rel, why = bench.check(tactic, {}, rows)
            cub_r, tab_r = [], []
            for _ in range(args.rounds):
                cub_r.append(bench.time(CUBLAS, {}, x, out)["median_us"])
                if tactic != CUBLAS:
                    tab_r.append(bench.time(tactic, {}, x, out)["median_us"])
            med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
            cub = med(cub_r)
            tab = med(tab_r) if tab_r else cub
            spread = max((max(v) - min(v)) / med(v) for v in (cub_r, tab_r) if v)
            e = {"tactic": literal(tactic), "ok": ok, "rel_err": rel, "cublas_us": cub, "table_us": tab,
                 "cublas_rounds_us": cub_r, "table_rounds_us": tab_r, "spread": spread}
            res["rows"][rows] = e
            flag = "" if ok else f"  CHECK FAILED: {why}"
            if tactic != CUBLAS and tab > cub:
                flag += "  SLOWER THAN CUBLAS"
            print(f"   rows={rows:3d} {literal(tactic):26s} {tab:8.2f} us ({common.tbps(bench.wbytes, tab):.3f} TB/s)"
                  f" | cublas {cub:8.2f} us ({common.tbps(bench.wbytes, cub):.3f} TB/s) | x{cub / tab:.3f}"
                  f" spread {spread * 100:.2f}%  err {rel:.1e}{flag}", flush=True)
            del x, out
        bench.free()
        torch.cuda.empty_cache()
        results[name] = res
    return results


def validate_report(results: dict) -> str:
    headers = ["shape", "rows", "tactic", "table us", "table TB/s", "/4.33", "/4.8", "cuBLAS us", "cuBLAS TB/s",
               "cuBLAS/table", "spread %"]
    lines = []
    for name, res in results.items():
        wb = res["weight_bytes"]
        for rows, e in res["rows"].items():
            t = common.tbps(wb, e["table_us"])
            lines.append([name, rows, e["tactic"], f"{e['table_us']:.2f}", f"{t:.3f}",
                          f"{t * 1e12 / common.HBM_PRACTICAL_BPS:.3f}", f"{t * 1e12 / common.HBM_SPEC_BPS:.3f}",
                          f"{e['cublas_us']:.2f}", f"{common.tbps(wb, e['cublas_us']):.3f}",
                          f"{e['cublas_us'] / e['table_us']:.3f}", f"{e['spread'] * 100:.2f}"])
    return common.format_table(headers, lines)


def validate_plot(results: dict, path: str) -> str | None:
    return _plot_tbps(results, path, lambda wb, es: {
        "cuBLAS": [common.tbps(wb, e["cublas_us"]) for e in es],
        "DepProjection table": [common.tbps(wb, e["table_us"]) for e in es],
    }, "DepProjection tables vs cuBLAS (H200, CUDA graphs, weights rotated past L2)")

def _start_gpu_run(args) -> float | None:
    """Check for a GPU, turn TF32 off, make the output dir, print the environment; the start time."""
    if not torch.cuda.is_available():
        print("bench_projection: needs a CUDA device", file=sys.stderr)
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    print("env:", common.env_info(), flush=True)
    return time.time()


def parse_configs(text: str | None, default):
    if not text:
        return default
    if text == "none":
        return ()
    return tuple(tuple(int(v) for v in c.split("/")) for c in text.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--configs", default=None, help="bn/bk/warps/stages,... (default: the built-in sweep)")
    p.add_argument("--tma-configs", default=None, help="same, for TMA loads; 'none' to skip")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--replay-us", type=float, default=1500.0, help="target length of one graph replay")
    p.add_argument("--rounds", type=int, default=3, help="interleaved confirmation rounds")
    p.add_argument("--finalists", type=int, default=3)
    p.add_argument("--min-margin", type=float, default=0.005, help="least relative win for split-K to take a bin")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping new tactics after this long")
    p.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    p.add_argument("--no-pdl", dest="pdl", action="store_false")
    p.add_argument("--no-between", dest="between", action="store_false")
    p.add_argument("--full", action="store_true", help="full sweep at every row count (default: only at "
                   + ",".join(map(str, FULL_SWEEP_ROWS)) + ", the others seeded from them)")
    p.add_argument("--dry-run", action="store_true", help="print the sweep plan and exit (no GPU needed)")
    p.add_argument("--validate", action="store_true",
                   help="no sweep: time the tables in dep_compile.tactics against cuBLAS at many batches")
    p.add_argument("--validate-rows", default=",".join(map(str, VALIDATE_ROWS)))
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.rows = [int(r) for r in args.rows.split(",") if r]
    args.configs = parse_configs(args.configs, BASE_CONFIGS)
    args.tma_configs = parse_configs(args.tma_configs, TMA_CONFIGS)

    args.validate_rows = [int(r) for r in args.validate_rows.split(",") if r]
    if args.validate:
        t_start = _start_gpu_run(args)
        if t_start is None:
            return 2
        results = validate(args)
        text = validate_report(results)
        png = validate_plot(results, os.path.join(args.out, "projection_tables.png"))
        common.write_json(os.path.join(args.out, "projection_tables.json"),
                          {"results": results, "args": vars(args), "table": text, "wall_s": time.time() - t_start})
        print("\n" + text)
        slower = [(name, r) for name, res in results.items() for r, e in res["rows"].items()
                  if e["tactic"] != "CUBLAS" and e["table_us"] > e["cublas_us"]]
        failed = [(name, r) for name, res in results.items() for r, e in res["rows"].items() if not e["ok"]]
        print(f"\nslower than cuBLAS: {slower or 'none'}; failed checks: {failed or 'none'}; "
              f"wrote {args.out}/projection_tables.json" + (f" and {png}" if png else "")
              + f"; wall {time.time() - t_start:.0f}s")
        return 1 if failed else 0

    jobs = set()
    n_meas = 0
    for name in args.shapes:
        n, k, _ = SHAPES[name]
        for rows in args.rows:
            cands = candidates(n, k, rows, args.configs, args.tma_configs)
            full = args.full or rows in FULL_SWEEP_ROWS or not any(
                block_m(r) == block_m(rows) and r in FULL_SWEEP_ROWS for r in args.rows)
            n_meas += len(cands) if full else 2 * SEEDS
            jobs.update(_job(k, rows, t, v) for t, v in cands)
            if args.dry_run:
                print(f"{name} rows={rows}: {len(cands)} tactics: " + " ".join(label(t, v) for t, v in cands))
    print(f"plan: {len(args.shapes)} shapes x {len(args.rows)} rows, {n_meas} tactic timings, "
          f"{len(jobs)} kernel specializations", flush=True)
    if args.dry_run:
        return 0
    t_start = _start_gpu_run(args)
    if t_start is None:
        return 2
    failures = precompile(sorted(jobs), args.workers)
    budget_end = t_start + args.budget_s
    results = {}
    for name in args.shapes:
        results[name] = measure_shape(name, args, budget_end, failures)
        common.write_json(os.path.join(args.out, "projection.json"),
                          {"results": results, "args": vars(args), "partial": True}, with_env=True)

    text = report(results)
    literals = table_literals(results)
    png = plot(results, os.path.join(args.out, "projection.png"))
    common.write_json(os.path.join(args.out, "projection.json"),
                      {"results": results, "args": vars(args), "table": text, "literals": literals,
                       "compile_failures": {str(k): v for k, v in failures.items()}, "wall_s": time.time() - t_start})
    print("\n" + text)
    print("\n# proposed tactic tables (bins = rows; CUBLAS where split-K does not win beyond the noise)")
    print(literals)
    print(f"\nwrote {args.out}/projection.json" + (f" and {png}" if png else "") + f"; wall {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
