"""Prepared-layer registry: the ``layer`` string a kimi_dep op carries names its prepared object.

Like vLLM's per-layer attention names, this keeps the graph readable (tensors are op inputs,
sizes and tactics live on the prepared object) without burning shapes into the schema. The
string is ``<module path>#<JSON of the prepared object>``, so a process that loads compiled
code from a cache (where no pass ran to register anything) rebuilds the object from the string.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..tactics import SplitK

_PREPARED: dict[str, Any] = {}
_CLASSES: dict[str, type] = {SplitK.__name__: SplitK}  # classes a layer string may name (``prepared``)


def prepared(cls: type) -> type:
    """Class decorator: ``cls`` (a dataclass baked into compiled graphs) may be rebuilt from a layer string."""
    _CLASSES[cls.__name__] = cls
    return cls


def prepared_classes() -> list[type]:
    """Every class a layer string may name (those decorated with :func:`prepared`; ``dep_compile.ops``
    registers its own on import)."""
    return list(_CLASSES.values())


def _encode(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {type(obj).__name__: {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):  # tactic tables: {max rows: SplitK or "cublas"}
        return {"table": [[k, _encode(v)] for k, v in obj.items()]}
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        (name, body), = obj.items()
        if name == "table":
            return {int(k): _decode(v) for k, v in body}
        return _CLASSES[name](**{k: _decode(v) for k, v in body.items()})
    return obj


def register(module: str, prepared: Any) -> str:
    """Register ``prepared`` for the layer at ``module``; returns the op's ``layer`` string."""
    key = f"{module}#{json.dumps(_encode(prepared), sort_keys=True, separators=(',', ':'))}"
    _PREPARED.pop(key, None)  # the latest registration last, also when an equal layer was registered before
    _PREPARED[key] = prepared
    return key


def lookup(key: str) -> Any:
    """The prepared object of an op's ``layer`` string (rebuilt from it on first use in a process)."""
    prepared = _PREPARED.get(key)
    if prepared is None:  # a process where no pass ran (compiled code from a cache)
        try:
            prepared = _PREPARED[key] = _decode(json.loads(key.split("#", 1)[1]))
        except (IndexError, KeyError, TypeError, ValueError) as e:
            raise KeyError(f"kimi_dep: cannot rebuild the prepared layer from {key[:120]!r}: {e}") from None
    return prepared

