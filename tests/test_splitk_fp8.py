"""Tests of the FP8 block-scaled split-K GEMM (``dep_compile.ops.splitk_fp8_triton``) against stock's arithmetic.

The kernel (and stock's own CUDA path, `stock/fp8_block_cuda.py`) quantizes the activations as stock does and sums each 128-input block's FP8 products before
scaling them. The reference is ``stock/fp8_block.py``'s ``fp8_block_linear`` on the same codes.

- Triton's CPU interpreter (CI; ``tests/triton_device.py`` makes it round as the GPU does): the block
  products are summed in FP32 as the reference sums them, so the output is the reference's to one BF16
  rounding at most (measured: equal).
- CUDA: the tensor cores sum a block's 128 FP8 products in their own order and precision, so the bound is
  ``MAX_REL`` of the largest value (measured at full size: below 4e-3, one BF16 rounding).

Packed weights whose segments are not multiples of 128 rows (K3.1's ``kv_a`` 576, ``wv`` 32, KDA's ``b`` 96)
keep each segment's own block scales; a mutant that reads the scales as one 128-row grid over the whole
packed weight must fail the check. Sizes: ``small`` everywhere (ragged tiles, odd K, split-K with empty
slices), ``full`` (K3.1's DSA projection, 14560 x 7168) on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.stock.fp8_block import fp8_block_linear, random_fp8_block, scale_rows
from dep_compile.tactics import SplitK

from triton_device import TRITON_DEV as DEV, device_test, ulps, use_triton

MAX_REL = 2.0 ** -7  # CUDA: max |out - ref| / max |ref|
SIZES = {"small": ([96, 40, 128, 32], 300), "full": ([1536, 576, 12288, 128, 32], 7168),
         "f_b": ([12288], 128),  # KDA's gate up-projection: one K block (cuBLAS's blockwise GEMM faulted there)
         "small_preset": ([96, 48, 16], 256),  # a small preset's packed runs (cuBLAS refused n 48, k 256)
         "square": ([128, 128], 256)}  # a small preset's shared gate_up: 2 x 2 block scales (cuBLAS computed it wrong)
SIZE_NAMES = ("small", "square") if DEV == "cpu" else ("small", "full", "f_b", "small_preset", "square")
TACTICS = [SplitK(1, 64, 128, 4, 4), SplitK(1, 128, 128, 8, 3), SplitK(3, 32, 128, 4, 2),
           SplitK(1, 64, 256, 4, 3), SplitK(2, 32, 512, 4, 2)]  # 2 and 4 scale blocks a step (ragged at k 300)


def _kernel():
    use_triton()
    from dep_compile.ops import splitk_fp8_triton  # noqa: PLC0415 - CUDA / interpreter only

    return splitk_fp8_triton


def _case(segments: list[int], k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w, s = random_fp8_block(sum(segments), k, segments, g, k ** -0.5)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    return x, w, s


def _run(kernel, x, w, s, rows, tactic):
    from dep_compile.ops.splitk_triton import splitk_workspace  # noqa: PLC0415 - CUDA / interpreter only

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEV)
    ws = splitk_workspace(x.shape[0], w.shape[0], tactic, DEV) if tactic.split_k > 1 else None
    kernel.fp8_splitk_linear(x.to(DEV), w.to(DEV), s.to(DEV), rows.int().to(DEV), out, tactic, ws)
    assert torch.isfinite(out).all(), "outputs not written"
    return out.cpu()


def _within(out, ref) -> bool:
    if DEV == "cpu":
        return bool(ulps(out, ref).max() <= 1)
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) <= MAX_REL


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
@pytest.mark.parametrize("tactic", TACTICS, ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 64])
def test_fp8_splitk_matches_stock(size, tactic, m):
    kernel = _kernel()
    segments, k = SIZES[size]
    x, w, s = _case(segments, k, m, seed=m)
    ref = fp8_block_linear(x, w, s, segments)
    out = _run(kernel, x, w, s, scale_rows(segments), tactic)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert _within(out, ref), f"max err {err:.3e} of the largest value ({tactic}, M={m}, {size})"


@device_test
@pytest.mark.parametrize("size", [n for n in SIZE_NAMES if n not in ("f_b", "square")])  # aligned segments: one grid
def test_fp8_splitk_mutant_one_grid_fails(size):
    """Scales read as one 128-row grid over the packed weight (ignoring the segments) must fail the check."""
    kernel = _kernel()
    segments, k = SIZES[size]
    x, w, s = _case(segments, k, 16, seed=7)
    n = sum(segments)
    ref = fp8_block_linear(x, w, s, segments)
    wrong = torch.arange(n) // 128  # rows past the first unaligned segment read their neighbour's block scales
    out = _run(kernel, x, w, s, wrong, TACTICS[0])
    assert not _within(out, ref)


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
def test_fp8_splitk_block_k_keeps_the_arithmetic(size):
    """Two or four scale blocks a loop step sum the same blocks in the same order: the output equals block_k 128's
    to the bit."""
    kernel = _kernel()
    segments, k = SIZES[size]
    x, w, s = _case(segments, k, 5, seed=3)
    rows = scale_rows(segments)
    one = _run(kernel, x, w, s, rows, SplitK(1, 64, 128, 4, 2))
    for block_k in (256, 512):
        assert torch.equal(_run(kernel, x, w, s, rows, SplitK(1, 64, block_k, 4, 2)), one), block_k


@device_test
def test_fp8_splitk_rejects_bad_operands():
    kernel = _kernel()
    x, w, s = _case([64], 256, 2, seed=1)
    out = torch.empty(2, 64, dtype=torch.bfloat16, device=DEV)
    rows = scale_rows([64]).int().to(DEV)
    with pytest.raises(ValueError, match="block_k must be one of"):
        kernel.fp8_splitk_linear(x.to(DEV), w.to(DEV), s.to(DEV), rows, out, SplitK(1, 64, 64, 4, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernel.fp8_splitk_linear(x.to(DEV), w.float().to(DEV), s.to(DEV), rows, out, SplitK(1, 64, 128, 4, 2))
    with pytest.raises(ValueError, match="do not match"):
        kernel.fp8_splitk_linear(x.to(DEV), w.to(DEV), s.t().contiguous().to(DEV), rows, out, SplitK(1, 64, 128, 4, 2))


@device_test
@pytest.mark.parametrize("shape", [(1, 7168), (5, 300), (64, 128)])
def test_quantize_is_stocks_bit_for_bit(shape):
    """The activation codes and scales are stock's exactly (wide-ranging rows, a short last group)."""
    from dep_compile.stock.fp8_block import quantize_activations  # noqa: PLC0415

    use_triton()
    from dep_compile.stock import fp8_block_cuda  # noqa: PLC0415 - CUDA / interpreter only

    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float()))
    x = x.to(torch.bfloat16)
    xq, xs = fp8_block_cuda.quantize_activations(x.to(DEV))
    ref_q, ref_s = quantize_activations(x)
    assert torch.equal(xs.cpu(), ref_s)
    assert torch.equal(xq.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@device_test
@pytest.mark.parametrize("size", SIZE_NAMES)
@pytest.mark.parametrize("m", [1, 5, 64, 70])
@pytest.mark.parametrize("path", ["block_fp8_linear", "block_fp8_gemm"])
def test_stock_block_fp8_matches_reference(size, m, path):
    """Stock's CUDA paths (quantizer + cuBLAS's blockwise GEMM per segment run, padded to 4 rows; quantizer + the
    plain Triton GEMM) against the reference, segment edges included. The interpreter has no cuBLAS: there
    ``block_fp8_linear`` takes the Triton path too."""
    use_triton()
    from dep_compile.stock import fp8_block_cuda  # noqa: PLC0415 - CUDA / interpreter only

    segments, k = SIZES[size]
    x, w, s = _case(segments, k, m, seed=m + 50)
    ref = fp8_block_linear(x, w, s, segments)
    out = getattr(fp8_block_cuda, path)(x.to(DEV), w.to(DEV), s.to(DEV), segments).cpu()
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert _within(out, ref), f"max err {err:.3e} of the largest value (M={m}, {size})"


def _blockwise_mm(a, b, scale_a, scale_b, out_dtype, transposed=False):
    """What cuBLAS's blockwise FP8 GEMM computes (a [M, K] codes, b [K, N], 1 x 128 and 128 x 128 scales), or with
    ``transposed`` the 128 x 128 scales misread as their transpose."""
    k, n = b.shape
    sb = scale_b.t() if transposed else scale_b
    wide_a = scale_a.repeat_interleave(128, 1)[:, :k]
    wide_b = sb.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    return ((a.float() * wide_a) @ (b.float() * wide_b)).to(out_dtype)


@device_test
@pytest.mark.parametrize("transposed", [False, True], ids=["right", "scales-transposed"])
def test_stock_cublas_probe(monkeypatch, caplog, transposed):
    """The once-per-shape probe of stock's ``block_fp8_linear`` keeps a GEMM that computes blockwise FP8 right and
    drops (and logs) one that misreads a square run's block scales, whatever the caller's inputs: both against a
    stand-in for ``torch._scaled_mm``, the Triton GEMM being the probe's yardstick."""
    use_triton()
    from dep_compile.stock import fp8_block_cuda  # noqa: PLC0415 - CUDA / interpreter only

    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: _blockwise_mm(*a, **k, transposed=transposed))
    monkeypatch.setattr(fp8_block_cuda, "has_blockwise_mm", lambda device: True)
    monkeypatch.setattr(fp8_block_cuda, "_TAKES", {})
    segments, k = SIZES["square"]
    x, w, s = _case(segments, k, 8, seed=72)
    out = fp8_block_cuda.block_fp8_linear(x.to(DEV), w.to(DEV), s.to(DEV), segments).cpu()
    ref = fp8_block_linear(x, w, s, segments)
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) <= MAX_REL
    assert list(fp8_block_cuda._TAKES.values()) == [not transposed]
    assert ("computed a" in caplog.text) == transposed


def test_dense_tables_name_k31_shapes_and_never_split_k():
    """``DEP_DENSE_FP8`` covers K3.1's one-at-a-time FP8 projections by shape, and no entry splits K (the shared
    expert's down runs on a side stream beside the latent up, and split-K workspaces are shared per width)."""
    from dep_compile import tactics  # noqa: PLC0415
    from dep_compile.stock.config import preset  # noqa: PLC0415

    c = preset("k31")
    want = {(c.mla_heads * c.qk_head_dim, c.q_lora_rank), (c.index_heads * c.index_head_dim, c.q_lora_rank),
            (c.kda_heads * c.kda_head_dim, c.kda_f_rank), (c.hidden_size, c.shared_intermediate),
            (c.hidden_size, c.moe_latent_size)}
    assert set(tactics.DEP_DENSE_FP8) == want
    for table in tactics.DEP_DENSE_FP8.values():
        for t in table.values():
            assert isinstance(t, SplitK) and t.split_k == 1 and t.block_k in (128, 256, 512), t


@device_test
@pytest.mark.parametrize("m", [1, 40])
def test_dense_linear_runs_the_fp8_table(monkeypatch, m):
    """An FP8 weight whose shape has a table runs the split-K kernel on CUDA (once, within ``MAX_REL`` of stock) and
    stock's op elsewhere (to the bit); a shape without one runs stock's op everywhere."""
    kernel = _kernel()
    from dep_compile import tactics  # noqa: PLC0415
    from dep_compile.ops.dense import Fp8Weight, dense_linear  # noqa: PLC0415

    n, k = 192, 384
    x, w, s = _case([n], k, m, seed=11)
    monkeypatch.setattr(tactics, "DEP_DENSE_FP8", {(n, k): {64: SplitK(1, 64, 256, 4, 2)}})
    calls = []
    real = kernel.fp8_splitk_linear
    monkeypatch.setattr(kernel, "fp8_splitk_linear", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    stock = torch.ops.kimi_k3.fp8_block_linear(x.to(DEV), w.to(DEV), s.to(DEV), [n]).cpu()
    got = dense_linear(x.to(DEV), Fp8Weight(w.to(DEV), s.to(DEV))).cpu()
    if DEV == "cuda":
        assert calls == [SplitK(1, 64, 256, 4, 2)]
        assert float((got.float() - stock.float()).abs().max() / stock.float().abs().max()) <= MAX_REL
    else:
        assert calls == [] and torch.equal(got, stock)
    calls.clear()
    x2, w2, s2 = (t.contiguous().to(DEV) for t in (x[:, :256], w[:, :256], s[:, :2]))  # K 256: no table
    untabled = dense_linear(x2, Fp8Weight(w2, s2))
    assert calls == [] and torch.equal(untabled, torch.ops.kimi_k3.fp8_block_linear(x2, w2, s2, [n]))
