"""The fused AttnRes -> RMSNorm op: one AttnRes point and the layer norm that reads its output.

Its bank part off the step's path (option ``attn_res_ahead``): a point's sources are the bank's slots and its
prefix; the slots it does not write are final once the point before it ran. So a point given ``next_*`` (the next
point's query and schedule) and ``part_out = k`` computes that next point's bank part (the online softmax over
those slots: mix, max, sum in FP32) right after its own work, on CUDA on the "attn_res" side stream, and the point
given ``part_in = k`` (joining that stream) merges the part with its prefix instead of reading the bank: the part
runs beside the sublayer between the two points. The pass links consecutive points of one graph
(``passes/attn_res.py``); the part is handed over in ``_PARTS`` with the identity of what it was computed from
(bank, query, eps, schedule), which the taker checks (else it reads the bank, logged); that the bank's contents did
not change in between is the pass's check. On CUDA the merge is within one BF16 rounding of the stock composition
(``merge_part_ref`` is the kernel's reference). On the CPU a linked point computes the stock composition exactly, as
every kimi_dep op there does, and checks the part it was handed instead of using it: recomputed from the bank at
the taker (``bank_part_ref``), it must be bit-equal, else the bank changed between the two points, a link the pass
should have refused, and that is logged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock import ops as stock_ops
from ..stock.reference.attn_res import attn_res_ref, bank_part_ref, empty_bank_part
from .fallbacks import log_fallback
from .streams import side_stream

_PARTS: dict = {}  # (device, link) -> (part [T, D + 4] FP32 or None, what it was computed from)


def _part_key(bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> tuple:
    """What a bank part depends on, as the giver and the taker can both say it."""
    return (bank.data_ptr(), tuple(bank.shape), tuple(bank.stride()), query.data_ptr(), float(eps), int(num_blocks),
            int(write_slot))


def _join(device: torch.device) -> None:
    """Make the current stream wait for the AttnRes side stream (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).wait_stream(side_stream(device, "attn_res"))


def _give(link: int, bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> None:
    """Compute the bank part of the point after this one (CUDA: on the side stream, after this stream's work)."""
    if (bank.device, link) in _PARTS:  # its taker never ran (a step that raised): join before the part is freed
        _join(bank.device)
        log_fallback("AttnRes", f"bank part {link} was never taken", "a join before it is dropped")
    if not bank.is_cuda:
        part = bank_part_ref(bank, query, eps, num_blocks, write_slot)
    else:
        from ..stock.attn_res_cuda import attn_res_bank_part_cuda, part_unsupported  # noqa: PLC0415

        why = part_unsupported(bank, query, num_blocks, write_slot)
        if why is not None:
            log_fallback("AttnRes", f"bank part: {why}", "the next point's bank rows read by the point itself")
            _PARTS[(bank.device, link)] = (None, None)
            return
        main, side = torch.cuda.current_stream(bank.device), side_stream(bank.device, "attn_res")
        part = empty_bank_part(bank)  # on this stream: freed on it after the taker, which waits for the side stream
        side.wait_stream(main)  # after this point's bank write (and every earlier use of the part's memory)
        with torch.cuda.stream(side):
            attn_res_bank_part_cuda(bank, query, eps, num_blocks, write_slot, out=part)
    _PARTS[(bank.device, link)] = (part, _part_key(bank, query, eps, num_blocks, write_slot))


def _take(link: int, bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> Tensor | None:
    """The bank part the point before left under ``link`` (joining the side stream), or None (then the bank is
    read): the point before could not compute it (logged there), left none (logged), or computed it from other
    inputs (logged)."""
    entry = _PARTS.pop((bank.device, link), None)
    if entry is None:
        log_fallback("AttnRes", f"no bank part was left under link {link}", "the bank rows")
        return None
    part, key = entry
    if part is None:
        return None
    _join(bank.device)
    if key != _part_key(bank, query, eps, num_blocks, write_slot):
        log_fallback("AttnRes", f"bank part {link} computed from other inputs than this point's", "the bank rows")
        return None
    return part


def _check_fresh(link: int, part: Tensor, bank: Tensor, query: Tensor, eps: float, num_blocks: int,
                 write_slot: int) -> None:
    """CPU: log a bank part that differs from the one this point's bank gives now (the bank changed after it)."""
    fresh = bank_part_ref(bank, query, eps, num_blocks, write_slot)
    if not torch.equal(part.view(torch.int32), fresh.view(torch.int32)):  # bits: a NaN from a NaN bank row is equal
        log_fallback("AttnRes", f"bank part {link} is stale: the bank changed after the point before computed it (a "
                                "link the pass should have refused)", "the bank rows")


@torch.library.custom_op("kimi_dep::attn_res_norm", mutates_args=("prefix", "bank"))
def attn_res_norm(
    prefix: Tensor, bank: Tensor, delta: Tensor, query: Tensor, norm_weight: Tensor, eps: float, num_blocks: int,
    write_slot: int, norm_eps: float, next_query: Optional[Tensor] = None, next_num_blocks: int = 0,
    next_write_slot: int = -1, part_in: int = -1, part_out: int = -1,
) -> Tensor:
    """``RMSNorm(norm_weight, norm_eps)(kimi_k3::attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot))``.

    prefix: [T, D] BF16 and bank: [NB, T, D] BF16, mutated as the stock op mutates them; delta: [T, D];
    query, norm_weight: [D]. Returns the normalized mix [T, D] BF16 (the mix itself is not kept).
    CUDA: one Triton launch (``stock.attn_res_cuda.attn_res_norm_cuda``); a call it cannot take runs
    the stock op and the norm, logged once. CPU: the stock reference, then stock's RMSNorm.
    Links (module docstring): ``part_in`` >= 0 takes this point's bank part from the point before (on the CPU:
    checks it); ``part_out`` >= 0 computes the next point's (``next_query``, ``next_num_blocks``,
    ``next_write_slot``).
    """
    part = _take(part_in, bank, query, eps, num_blocks, write_slot) if part_in >= 0 else None
    y = None
    if prefix.is_cuda:
        from ..stock.attn_res_cuda import attn_res_norm_cuda, unsupported  # noqa: PLC0415 - imports Triton

        why = unsupported(prefix, bank, delta, query, num_blocks, write_slot, norm_weight)
        if why is None:
            y = attn_res_norm_cuda(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps,
                                   part=part)
        else:
            log_fallback("AttnRes", why, "the stock AttnRes op and RMSNorm")
            h = stock_ops.attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot)
    else:
        if part is not None:  # before the point writes its slot (which the part leaves out)
            _check_fresh(part_in, part, bank, query, eps, num_blocks, write_slot)
        h = attn_res_ref(prefix, bank, delta, query, eps, num_blocks, write_slot)
    if y is None:  # stock's RMSNorm module (dep_compile.stock.layers.RMSNorm), written the same way
        y = F.rms_norm(h.float(), (h.shape[-1],), norm_weight.float(), norm_eps).to(h.dtype)
    if part_out >= 0 and next_query is not None:
        _give(part_out, bank, next_query, eps, next_num_blocks, next_write_slot)
    return y


@attn_res_norm.register_fake
def _(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps, next_query=None,
      next_num_blocks=0, next_write_slot=-1, part_in=-1, part_out=-1):
    return torch.empty_like(prefix)
