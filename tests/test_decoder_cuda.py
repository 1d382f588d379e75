"""The whole decoder on the GPU: kimi_dep against stock over decode and verify steps, with eager and plain
Inductor on the same stock model as the yardsticks (logits, every cache and state, routing).

Logits are measured against the truth: the same model upcast to FP32, run eagerly on the CPU (the ops'
PyTorch references; FP32 is within 3e-4 of FP64 there), one step at a time from the truth's own caches
before that step, so that errors do not compound over steps. Distance from eager BF16 over many steps
is no measure of accuracy: every BF16 side rounds, these random models amplify an ulp a great deal over
steps (on the CPU, a 2^-7 nudge of one embedding column moves the small model's logits by 26 % over 11
steps), and plain Inductor shares most kernels with eager, so it sits closer to eager without being
more accurate (issue #17: kimi_dep 0.077 from eager, Inductor 0.029; docs/precision.md finds no kimi_dep
kernel less accurate than the stock one it replaces). Near-tied routers are one such amplifier: the
test model's correction biases are set apart (``decisive_routing``), so every side picks the same
experts. kimi_dep's one-step logits error is held to 1.5x the worse of eager's and Inductor's, and
never tighter than 2e-2. On the CPU (the small model, 2026-12-01) eager's one-step error is 0.019 and
the DSA layer's output scaled by 0.5 gives 0.052, by 0 gives 0.098.

Caches and routing are compared with eager over the steps: caches within twice Inductor's difference,
never tighter than 0.2 absolute (test_cudagraphs.bounds), since a lost or misplaced cache write misses
by O(1); routing agreement no worse than plain Inductor's, up to 1 % of picks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decoder as bd  # noqa: E402
from helpers import CUBLAS_ONLY  # noqa: E402
from test_cudagraphs import bounds, compile_backend, errors  # noqa: E402

import dep_compile  # noqa: E402
from dep_compile.debug.parity import (decisive_routing, fp32_truth, one_step_logits, record_routing,  # noqa: E402
                                      rel_err, routing_agreement, run_steps, within_bound)
from dep_compile.stock import KimiCache, build_model, preset  # noqa: E402

pytestmark = pytest.mark.cuda

WIDTHS = {
    # small widths, 4 layers (KDA + dense MLP, KDA, KDA, DSA), 3 MoE layers of 64 experts: the model of
    # test_cudagraphs, so their compiles share Inductor's caches
    "small": lambda: (preset("k31-small", num_layers=4), lambda cfg: build_model(cfg, seed=1, device="cuda")),
    # full width, 4 layers (KDA + dense MLP, KDA, KDA, DSA), 3 MoE layers of 16 experts: ~13 GB of weights
    "full-slice": lambda: (preset("k31", num_layers=4, n_routed_experts=16),
                           lambda cfg: bd.build_model(cfg, torch.device("cuda"), seed=1)),
    # the same two with every dense projection FP8 block-scaled (issue #28: kimi_dep's FP8 split-K against
    # stock's cuBLAS block-FP8 GEMMs, both against the FP32 truth of the dequantized model)
    "small-fp8": lambda: (preset("k31-small", num_layers=4, dense_format="fp8_block"),
                          lambda cfg: build_model(cfg, seed=1, device="cuda")),
    "full-slice-fp8": lambda: (preset("k31", num_layers=4, n_routed_experts=16, dense_format="fp8_block"),
                               lambda cfg: bd.build_model(cfg, torch.device("cuda"), seed=1)),
}


def run_side(model, fn, start: KimiCache):
    """The steps through ``fn`` from a copy of ``start``: logits, the caches after, the routing of
    every MoE call. A first pass on a scratch copy compiles both graphs (kimi_dep's translation
    validation runs the MoE op too), so the routing recorded is the steps' alone."""
    if fn is not None:
        run_steps(model, fn, start.clone())
    cache = start.clone()
    with record_routing() as ids:
        logits = run_steps(model, fn, cache)
    return logits, cache, ids


@pytest.mark.parametrize("width", list(WIDTHS))
def test_kimi_dep_no_less_accurate_than_eager_or_inductor(width):
    cfg, build = WIDTHS[width]()
    torch.manual_seed(0)
    model = build(cfg)
    decisive_routing(model)
    start = KimiCache.allocate(cfg, num_slots=8, num_blocks=32, block_size=4, device="cuda")
    truth, states = fp32_truth(model, start)
    ref, ref_cache, ref_ids = run_side(model, None, start)
    results = {}
    step_err = {"eager": rel_err(one_step_logits(model, None, start, states), truth)}
    for side, backend, opts in (("inductor", "inductor", None), ("kimi_dep", "kimi_dep", {}),
                                ("kimi_dep cuBLAS", "kimi_dep", dict(CUBLAS_ONLY))):
        fn = compile_backend(model, backend, options=opts)
        logits, cache, ids = run_side(model, fn, start)
        results[side] = (*errors(logits, ref, cache, ref_cache), routing_agreement(ids, ref_ids))
        step_err[side] = rel_err(one_step_logits(model, fn, start, states), truth)
        if backend == "kimi_dep":
            rewritten = {m.kind for m in dep_compile.last_report().layers if m.rewritten}
            assert rewritten == {"kda", "dsa", "moe"}, dep_compile.last_report().table()
        torch._dynamo.reset()
    print(f"{width} eager: one-step logits rel {step_err['eager']:.3g} from FP32")
    for side, (lg, ca, route) in results.items():
        print(f"{width} {side}: one-step logits rel {step_err[side]:.3g} from FP32; over the steps {lg:.3g} from "
              f"eager, caches {ca:.3g} from eager; routing agreement {route:.5f}")
    cache_bound = bounds(results["inductor"][:2])[1]
    for side in ("kimi_dep", "kimi_dep cuBLAS"):
        _, ca, route = results[side]
        ok, logit_bound = within_bound(step_err[side], step_err["eager"], step_err["inductor"])
        assert ok and ca <= cache_bound, (side, logit_bound, step_err, results)
        assert route >= results["inductor"][2] - 0.01, (side, results)
