"""``bench_decoder.py`` at DEP across the ranks of one host (``torchrun --nproc-per-node P``).

Each rank holds the whole slice but only its block of routed experts (``dep_compile.runtime.ep``), decodes its
own requests, and meets the others in every MoE layer's dispatch (three all-gathers) and combine (one
all-to-all). What this module adds to the single-GPU benchmark: the process group, the sharding, the bytes the
collectives bring to a rank and the link's measured bandwidth (the floor's extra term), the collectives timed
alone, and one point per grid point from every rank's (the step takes as long as its slowest rank).
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics

import torch
import torch.distributed as dist
from common import time_graph

from dep_compile.runtime import ep

# ranks compile at their own pace before they meet in a collective; a hang still ends inside a 10-minute GPU call
TIMEOUT = datetime.timedelta(minutes=5)


def world() -> tuple[int, int]:
    """(this rank, ranks) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init(device: torch.device) -> torch.device:
    """Join the process group (NCCL on CUDA, this rank's ``LOCAL_RANK`` GPU; gloo on the CPU); the rank's device."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return device


def shard(full: torch.nn.Module, keep_full: bool) -> torch.nn.Module:
    """This rank's model: ``full`` (every rank built the same weights) with only its block of each MoE's experts,
    in the active EP group; a copy when ``keep_full`` (the unsharded model stays as the parity reference)."""
    ep.init_ep(full.config, timeout_s=TIMEOUT.total_seconds())
    rank, size = world()
    return ep.shard_experts(copy.deepcopy(full) if keep_full else full, rank, size)


def gather_routing(ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's expert ids per MoE layer ([T, K] each, equal shapes), concatenated: [P*T, K]; what this rank's
    experts see."""
    out = []
    for x in ids:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        out.append(torch.cat(parts))
    return out


def link_bytes(cfg, tokens: int, size: int, moe_layers: int) -> int:
    """Bytes the EP collectives bring to one rank in a step, ``tokens`` rows a rank (``ep.dispatch_combine``): the
    all-gathers of the latents [T, Lat] BF16, the routing weights [T, K] FP32 and ids [T, K] int64 from each other
    rank, and the all-to-all of the FP32 partials [T, Lat] back from each."""
    lat, k = cfg.moe_latent_size, cfg.num_experts_per_tok
    return moe_layers * (size - 1) * tokens * (2 * lat + 4 * k + 8 * k + 4 * lat)


def link_bandwidth(device: torch.device, nbytes: int = 256 << 20, reps: int = 10) -> float | None:
    """Bytes a second one rank receives in a large all-gather (the link's measured bandwidth, median of ``reps``);
    None on the CPU."""
    if device.type != "cuda":
        return None
    size = dist.get_world_size()
    send = torch.randn(nbytes // 2 // size, device=device, dtype=torch.bfloat16)
    recv = torch.empty(size * send.numel(), device=device, dtype=send.dtype)
    dist.all_gather_into_tensor(recv, send)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dist.all_gather_into_tensor(recv, send)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return (size - 1) * send.numel() * send.element_size() / statistics.median(times)


def collectives_alone_us(cfg, tokens: int, moe_layers: int, device: torch.device) -> float | None:
    """µs of one step's EP collectives alone, as ``ep.dispatch_combine`` issues them (per MoE layer three
    all-gathers and one all-to-all, at ``tokens`` rows a rank), captured in a CUDA graph: the latency the
    fixed-size dispatch costs with no experts between. On the CPU they run once, untimed (the CI smoke run checks
    the calls), and the result is None."""
    size, lat, k = dist.get_world_size(), cfg.moe_latent_size, cfg.num_experts_per_tok
    x = torch.randn(tokens, lat, device=device, dtype=torch.bfloat16)
    w = torch.rand(tokens, k, device=device)
    ids = torch.randint(0, cfg.n_routed_experts, (tokens, k), device=device)
    partial = torch.randn(size * tokens, lat, device=device)  # FP32 partials of every rank's rows
    gathered = [torch.empty(size * tokens, *t.shape[1:], device=device, dtype=t.dtype) for t in (x, w, ids)]
    back = torch.empty_like(partial)

    def step(_):
        for _ in range(moe_layers):
            for src, dst in zip((x, w, ids), gathered):
                dist.all_gather_into_tensor(dst, src)
            dist.all_to_all_single(back, partial)

    if device.type != "cuda":
        step(0)
        return None
    return time_graph(step, 1)["median_us"]


def merge(point: dict) -> dict:
    """One grid point from every rank's ``point`` (on every rank): timings and floors the largest over the ranks
    (the step waits for its slowest rank), errors the largest, routing agreement the smallest, tokens/s the
    host's (every rank's tokens over the step); ``ranks`` keeps each rank's own."""
    ranks: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(ranks, point)
    out = dict(ranks[0], ranks=ranks)
    for key in ranks[0]:
        vals = [r.get(key) for r in ranks]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            continue
        if key.endswith(("_us", "_err")):
            out[key] = max(vals)
        elif key.endswith("_routing"):
            out[key] = min(vals)
    for side in ("stock", "kimi_dep"):
        if f"{side}_hand_us" in out and f"{side}_tokens_per_s" in out:
            out[f"{side}_tokens_per_s"] = sum(r["rows"] * r["q"] for r in ranks) * 1e6 / out[f"{side}_hand_us"]
    return out
