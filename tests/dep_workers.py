"""Process entry points for the DEP tests (spawned: they must live in an importable module)."""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from free_ports import free_ports


def run_ranks(fn, world, *args):
    """``fn(rank, world, port, *args)`` in ``world`` spawned processes, on a free local port."""
    mp.spawn(fn, args=(world, free_ports(), *args), nprocs=world, join=True)


def _init(rank, world, port, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))


def dep_check_worker(rank, world, port, out_dir, backend="gloo"):
    from dep_compile.runtime.dep_check import run_dep_check

    _init(rank, world, port, backend)
    try:
        res = run_dep_check(rank, world, device="cuda" if backend == "nccl" else "cpu", steps=4, q=2)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def bad_setup_worker(rank, world, port, out_dir, mismatch):
    """init_ep with a world that does not divide the experts, or a config differing on rank 1."""
    from dep_compile.runtime.ep import EpError, init_ep
    from dep_compile.stock import preset

    _init(rank, world, port)
    cfg = preset("k31-small", num_layers=4)
    if mismatch and rank == 1:
        cfg = cfg.replace(moe_latent_size=96)
    try:
        init_ep(cfg, timeout_s=60)  # a loaded 2-core machine starts 3 gloo processes slowly
        msg = "no error"
    except EpError as e:
        msg = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(msg)


def padded_rows_worker(rank, world, port, out_dir):
    """Routed experts at EP2 on a different number of rows per rank (rank r: 1 + 5r), inside ``padded_rows`` of
    the largest, against all the experts on this rank alone; and a call with more rows than agreed."""
    import copy

    from dep_compile.runtime import ep
    from dep_compile.stock import build_model, preset

    _init(rank, world, port)
    cfg = preset("k31-small", num_layers=2)
    ep.init_ep(cfg)
    full = build_model(cfg, seed=1).model.layers[1].mlp.experts  # every expert, no dispatch
    mine = ep.shard_experts(copy.deepcopy(full), rank, world)
    g = torch.Generator().manual_seed(rank)
    T, K = 1 + 5 * rank, cfg.num_experts_per_tok
    x = torch.randn(T, cfg.moe_latent_size, generator=g).bfloat16()  # [T, Lat]
    ids = torch.rand(T, cfg.n_routed_experts, generator=g).argsort(-1)[:, :K]  # [T, K] distinct experts
    w = torch.rand(T, K, generator=g)  # [T, K] FP32
    try:
        with torch.no_grad(), ep.padded_rows(1 + 5 * (world - 1)):
            out = mine(x, w, ids)
        ref = full(x, w, ids)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        try:
            with ep.padded_rows(T - 1):
                mine(x, w, ids)
            too_many = "no error"
        except ep.EpError as e:
            too_many = str(e)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"err": err, "rows": T, "too_many": too_many}, f)


def aligned_calls_worker(rank, world, port, out_dir):
    """vLLM's model at EP2 on one step whose groups differ per rank (rank 0: a decode group of 2; rank 1: a decode
    group of 1 and a 12-token prefill): ``dp.align_calls`` over gloo, then each call's experts inside its
    ``padded_rows``, against all the experts on this rank alone."""
    import copy

    from dep_compile.integrations.vllm_k3.dp import align_calls
    from dep_compile.integrations.vllm_k3.layout import build_groups
    from dep_compile.runtime import ep
    from dep_compile.stock import build_model, preset

    _init(rank, world, port)
    counts = [1, 1] if rank == 0 else [1, 12]
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    T = int(qsl[-1])
    groups = build_groups(qsl, torch.tensor(counts, dtype=torch.int32) + 5, torch.arange(2).view(2, 1) + 1,
                          torch.arange(T), width=4, decode_q=1)
    cfg = preset("k31-small", num_layers=2)
    ep.init_ep(cfg)
    full = build_model(cfg, seed=1).model.layers[1].mlp.experts
    mine = ep.shard_experts(copy.deepcopy(full), rank, world)
    g = torch.Generator().manual_seed(rank)
    calls, err = [], 0.0
    try:
        for grp, rows in align_calls(groups, dist.group.WORLD, 4, "cpu"):
            n, q = grp.shape
            x = torch.randn(n * q, cfg.moe_latent_size, generator=g).bfloat16()
            ids = torch.rand(n * q, cfg.n_routed_experts, generator=g).argsort(-1)[:, :cfg.num_experts_per_tok]
            w = torch.rand(n * q, cfg.num_experts_per_tok, generator=g)
            with torch.no_grad(), ep.padded_rows(rows):
                out = mine(x, w, ids)
            ref = full(x, w, ids)
            err = max(err, ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
            calls.append([grp.kind, n, q, rows, grp.dest.numel()])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": calls, "err": err}, f)


def bench_decoder_worker(rank, world, port, out_dir, argv):
    """``benchmarks/bench_decoder.py`` as torchrun starts it on each rank (its env), gloo on the CPU; each rank's
    returned points go to ``rank<r>.json``."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_decoder

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        points = bench_decoder.main([*argv, "--out", out_dir])
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(points, f, default=str)
