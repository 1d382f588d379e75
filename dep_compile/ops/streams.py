"""The side stream the kimi_dep ops run independent work on, beside the capturing stream."""

from __future__ import annotations

import torch

_SIDE: dict = {}


def side_stream(device) -> "torch.cuda.Stream":
    """One side stream per device, made once (creating streams inside a step would allocate)."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]
