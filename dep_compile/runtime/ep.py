"""Expert parallelism (the EP half of DEP): the process group, expert sharding, dispatch and combine.

Each of P ranks owns E/P consecutive experts. A routed-experts call sends every token's latent,
top-k ids and weights to every rank (a fixed-size all-to-all: no host sync, so a decode step
stays CUDA-graph capturable), each rank runs its own experts on what it received (FP32
partial sums), and a second all-to-all brings the partials home, where they are summed and
rounded to BF16 once. All ranks must run the same number of tokens per step (DEP pads).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib

import torch
import torch.distributed as dist


class EpError(RuntimeError):
    """Expert parallelism is set up wrongly (raised identically on every rank)."""


@dataclasses.dataclass
class EpGroup:
    """The active EP group: its size, this rank, the torch.distributed group."""

    size: int
    rank: int
    group: object


_ACTIVE: EpGroup | None = None


def init_ep(config, timeout_s: float = 60.0) -> EpGroup:
    """Make an EP group over the whole world and check every rank has the same K3 config.

    ``torch.distributed`` must be initialized. Raises EpError on every rank (no hang: a size
    check needs no collective, and the config check is one all_gather under ``timeout_s``).
    """
    global _ACTIVE
    if not dist.is_initialized():
        raise EpError("init_ep: torch.distributed is not initialized")
    size, rank = dist.get_world_size(), dist.get_rank()
    if config.n_routed_experts % size:
        raise EpError(f"init_ep: {size} ranks do not divide {config.n_routed_experts} experts")
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
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


def shard_experts(model: torch.nn.Module, rank: int, size: int) -> torch.nn.Module:
    """Keep only rank ``rank``'s E/size experts in every MoE of a full model (in place): every parameter of an
    experts module (BF16 weights, or MXFP4 codes and scales) is stacked by expert along its first dim."""
    for mod in model.modules():
        if hasattr(mod, "expert_start") and hasattr(mod, "ep_size"):
            params = dict(mod.named_parameters(recurse=False))
            E = next(iter(params.values())).shape[0]
            if E % size:
                raise EpError(f"shard_experts: {size} ranks do not divide {E} experts")
            n = E // size
            sl = slice(rank * n, (rank + 1) * n)
            for name, p in params.items():
                setattr(mod, name, torch.nn.Parameter(p.data[sl].clone(), requires_grad=False))
            mod.num_local, mod.expert_start, mod.ep_size = n, rank * n, size
    return model


def dispatch_combine(x, w13, w2, topk_weights, topk_ids, expert_start: int, ep_size: int, local_experts):
    """Routed experts across the EP group: x [T, Lat] -> [T, Lat] BF16.

    ``local_experts(x, w13, w2, weights, ids, expert_start) -> FP32 [N, Lat]`` runs this
    rank's experts; ids owned elsewhere contribute nothing there.
    """
    g = require_group(ep_size)
    P, T = g.size, x.shape[0]
    # every rank gets all ranks' tokens (fixed size: [P*T, ...], rank r's rows at r*T)
    recv_x = torch.empty(P * T, x.shape[1], dtype=x.dtype, device=x.device)
    recv_w = torch.empty(P * T, topk_weights.shape[1], dtype=torch.float32, device=x.device)
    recv_ids = torch.empty(P * T, topk_ids.shape[1], dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(recv_x, x.contiguous(), group=g.group)
    dist.all_gather_into_tensor(recv_w, topk_weights.float().contiguous(), group=g.group)
    dist.all_gather_into_tensor(recv_ids, topk_ids.long().contiguous(), group=g.group)
    partial = local_experts(recv_x, w13, w2, recv_w, recv_ids, expert_start)  # [P*T, Lat] FP32
    back = torch.empty_like(partial)
    dist.all_to_all_single(back, partial.contiguous(), group=g.group)
    return back.view(P, T, -1).sum(0).to(x.dtype)
