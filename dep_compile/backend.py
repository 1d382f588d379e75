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
    if patches.get("triton.cudagraphs"):
        warn_if_not_graphable(gm, example_inputs)
    if opts.dump_dir:  # a dump wants a fresh compile of everything downstream, not a cache hit
        patches.setdefault("force_disable_caches", True)
    compiled = compile_fx(gm, example_inputs, config_patches=patches or None)
    rewrite.finalize()  # zero-copy weight packing: swap param.data only after compile_fx returns
    return compiled


def mutated_inputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The placeholders some call writes in place (``passes.calls.written``: a schema argument marked ``(a!)``,
    a ``x.op_()`` method, ...)."""
    from .passes.calls import written

    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    out: dict[torch.fx.Node, None] = {}
    for node in gm.graph.nodes:
        out.update((w, None) for w in written(node) if w in placeholders)
    return list(out)


def cudagraph_blockers(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
    """Why cudagraph trees would run this graph without a CUDA graph; empty when it can be graphed."""
    reasons = []
    devices = sorted({str(x.device) for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type != "cuda"})
    if devices:
        reasons.append(f"inputs on {', '.join(devices)} (CUDA graphs need every tensor on CUDA)")
    loose = [n.name for n in mutated_inputs(gm)
             if not n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    if loose:
        reasons.append(f"{len(loose)} input(s) written in place without a static address ({', '.join(loose[:4])}"
                       f"{', ...' if len(loose) > 4 else ''}): allocate caches with KimiCache.allocate, or call "
                       "cache.mark_static() (torch._dynamo.mark_static_address on each tensor) before the first step")
    return reasons


def warn_if_not_graphable(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Log, as one warning per compiled graph, why ``mode="reduce-overhead"`` will not CUDA-graph it."""
    reasons = cudagraph_blockers(gm, example_inputs)
    if reasons:
        log.warning("kimi_dep: CUDA graphs were asked for (mode=\"reduce-overhead\" or triton.cudagraphs) but this "
                    "graph will run without them: %s.", "; ".join(reasons))
