"""Parity yardsticks that do not depend on chaotic amplification (docs/design.md §7.4).

Distance from eager BF16 over many steps is no measure of a rewrite on these random tiny models: any
side that rounds one BF16 value differently (split-K sums, Inductor's fused glue, CUDA kernels) can
flip a near-tied top-16 expert, and over a few steps that moves logits by O(1) (docs/vllm.md). The
yardsticks here remove that amplifier and measure what is left:

- ``decisive_routing(model)``: every MoE's correction biases 1 apart, beyond any sigmoid score's
  reach, so every side picks the same experts (the routing weights still vary by token);
- ``fp32_truth``: the model upcast to FP32, eager on the CPU, from a CPU copy of the start caches,
  recording the caches before each step; ``one_step_logits`` runs each step of a side from the
  truth's caches before it, so errors do not compound over steps; ``rel_err`` compares them;
- ``record_routing`` / ``routing_agreement``: the fraction of (token, expert) picks two runs share;
- ``logit_bound`` / ``within_bound``: kimi_dep's one-step error is held to 1.5x the worse of eager
  BF16's and plain Inductor's, never tighter than ``LOGIT_REL`` (the tests' rule).

``run_steps`` is the step schedule these functions share (decode steps, then verify steps, two
request batches alternating so every step has new metadata).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable
from unittest import mock

import torch

from ..stock import KimiCache, RequestBatch
from ..stock.cache import LayerCache
from ..stock.fp8_block import dequantize_linears

LOGIT_REL = 2e-2  # the floor of the one-step logits bound (relative Frobenius): BF16 rounding + summation order
BOUND_FACTOR = 1.5  # kimi_dep may be this much worse than the worse of eager BF16 and plain Inductor


def decisive_routing(model):
    """Put every MoE's experts 1 apart in their correction bias (a random order), beyond any sigmoid
    score's reach: every token then selects the same top-k, so no rounding can flip a pick, while the
    routing weights still vary by token. Returns ``model``."""
    for n, gate in enumerate(m for m in model.modules() if hasattr(m, "e_score_correction_bias")):
        bias = gate.e_score_correction_bias
        order = torch.randperm(bias.shape[0], generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            bias.copy_(order.to(bias.dtype))
    return model


def run_steps(model, fn, cache: KimiCache, steps: int = 8, verify: int = 3, rows: int = 3, q: int = 2,
              seed: int = 0, before_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """``steps`` decode steps then ``verify`` verify steps (``q`` tokens, the first request accepting
    one), alternating two request batches (other block tables, state slots and lengths: new metadata
    each step), through ``fn`` (None: eager); the logits of each step, cloned (cudagraph trees reuse
    output buffers). ``before_step(i)`` runs before step ``i`` (e.g. to set the caches). ``cache``
    needs ``2 * rows`` state slots."""
    device = next(iter(cache.layers[0].tensors().values())).device
    a = RequestBatch(cache, rows, start_len=9, device=device, seed=seed)
    b = RequestBatch(cache, rows, start_len=17, device=device, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for i in range(steps + verify):
            qi = 1 if i < steps else q
            meta = (a if i % 2 == 0 else b).step(qi, None if qi == 1 else [1] + [qi] * (rows - 1))
            ids = torch.randint(0, model.config.vocab_size, (rows * qi,), generator=g).to(device)
            if before_step is not None:
                before_step(i)
            out.append(model.step(ids, meta, cache, fn=fn).clone())
    return out


def cpu_copy(cache: KimiCache) -> KimiCache:
    """A copy of ``cache`` on the CPU (each tensor keeps its dtype)."""
    layers = [LayerCache(**{n: t.to("cpu", copy=True) for n, t in lc.tensors().items()}) for lc in cache.layers]
    return KimiCache(layers, cache.num_slots, cache.num_blocks, cache.block_size)


def fp32_truth(model, start: KimiCache, **steps) -> tuple[torch.Tensor, list[dict]]:
    """The stock model upcast to FP32, eager on the CPU, from a CPU copy of ``start`` (caches keep their
    dtypes; FP8 block-scaled projections become their dequantized weights): every step's logits
    [steps * rows, vocab] FP32, and its caches before each step (``run_steps`` takes ``steps``)."""
    ref = dequantize_linears(copy.deepcopy(model)).float().cpu()
    cache = cpu_copy(start)
    states: list[dict] = []
    logits = torch.cat(run_steps(ref, None, cache, before_step=lambda i: states.append(cache.snapshot()), **steps))
    del ref
    return logits, states


def one_step_logits(model, fn, start: KimiCache, states: list[dict], **steps) -> torch.Tensor:
    """Each step through ``fn`` (None: eager) from the truth's caches before it, copied into a copy of
    ``start`` (on its device), so errors do not compound over steps: every step's logits
    [steps * rows, vocab] on the CPU."""
    cache = start.clone()
    tensors = {f"layer.{i}.{n}": t for i, lc in enumerate(cache.layers) for n, t in lc.tensors().items()}

    def load(step: int) -> None:
        for name, t in tensors.items():
            t.copy_(states[step][name])

    return torch.cat(run_steps(model, fn, cache, before_step=load, **steps)).cpu()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref|| in FP32 (the absolute one when ref is 0)."""
    diff = (got.detach().float() - ref.detach().float().to(got.device)).norm().item()
    norm = ref.detach().float().norm().item()
    return diff / norm if norm else diff


def logit_bound(*yardsticks: float, factor: float = BOUND_FACTOR, floor: float = LOGIT_REL) -> float:
    """The bound on kimi_dep's one-step logits error: ``factor`` x the worst of the yardsticks' errors
    (eager BF16, plain Inductor), never tighter than ``floor``."""
    return max(factor * max(yardsticks), floor)


def within_bound(err: float, *yardsticks: float, factor: float = BOUND_FACTOR, floor: float = LOGIT_REL
                 ) -> tuple[bool, float]:
    """(``err`` <= the bound, the bound): see :func:`logit_bound`."""
    bound = logit_bound(*yardsticks, factor=factor, floor=floor)
    return err <= bound, bound


@contextlib.contextmanager
def record_routing():
    """Yields a list that receives the topk_ids [T, K] (a copy) of each MoE layer's experts call, in
    call order (one per MoE layer and step), from eager and compiled code alike.

    Two hooks: the stock ``kimi_k3::routed_experts`` and ``routed_experts_mxfp4`` ops (wrapping ``CustomOpDef._backend_fns``, which
    the dispatcher's kernel for each device looks up per call, so Inductor's code is seen too), and
    the kimi_dep MoE op's ``EpMoeLayer.experts_tail`` (which may run its own experts kernels; a stock
    op call inside it is not counted twice). Run graphs by hand outside it: a replay runs no Python.
    """
    from ..ops.moe import EpMoeLayer  # noqa: PLC0415
    from ..stock import ops as stock_ops  # noqa: PLC0415

    calls: list[torch.Tensor] = []
    inside_tail = []
    ops = {stock_ops.routed_experts: 4, stock_ops.routed_experts_mxfp4: 6}  # op -> the position of topk_ids

    def hook_op(impl, ids_at):
        def hooked(*args):
            if not inside_tail:
                calls.append(args[ids_at].detach().clone())
            return impl(*args)
        return hooked

    tail = EpMoeLayer.experts_tail

    def hooked_tail(self, latent, topk_w, topk_ids, *rest):
        calls.append(topk_ids.detach().clone())
        inside_tail.append(True)
        try:
            return tail(self, latent, topk_w, topk_ids, *rest)
        finally:
            inside_tail.pop()

    with contextlib.ExitStack() as stack:
        for op, ids_at in ops.items():
            fns = op._backend_fns
            stack.enter_context(mock.patch.dict(fns, {dev: hook_op(impl, ids_at) for dev, impl in fns.items()}))
        stack.enter_context(mock.patch.object(EpMoeLayer, "experts_tail", hooked_tail))
        yield calls


def routing_agreement(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The fraction of (token, expert) picks in ``got`` that ``ref`` also made, over every MoE call."""
    assert len(got) == len(ref) and got, f"{len(got)} MoE calls recorded vs {len(ref)} for eager"
    same = total = 0
    for a, b in zip(got, ref):
        a, b = a.cpu(), b.cpu()
        hit = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # [T, K]: pick a[t, k] is among b[t]
        same += int(hit.sum())
        total += hit.numel()
    return same / total
