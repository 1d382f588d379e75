"""The kimi_dep ops: importing this package registers every ``kimi_dep::*`` custom op and every
prepared-layer class a compiled graph can name (``registry.prepared``), so a process that loads
compiled code from a cache rebuilds its layers without a pass having run."""

from . import attn_res, dsa, kda, moe  # noqa: F401  (registration)
