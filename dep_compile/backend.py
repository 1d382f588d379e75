"""The ``kimi_dep`` torch.compile backend: rewrite DSA / KDA / MoE on the Dynamo graph, then Inductor."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from .config import DepOptions

log = logging.getLogger("dep_compile")


def kimi_dep(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
             mode: str | None = None):
    """Compile a Dynamo graph: run the dep_compile passes on it, then ``compile_fx``.

    ``options`` become a DepOptions (unknown names raise); ``mode`` ("reduce-overhead",
    "max-autotune", ...) maps to Inductor's config through ``list_mode_options``.
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    from .passes.manager import DepPassManager

    opts = DepOptions.from_dict(options)
    manager = DepPassManager(opts)
    rewrite = manager.run(gm, example_inputs)
    if not opts.inductor:
        rewrite.finalize()
        return gm.forward
    patches = {**(list_mode_options(mode) if mode else {}), **opts.inductor_config}
    if opts.dump_dir:  # a dump wants a fresh compile of everything downstream, not a cache hit
        patches.setdefault("force_disable_caches", True)
    compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    rewrite.finalize()  # zero-copy weight packing: swap param.data only after compile_fx returns
    return compiled
