"""Tests of the Triton split-K GEMM (``dep_compile.ops.splitk_triton``).

Every case runs ``splitk_linear`` into a NaN-poisoned output and compares it with the FP32
reference ``x.float() @ w.float().T`` on fresh random inputs (seeded, made on the CPU).

Tolerance: BF16 operands are exact in FP32, the kernel accumulates in FP32 and rounds once to
BF16, so the error is the final rounding (relative ~2^-9) plus FP32 summation-order noise. We
require every output finite and ``||out - ref||_F / ||ref||_F <= 1e-2``; measured values are
about 3e-3 on the GPU, 1.6e-3 in the interpreter.

Sizes: ``full`` (K3-like widths: N 1000-4096, K 1536-4096) runs on CUDA only (marked ``cuda``,
skipped without a GPU); ``small`` (N <= 300, K <= 515, the same tactics, row counts, ragged
tiles, odd K, empty K-splits and workspace reuse) runs on CUDA too, and in Triton's CPU
interpreter with ``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1`` (the interpreter runs the
programs one after another, so the split-K arrival counter and the last-arriver's ordered sum
run as on the GPU, minus the concurrency). CUDA-graph capture and the TMA / PDL variants are
CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.tactics import SplitK

from triton_device import TRITON_DEV as _DEV, device_test, use_triton

REL_TOL = 1e-2
SIZE_NAMES = ("full", "small") if _DEV != "cpu" else ("small",)

TACTICS = [
    SplitK(1, 64, 256, 4, 4),
    SplitK(4, 64, 256, 4, 4),
    SplitK(3, 128, 128, 8, 4),
    SplitK(7, 32, 128, 4, 3),
    SplitK(2, 256, 64, 8, 4),
]


def _sk():
    use_triton()
    from dep_compile.ops import splitk_triton  # noqa: PLC0415 - CUDA / interpreter only

    return splitk_triton


def _randn(*shape, seed: int) -> torch.Tensor:
    """Seeded BF16 N(0, 1) on the test device (drawn on the CPU: the same values on either device)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(_DEV)


def _check(sk, x, w, tactic, workspace=None, **kw):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=x.device)
    ret = sk.splitk_linear(x, w, out, tactic, workspace, **kw)
    assert ret is out
    ref = sk.fp32_linear_oracle(x, w)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} outputs not written"
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel <= REL_TOL, f"rel err {rel:.3e} for {tactic}, M={x.shape[0]} N={w.shape[0]} K={x.shape[1]}"
    return out


# (n, k): N is not a multiple of any block_n; K is a multiple of every block_k (the EVEN_K path),
# and the 7-way split of the small K leaves its last 3 K-slices empty (their partials are zeros).
REF_SIZES = {"full": (1000, 1536), "small": (200, 512)}


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
@pytest.mark.parametrize("tactic", TACTICS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_splitk_matches_fp32_reference(tactic, m, size):
    sk = _sk()
    n, k = REF_SIZES[size]
    x = _randn(m, k, seed=m)
    w = _randn(n, k, seed=100 + m)
    ws = sk.splitk_workspace(64, n, tactic, _DEV)
    _check(sk, x, w, tactic, ws)
    # The workspace's arrival counters are back to zero: a second call on fresh data is right.
    _check(sk, _randn(m, k, seed=200 + m), w, tactic, ws)
    if tactic.split_k > 1:
        grid = sk.splitk_grid(m, n, tactic)
        counters = ws.view(torch.int32)[ws.numel() - grid[0] // tactic.split_k * grid[1]:]
        assert not counters.any(), counters


ODD_SHAPES = {"full": [(1, 77, 1000), (3, 333, 515), (17, 129, 2047), (64, 65, 136)],
              "small": [(1, 77, 264), (3, 150, 515), (17, 129, 300), (64, 65, 136)]}


@device_test
@pytest.mark.parametrize("tactic", [SplitK(1, 64, 128, 4, 3), SplitK(5, 64, 128, 4, 3), SplitK(2, 128, 64, 4, 4)], ids=str)
@pytest.mark.parametrize("size,m,n,k", [(s, *shape) for s in SIZE_NAMES for shape in ODD_SHAPES[s]])
def test_splitk_odd_shapes(tactic, size, m, n, k):
    sk = _sk()
    if k % 8:
        # Rows of w and x must start 16-byte aligned for the vector loads; an odd K gets a
        # padded row stride, as a packed weight would have.
        w = _randn(n, k + (8 - k % 8), seed=1)[:, :k]
        x = _randn(m, k + (8 - k % 8), seed=2)[:, :k]
    else:
        w = _randn(n, k, seed=1)
        x = _randn(m, k, seed=2)
    _check(sk, x, w, tactic)  # allocates its own workspace


# k, packed rows, the row slices [lo, hi) taken as w, workspace columns
SLICE_SIZES = {"full": (2048, 3000, [(0, 1000), (1000, 2900), (2900, 3000)], 2000),
               "small": (512, 300, [(0, 100), (100, 290), (290, 300)], 200)}


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
@pytest.mark.parametrize("tactic", [SplitK(1, 64, 256, 4, 4), SplitK(4, 64, 256, 4, 4)], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_splitk_row_slice_of_packed_weight(tactic, m, size):
    sk = _sk()
    k, rows, slices, ws_n = SLICE_SIZES[size]
    packed = _randn(rows, k, seed=3)
    x = _randn(m, k, seed=4)
    ws = sk.splitk_workspace(64, ws_n, tactic, _DEV)
    for lo, hi in slices:
        w = packed[lo:hi]
        assert w.stride() == (k, 1) and w.storage_offset() == lo * k
        _check(sk, x, w, tactic, ws)


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
def test_splitk_more_than_64_rows(size):
    sk = _sk()
    tactic = SplitK(4, 64, 128, 4, 3)
    n, k = (300, 1024) if size == "full" else (130, 512)
    x = _randn(150, k, seed=5)
    w = _randn(n, k, seed=6)
    ws = sk.splitk_workspace(150, n, tactic, _DEV)
    _check(sk, x, w, tactic, ws)
    _check(sk, x[:20], w, tactic, ws)  # a smaller batch on the same workspace


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
def test_splitk_deterministic(size):
    sk = _sk()
    tactic = SplitK(8, 64, 128, 4, 4)
    n, k = (4096, 4096) if size == "full" else (192, 1024)
    x = _randn(8, k, seed=7)
    w = _randn(n, k, seed=8)
    ws = sk.splitk_workspace(8, n, tactic, _DEV)
    first = _check(sk, x, w, tactic, ws).clone()
    for _ in range(5 if size == "full" else 2):
        assert torch.equal(_check(sk, x, w, tactic, ws), first)


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@device_test
def test_splitk_rejects_bad_inputs():
    sk = _sk()
    tactic = SplitK(2)
    x = _randn(2, 64, seed=9)
    w = _randn(32, 64, seed=10)
    with pytest.raises(ValueError):
        sk.splitk_linear(x, w, torch.empty(2, 31, dtype=torch.bfloat16, device=_DEV), tactic)
    with pytest.raises(ValueError):
        sk.splitk_linear(x, w, torch.empty(2, 32, dtype=torch.bfloat16, device=_DEV), tactic,
                         torch.zeros(3, dtype=torch.float32, device=_DEV))
