"""One vLLM step as uniform sub-steps for the stock decoder: groups of n requests x q tokens.

vLLM hands the model a flat, ragged batch (``query_start_loc``: request i owns tokens
``qsl[i]:qsl[i+1]``). The stock ``kimi_k3`` ops take uniform steps. So each step is split:

- the requests with at most ``decode_q`` tokens (1, or 1 + the speculative tokens: vLLM's uniform
  decode query length) form one group of q = their largest count: a decode step of n requests runs
  n x 1 rows, no padding;
- the others (prefill chunks), largest first, in groups whose counts all exceed half the group's
  largest, so a group's padding is less than its tokens.

A request with c < q tokens fills the start of its row; the rest is padding (cache slot -1, outputs
dropped), its KDA state is committed after ``accepted = c`` tokens, and its token i sits at position
``seq - c + i`` (``seq_lens = seq - c + q``), so every cache ends as c single-token steps would leave it.
No vLLM import: the planner is plain torch, host-side (it reads vLLM's CPU copy of the query starts).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass
class StepGroup:
    """n requests x q token slots of one step, as the compiled decoder takes them."""

    kind: str  # "decode" (q = 1), "verify" (1 < q <= decode_q), "prefill"; "dummy", "padding" (no metadata; dp.py)
    tokens: Tensor  # [n*q] int64: the flat-batch token each slot reads (a padding slot reads token 0)
    slot_mapping: Tensor  # [n, q] int64: cache slot per token slot, -1 = padding
    block_table: Tensor  # [n, W] int32
    seq_lens: Tensor  # [n] int32: seq - c + q
    state_indices: Tensor  # [n] int32: KDA state slot (-1: none, a dummy step)
    accepted: Tensor  # [n] int32: c, the request's real tokens
    rows: Tensor  # [C] int64: the slots (into n*q) that hold real tokens
    dest: Tensor  # [C] int64: their places in the flat batch
    whole: bool  # the group is the whole step in order, unpadded (its output is the step's, as is)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.slot_mapping.shape)


def group_requests(counts: list[int], decode_q: int) -> list[list[int]]:
    """Request indices per group (module docstring): decode/verify-sized requests together, then prefill
    chunks largest first, each group's counts above half its largest."""
    decode = [i for i, c in enumerate(counts) if c <= decode_q]
    groups = [decode] if decode else []
    for i in sorted((i for i, c in enumerate(counts) if c > decode_q), key=lambda i: -counts[i]):
        if groups and groups[-1] is not decode and 2 * counts[i] > counts[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def kind_of(q: int, decode_q: int) -> str:
    return "decode" if q == 1 else "verify" if q <= decode_q else "prefill"


def build_groups(qsl: Tensor, seq_lens: Tensor, block_table: Tensor, slot_mapping: Tensor, width: int,
                 decode_q: int) -> list[StepGroup]:
    """The step's groups. qsl [n+1] int (CPU: vLLM's ``query_start_loc_cpu``); seq_lens [n] (context length
    including this step's tokens), block_table [n, >=1] and slot_mapping [>=T] on the device; ``width``: the
    block-table width the model's graph takes (blocks beyond it are dropped, past every request's end)."""
    qsl = qsl.long()
    counts = (qsl[1:] - qsl[:-1]).tolist()
    if not counts or min(counts) < 1:
        raise ValueError(f"dep_compile K3: a step needs requests of at least one token each, got counts {counts}")
    dev = slot_mapping.device
    groups = []
    for members in group_requests(counts, decode_q):
        req = torch.tensor(members)
        n, c = len(members), qsl[req + 1] - qsl[req]  # [n] tokens each
        q = int(c.max())
        j = torch.arange(q)
        real = j.view(1, q) < c.view(n, 1)  # [n, q]
        flat = (qsl[req].view(n, 1) + j.view(1, q)).where(real, 0)  # [n, q] flat-batch token of each slot
        rows = real.view(-1).nonzero().view(-1)
        dest = flat.view(-1)[rows]
        slots = slot_mapping[flat.view(-1).to(dev)].long().view(n, q).where(real.to(dev), -1)
        req_d, c_d = req.to(dev), c.to(dev, torch.int32)
        w = min(width, block_table.shape[1])
        table = torch.zeros(n, width, dtype=torch.int32, device=dev)
        table[:, :w] = block_table[req_d, :w].to(torch.int32)
        whole = n == len(counts) and members == list(range(n)) and bool(real.all())
        groups.append(StepGroup(kind_of(q, decode_q), flat.view(-1).to(dev), slots, table,
                                seq_lens[req_d].to(torch.int32) - c_d + q, table[:, 0].clone(), c_d, rows.to(dev),
                                dest.to(dev), whole))
    return groups


def dummy_group(num_tokens: int, width: int, device) -> StepGroup:
    """vLLM's dummy and profile runs (no metadata): ``num_tokens`` as 2 requests x ceil(T/2) (q >= 2, so the
    first call, which Dynamo traces, specializes neither n nor q to 1), writing no cache (slots and KDA state
    -1); the output's first T rows are returned."""
    q = max(2, -(-num_tokens // 2))
    i32 = dict(dtype=torch.int32, device=device)
    return StepGroup("dummy", torch.arange(2 * q, device=device).clamp_max(num_tokens - 1),
                     torch.full((2, q), -1, dtype=torch.int64, device=device), torch.zeros(2, width, **i32),
                     torch.full((2,), q, **i32), torch.full((2,), -1, **i32), torch.full((2,), q, **i32),
                     torch.arange(num_tokens, device=device), torch.arange(num_tokens, device=device),
                     2 * q == num_tokens)


__all__ = ["StepGroup", "group_requests", "build_groups", "dummy_group", "kind_of"]
