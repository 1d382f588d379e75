"""The whole decoder on the GPU: kimi_dep against stock over decode and verify steps, with eager and plain
Inductor on the same stock model as the yardsticks (logits, every cache and state, routing).

Logits are measured against the truth: the same model upcast to FP32, run eagerly on the CPU (the ops'
PyTorch references; FP32 is within 3e-4 of FP64 there). Distance from eager BF16 is no measure of
accuracy: every BF16 side rounds, and these random models amplify one ulp a great deal (on the CPU, a
2^-7 nudge of one embedding column moves the small model's logits by 26 %, and eager BF16 is 28 % from
FP32), while plain Inductor shares most kernels with eager and so sits closer to it without being more
accurate (issue #17: kimi_dep 0.077 from eager, Inductor 0.029; docs/precision.md: no kimi_dep kernel
is less accurate than the stock one it replaces). So kimi_dep's logits error against FP32 is held to
1.5x the worse of eager's and Inductor's, and never tighter than 2e-2. Caches stay checked against
eager (twice Inductor's difference, never tighter than 0.2 absolute: test_cudagraphs.bounds), since a
lost or misplaced cache write misses by O(1). Routing: kimi_dep's agreement with eager must be no worse
than plain Inductor's, up to 1 % of picks (3 requests x 11 steps make 33 x 16 picks per MoE layer).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decoder as bd  # noqa: E402
from helpers import CUBLAS_ONLY  # noqa: E402
from test_cudagraphs import LOGIT_REL, bounds, compile_backend, errors, rel_err, run_steps  # noqa: E402

import dep_compile  # noqa: E402
from dep_compile.stock import KimiCache, build_model, preset  # noqa: E402
from dep_compile.stock.cache import LayerCache  # noqa: E402

pytestmark = pytest.mark.cuda

WIDTHS = {
    # small widths, 4 layers (KDA + dense MLP, KDA, KDA, DSA), 3 MoE layers of 64 experts: the model of
    # test_cudagraphs, so their compiles share Inductor's caches
    "small": lambda: (preset("k31-small", num_layers=4), lambda cfg: build_model(cfg, seed=1, device="cuda")),
    # full width, 4 layers (KDA + dense MLP, KDA, KDA, DSA), 3 MoE layers of 16 experts: ~13 GB of weights
    "full-slice": lambda: (preset("k31", num_layers=4, n_routed_experts=16),
                           lambda cfg: bd.build_model(cfg, torch.device("cuda"), seed=1)),
}


def run_side(model, fn, start: KimiCache):
    """The steps through ``fn`` from a copy of ``start``: logits, the caches after, the routing of
    every MoE call. A first pass on a scratch copy compiles both graphs (kimi_dep's translation
    validation runs the MoE op too), so the routing recorded is the steps' alone."""
    if fn is not None:
        run_steps(model, fn, start.clone())
    cache = start.clone()
    with bd.record_routing() as ids:
        logits = run_steps(model, fn, cache)
    return logits, cache, ids


def fp32_truth(model, start: KimiCache) -> torch.Tensor:
    """Every step's logits from the stock model upcast to FP32, eager on the CPU, from a CPU copy of
    ``start`` (caches keep their dtypes): [steps * rows, vocab] FP32."""
    ref = copy.deepcopy(model).float().cpu()
    layers = [LayerCache(**{n: t.to("cpu", copy=True) for n, t in lc.tensors().items()}) for lc in start.layers]
    cache = KimiCache(layers, start.num_slots, start.num_blocks, start.block_size)
    logits = torch.cat(run_steps(ref, None, cache))
    del ref
    return logits


@pytest.mark.parametrize("width", list(WIDTHS))
def test_kimi_dep_no_less_accurate_than_eager_or_inductor(width):
    cfg, build = WIDTHS[width]()
    torch.manual_seed(0)
    model = build(cfg)
    start = KimiCache.allocate(cfg, num_slots=8, num_blocks=32, block_size=4, device="cuda")
    truth = fp32_truth(model, start)
    ref, ref_cache, ref_ids = run_side(model, None, start)
    results = {}
    truth_err = {"eager": rel_err(torch.cat(ref).cpu(), truth)}
    for side, backend, opts in (("inductor", "inductor", None), ("kimi_dep", "kimi_dep", {}),
                                ("kimi_dep cuBLAS", "kimi_dep", dict(CUBLAS_ONLY))):
        logits, cache, ids = run_side(model, compile_backend(model, backend, options=opts), start)
        results[side] = (*errors(logits, ref, cache, ref_cache), bd.routing_agreement(ids, ref_ids))
        truth_err[side] = rel_err(torch.cat(logits).cpu(), truth)
        if backend == "kimi_dep":
            rewritten = {m.kind for m in dep_compile.last_report().layers if m.rewritten}
            assert rewritten == {"kda", "dsa", "moe"}, dep_compile.last_report().table()
        torch._dynamo.reset()
    print(f"{width} eager: logits rel {truth_err['eager']:.3g} from FP32")
    for side, (lg, ca, route) in results.items():
        print(f"{width} {side}: logits rel {truth_err[side]:.3g} from FP32, {lg:.3g} from eager; caches {ca:.3g} "
              f"from eager; routing agreement {route:.5f}")
    logit_bound = max(1.5 * max(truth_err["eager"], truth_err["inductor"]), LOGIT_REL)
    cache_bound = bounds(results["inductor"][:2])[1]
    for side in ("kimi_dep", "kimi_dep cuBLAS"):
        _, ca, route = results[side]
        assert truth_err[side] <= logit_bound and ca <= cache_bound, (side, truth_err, results)
        assert route >= results["inductor"][2] - 0.01, (side, results)
