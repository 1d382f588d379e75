"""The fused AttnRes -> RMSNorm op: one AttnRes point and the layer norm that reads its output.

Its bank part off the step's path (CUDA): a point's sources are the bank's slots and its prefix; the slots it does
not write are final once the point before it ran. So a point given ``next_*`` (the next point's query and
schedule) and ``part_out = k`` launches that next point's bank part (``attn_res_bank_part_cuda``) on the
"attn_res" side stream right after its own kernel, and the point given ``part_in = k`` joins that stream and
merges the part with its prefix instead of reading the bank: the part runs beside the sublayer between the two
points. The pass links consecutive points of one graph (``passes/attn_res.py``); the part is handed over in
``_PARTS``, with what it was computed from, which the taker checks before using it (else it reads the bank).
On the CPU the op is the stock composition and the links are not used.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock import ops as stock_ops
from ..stock.reference.attn_res import attn_res_ref
from .fallbacks import log_fallback
from .streams import side_stream

_PARTS: dict = {}  # (device, link) -> (part [T, D + 4] FP32 or None, what it was computed from)


def _part_key(bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> tuple:
    """What a bank part depends on, as the giver and the taker can both say it."""
    return (bank.data_ptr(), tuple(bank.shape), tuple(bank.stride()), query.data_ptr(), float(eps), int(num_blocks),
            int(write_slot))


def _give(link: int, bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> None:
    """Launch the bank part of the point after this one on the side stream, after everything on this stream."""
    from ..stock.attn_res_cuda import PART_EXTRA, attn_res_bank_part_cuda, part_unsupported  # noqa: PLC0415

    why = part_unsupported(bank, query, num_blocks, write_slot)
    if why is not None:
        log_fallback("AttnRes", f"bank part: {why}", "the next point's bank rows read by the point itself")
        _PARTS[(bank.device, link)] = (None, None)
        return
    main, side = torch.cuda.current_stream(bank.device), side_stream(bank.device, "attn_res")
    _, T, D = bank.shape
    # allocated on this stream, freed on it after the taker, which waits for the side stream's writes
    part = torch.empty(T, D + PART_EXTRA, dtype=torch.float32, device=bank.device)
    side.wait_stream(main)  # after this point's bank write (and every earlier use of the part's memory)
    with torch.cuda.stream(side):
        attn_res_bank_part_cuda(bank, query, eps, num_blocks, write_slot, out=part)
    _PARTS[(bank.device, link)] = (part, _part_key(bank, query, eps, num_blocks, write_slot))


def _take(link: int, bank: Tensor, query: Tensor, eps: float, num_blocks: int, write_slot: int) -> Tensor | None:
    """The bank part the point before left under ``link`` (joining the side stream), or None (then the bank is
    read): none was left, or it was computed from other inputs."""
    part, key = _PARTS.pop((bank.device, link), (None, None))
    if part is None:
        return None
    torch.cuda.current_stream(bank.device).wait_stream(side_stream(bank.device, "attn_res"))
    if key != _part_key(bank, query, eps, num_blocks, write_slot):
        log_fallback("AttnRes", f"bank part {link} computed from other inputs than this point's", "the bank rows")
        return None
    return part


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
    Links (CUDA; module docstring): ``part_in`` >= 0 takes this point's bank part from the point before;
    ``part_out`` >= 0 computes the next point's (``next_query``, ``next_num_blocks``, ``next_write_slot``).
    """
    if prefix.is_cuda:
        from ..stock.attn_res_cuda import attn_res_norm_cuda, unsupported  # noqa: PLC0415 - imports Triton

        part = _take(part_in, bank, query, eps, num_blocks, write_slot) if part_in >= 0 else None
        why = unsupported(prefix, bank, delta, query, num_blocks, write_slot, norm_weight)
        if why is None:
            y = attn_res_norm_cuda(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps,
                                   part=part)
        else:
            log_fallback("AttnRes", why, "the stock AttnRes op and RMSNorm")
            h = stock_ops.attn_res(prefix, bank, delta, query, eps, num_blocks, write_slot)
            y = F.rms_norm(h.float(), (h.shape[-1],), norm_weight.float(), norm_eps).to(h.dtype)
        if part_out >= 0 and next_query is not None:
            _give(part_out, bank, next_query, eps, next_num_blocks, next_write_slot)
        return y
    h = attn_res_ref(prefix, bank, delta, query, eps, num_blocks, write_slot)
    # stock's RMSNorm module (dep_compile.stock.layers.RMSNorm), written the same way
    return F.rms_norm(h.float(), (h.shape[-1],), norm_weight.float(), norm_eps).to(h.dtype)


@attn_res_norm.register_fake
def _(prefix, bank, delta, query, norm_weight, eps, num_blocks, write_slot, norm_eps, next_query=None,
      next_num_blocks=0, next_write_slot=-1, part_in=-1, part_out=-1):
    return torch.empty_like(prefix)
