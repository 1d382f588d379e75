"""Expert parallelism (the EP half of DEP): the process group, expert sharding, dispatch and combine.

Each of P ranks owns E/P consecutive experts. A routed-experts call sends every token's latent,
top-k ids and weights to every rank (a fixed-size all-to-all: no host sync, so a decode step
stays CUDA-graph capturable), each rank runs its own experts on what it received (FP32
partial sums), and a second all-to-all brings the partials home, where they are summed and
rounded to BF16 once. Every rank's call must take the same number of rows: on the torch route DEP
pads each step; where DP ranks run batches of different sizes (vLLM without CUDA graphs), the
caller agrees on the rows first and runs the calls inside :func:`padded_rows`.

The group is ours (:func:`init_ep` over the whole world, the torch route) or one the caller hands
in (vLLM's EP group, ``get_ep_group().device_group``); nothing else differs between the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F


class EpError(RuntimeError):
    """Expert parallelism is set up wrongly (raised identically on every rank)."""


@dataclasses.dataclass
class EpGroup:
    """The active EP group: its size, this rank, the torch.distributed group."""

    size: int
    rank: int
    group: object


_ACTIVE: EpGroup | None = None
_ROWS: int | None = None  # inside padded_rows: the rows every rank's experts call takes


def expert_block(num_experts: int, rank: int, size: int) -> range:
    """The experts EP rank ``rank`` of ``size`` owns: the rank-th of ``size`` equal consecutive blocks."""
    if num_experts % size:
        raise EpError(f"{size} ranks do not divide {num_experts} experts")
    n = num_experts // size
    return range(rank * n, (rank + 1) * n)


def init_ep(config, group=None, timeout_s: float = 60.0) -> EpGroup:
    """Make the EP group (``group`` None: over the whole world) or adopt ``group`` (a ProcessGroup, e.g.
    vLLM's EP group), make it the active one, and check every rank in it has the same K3 config.

    ``torch.distributed`` must be initialized. Raises EpError on every rank (no hang: a size
    check needs no collective, and the config check is one all_gather under ``timeout_s``
    for a group made here, under the given group's own timeout otherwise).
    """
    global _ACTIVE
    if not dist.is_initialized():
        raise EpError("init_ep: torch.distributed is not initialized")
    size = dist.get_world_size(group)
    expert_block(config.n_routed_experts, 0, size)  # EpError unless the ranks divide the experts
    if group is None:
        group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank(group)
    digest = hashlib.sha256(repr(config).encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, mine)]
    if bad:
        raise EpError(f"init_ep: rank {rank}'s config differs from ranks {bad}; every rank must build the same model")
    _ACTIVE = EpGroup(size, rank, group)
    return _ACTIVE


def require_group(ep_size: int) -> EpGroup:
    """The active group, checked against the ep_size a layer was built for."""
    g = _ACTIVE
    if g is None:
        raise EpError(f"a MoE layer is sharded over {ep_size} ranks but no EP group is active; call "
                      "dep_compile.runtime.ep.init_ep(config) after torch.distributed.init_process_group")
    if g.size != ep_size:
        raise EpError(f"a MoE layer is sharded over {ep_size} ranks but the EP group has {g.size}")
    return g


@contextlib.contextmanager
def padded_rows(rows: int):
    """Inside: every experts call on every rank takes ``rows`` rows, this rank's tokens padded with rows that
    route nowhere (for DP ranks whose batches differ in size; every rank must pass the same ``rows``)."""
    global _ROWS
    before, _ROWS = _ROWS, rows
    try:
        yield
    finally:
        _ROWS = before


def shard_experts(model: torch.nn.Module, rank: int, size: int) -> torch.nn.Module:
    """Keep only rank ``rank``'s E/size experts in every MoE of a full model (in place): every parameter of an
    experts module (BF16 weights, or MXFP4 codes and scales) is stacked by expert along its first dim."""
    for mod in model.modules():
        if hasattr(mod, "expert_start") and hasattr(mod, "ep_size"):
            params = dict(mod.named_parameters(recurse=False))
            block = expert_block(next(iter(params.values())).shape[0], rank, size)
            for name, p in params.items():
                setattr(mod, name, torch.nn.Parameter(p.data[block.start:block.stop].clone(), requires_grad=False))
            mod.num_local, mod.expert_start, mod.ep_size = len(block), block.start, size
    return model


def dispatch_combine(x, w13, w2, topk_weights, topk_ids, expert_start: int, ep_size: int, local_experts):
    """Routed experts across the EP group: x [T, Lat] -> [T, Lat] BF16.

    ``local_experts(x, w13, w2, weights, ids, expert_start) -> FP32 [N, Lat]`` runs this
    rank's experts; ids owned elsewhere contribute nothing there.
    """
    g = require_group(ep_size)
    P, T = g.size, x.shape[0]
    R = T if _ROWS is None else _ROWS  # rows of every rank's call
    if T > R:
        raise EpError(f"an experts call has {T} rows, more than the {R} the EP ranks agreed on (padded_rows)")
    w, ids = topk_weights.float(), topk_ids.long()
    if R > T:  # padding rows: weight 0, expert id -1 (owned by no rank: no work anywhere)
        x, w, ids = F.pad(x, (0, 0, 0, R - T)), F.pad(w, (0, 0, 0, R - T)), F.pad(ids, (0, 0, 0, R - T), value=-1)
    # every rank gets all ranks' rows (fixed size: [P*R, ...], rank r's rows at r*R)
    recv_x = torch.empty(P * R, x.shape[1], dtype=x.dtype, device=x.device)
    recv_w = torch.empty(P * R, w.shape[1], dtype=torch.float32, device=x.device)
    recv_ids = torch.empty(P * R, ids.shape[1], dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(recv_x, x.contiguous(), group=g.group)
    dist.all_gather_into_tensor(recv_w, w.contiguous(), group=g.group)
    dist.all_gather_into_tensor(recv_ids, ids.contiguous(), group=g.group)
    partial = local_experts(recv_x, w13, w2, recv_w, recv_ids, expert_start)  # [P*R, Lat] FP32
    back = torch.empty_like(partial)
    dist.all_to_all_single(back, partial.contiguous(), group=g.group)
    return back.view(P, R, -1)[:, :T].sum(0).to(x.dtype)
