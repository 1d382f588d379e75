"""The warning a kimi_dep op logs when it runs stock code instead of its kernels: once per reason."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
LOGGED: set[str] = set()  # "layer: reason" strings already logged in this process


def log_fallback(layer: str, why: str, instead: str) -> None:
    """Warn once per process that ``layer``'s kernels were not used because ``why``; ``instead`` runs."""
    key = f"{layer}: {why}"
    if key not in LOGGED:
        LOGGED.add(key)
        log.warning("kimi_dep %s layer: Triton kernels not used (%s); running %s", layer, why, instead)
