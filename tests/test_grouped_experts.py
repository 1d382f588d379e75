"""The grouped-GEMM experts path (the stock GPU kernel) against the readable reference."""

from __future__ import annotations

import pytest
import torch

from dep_compile.stock.grouped_experts import routed_experts_grouped
from dep_compile.stock.reference.moe import routed_experts_partial


def _case(device, T=37, E=12, K=4, lat=64, inter=32, start=0, E_total=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, lat, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * inter, lat, generator=g) * lat ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, lat, inter, generator=g) * inter ** -0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E_total, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return [t.to(device) for t in (x, w13, w2, w, ids)] + [start]


@pytest.mark.parametrize("start, E_total", [(0, 12), (12, 36)])  # all local; a middle rank of 3
def test_grouped_matches_reference_cpu(start, E_total):
    x, w13, w2, w, ids, start = _case("cpu", start=start, E_total=E_total)
    got = routed_experts_grouped(x, w13, w2, w, ids, start, 4.0, 25.0)
    ref = routed_experts_partial(x, w13, w2, w, ids, start, 4.0, 25.0)
    # one extra BF16 rounding of each expert output (relative 2^-8) before the FP32 weighted sum
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)
    assert ref.abs().max() > 0.1  # the case routes real work to local experts


@pytest.mark.cuda
def test_grouped_matches_reference_cuda():
    x, w13, w2, w, ids, start = _case("cuda", T=64, E=56, K=16, lat=256, inter=128, start=56, E_total=896)
    got = routed_experts_grouped(x, w13, w2, w, ids, start, 4.0, 25.0)
    ref = routed_experts_partial(x, w13, w2, w, ids, start, 4.0, 25.0)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)
