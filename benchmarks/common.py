"""Timing and reporting helpers shared by the project's GPU benchmarks.

How the project times GPU work (docs/design.md §7.2):

* CUDA events around CUDA-graph replays; one replay runs ``n_steps`` launches back to back and
  the time per launch is the replay's time over ``n_steps``; we report the median over
  replays (and keep min / p20 / p80);
* weights rotated past L2: a benchmark keeps :func:`rotation_copies` copies of its weights
  (together more than twice the L2) and launch ``i`` of the graph reads copy ``i % copies``,
  so no launch finds its weights in L2;
* never on zeros: inputs are random;
* floors: the bytes that must move over the practical read ceiling (4.33 TB/s, a streaming
  read measured on the H200) and over the spec (4.8 TB/s). The floors are the H200's on any GPU; each run's
  ``env`` records the GPU's own read ceiling (``hbm_read_tbps``), by which a run on another GPU (an H100 reads
  ~30 % slower) is set against its own floor.

Nothing here imports CUDA-only packages at import time; matplotlib is imported by
:func:`plot_panels` only.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from typing import Callable, Iterable, Mapping, Sequence

import torch

from dep_compile.debug.parity import rel_err  # noqa: F401  (relative Frobenius error, used by every benchmark)
from dep_compile.ops.fallbacks import LOGGED

HBM_PRACTICAL_BPS = 4.33e12
"""Practical read ceiling (bytes/s): a streaming read on the H200 (Triton load-only, torch.sum)."""
HBM_SPEC_BPS = 4.8e12
"""H200 HBM3e bandwidth by the datasheet (bytes/s)."""
DEFAULT_L2_BYTES = 60 * 1000 * 1000


def floor_us(nbytes: float, bps: float = HBM_PRACTICAL_BPS) -> float:
    """Microseconds to move ``nbytes`` at ``bps`` bytes/s."""
    return nbytes / bps * 1e6


def floors_us(nbytes: float) -> dict[str, float]:
    """Both floors for ``nbytes``: ``{"practical": at 4.33 TB/s, "spec": at 4.8 TB/s}`` in µs."""
    return {"practical": floor_us(nbytes, HBM_PRACTICAL_BPS), "spec": floor_us(nbytes, HBM_SPEC_BPS)}


def tbps(nbytes: float, us: float) -> float:
    """Effective TB/s of moving ``nbytes`` in ``us`` microseconds."""
    return nbytes / (us * 1e-6) / 1e12


def l2_bytes(device: "torch.device | int | None" = None) -> int:
    """The device's L2 size in bytes (60 MB on the H200 when the property is missing)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        size = getattr(props, "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def rotation_copies(nbytes_per_copy: int, l2: int | None = None, min_copies: int = 2) -> int:
    """How many copies of an operand of ``nbytes_per_copy`` bytes to rotate among so that
    their total exceeds twice the L2 (and at least ``min_copies``)."""
    l2 = l2 if l2 is not None else l2_bytes()
    return max(min_copies, math.ceil(2 * l2 / max(1, nbytes_per_copy)) + 1)


def steps_per_replay(est_us: float, copies: int, target_us: float = 1500.0, max_steps: int = 200) -> int:
    """Launches per graph replay: a multiple of ``copies`` whose replay lasts about ``target_us``."""
    steps = max(1, math.ceil(target_us / max(est_us, 1e-3)))
    steps = min(max_steps, max(steps, copies))
    return math.ceil(steps / copies) * copies


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)

    def q(p: float) -> float:
        return ordered[min(n - 1, max(0, int(round(p * (n - 1)))))]

    return {
        "median_us": statistics.median(ordered),
        "min_us": ordered[0],
        "p20_us": q(0.2),
        "p80_us": q(0.8),
        "n": n,
    }


def raise_recompile_limits(graphs: int) -> None:
    """Room in dynamo's caches for ``graphs`` compiled graphs of one function (a benchmark
    compiles one per batch size and backend)."""
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), graphs + 8))


def capture_graph(step: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``step()`` captured in a CUDA graph, after one eager run on a side stream (compiles Triton
    kernels, creates cuBLAS handles, warms the caching allocator)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def time_graph(
    step: Callable[[int], object],
    n_steps: int,
    *,
    replays: int = 10,
    warmup_replays: int = 3,
) -> dict[str, float]:
    """Time ``step(0), ..., step(n_steps - 1)`` captured in one CUDA graph.

    ``step(i)`` enqueues launch ``i`` (rotate operands by ``i``). Each step runs once eagerly
    on a side stream first (compiles Triton kernels, creates cuBLAS handles), then the graph
    is captured, replayed ``warmup_replays`` times, and ``replays`` replays are timed with CUDA
    events. Returns per-launch µs statistics (median, min, p20, p80).
    """
    graph = capture_graph(lambda: [step(i) for i in range(n_steps)])
    for _ in range(warmup_replays):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for r in range(replays):
        starts[r].record()
        graph.replay()
        ends[r].record()
    torch.cuda.synchronize()
    per_launch = [s.elapsed_time(e) * 1e3 / n_steps for s, e in zip(starts, ends)]
    graph.reset()
    del graph
    out = _stats(per_launch)
    out["n_steps"] = n_steps
    return out


def profiled_replays(step: Callable[[], object], replays: int) -> "torch.profiler.profile":
    """``step()`` captured once in a CUDA graph (after an eager warm-up on a side stream), replayed once, then
    ``replays`` times under the torch profiler (CUDA activity): the profiler."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    graph.reset()
    return prof


def kernel_profile(step: Callable[[], object], replays: int = 5, top: int | None = 12,
                   name_chars: int | None = 90) -> list[dict[str, object]]:
    """The ``top`` kernels (None: all) of one CUDA-graph-captured ``step()`` by GPU time (``profiled_replays``):
    name (its first ``name_chars``; None: whole), µs per step, launches per step."""
    prof = profiled_replays(step, replays)
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.device_time
            t[1] += 1
    rows = [dict(kernel=n[:name_chars], us=t / replays, launches=c / replays) for n, (t, c) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def kernel_trace(step: Callable[[], object], replays: int = 3) -> list[dict[str, object]]:
    """The GPU work (kernels, memcpys, memsets) of the last of ``replays`` profiled CUDA-graph replays of
    ``step()``: name, stream, start and duration (µs, from the trace's clock), by start."""
    import tempfile

    prof = profiled_replays(step, replays)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events or len(events) % replays:
        raise RuntimeError(f"kernel_trace: {len(events)} GPU events over {replays} replays: not the same work each")
    events.sort(key=lambda e: e["ts"])
    return [dict(name=e["name"], stream=e["args"].get("stream"), ts=float(e["ts"]), dur=float(e["dur"]))
            for e in events[-(len(events) // replays):]]


def wall_attribution(kernels: Sequence[Mapping[str, object]], group_of: Callable[[str], str],
                     gaps: int = 8) -> dict[str, object]:
    """Where the wall time of one traced step went: each instant goes to the one kernel group running then
    (``alone_us``), to two or more groups at once (``overlapped_us``), or to no kernel (``idle_us``: launch
    latency, waits); the three sum to the step's span. ``longest_idle``: the ``gaps`` longest idle stretches,
    with the kernels that ended and started around each."""
    marks = sorted([(k["ts"], 1, k["name"]) for k in kernels] + [(k["ts"] + k["dur"], -1, k["name"]) for k in kernels],
                   key=lambda m: (m[0], m[1]))  # at one instant, ends before starts
    active: dict[str, int] = {}
    alone: dict[str, float] = {}
    overlapped = idle = 0.0
    spans = []
    last_end = "-"
    for (t, kind, name), (t_next, _, next_name) in zip(marks, marks[1:] + [(marks[-1][0], 0, "-")] if marks else []):
        g = group_of(name)
        active[g] = active.get(g, 0) + kind
        if kind < 0:
            last_end = name
        live = [x for x, n in active.items() if n > 0]
        dt = t_next - t
        if dt <= 0:
            continue
        if not live:
            idle += dt
            spans.append((dt, last_end[:60], next_name[:60]))
        elif len(live) == 1:
            alone[live[0]] = alone.get(live[0], 0.0) + dt
        else:
            overlapped += dt
    longest = [dict(us=us, after=a, before=b) for us, a, b in sorted(spans, reverse=True)[:gaps]]
    return dict(span_us=marks[-1][0] - marks[0][0] if marks else 0.0,
                alone_us=dict(sorted(alone.items(), key=lambda kv: -kv[1])), overlapped_us=overlapped, idle_us=idle,
                idle_gaps=len(spans), longest_idle=longest)


def read_ceiling_tbps(nbytes: int = 1 << 30, reps: int = 20) -> float | None:
    """This GPU's streaming-read ceiling in TB/s: ``torch.sum`` over ``nbytes`` of FP32, the median of ``reps``
    event-timed calls; None where less than twice ``nbytes`` is free (a full-depth rank leaves no room)."""
    if torch.cuda.mem_get_info()[0] < 2 * nbytes:
        return None
    x = torch.rand(nbytes // 4, device="cuda")
    torch.sum(x)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.sum(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del x
    return nbytes / statistics.median(times) / 1e12


def env_info() -> dict[str, object]:
    """Where a measurement ran: date, host, GPU, SMs, L2, its read ceiling, torch / CUDA / Triton versions."""
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton  # noqa: PLC0415 - optional, CUDA machines only

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            l2_bytes=l2_bytes(),
            memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            hbm_read_tbps=read_ceiling_tbps(),
        )
    return info


def stock_kernels() -> dict[str, object]:
    """Which code the stock ``kimi_k3`` ops run on CUDA in this process, and the versions behind it.

    ``versions``: torch, Triton, fla-core (None where absent). ``ops``: per stock op, the function
    its CUDA path calls (named from the function objects, so a rename shows here) and, for the
    KDA core, the recurrence backend actually selected (fla-core, or the torch recurrence and why).
    """
    import importlib.metadata as md  # noqa: PLC0415

    from dep_compile.stock import batched_attention, grouped_experts  # noqa: PLC0415

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    name = lambda fn: f"{fn.__module__}.{fn.__qualname__}"  # noqa: E731
    try:
        from dep_compile.stock import kda_cuda  # noqa: PLC0415 - imports Triton

        kda = f"{name(kda_cuda.kda_core_cuda)}; recurrence: {kda_cuda.recurrence_backend()}"
    except ImportError as e:
        kda = f"not importable here ({e!r})"
    return {
        "versions": {"torch": torch.__version__, "triton": version("triton"), "fla-core": version("fla-core")},
        "ops": {
            "kimi_k3::kda_core": kda,
            "kimi_k3::dsa_indexer": f"{name(batched_attention.dsa_indexer_batched)} (torch: FP8 keys of the whole "
                                    "block table gathered once, BF16 bmm + FP32 head sum, torch.topk)",
            "kimi_k3::sparse_mla_decode": f"{name(batched_attention.sparse_mla_decode_batched)} (torch: the selected "
                                          "latent rows gathered, BF16 bmm with FP32 accumulation, softmax)",
            "kimi_k3::mla_decode": f"{name(batched_attention.mla_decode_batched)} (torch: the whole block table "
                                   "gathered, BF16 bmm with FP32 accumulation, masked softmax)",
            "kimi_k3::routed_experts": f"{name(grouped_experts.routed_experts_grouped)} (two torch._grouped_mm)",
        },
    }


def write_json(path: str, payload: Mapping[str, object], *, with_env: bool = True) -> str:
    """Write ``payload`` (plus ``env``: :func:`env_info`, ``stock_kernels``: :func:`stock_kernels`, and
    ``kimi_dep_fallbacks``: every kimi_dep kernel fallback logged in this process, with its reason) as indented
    JSON; returns the path."""
    data = dict(payload)
    if with_env and "env" not in data:
        data["env"] = env_info()
    if with_env and "stock_kernels" not in data:
        data["stock_kernels"] = stock_kernels()
    if with_env:
        data["kimi_dep_fallbacks"] = sorted(LOGGED)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain aligned text table (also valid Markdown)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def plot_panels(
    path: str,
    panels: Sequence[Mapping[str, object]],
    *,
    xlabel: str,
    ylabel: str,
    suptitle: str = "",
    logx: bool = True,
) -> str | None:
    """Save a PNG with one subplot per panel; returns the path, or None without matplotlib.

    Each panel: ``{"title": str, "x": [..], "series": {label: [y..]}, "hlines": {label: y}}``.
    """
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        xs = list(panel["x"])
        for label, ys in dict(panel.get("series", {})).items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for i, (label, y) in enumerate(dict(panel.get("hlines", {})).items()):
            ax.axhline(y, linestyle="--", linewidth=1, color=f"C{7 + i}", label=label)
        if logx:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs], rotation=45 if len(xs) > 8 else 0)
            ax.minorticks_off()
        ax.set_title(str(panel.get("title", "")))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
