"""GPU tests of the Triton split-K GEMM (``dep_compile.ops.splitk_triton``).

Every case runs ``splitk_linear`` into a NaN-poisoned output and compares it with the FP32
reference ``x.float() @ w.float().T`` on fresh random inputs.

Tolerance: BF16 operands are exact in FP32, the kernel accumulates in FP32 and rounds once to
BF16, so the error is the final rounding (relative ~2^-9) plus FP32 summation-order noise. We
require every output finite and ``||out - ref||_F / ||ref||_F <= 1e-2``; measured values are
about 3e-3.

Skipped cleanly without CUDA (CI), and without Triton.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.tactics import SplitK

pytestmark = pytest.mark.cuda  # conftest skips these without a GPU

REL_TOL = 1e-2

TACTICS = [
    SplitK(1, 64, 256, 4, 4),
    SplitK(4, 64, 256, 4, 4),
    SplitK(3, 128, 128, 8, 4),
    SplitK(7, 32, 128, 4, 3),
    SplitK(2, 256, 64, 8, 4),
]


def _sk():
    pytest.importorskip("triton")
    from dep_compile.ops import splitk_triton  # noqa: PLC0415 - CUDA-only module

    return splitk_triton


def _check(sk, x, w, tactic, workspace=None, **kw):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=x.device)
    ret = sk.splitk_linear(x, w, out, tactic, workspace, **kw)
    assert ret is out
    ref = sk.fp32_linear_oracle(x, w)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} outputs not written"
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel <= REL_TOL, f"rel err {rel:.3e} for {tactic}, M={x.shape[0]} N={w.shape[0]} K={x.shape[1]}"
    return out


@pytest.mark.parametrize("tactic", TACTICS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_splitk_matches_fp32_reference(tactic, m):
    sk = _sk()
    n, k = 1000, 1536  # N not a multiple of any block_n
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    ws = sk.splitk_workspace(64, n, tactic, "cuda")
    _check(sk, x, w, tactic, ws)
    # The workspace's arrival counters are back to zero: a second call on fresh data is right.
    _check(sk, torch.randn_like(x), w, tactic, ws)


@pytest.mark.parametrize("tactic", [SplitK(1, 64, 128, 4, 3), SplitK(5, 64, 128, 4, 3), SplitK(2, 128, 64, 4, 4)], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 77, 1000), (3, 333, 515), (17, 129, 2047), (64, 65, 136)])
def test_splitk_odd_shapes(tactic, m, n, k):
    sk = _sk()
    if k % 8:
        # Rows of w and x must start 16-byte aligned for the vector loads; an odd K gets a
        # padded row stride, as a packed weight would have.
        wbig = torch.randn(n, k + (8 - k % 8), dtype=torch.bfloat16, device="cuda")
        w = wbig[:, :k]
        xbig = torch.randn(m, k + (8 - k % 8), dtype=torch.bfloat16, device="cuda")
        x = xbig[:, :k]
    else:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    _check(sk, x, w, tactic)  # allocates its own workspace


@pytest.mark.parametrize("tactic", [SplitK(1, 64, 256, 4, 4), SplitK(4, 64, 256, 4, 4)], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_splitk_row_slice_of_packed_weight(tactic, m):
    sk = _sk()
    k = 2048
    packed = torch.randn(3000, k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ws = sk.splitk_workspace(64, 2000, tactic, "cuda")
    for lo, hi in [(0, 1000), (1000, 2900), (2900, 3000)]:
        w = packed[lo:hi]
        assert w.stride() == (k, 1) and w.storage_offset() == lo * k
        _check(sk, x, w, tactic, ws)


def test_splitk_more_than_64_rows():
    sk = _sk()
    tactic = SplitK(4, 64, 128, 4, 3)
    x = torch.randn(150, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(300, 1024, dtype=torch.bfloat16, device="cuda")
    ws = sk.splitk_workspace(150, 300, tactic, "cuda")
    _check(sk, x, w, tactic, ws)
    _check(sk, x[:20], w, tactic, ws)  # a smaller batch on the same workspace


def test_splitk_deterministic():
    sk = _sk()
    tactic = SplitK(8, 64, 128, 4, 4)
    x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    ws = sk.splitk_workspace(8, 4096, tactic, "cuda")
    first = _check(sk, x, w, tactic, ws).clone()
    for _ in range(5):
        assert torch.equal(_check(sk, x, w, tactic, ws), first)


def test_splitk_cuda_graph_capture():
    sk = _sk()
    tactic = SplitK(4, 64, 256, 4, 4)
    x = torch.randn(4, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(1536, 2048, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(4, 1536, dtype=torch.bfloat16, device="cuda")
    ws = sk.splitk_workspace(4, 1536, tactic, "cuda")
    sk.splitk_linear(x, w, out, tactic, ws)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sk.splitk_linear(x, w, out, tactic, ws)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        ref = sk.fp32_linear_oracle(x, w)
        assert torch.isfinite(out).all()
        assert float((out.float() - ref).norm() / ref.norm()) <= REL_TOL


@pytest.mark.parametrize("variant", [{"use_tma": True}, {"pdl": True}, {"pdl": True, "prefetch_k": 512}], ids=str)
def test_splitk_variants(variant):
    sk = _sk()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA / PDL need SM90+")
    tactic = SplitK(4, 64, 256, 4, 4)
    for m, n in [(1, 1000), (16, 777), (64, 2048)]:
        x = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, 2048, dtype=torch.bfloat16, device="cuda")
        _check(sk, x, w, tactic, **variant)


def test_splitk_rejects_bad_inputs():
    sk = _sk()
    tactic = SplitK(2)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError):
        sk.splitk_linear(x, w, torch.empty(2, 31, dtype=torch.bfloat16, device="cuda"), tactic)
    with pytest.raises(ValueError):
        sk.splitk_linear(x, w, torch.empty(2, 32, dtype=torch.bfloat16, device="cuda"), tactic,
                         torch.zeros(3, dtype=torch.float32, device="cuda"))
