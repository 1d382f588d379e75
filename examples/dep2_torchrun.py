"""DEP2: attention on each rank's own requests, experts split over two ranks, checked against one device.

    torchrun --nproc-per-node 2 examples/dep2_torchrun.py            # 2 GPUs (NCCL), or CPUs (gloo)
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from dep_compile.runtime.dep_check import run_dep_check


def main() -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    res = run_dep_check(dist.get_rank(), dist.get_world_size(), device="cuda" if cuda else "cpu", steps=8)
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} ({'nccl' if cuda else 'gloo'}): MoE ops {sorted(set(res['ops']))}, "
          f"max |logits - single device| = {res['logits_err']:.3g}, max |cache - single device| = {res['cache_err']:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
