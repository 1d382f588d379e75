"""Prepared-layer registry: the ``layer`` string a kimi_dep op carries names its prepared object.

Like vLLM's per-layer attention names, this keeps the graph readable (tensors are op inputs,
sizes and tactics live on the prepared object) without burning shapes into the schema.
"""

from __future__ import annotations

from typing import Any

_PREPARED: dict[str, Any] = {}


def register(key: str, prepared: Any) -> str:
    _PREPARED[key] = prepared
    return key


def lookup(key: str) -> Any:
    try:
        return _PREPARED[key]
    except KeyError:
        raise KeyError(f"kimi_dep: no prepared layer {key!r}; was the graph compiled in this process?") from None
