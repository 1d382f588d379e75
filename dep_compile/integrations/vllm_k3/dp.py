"""DEP inside vLLM: the model's experts on vLLM's EP group, and every EP rank's decoder calls aligned.

vLLM's DP ranks each run their own batch. Without CUDA graphs (the CPU path) their token counts differ:
vLLM pads the DP ranks to one count only when CUDA graphs or micro-batches need it (0.32's
``v1/worker/dp_utils.py``, ``coordinate_batch_across_dp``); a rank with no requests runs a dummy step
(``execute_dummy_batch``) so that collectives meet, and vLLM agrees on the counts with a host-side all-reduce
over the DP group (its CPU group under ``disable_nccl_for_dp_synchronization``).

This model runs its compiled decoder once per step group (``layout.py``), and the groups differ between
ranks. So under EP the ranks first agree, the same way (two all-reduces of host ints over the EP group's CPU
group, no device sync), on the number of decoder calls and on each call's experts rows: a rank with fewer
groups runs padding groups (they write no cache and return nothing), and each call's experts pad their rows
to the largest rank's (``runtime.ep.padded_rows``). A batch vLLM has padded past a rank's real tokens (CUDA
graphs) needs nothing more: the groups hold the real tokens only, and the padded rows' outputs are unused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dep_compile.runtime import ep

from .config import ep_size
from .layout import StepGroup, dummy_group


@dataclasses.dataclass
class EpPlacement:
    """This rank's routed experts and the group its decoder calls are aligned over (None: EP off)."""

    rank: int
    size: int
    experts: range  # the checkpoint's experts this rank holds
    cpu_group: object | None  # vLLM's EP group's CPU (gloo) ProcessGroup


def join_ep(vllm_config, config) -> EpPlacement:
    """Check the parallel layout (``config.ep_size``) and, under EP, make vLLM's EP group the MoE op's (its
    ``device_group``: gloo on CPU, NCCL on GPUs) and this rank's block of the config's experts its own."""
    size = ep_size(vllm_config.parallel_config, config.n_routed_experts)
    if size == 1:
        return EpPlacement(0, 1, range(config.n_routed_experts), None)
    from vllm.distributed.parallel_state import get_ep_group

    group = get_ep_group()
    if group.world_size != size:
        raise ValueError(f"vLLM's EP group has {group.world_size} ranks, the parallel config asks for {size}")
    ep.init_ep(config, group.device_group)
    rank = group.rank_in_group
    return EpPlacement(rank, size, ep.expert_block(config.n_routed_experts, rank, size), group.cpu_group)


def padding_group(width: int, device) -> StepGroup:
    """A decoder call that only meets the other ranks' collectives: no cache written, no output row kept."""
    none = torch.empty(0, dtype=torch.int64, device=device)
    return dataclasses.replace(dummy_group(1, width, device), kind="padding", rows=none, dest=none, whole=False)


def align_calls(groups: list[StepGroup], cpu_group, width: int, device) -> list[tuple[StepGroup, int]]:
    """This rank's calls of one step, padded to the EP ranks' largest count, each with the largest rank's rows
    in that call (n*q): [(group, experts rows)]. Every rank must call it once per forward."""
    count = torch.tensor([len(groups)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=cpu_group)
    groups = groups + [padding_group(width, device) for _ in range(int(count) - len(groups))]
    rows = torch.tensor([n * q for n, q in (g.shape for g in groups)])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=cpu_group)
    return list(zip(groups, rows.tolist()))


__all__ = ["EpPlacement", "join_ep", "padding_group", "align_calls"]
