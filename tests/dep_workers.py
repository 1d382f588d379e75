"""Process entry points for the DEP tests (spawned: they must live in an importable module)."""

from __future__ import annotations

import datetime
import json
import os

import torch
import torch.distributed as dist


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
