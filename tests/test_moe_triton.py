"""The Triton SiTU, RMSNorm and router (``dep_compile.ops.moe_triton``, ``norm_triton``,
``router_triton``) against stock's torch.

Random BF16 inputs at K3 widths (SiTU 2 x 6144, latent 3584; router 896 experts x 7168, top-16)
and a small width. SiTU and RMSNorm: every output element within one BF16 ulp of stock's (only
the FP32 summation order and the tanh implementation differ before the single rounding, which
can flip it by one ulp). Router: see its test. CUDA only (marked ``cuda``), or the small width
in Triton's CPU interpreter with ``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1``.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dep_compile.stock.layers import situ

from triton_device import DEVICE_MARKS, TRITON_DEV as _DEV, ulps, use_triton

pytestmark = DEVICE_MARKS
WIDTHS = [w for w in ((6144, 3584), (100, 72)) if _DEV != "cpu" or w[0] < 1000]


def _mt():
    use_triton()
    from dep_compile.ops import moe_triton  # noqa: PLC0415 - CUDA / interpreter only

    return moe_triton


def within_one_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element of ``got`` within one BF16 ulp of ``ref``."""
    worst = float(ulps(got, ref).max())
    assert worst <= 1, f"an element is {worst:.2f} BF16 ulps off"


@pytest.mark.parametrize("inter,latent", WIDTHS)
@pytest.mark.parametrize("T", [1, 7, 64])
def test_situ_fused(inter, latent, T):
    mt = _mt()
    g = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(T, 2 * inter + 8, generator=g) * 3).to(torch.bfloat16)[:, : 2 * inter]  # row stride
    ref = situ(gate_up, 4.0, 25.0)
    within_one_ulp(mt.situ_fused(gate_up.to(_DEV), 4.0, 25.0), ref)


@pytest.mark.parametrize("latent", [latent for _, latent in WIDTHS])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_rms_norm_fused(latent, T):
    _mt()
    g = torch.Generator().manual_seed(T + 1)
    x = (torch.randn(T, latent, generator=g) * 2).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(latent, generator=g)).to(torch.bfloat16)
    ref = F.rms_norm(x.float(), (latent,), w.float(), 1e-5).to(torch.bfloat16)
    from dep_compile.ops.norm_triton import rms_norm_fused  # noqa: PLC0415

    within_one_ulp(rms_norm_fused(x.to(_DEV), w.to(_DEV), 1e-5), ref)


ROUTER_SIZES = [s for s in ((896, 7168, 16), (100, 256, 8)) if _DEV != "cpu" or s[0] < 500]


@pytest.mark.parametrize("experts,hidden,top_k", ROUTER_SIZES)
@pytest.mark.parametrize("T,masked", [(1, False), (7, False), (64, False), (7, True)])
def test_route_sigmoid_topk(experts, hidden, top_k, T, masked):
    """The two-launch router against FP32 torch on the same BF16 operands: the picked ids are a
    top-k of the reference keys (within FP32 summation-order noise), the weights are the
    reference scores of those ids, renormalized and scaled. ``masked``: a -inf bias on all but 3
    experts (fewer than top-k selectable), and the ids must still be distinct."""
    _mt()
    from dep_compile.ops.router_triton import route_sigmoid_topk  # noqa: PLC0415

    g = torch.Generator().manual_seed(T + 2)
    x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
    gate_w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    bias = 0.1 * torch.randn(experts, generator=g)
    if masked:
        bias[3:] = float("-inf")
    w, ids = route_sigmoid_topk(x.to(_DEV), gate_w.to(_DEV), bias.to(_DEV), top_k, 2.5)
    w, ids = w.cpu(), ids.cpu()
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, top_k)
    scores = torch.sigmoid(x.float() @ gate_w.float().t())
    keyed = scores + bias
    assert all(len(set(row.tolist())) == top_k for row in ids), "an expert picked twice"
    assert int(ids.min()) >= 0 and int(ids.max()) < experts
    picked = keyed.gather(1, ids)
    torch.testing.assert_close(picked, keyed.topk(top_k).values, rtol=0, atol=1e-5)  # descending top-k keys
    ref_w = scores.gather(1, ids)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True) * 2.5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,top_k", [(896, 16), (100, 8), (128, 6), (100, 5)])  # E = BLOCK_E; top_k < BLOCK_K
@pytest.mark.parametrize("case", ["random", "ties", "masked", "nan", "masked_nan"])
def test_select_experts_exact(experts, top_k, case):
    """The router's pick on given logit partials against the documented rule, exactly: keys
    ``sigmoid(sum of partials in slice order) + bias`` descending, equal keys by the lower id,
    a NaN key as -inf, never an expert twice. ``ties``: groups of experts with the same partials and
    bias; ``masked``: -inf bias on all but 3; ``nan``: NaN partials for every third expert;
    ``masked_nan``: both, so NaN and -inf keys are picked, by id."""
    _mt()
    from dep_compile.ops.router_triton import select_experts  # noqa: PLC0415

    S, T = 3, 5
    g = torch.Generator().manual_seed(experts + top_k)
    parts = torch.randn(S, T, experts, generator=g)
    bias = 0.1 * torch.randn(experts, generator=g)
    if case == "ties":  # experts 4j+1..4j+3 copy expert 4j
        parts = parts[:, :, torch.arange(experts) // 4 * 4]
        bias = bias[torch.arange(experts) // 4 * 4]
    if case in ("masked", "masked_nan"):
        bias[3:] = float("-inf")
    if case in ("nan", "masked_nan"):
        parts[1, :, ::3] = float("nan")
    w, ids = select_experts(parts.to(_DEV), bias.to(_DEV), top_k, 2.5)
    w, ids = w.cpu(), ids.cpu()
    logits = parts[0] + parts[1] + parts[2]
    keys = torch.sigmoid(logits) + bias
    keys = torch.where(keys.isnan(), float("-inf"), keys)
    want = torch.sort(-keys, dim=-1, stable=True).indices[:, :top_k]  # descending, equal keys by the lower id
    assert torch.equal(ids, want), f"picked {ids.tolist()} want {want.tolist()}"
    ref_w = torch.sigmoid(logits).gather(1, want)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-7, equal_nan=True)
