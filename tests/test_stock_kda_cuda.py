"""Tests of the stock KDA core on CUDA (``dep_compile.stock.kda_cuda``) against ``kda_core_ref``.

Every case is one step on random data (never zeros): q, k, v, g_out, g_raw and beta as column
slices of one packed BF16 tensor (rows strided, as a packed projection gives them), both states
as strided views into pools with a spare layer interleaved in every slot, B in {1, 4} with a
padding request (state index -1) in the middle when B > 1, q_len 1, 2 or 4 with
``accepted < q_len`` for some requests. The reference runs on CPU copies of the same inputs.
Device tests run both recurrences: fla-core's kernel (skipped where fla does not import) and the
torch fallback (fla switched off). Sizes: full Kimi K3 (96 heads x 128) and small (3 x 32).

Tolerances (the CUDA path differs from the reference only in the FP32 summation order, in
exp / sigmoid / rsqrt implementations, and in the BF16 roundings those can flip by one ulp:
the conv outputs and the output):

* output: every element finite, padding rows exactly 0,
  ``||out - ref||_F / ||ref||_F <= 1e-2`` and ``max |out - ref| <= 0.05`` (outputs are O(1);
  one BF16 ulp at 4 is 0.03);
* recurrent state (FP32): ``||S - S_ref||_F / ||S_ref||_F <= 1e-3`` per live slot (measured:
  ~1e-7); every slot not addressed by a live request and the spare layer bit-identical;
* conv state (BF16): bit-identical everywhere (the committed taps are copies of BF16 inputs);
* conv outputs (:func:`conv_step` alone): within one BF16 rounding step of the reference
  (``|d| <= 2^-7 |ref|``) and at least 99 % bit-identical; the layouts it writes (g_raw and
  beta copies, packed rows, ``cu_seqlens``, slot table) exact.

CUDA tests are marked ``cuda`` (skipped without a GPU). ``TRITON_TEST_DEVICE=cpu
TRITON_INTERPRET=1`` runs the device tests at the small size in Triton's CPU interpreter (fla's
kernel too, where fla imports). The torch recurrence is also checked on CPU on every run.
"""

from __future__ import annotations


import pytest
import torch

from dep_compile.stock.reference.common import l2_normalize
from dep_compile.stock.reference.kda import causal_conv_step, decay_gate, delta_rule, kda_core_ref

from kda_parity import assert_kda_step as check
from triton_device import TRITON_DEV as _DEV, device_test, use_triton

LOWER_BOUND, NORM_EPS, W = -5.0, 1e-5, 4
SIZES = {"full": (96, 128), "small": (3, 32)}  # small: H and H*D not powers of two
BF16 = torch.bfloat16


def _kc():
    """The module under test; in interpreter mode, with BF16 rounding to nearest even as on the GPU."""
    use_triton()
    from dep_compile.stock import kda_cuda  # noqa: PLC0415 - imports Triton

    return kda_cuda


@pytest.fixture(params=["fla", "torch"])
def recurrence(request, monkeypatch):
    """Run kda_core_cuda with fla's recurrence (skipped where fla does not import) or the torch one."""
    kc = _kc()
    if request.param == "fla" and kc._fla_fwd() is None:
        pytest.skip(f"fla-core not importable: {kc.recurrence_backend()}")
    if request.param == "torch":
        monkeypatch.setattr(kc, "_FLA", False)
    return request.param


def make_case(H, D, B, q_len, seed, device, spare_slots=3):
    """Random inputs of one step; the states are views into pools with a spare layer per slot."""
    g = torch.Generator().manual_seed(seed)
    HD, T, S = H * D, B * q_len, B + spare_slots
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    packed = rn(T, 5 * HD + H)
    packed[:, 4 * HD:5 * HD] *= 2.0  # g_raw = f_b(f_a): spread over the gate's sigmoid
    c = dict(
        packed=packed.to(BF16),
        conv_w=(rn(3 * HD, W) * 0.5).to(BF16),
        A_log=torch.log(torch.rand(H, generator=g) * 15 + 1),
        dt_bias=rn(HD),
        o_norm_w=(1 + 0.2 * rn(D)).to(BF16),
        conv_pool=rn(S, 2, W - 1, 3 * HD).to(BF16),
        rec_pool=rn(S, 2, H, D, D) * 0.3,
        state_indices=torch.randperm(S, generator=g)[:B].to(torch.int32),
        accepted=torch.randint(1, q_len + 1, (B,), generator=g, dtype=torch.int32),
    )
    if B > 1:
        c["state_indices"][B // 2] = -1
    if q_len > 1:
        c["accepted"][0], c["accepted"][-1] = 1, q_len
    return views({n: x.to(device) for n, x in c.items()}, H)


def views(c, H):
    """Add the column slices of ``packed`` and the layer-1 state views to a case."""
    HD = c["dt_bias"].shape[0]
    q, k, v, g_out, g_raw, beta = c["packed"].split([HD] * 5 + [H], -1)
    return {**c, "q": q, "k": k, "v": v, "g_out": g_out, "g_raw": g_raw, "beta": beta,
            "conv_state": c["conv_pool"][:, 1], "rec_state": c["rec_pool"][:, 1]}


def core_args(c, q_len):
    """The arguments of kda_core_ref / kda_core_cuda, in order."""
    return (c["q"], c["k"], c["v"], c["g_raw"], c["beta"], c["g_out"], c["conv_w"], c["A_log"], c["dt_bias"],
            c["o_norm_w"], c["conv_state"], c["rec_state"], c["state_indices"], c["accepted"], q_len,
            LOWER_BOUND, NORM_EPS)


def reference(c, q_len):
    """kda_core_ref on CPU copies; returns (out, conv_pool, rec_pool)."""
    H = c["beta"].shape[1]
    cp = views({n: c[n].detach().cpu().clone() for n in ("packed", "conv_w", "A_log", "dt_bias", "o_norm_w",
                                                          "conv_pool", "rec_pool", "state_indices", "accepted")}, H)
    return kda_core_ref(*core_args(cp, q_len)), cp["conv_pool"], cp["rec_pool"]


CASES = [(size, B, q) for size in ("full", "small") for B in (1, 4) for q in (1, 2, 4)]
if _DEV == "cpu":
    CASES = [case for case in CASES if case[0] == "small"]


@device_test
@pytest.mark.parametrize("size,B,q_len", CASES, ids=str)
def test_kda_core_cuda_matches_reference(size, B, q_len, recurrence):
    """One step (decode or verify, with padding) against the reference: outputs and every state."""
    kc = _kc()
    H, D = SIZES[size]
    c = make_case(H, D, B, q_len, seed=100 * B + q_len + (0 if size == "full" else 7), device=_DEV)
    ref = reference(c, q_len)
    out = kc.kda_core_cuda(*core_args(c, q_len))
    print(size, B, q_len, recurrence, check(c, q_len, out, ref))


@device_test
@pytest.mark.parametrize("q_len", [1, 3])
def test_kda_core_cuda_several_steps(q_len, recurrence):
    """Three steps on the same states: conv taps and recurrent states carried between steps."""
    kc = _kc()
    H, D = SIZES["small"]
    c = make_case(H, D, 5, q_len, seed=31 + q_len, device=_DEV)
    for step in range(3):
        ref = reference(c, q_len)
        check(c, q_len, kc.kda_core_cuda(*core_args(c, q_len)), ref)
        c["packed"].copy_(torch.randn(c["packed"].shape, generator=torch.Generator().manual_seed(step)).to(BF16))


@device_test
@pytest.mark.parametrize("size,B,q_len", [("small", 4, 1), ("small", 5, 3), ("full", 4, 2)], ids=str)
def test_conv_step_matches_reference(size, B, q_len):
    """The conv kernel alone: outputs, committed taps and the plain / packed layouts."""
    kc = _kc()
    H, D = SIZES[size]
    if _DEV == "cpu" and size == "full":
        pytest.skip("full size on CUDA only")
    HD, T = H * D, B * q_len
    c = make_case(H, D, B, q_len, seed=7 * B + q_len, device=_DEV)
    cp = {n: x.detach().cpu().clone() for n, x in c.items()}
    co = kc.conv_step(c["q"], c["k"], c["v"], c["g_raw"], c["beta"], c["conv_w"], c["conv_state"],
                      c["state_indices"], c["accepted"], q_len, plain=True, packed=True)
    slots, acc = cp["state_indices"].tolist(), cp["accepted"].tolist()
    ref_pool = cp["conv_pool"].clone()
    ref_qkv = torch.zeros(T, 3 * HD, dtype=BF16)
    keep = []
    for b, (s, a) in enumerate(zip(slots, acc)):
        rows = slice(b * q_len, (b + 1) * q_len)
        if s < 0:
            continue
        x = torch.cat([cp["q"][rows], cp["k"][rows], cp["v"][rows]], -1)
        ref_qkv[rows], ref_pool[s, 1] = causal_conv_step(x, cp["conv_pool"][s, 1], cp["conv_w"], a)
        keep += list(range(b * q_len, b * q_len + a))
    assert torch.equal(c["conv_pool"].cpu(), ref_pool), "conv state differs from the reference"
    plain = co.plain.cpu()
    got = torch.cat([plain[0], plain[1], plain[2]], -1).float()
    d = (got - ref_qkv.float()).abs()
    assert (d <= ref_qkv.float().abs() * 2 ** -7).all(), f"conv output off by more than one ulp: {float(d.max()):.3g}"
    assert float((d == 0).float().mean()) >= 0.99, "conv outputs differ in more than 1 % of the elements"
    live = torch.tensor([s >= 0 for s in slots]).repeat_interleave(q_len)
    assert torch.equal(plain[3], torch.where(live[:, None], cp["g_raw"], 0)), "plain g_raw copy"
    assert torch.equal(co.plain_beta.cpu(), torch.where(live[:, None], cp["beta"], 0)), "plain beta copy"
    n = len(keep)
    assert torch.equal(co.packed.cpu()[:, :n], plain[:, keep]), "packed rows are not the accepted live rows"
    assert torch.equal(co.packed_beta.cpu()[:n], co.plain_beta.cpu()[keep])
    lens = torch.tensor([a if s >= 0 else 0 for s, a in zip(slots, acc)])
    assert co.cu.cpu().tolist() == [0] + torch.cumsum(lens, 0).tolist()
    assert co.slots.cpu().tolist() == [[max(s, 0)] * q_len for s in slots]


def test_recurrence_torch_matches_delta_rule():
    """The batched torch delta rule (the fallback without fla) against the reference, per request (CPU)."""
    pytest.importorskip("triton")
    from dep_compile.stock.kda_cuda import recurrence_torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    B, L, H, D = 3, 3, 4, 16
    q, k, v, g_raw = (torch.randn(B, L, H, D, generator=g).to(BF16) for _ in range(4))
    beta = torch.randn(B, L, H, generator=g).to(BF16)
    A_log, dt_bias = torch.log(torch.rand(H, generator=g) * 15 + 1), torch.randn(H * D, generator=g)
    state = torch.randn(B, H, D, D, generator=g) * 0.3
    state0 = state.clone()
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    o, committed = recurrence_torch(q, k, v, g_raw, beta, A_log, dt_bias, state, accepted, LOWER_BOUND)
    assert torch.equal(state, state0), "the gathered states must not be mutated"
    for b in range(B):
        gate = decay_gate(g_raw[b], A_log, dt_bias, LOWER_BOUND)
        ro, rs = delta_rule(l2_normalize(q[b]) * D ** -0.5, l2_normalize(k[b]), v[b], gate,
                            torch.sigmoid(beta[b].float()), state[b], int(accepted[b]))
        torch.testing.assert_close(o[b], ro, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(committed[b], rs, rtol=1e-5, atol=1e-6)


@device_test
def test_scatter_states_skips_padding():
    """The torch path's write-back: live slots replaced, padding (-1) and every other slot untouched."""
    kc = _kc()
    pool = torch.randn(6, 2, 3, 4, 4).to(_DEV)
    states = torch.randn(3, 3, 4, 4).to(_DEV)
    idx = torch.tensor([4, -1, 1], dtype=torch.int32, device=_DEV)
    ref = pool.clone()
    ref[4, 1], ref[1, 1] = states[0], states[2]
    kc.scatter_states(pool[:, 1], states, idx, block=16)
    assert torch.equal(pool, ref)


@pytest.mark.cuda
@pytest.mark.skipif(_DEV == "cpu", reason="CUDA graphs")
@pytest.mark.parametrize("q_len", [1, 2])
def test_kda_core_cuda_graph_capture(q_len, recurrence):
    """Captured once, replayed on new inputs, slots and accepted counts: the reference's results each time."""
    kc = _kc()
    H, D = SIZES["full"]
    B = 4
    c = make_case(H, D, B, q_len, seed=11 + q_len, device="cuda")
    kc.kda_core_cuda(*core_args(c, q_len))  # warm-up: compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kc.kda_core_cuda(*core_args(c, q_len))
    for seed in (1, 2):
        new = make_case(H, D, B, q_len, seed=200 + seed, device="cpu")
        for name in ("packed", "conv_pool", "rec_pool", "state_indices", "accepted"):
            c[name].copy_(new[name])
        ref = reference(c, q_len)
        graph.replay()
        torch.cuda.synchronize()
        print(q_len, recurrence, seed, check(c, q_len, out, ref))


@pytest.mark.cuda
@pytest.mark.skipif(_DEV == "cpu", reason="routing of CUDA tensors")
def test_stock_op_runs_kda_core_cuda_on_cuda(monkeypatch):
    """``kimi_k3::kda_core`` on CUDA tensors runs kda_core_cuda (called, and the result matches the reference)."""
    import dep_compile.stock.ops  # noqa: F401, PLC0415 - registers kimi_k3::*

    kc = _kc()
    calls = []
    real = kc.kda_core_cuda
    monkeypatch.setattr(kc, "kda_core_cuda", lambda *a: calls.append(1) or real(*a))
    H, D = SIZES["small"]
    c = make_case(H, D, 4, 2, seed=3, device="cuda")
    ref = reference(c, 2)
    check(c, 2, torch.ops.kimi_k3.kda_core(*core_args(c, 2)), ref)
    assert calls, "kimi_k3::kda_core did not route CUDA tensors to kda_core_cuda"
