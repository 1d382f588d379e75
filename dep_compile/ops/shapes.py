"""Sizes of possibly symbolic shapes, as the passes and the ops' kernel choices read them."""

from __future__ import annotations

import torch


def size_hint(d: int | torch.SymInt) -> int:
    """A size as an int: a SymInt's hint (the size of the example the graph was traced with)."""
    return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)
