"""The side streams the kimi_dep ops run independent work on, beside the capturing stream."""

from __future__ import annotations

import torch

_SIDE: dict = {}


def side_stream(device, role: str = "layer") -> "torch.cuda.Stream":
    """One side stream per device and ``role``, made once (creating streams inside a step would allocate):
    "layer" for a layer op's own branch (the DSA indexer, the MoE router and shared expert), "attn_res" for the
    AttnRes bank parts that run beside whole layers (on the layer stream they would queue ahead of its branch)."""
    key = (torch.device(device), role)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=device)
    return _SIDE[key]
