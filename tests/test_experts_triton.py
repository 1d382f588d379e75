"""kimi_dep's routed-experts kernels (``dep_compile.ops.experts_triton``) against the CPU reference.

Each case draws seeded random BF16 inputs on the CPU (never zeros), runs the Triton path and
compares with ``routed_experts_partial`` (FP32 [T, Lat]) on the same inputs. The kernels compute
the reference's function with the reference's roundings (gate/up rounded to BF16, SiTU in FP32
rounded to BF16, FP32 second GEMM times the routing weight, FP32 sum in the reference's order);
only the FP32 accumulation order inside the GEMMs and the tanh / sigmoid implementation differ,
which can flip a BF16 rounding of a gate/up/activation element by one ulp (2^-8 relative). Bound:
``max |got - ref| <= 2^-6 * max |ref|`` and ``||got - ref|| / ||ref|| <= 4e-3`` (stock's grouped
GEMMs, which round each expert's output to BF16 once more, are held to 2e-2).

Sizes: ``small`` (Lat 96, I 48, 12 local experts, top-4; ragged tiles and K tail) runs in Triton's
CPU interpreter (``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1``) and on CUDA; ``full`` (K3's Lat
3584, I 3072, top-16; 56 local experts of 896, or the slice's 64) on CUDA only. Cases: 1 / 4 /
16 (/ 64) tokens, ids of other ranks, one expert taking every token, empty experts, and two runs
bit-equal. The MoE op test checks ``kimi_dep::moe`` with this path against the stock layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dep_compile.stock.reference.moe import routed_experts_partial

from helpers import MoeBlock
from triton_device import TRITON_DEV as _DEV, device_test, use_triton

BETA, BETA_LIN = 4.0, 25.0
SMALL = dict(lat=96, inter=48, E=12, K=4)
FULL = dict(lat=3584, inter=3072, K=16)


def _et():
    use_triton()
    from dep_compile.ops import experts_triton  # noqa: PLC0415 - CUDA / interpreter only

    return experts_triton


def _tactic(et, size):
    """Small tiles in the interpreter (ragged last N tile, a K tail); the default on CUDA at full size."""
    return et.ExpertsTactic(block_n1=32, block_n2=64, block_k=32, num_warps=4, num_stages=2) if size == "small" \
        else et.DEFAULT_TACTIC


def _case(T, *, lat, inter, E, K, start=0, E_total=None, ids=None, seed=0):
    """(x, w13, w2, topk_weights, topk_ids) on the test device, seeded random (drawn there: full-size
    weights are GBs); each token picks K distinct experts of E_total unless ``ids`` is given."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=_DEV).manual_seed(seed)
    x = torch.randn(T, lat, generator=gd, device=_DEV).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * inter, lat, generator=gd, device=_DEV) * lat ** -0.5 * 2).to(torch.bfloat16)
    w2 = (torch.randn(E, lat, inter, generator=gd, device=_DEV) * inter ** -0.5).to(torch.bfloat16)
    if ids is None:
        ids = torch.stack([torch.randperm(E_total or E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return x, w13, w2, w.to(_DEV), ids.to(_DEV)


def _check(et, case, start, tactic):
    """The kernels against the reference (run on the same device, FP32) within the module's bounds."""
    ref = routed_experts_partial(*case, start, BETA, BETA_LIN)
    got = et.routed_experts_triton(*case, start, BETA, BETA_LIN, tactic=tactic)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.isfinite(got).all()
    scale = float(ref.abs().max())
    assert scale > 0.1, "the case routes no real work to local experts"
    err = float((got - ref).abs().max())
    rel = float((got - ref).norm() / ref.norm())
    assert err <= 2 ** -6 * scale and rel <= 4e-3, f"max err {err:.3e} (scale {scale:.2f}), rel {rel:.2e}"
    return got


SIZES = ("small",) if _DEV == "cpu" else ("small", "full")


def _shape(size, E=None):
    if size == "small":
        return dict(SMALL)
    return dict(FULL, E=E or 56)


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 4, 16])
def test_all_local(size, T):
    et = _et()
    sh = _shape(size, E=64)
    _check(et, _case(T, **sh, seed=T), 0, _tactic(et, size))


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 4, 16])
def test_ep_ids_of_other_ranks(size, T):
    """A middle rank: local experts start .. start + E of 16 ranks' worth; most ids are elsewhere."""
    et = _et()
    sh = _shape(size)
    E = sh["E"]
    tokens = T if size == "small" else 4 * T  # enough tokens that some land on this rank
    case = _case(tokens, **sh, E_total=16 * E if size == "full" else 3 * E, seed=100 + T)
    ids = case[4]
    for t in range(0, tokens, 2):  # every other token picks at least one of this rank's experts
        if not ((ids[t] >= E) & (ids[t] < 2 * E)).any():
            ids[t, t % sh["K"]] = E + (5 * t) % E
    _check(et, case, E, _tactic(et, size))


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("passes", [None, (16, 32, None, True), (64, 128, None, False), (32, 64, 2, False),
                                    (32, 64, None, True)],
                         ids=["default", "m16big32tail", "m64big128", "big2deep", "tail"])
def test_one_expert_takes_every_token_and_empty_experts(size, passes):
    """Every token picks local expert 3 (plus other ranks' ids); the other local experts are empty.
    70 rows: more than one pass of block_m (32), so the crowded-expert loop runs two passes of 64 (``passes``
    (block_m, big_m, big_stages, small_tail): two of 32 and the last 6 rows one of 16, one of 128, two of 64
    pipelined 2 deep, or one of 64 and the last 6 rows one of 32, as MXFP4's default does)."""
    et = _et()
    sh = _shape(size)
    E, K = sh["E"], sh["K"]
    T = 70
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.cat([torch.tensor([3]), E + torch.randperm(2 * E, generator=g)[: K - 1]])
                       for _ in range(T)])
    ids = ids[:, torch.randperm(K, generator=g)]  # expert 3 in any slot
    tactic = _tactic(et, size)
    if passes:
        tactic = dataclasses.replace(tactic, block_m=passes[0], big_m=passes[1], big_stages=passes[2],
                                     small_tail=passes[3])
    _check(et, _case(T, **sh, ids=ids, seed=8), 0, tactic)


@device_test
def test_tokens_without_local_experts_give_zero():
    et = _et()
    x, w13, w2, w, ids = _case(5, **SMALL, E_total=3 * SMALL["E"], seed=9)
    ids[1] = torch.arange(SMALL["K"]) + 2 * SMALL["E"]  # token 1: only another rank's experts
    got = et.routed_experts_triton(x, w13, w2, w, ids, SMALL["E"], BETA, BETA_LIN, tactic=_tactic(et, "small"))
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    ref = routed_experts_partial(x, w13, w2, w, ids, SMALL["E"], BETA, BETA_LIN)
    assert float((got - ref).abs().max()) <= 2 ** -6 * float(ref.abs().max())


@device_test
@pytest.mark.parametrize("size", SIZES)
def test_deterministic(size):
    """Two runs on the same inputs are bit-equal (no atomics; fixed row and summation order)."""
    et = _et()
    sh = _shape(size)
    case = _case(16, **sh, E_total=2 * sh["E"], seed=11)
    tac = _tactic(et, size)
    a = et.routed_experts_triton(*case, 0, BETA, BETA_LIN, tactic=tac)
    b = et.routed_experts_triton(*case, 0, BETA, BETA_LIN, tactic=tac)
    assert torch.equal(a, b)


class _Mutant:
    """A kernel launcher that overrides some of the launch's keyword arguments (a broken-kernel mutant made of
    the real kernel)."""

    def __init__(self, kernel, **force):
        self.kernel, self.force = kernel, force

    def __getitem__(self, grid):
        return lambda *a, **k: self.kernel[grid](*a, **{**k, **self.force})


def _few_touched_ids(T, E, K, ranks, seed):
    """ids [T, K] of T tokens on EP rank 1 of ``ranks`` (local experts E .. 2E): one local pick each (expert 2t),
    K - 1 elsewhere."""
    others = torch.cat([torch.arange(0, E), torch.arange(2 * E, ranks * E)])
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.cat([torch.tensor([E + 2 * t]), others[torch.randperm(len(others), generator=g)[:K - 1]]])
                        for t in range(T)])


def _few_touched(size, T):
    """(BF16 case, expert_start) of ``_few_touched_ids`` at ``size``."""
    sh = _shape(size)
    ids = _few_touched_ids(T, sh["E"], sh["K"], 16 if size == "full" else 3, 70 + T)
    return _case(T, **sh, ids=ids, seed=70 + T), sh["E"]


def _uneven(et, size):
    """The size's tactic, or at the small size one with more K steps than slices (GEMM1 6 steps in 4 slices,
    GEMM2 3 in 3; full size: 28 in 8 and 24 in 7 already)."""
    tac = _tactic(et, size)
    return dataclasses.replace(tac, block_k=16, split_k=4) if size == "small" else tac


def _poisoned_slice_sum(et):
    """``_situ_kernel`` given a NaN beta: the output of every token whose expert GEMM1 split turns NaN."""
    return _Mutant(et._situ_kernel, beta=float("nan"))


def _check_split(et, case, start, tac, monkeypatch):
    """The split call within the reference's bounds and bit-equal to itself, and the split is what ran: every
    output NaN with GEMM1's slice sum poisoned, and a combine that reads only GEMM2's first slice misses."""
    got = _check(et, case, start, tac)
    assert torch.equal(got, et.routed_experts_triton(*case, start, BETA, BETA_LIN, tactic=tac))
    ref = routed_experts_partial(*case, start, BETA, BETA_LIN)
    with monkeypatch.context() as m:
        m.setattr(et, "_situ_kernel", _poisoned_slice_sum(et))
        assert torch.isnan(et.routed_experts_triton(*case, start, BETA, BETA_LIN, tactic=tac)).all(), "GEMM1 ran whole"
    with monkeypatch.context() as m:
        m.setattr(et, "_combine_kernel", _Mutant(et._combine_kernel, S_MAX=1))
        first = et.routed_experts_triton(*case, start, BETA, BETA_LIN, tactic=tac)
        assert float((first - ref).abs().max()) > 2 ** -6 * float(ref.abs().max()), "GEMM2 ran whole"


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_split_k_where_few_experts_are_touched(size, T, uneven, monkeypatch):
    """One or two tokens on an EP rank touch one or two local experts: both GEMMs split their K range
    (``_slices``), evenly or not; ``split_k=1`` stays within the bounds too."""
    et = _et()
    case, start = _few_touched(size, T)
    tac = _uneven(et, size) if uneven else _tactic(et, size)
    _check_split(et, case, start, tac, monkeypatch)
    _check(et, case, start, dataclasses.replace(tac, split_k=1))


@device_test
@pytest.mark.parametrize("size", SIZES)
def test_split_k_of_a_crowded_expert(size, monkeypatch):
    """20 tokens on local expert 3, their other picks elsewhere, 16-row passes: the crowded loop's 64-row passes
    (20 rows > 16) inside each K slice (at most 64 / 20 = 3 slices)."""
    et = _et()
    sh = _shape(size)
    E, K, T = sh["E"], sh["K"], 20
    others = torch.arange(E, (16 if size == "full" else 3) * E)
    g = torch.Generator().manual_seed(75)
    ids = torch.stack([torch.cat([torch.tensor([3]), others[torch.randperm(len(others), generator=g)[:K - 1]]])
                       for _ in range(T)])
    case = _case(T, **sh, ids=ids[:, torch.randperm(K, generator=g)], seed=75)
    _check_split(et, case, 0, dataclasses.replace(_uneven(et, size), block_m=16), monkeypatch)


@device_test
def test_bad_input_raises():
    et = _et()
    x, w13, w2, w, ids = _case(2, **SMALL)
    with pytest.raises(ValueError, match="BF16"):
        et.routed_experts_triton(x.float(), w13, w2, w, ids, 0, BETA, BETA_LIN)
    with pytest.raises(ValueError, match="do not match"):
        et.routed_experts_triton(x[:, :-1], w13, w2, w, ids, 0, BETA, BETA_LIN)


@device_test
def test_pipeline_depths_of_the_two_loops():
    """MXFP4's default runs GEMM1's crowded 64-row passes 3 deep beside the 32-row loop's 4; unset, the crowded
    depth is held to the one-pass loop's shared memory (2); a depth past an SM's shared memory is cut to fit."""
    et = _et()
    t = et.DEFAULT_MXFP4_TACTIC
    assert et._pipeline(2 * t.block_n1, 32, 64, t, True) == dict(STAGES=4, BIG_STAGES=3, num_stages=4)
    held = et._pipeline(2 * t.block_n1, 32, 64, dataclasses.replace(t, big_stages=None), True)
    assert held["BIG_STAGES"] == 2
    deep = et._pipeline(128, 32, 256, dataclasses.replace(t, big_stages=16), True)
    big_step = 128 * (t.block_k // 2 + t.block_k // 32) + 256 * 2 * t.block_k  # bytes a stage: codes, scales, act
    assert deep["BIG_STAGES"] == et._SMEM_BYTES // big_step < 16


@pytest.mark.cuda
@pytest.mark.parametrize("E", [56, 64])
@pytest.mark.parametrize("T", [1, 4, 16, 64])
def test_full_size(E, T):
    """K3 widths; E = 56 as one EP16 rank (ids of all 896 experts, rank 3's local) or the slice's 64."""
    et = _et()
    start, total = (3 * 56, 896) if E == 56 else (0, 64)
    tokens = T if E == 64 else 16 * T  # on an EP16 rank about 1 of a token's 16 picks is local
    _check(et, _case(tokens, **FULL, E=E, E_total=total, seed=T + E), start, et.DEFAULT_TACTIC)


def _captured(et, case):
    """(CUDA graph of one call on ``case``, its output), warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        et.routed_experts_triton(*case, 0, BETA, BETA_LIN)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = et.routed_experts_triton(*case, 0, BETA, BETA_LIN)
    return graph, captured


@pytest.mark.cuda
def test_capture_in_cuda_graph():
    """Captured once, replayed on new ids and inputs: equals an eager call (no host sync inside)."""
    et = _et()
    sh = dict(FULL, E=56)
    case = _case(64, **sh, E_total=112, seed=21)
    graph, captured = _captured(et, case)
    fresh = _case(64, **sh, E_total=112, seed=22)
    for dst, src in zip(case, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, et.routed_experts_triton(*case, 0, BETA, BETA_LIN))


@pytest.mark.cuda
def test_capture_replays_another_split(monkeypatch):
    """Captured with 64 tokens (many touched experts: one slice), replayed with one token's picks (two touched
    experts: split K, seen by poisoning the slice sum): the slices are read on the device, so the replay equals
    an eager call."""
    et = _et()
    sh = dict(FULL, E=56)
    case = _case(64, **sh, E_total=896, seed=23)
    graph, captured = _captured(et, case)
    ids = case[4]
    ids.copy_(torch.arange(56, 56 + 16, device="cuda").repeat(64, 1))  # every pick elsewhere ...
    ids[0, :2] = torch.tensor([5, 9], device="cuda")  # ... but token 0's first two
    graph.replay()
    torch.cuda.synchronize()
    eager = et.routed_experts_triton(*case, 0, BETA, BETA_LIN)
    assert torch.equal(captured, eager)
    assert float(captured[0].abs().max()) > 0.1 and not captured[1:].any()
    monkeypatch.setattr(et, "_situ_kernel", _poisoned_slice_sum(et))
    assert torch.isnan(et.routed_experts_triton(*case, 0, BETA, BETA_LIN)[0]).all(), "no K split at two experts"


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 16, 64])
def test_moe_op_experts_tail_matches_stock(T):
    """EpMoeLayer.experts_tail (this path) against the same tail over the stock op, full-size experts.

    Same routing and latent in; outputs BF16 [T, hidden]. The stock op rounds each expert's output
    to BF16 before the weighted sum; we do not: relative Frobenius error <= 1e-2, max <= 2^-4 of the
    largest output (the translation-validation bound on CUDA)."""
    from dep_compile.ops import fallbacks  # noqa: PLC0415
    from dep_compile.ops.moe import EpMoeLayer  # noqa: PLC0415

    sh = dict(FULL, E=56)
    x, w13, w2, w, ids = _case(T * 16, **sh, E_total=896, seed=30 + T)
    g = torch.Generator().manual_seed(31)
    norm_w = (1 + 0.1 * torch.randn(sh["lat"], generator=g)).to(torch.bfloat16).cuda()
    up_w = (torch.randn(512, sh["lat"], generator=g) * sh["lat"] ** -0.5).to(torch.bfloat16).cuda()
    layer = EpMoeLayer(shared_inter=0, latent=sh["lat"], top_k=16, scale=2.5, beta=BETA, beta_lin=BETA_LIN,
                       norm_eps=1e-5, expert_start=168, ep_size=1, front_max=64, front=None)
    got = layer.experts_tail(x, w, ids, w13, w2, norm_w, up_w).float()
    assert not [k for k in fallbacks.LOGGED if "routed experts" in k], "the Triton path fell back to stock"
    stock = torch.ops.kimi_k3.routed_experts(x, w13, w2, w, ids, 168, 1, BETA, BETA_LIN)
    ref = torch.nn.functional.rms_norm(stock.float(), (sh["lat"],), norm_w.float(), 1e-5).to(x.dtype)
    ref = torch.nn.functional.linear(ref, up_w).float()
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= 1e-2 and float((got - ref).abs().max()) <= 2 ** -4 * float(ref.abs().max()), rel


@pytest.mark.cuda
def test_moe_op_matches_stock_layer():
    """The whole kimi_dep MoE op (this experts path inside) against the stock layer in eager, small
    widths (latent 256, intermediate 64: masked K tails), 16 rows; relative Frobenius error < 2e-2."""
    import dep_compile  # noqa: PLC0415
    from dep_compile.ops import fallbacks  # noqa: PLC0415
    from dep_compile.stock import preset  # noqa: PLC0415
    from dep_compile.stock.model import init_weights  # noqa: PLC0415

    rows = 16
    cfg = preset("k31-small", hidden_size=512, moe_latent_size=256, shared_intermediate=256)
    block = init_weights(MoeBlock(cfg), seed=0).cuda().eval().requires_grad_(False)
    dep = torch.compile(block, backend="kimi_dep", fullgraph=True)
    x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref, out = block(x), dep(x)
    assert dep_compile.last_report().rewritten("moe")
    assert not [k for k in fallbacks.LOGGED if "routed experts" in k], "the Triton path fell back to stock"
    # BF16 outputs; the FP32 router summed in another order can flip a near-tied expert
    rel = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 2e-2, rel


# ---- MXFP4 experts (K3's format): dequantized in registers --------------------------------------------

SMALL_MX = dict(lat=96, inter=64, E=12, K=4)  # widths divisible by the MXFP4 group (32)
SMALL_TILES = dict(lat=128, inter=64, E=12, K=4)  # widths divisible by the tiles (64 rows x 64 inputs)


def _mx_case(T, *, lat, inter, E, K, E_total=None, ids=None, seed=0):
    """(x, w13, w2, topk_weights, topk_ids) with MXFP4 experts (random codes, scales for the BF16 case's RMS)."""
    from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4

    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=_DEV).manual_seed(seed)
    x = torch.randn(T, lat, generator=gd, device=_DEV).to(torch.bfloat16)
    w13 = Mxfp4Weight(*random_mxfp4((E, 2 * inter, lat), gd, 2 * lat ** -0.5))  # drawn on the device: GBs
    w2 = Mxfp4Weight(*random_mxfp4((E, lat, inter), gd, inter ** -0.5))
    if ids is None:
        ids = torch.stack([torch.randperm(E_total or E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return x, w13, w2, w.to(_DEV), ids.to(_DEV)


def _mx_tactic(et, size):
    return et.ExpertsTactic(block_n1=32, block_n2=64, block_k=64, num_warps=4, num_stages=2) if size == "small" \
        else et.DEFAULT_TACTIC


def _check_mx(et, case, start, tactic):
    """MXFP4 kernels: bit-equal to the BF16 kernels on the dequantized weights (the same tiles, dequantized in
    registers), and within the BF16 kernels' bounds of the reference on them."""
    x, w13, w2, w, ids = case
    dense = (x, w13.dequantize(), w2.dequantize(), w, ids)
    ref = routed_experts_partial(*dense, start, BETA, BETA_LIN)
    got = et.routed_experts_triton(x, w13, w2, w, ids, start, BETA, BETA_LIN, tactic=tactic)
    assert torch.equal(got, et.routed_experts_triton(*dense, start, BETA, BETA_LIN, tactic=tactic))
    scale = float(ref.abs().max())
    assert scale > 0.1, "the case routes no real work to local experts"
    err, rel = float((got - ref).abs().max()), float((got - ref).norm() / ref.norm())
    assert err <= 2 ** -6 * scale and rel <= 4e-3, f"max err {err:.3e} (scale {scale:.2f}), rel {rel:.2e}"
    return got


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 16])
def test_mxfp4_matches_the_bf16_kernels_on_dequantized_weights(size, T):
    et = _et()
    sh = SMALL_MX if size == "small" else dict(FULL, E=64)
    _check_mx(et, _mx_case(T, **sh, seed=30 + T), 0, _mx_tactic(et, size))


@device_test
@pytest.mark.parametrize("size", SIZES)
def test_mxfp4_crowded_expert_and_other_ranks(size):
    """70 tokens all on local expert 3 (two passes of the crowded loop) with other ranks' ids around it."""
    et = _et()
    sh = SMALL_MX if size == "small" else dict(FULL, E=56)
    E, K, T = sh["E"], sh["K"], 70
    g = torch.Generator().manual_seed(31)
    ids = torch.stack([torch.cat([torch.tensor([3]), E + torch.randperm(2 * E, generator=g)[: K - 1]])
                       for _ in range(T)])
    _check_mx(et, _mx_case(T, **sh, ids=ids[:, torch.randperm(K, generator=g)], seed=32), 0, _mx_tactic(et, size))


@device_test
def test_mxfp4_check_fails_on_a_kernel_reading_another_experts_scales():
    """The check can fail: the kernels fed each expert's neighbour's scales miss the reference by far."""
    from dep_compile.stock.mxfp4 import Mxfp4Weight

    et = _et()
    x, w13, w2, w, ids = _mx_case(16, **SMALL_MX, seed=33)
    wrong = Mxfp4Weight(w13.packed, w13.scale.roll(1, 0))
    got = et.routed_experts_triton(x, wrong, w2, w, ids, 0, BETA, BETA_LIN, tactic=_mx_tactic(et, "small"))
    ref = routed_experts_partial(x, w13.dequantize(), w2.dequantize(), w, ids, 0, BETA, BETA_LIN)
    assert float((got - ref).abs().max()) > 2 ** -6 * float(ref.abs().max())


def _tiles_tactic(et, size, ptx=True):
    """The re-packed MXFP4 path: the small case's 64 x 64 tiles, or the default MXFP4 tactic's; ``ptx``: the
    PTX dequantizer on CUDA (the interpreter runs its integer twin)."""

    if size == "small":  # 64-row tiles, as at full size: 32 would run another MMA than the BF16 kernels' on the GPU
        return et.ExpertsTactic(block_n1=64, block_n2=64, block_k=64, num_warps=4, num_stages=2, ptx_dequant=ptx,
                                tiles=True)
    return dataclasses.replace(et.DEFAULT_MXFP4_TACTIC, ptx_dequant=ptx, tiles=True)


def _tiles_logged(before: set[str]) -> set[str]:
    """The tiles fallbacks logged since ``before``."""
    from dep_compile.ops import fallbacks

    return {k for k in fallbacks.LOGGED - before if "tiles" in k}


@device_test
@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "integer"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 16])
def test_mxfp4_tiles_match_the_bf16_kernels_on_dequantized_weights(size, T, ptx):
    """Experts re-packed into the MMA's operand order (a copy, ops/mxfp4_tiles.py): bit-equal to the BF16 kernels on the
    dequantized weights under the same tiles, and no fallback taken."""
    from dep_compile.ops import fallbacks

    if ptx and _DEV == "cpu":
        pytest.skip("the interpreter runs the integer dequantizer only (the 'integer' case)")
    et = _et()
    sh = SMALL_TILES if size == "small" else dict(FULL, E=64)
    before = set(fallbacks.LOGGED)
    _check_mx(et, _mx_case(T, **sh, seed=60 + T), 0, _tiles_tactic(et, size, ptx))
    assert not _tiles_logged(before)


@device_test
@pytest.mark.parametrize("size", SIZES)
def test_mxfp4_tiles_crowded_expert_strided_views_and_other_ranks(size):
    """70 tokens on local expert 3 (the crowded loop's passes), other ranks' ids around it, ``expert_start`` 5, and
    the experts as strided views of a larger stack: the tiles path bit-equal to the BF16 kernels (its contract;
    the BF16 kernels' own bound on crowded experts is test_mxfp4_crowded_expert_and_other_ranks')."""
    from dep_compile.ops import fallbacks
    from dep_compile.stock.mxfp4 import Mxfp4Weight

    et = _et()
    sh = dict(SMALL_TILES if size == "small" else FULL, E=2 * (SMALL_TILES["E"] if size == "small" else 28))
    E, K, T, start = sh["E"] // 2, sh["K"], 70, 5
    g = torch.Generator().manual_seed(63)
    ids = torch.stack([torch.cat([torch.tensor([start + 3]), start + E + torch.randperm(2 * E, generator=g)[: K - 1]])
                       for _ in range(T)])
    x, w13, w2, w, ids = _mx_case(T, **sh, ids=ids[:, torch.randperm(K, generator=g)], seed=64)
    w13, w2 = (Mxfp4Weight(m.packed[1::2], m.scale[1::2]) for m in (w13, w2))  # every other expert
    before = set(fallbacks.LOGGED)
    tactic = _tiles_tactic(et, size)
    got = et.routed_experts_triton(x, w13, w2, w, ids, start, BETA, BETA_LIN, tactic=tactic)
    dense = (w13.dequantize(), w2.dequantize())
    assert torch.equal(got, et.routed_experts_triton(x, *dense, w, ids, start, BETA, BETA_LIN, tactic=tactic))
    assert float(got.abs().max()) > 0.1 and not _tiles_logged(before)


@device_test
@pytest.mark.parametrize("size", SIZES)
def test_mxfp4_tiles_split_k_where_few_experts_are_touched(size):
    """One token on an EP rank (one local expert: both GEMMs split K) on the re-packed MXFP4 experts: bit-equal to
    the BF16 kernels on the dequantized weights (the slices are chosen from the routing alone)."""
    et = _et()
    sh = SMALL_TILES if size == "small" else dict(FULL, E=56)
    ids = _few_touched_ids(1, sh["E"], sh["K"], 16 if size == "full" else 3, 72)
    _check_mx(et, _mx_case(1, **sh, ids=ids, seed=72), sh["E"], _tiles_tactic(et, size))


@device_test
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("T", [1, 16])
def test_mxfp4_tiled_in_place_are_read_as_they_are(size, T):
    """Experts tiled in place at load time (``stock/mxfp4_tiles.tile_in_place``): the kernels read them with the
    tiles' blocks whatever tactic is asked and are bit-equal to the copy path and, through the MoE
    op's stock fallback, the stock op agrees with the reference."""
    from dep_compile.stock.mxfp4 import Mxfp4Weight
    from dep_compile.stock.mxfp4_tiles import tile_in_place

    et = _et()
    sh = SMALL_TILES if size == "small" else dict(FULL, E=64)
    x, w13, w2, w, ids = _mx_case(T, **sh, seed=80 + T)
    tactic = _tiles_tactic(et, size, ptx=_DEV != "cpu")
    want = et.routed_experts_triton(x, w13, w2, w, ids, 0, BETA, BETA_LIN, tactic=tactic)  # through a copy
    t13 = tile_in_place(Mxfp4Weight(w13.packed.clone(), w13.scale.clone()), tactic.block_n1, tactic.block_k)
    t2 = tile_in_place(Mxfp4Weight(w2.packed.clone(), w2.scale.clone()), tactic.block_n2, tactic.block_k)
    asked = dataclasses.replace(tactic, block_n1=32, block_k=32, tiles=False)
    got = et.routed_experts_triton(x, t13, t2, w, ids, 0, BETA, BETA_LIN, tactic=asked)
    assert torch.equal(got, want) and float(got.abs().max()) > 0.1
    t2_other = tile_in_place(Mxfp4Weight(w2.packed.clone(), w2.scale.clone()), tactic.block_n2, 32)
    assert "one block_k" in et.unsupported(x, t13, t2_other, w, ids)
    assert "different formats" in et.unsupported(x, t13, w2, w, ids)


@device_test
@pytest.mark.parametrize("bn13, bn2, bk", [(48, 32, 32), (32, 48, 32), (32, 32, 96)])
def test_mxfp4_tiles_not_powers_of_two_are_left_to_stock(bn13, bn2, bk, monkeypatch, caplog):
    """Tiles of 48 rows or 96 inputs (legal for stock's op, which reads any) cannot compile in the kernels (tl.arange
    needs powers of two): ``unsupported`` says so, and the MoE op runs stock's op on them, logged."""
    from dep_compile.ops import fallbacks
    from dep_compile.stock.moe import stock_routed_experts
    from dep_compile.stock.mxfp4_tiles import tile_mxfp4

    et = _et()
    x, w13, w2, w, ids = _mx_case(4, lat=96, inter=96, E=2, K=2, seed=3)
    t13, t2 = tile_mxfp4(w13, bn13, bk), tile_mxfp4(w2, bn2, bk)
    assert "powers of two" in et.unsupported(x, t13, t2, w, ids)
    monkeypatch.setattr(fallbacks, "LOGGED", set())
    with caplog.at_level("WARNING", logger=fallbacks.__name__):
        got = et.routed_experts_dep(x, t13, t2, w, ids, 0, 1, BETA, BETA_LIN)
    assert "powers of two" in caplog.text and "the stock routed-experts op" in caplog.text
    assert torch.equal(got, stock_routed_experts(x, t13, t2, w, ids, 0, 1, BETA, BETA_LIN))
    assert et.unsupported(x, tile_mxfp4(w13, 32, 32), tile_mxfp4(w2, 32, 32), w, ids) is None


@device_test
def test_mxfp4_tiles_follow_weight_updates_in_their_buffers():
    """Codes updated in place, then scales swapped for another tensor: the copy is re-packed into the same buffers
    (graphs captured on it keep their addresses) and the result follows the new weights."""
    from dep_compile.ops import mxfp4_tiles
    from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4

    et = _et()
    x, w13, w2, w, ids = _mx_case(16, **SMALL_TILES, seed=65)
    tactic = _tiles_tactic(et, "small")
    et.routed_experts_triton(x, w13, w2, w, ids, 0, BETA, BETA_LIN, tactic=tactic)
    tiles = mxfp4_tiles.cached_tiles(w13, tactic.block_n1, tactic.block_k)
    addresses = (tiles.words.data_ptr(), tiles.scales.data_ptr())
    gd = torch.Generator(device=_DEV).manual_seed(66)
    new_codes, new_scale = random_mxfp4(tuple(w13.shape), gd, 2 * SMALL_TILES["lat"] ** -0.5)
    w13.packed.copy_(new_codes)  # in place: the version counter moves
    w13 = Mxfp4Weight(w13.packed, new_scale)  # another scale tensor
    got = et.routed_experts_triton(x, w13, w2, w, ids, 0, BETA, BETA_LIN, tactic=tactic)
    dense = (w13.dequantize(), w2.dequantize())
    assert torch.equal(got, et.routed_experts_triton(x, *dense, w, ids, 0, BETA, BETA_LIN, tactic=tactic))
    again = mxfp4_tiles.cached_tiles(w13, tactic.block_n1, tactic.block_k)
    assert (again.words.data_ptr(), again.scales.data_ptr()) == addresses


@device_test
def test_mxfp4_tiles_refuse_an_up_half_inside_a_tile():
    """An expert width (96) that is no multiple of the 64-row tile: the up half would start inside a tile, so the
    kernels read the checkpoint's layout (logged) and stay bit-equal to the BF16 kernels."""
    from dep_compile.ops import fallbacks

    et = _et()
    x, w13, w2, w, ids = _mx_case(16, lat=128, inter=96, E=12, K=4, seed=67)
    before = set(fallbacks.LOGGED)
    tactic = _tiles_tactic(et, "small")
    got = et.routed_experts_triton(x, w13, w2, w, ids, 0, BETA, BETA_LIN, tactic=tactic)
    dense = (w13.dequantize(), w2.dequantize())
    assert torch.equal(got, et.routed_experts_triton(x, *dense, w, ids, 0, BETA, BETA_LIN, tactic=tactic))
    assert any("up half" in k for k in _tiles_logged(before)), fallbacks.LOGGED - before


@device_test
def test_mxfp4_tiles_check_fails_on_swapped_rows():
    """The tiles check can fail: a copy whose rows n and n + 8 trade bytes misses the reference by far."""
    from dep_compile.ops import mxfp4_tiles

    et = _et()
    x, w13, w2, w, ids = _mx_case(16, **SMALL_TILES, seed=61)
    tactic = _tiles_tactic(et, "small")
    tiles = mxfp4_tiles.cached_tiles(w13, tactic.block_n1, tactic.block_k)
    words = tiles.words.clone()
    tiles.words.copy_(((words >> 16) & 0xFFFF) | (words << 16))  # bytes 0-1 (row n) <-> 2-3 (row n + 8)
    got = et.routed_experts_triton(x, w13, w2, w, ids, 0, BETA, BETA_LIN, tactic=tactic)
    tiles.words.copy_(words)
    ref = routed_experts_partial(x, w13.dequantize(), w2.dequantize(), w, ids, 0, BETA, BETA_LIN)
    assert float((got - ref).abs().max()) > 2 ** -6 * float(ref.abs().max())


def test_mxfp4_tiles_refuse_what_they_cannot_hold():
    """tile_mxfp4 names why: rows that do not tile, a scale above 2^1 (its folded scale is no normal BF16)."""
    from dep_compile.stock.mxfp4_tiles import tile_mxfp4
    from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4

    w = Mxfp4Weight(*random_mxfp4((2, 96, 64), torch.Generator().manual_seed(62), 0.05))
    with pytest.raises(ValueError, match="does not tile"):
        tile_mxfp4(w, 64, 32)
    big = Mxfp4Weight(w.packed, w.scale.clone().index_fill_(-1, torch.tensor([1]), 129))
    with pytest.raises(ValueError, match="scale above"):
        tile_mxfp4(big, 32, 32)


@device_test
def test_stock_dequantizes_the_touched_experts_exactly():
    """The stock CUDA path's Triton dequantizer: each touched expert bit-equal to the reference; untouched
    experts' rows are not written."""
    use_triton()
    from dep_compile.stock.mxfp4_cuda import dequantize_touched, touched_experts

    x, w13, w2, w, ids = _mx_case(3, **SMALL_MX, seed=34)
    touched = touched_experts(ids, 0, SMALL_MX["E"])
    assert int(touched.sum()) == len(set(ids.flatten().tolist()))
    for wt in (w13, w2):
        got, ref = dequantize_touched(wt, touched), wt.dequantize()
        for e in range(SMALL_MX["E"]):
            if touched[e]:
                assert torch.equal(got[e].view(torch.int16), ref[e].view(torch.int16)), e


@pytest.mark.cuda
@pytest.mark.parametrize("ptx", [False, True], ids=["triton_dequant", "ptx_dequant"])
@pytest.mark.parametrize("E", [56, 64])
@pytest.mark.parametrize("T", [1, 4, 16, 64])
def test_mxfp4_full_size(E, T, ptx):
    """K3 widths, MXFP4: one EP16 rank's 56 experts (ids of all 896) or the slice's 64; both dequantizers
    (the default MXFP4 tactic's 256-input steps)."""

    et = _et()
    start, total = (3 * 56, 896) if E == 56 else (0, 64)
    tokens = T if E == 64 else 16 * T
    tactic = dataclasses.replace(et.DEFAULT_MXFP4_TACTIC, ptx_dequant=ptx, tiles=False)  # the checkpoint's layout
    _check_mx(et, _mx_case(tokens, **FULL, E=E, E_total=total, seed=T + E + 40), start, tactic)


@pytest.mark.cuda
def test_mxfp4_stock_op_on_cuda_matches_its_reference():
    """kimi_k3::routed_experts_mxfp4 on CUDA (touched experts dequantized, grouped GEMMs) against the CPU
    reference on the same weights, within the grouped GEMMs' bound (one more BF16 rounding per expert)."""
    x, w13, w2, w, ids = _mx_case(16, **FULL, E=64, seed=50)
    got = torch.ops.kimi_k3.routed_experts_mxfp4(x, *w13, *w2, w, ids, 0, 1, BETA, BETA_LIN).float().cpu()
    ref = torch.ops.kimi_k3.routed_experts_mxfp4(x.cpu(), *(t.cpu() for t in (*w13, *w2)), w.cpu(), ids.cpu(), 0, 1,
                                                 BETA, BETA_LIN).float()
    assert float((got - ref).norm() / ref.norm()) <= 2e-2
