"""GPU tests of the Triton KDA decode core (``dep_compile.ops.kda_triton``).

Every case runs ``kda_decode_core`` into a NaN-poisoned output, on fresh random inputs (never
zeros), with q/k/v/g/f_a/beta as column slices of one packed in_proj output (row stride
4HD + F + H, as the rewritten layer passes them) and both states as strided views into a
pooled tensor (a spare layer interleaved in every slot), and compares with the readable
reference ``kda_core_ref`` run in FP32 on the CPU on copies of the same inputs.

Sizes: full Kimi K3 (H=96, D=128, F=128) and a small one (H=4, D=32, F=32); B in {1, 4, 16};
q_len in {1, 2, 4} with ``accepted < q_len`` for some requests; one padding request
(state index -1) when B > 1.

Tolerances (the kernel differs from the reference only in FP32 summation order, fast
exp/rsqrt, and the BF16 roundings this can flip by one ulp: g_raw, the conv outputs, the
output):

* output: every element finite (written), padding rows exactly 0,
  ``||out - ref||_F / ||ref||_F <= 1e-2`` and ``max |out - ref| <= 0.05`` (outputs are O(1);
  one BF16 ulp at 4 is 0.03);
* recurrent state (FP32): ``||S - S_ref||_F / ||S_ref||_F <= 1e-3`` per committed slot; every
  slot not addressed by a live request (padding, unused slots, the interleaved spare layer)
  bit-identical;
* conv state (BF16): bit-identical everywhere (the committed taps are copies of BF16 inputs).

Skipped cleanly without CUDA (CI). ``TRITON_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1``
runs the same checks in Triton's CPU interpreter (small size).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dep_compile.stock.reference.kda import kda_core_ref

from helpers import fallback_log
from kda_parity import assert_kda_step as check
from triton_device import DEVICE_MARKS, TRITON_DEV as _DEV, use_triton

pytestmark = DEVICE_MARKS

LOWER_BOUND, NORM_EPS, W = -5.0, 1e-5, 4
SIZES = {"full": (96, 128, 128), "small": (4, 32, 32), "small_f128": (4, 32, 128)}


def _kt():
    use_triton()
    from dep_compile.ops import kda_triton  # noqa: PLC0415 - CUDA-only module

    return kda_triton


def make_case(H, D, Fr, B, q_len, seed, device, padding=True, spare_slots=3, W=W):
    """Random inputs of one step (conv width ``W``); states are views into pools with a spare layer per slot."""
    g = torch.Generator().manual_seed(seed)
    HD, T = H * D, B * q_len
    S = B + spare_slots
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    packed = rn(T, 4 * HD + Fr + H).to(torch.bfloat16)
    packed[:, 4 * HD:4 * HD + Fr] *= 2.0  # f_a
    q, k, v, g_out, f_a, beta = packed.split([HD, HD, HD, HD, Fr, H], -1)
    f_b_w = (rn(HD, Fr) * Fr ** -0.5).to(torch.bfloat16)
    conv_w = (rn(3 * HD, W) * 0.5).to(torch.bfloat16)
    A_log = torch.log(torch.rand(H, generator=g) * 15 + 1)
    dt_bias = rn(HD)
    o_norm_w = (1 + 0.2 * rn(D)).to(torch.bfloat16)
    conv_pool = rn(S, 2, W - 1, 3 * HD).to(torch.bfloat16)
    rec_pool = rn(S, 2, H, D, D) * 0.3
    slots = torch.randperm(S, generator=g)[:B].to(torch.int32)
    if padding and B > 1:
        slots[B // 2] = -1
    acc = torch.randint(1, q_len + 1, (B,), generator=g, dtype=torch.int32)
    if q_len > 1:
        acc[0] = 1
        acc[-1] = q_len
    t = dict(packed=packed, q=q, k=k, v=v, g_out=g_out, f_a=f_a, beta=beta, f_b_w=f_b_w, conv_w=conv_w,
             A_log=A_log, dt_bias=dt_bias, o_norm_w=o_norm_w, conv_pool=conv_pool, rec_pool=rec_pool,
             state_indices=slots, accepted=acc)
    if device != "cpu":
        moved = {n: x.to(device) for n, x in t.items() if n in ("packed", "conv_pool", "rec_pool")}
        HDs = [HD, HD, HD, HD, Fr, H]
        qq, kk, vv, gg, ff, bb = moved["packed"].split(HDs, -1)
        t2 = {n: x.to(device) for n, x in t.items()}
        t2.update(moved, q=qq, k=kk, v=vv, g_out=gg, f_a=ff, beta=bb)
        t = t2
    t["conv_state"] = t["conv_pool"][:, 1]
    t["rec_state"] = t["rec_pool"][:, 1]
    return t


def reference(c, q_len):
    """kda_core_ref in FP32 on the CPU on copies; returns (out, conv_pool, rec_pool)."""
    cp = {n: x.detach().cpu().clone() for n, x in c.items()}
    conv_pool, rec_pool = cp["conv_pool"], cp["rec_pool"]
    HD = cp["q"].shape[1]
    Fr = cp["f_a"].shape[1]
    H = cp["beta"].shape[1]
    q, k, v, g_out, f_a, beta = cp["packed"].split([HD, HD, HD, HD, Fr, H], -1)
    g_raw = F.linear(f_a, cp["f_b_w"])
    out = kda_core_ref(q, k, v, g_raw, beta, g_out, cp["conv_w"], cp["A_log"], cp["dt_bias"], cp["o_norm_w"],
                       conv_pool[:, 1], rec_pool[:, 1], cp["state_indices"], cp["accepted"], q_len,
                       LOWER_BOUND, NORM_EPS)
    return out, conv_pool, rec_pool


def run_kernel(kt, c, q_len, **kw):
    T, HD = c["q"].shape
    out = torch.full((T, HD), float("nan"), dtype=torch.bfloat16, device=c["q"].device)
    why = kt.kda_decode_unsupported(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"],
                                    c["conv_w"], c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"],
                                    c["rec_state"], c["state_indices"], c["accepted"], q_len)
    assert why is None, why
    ret = kt.kda_decode_core(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"], c["conv_w"],
                             c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                             c["state_indices"], c["accepted"], q_len, LOWER_BOUND, NORM_EPS, out=out, **kw)
    assert ret is out
    return out


CASES = [(size, B, q) for size in ("full", "small") for B in (1, 4, 16) for q in (1, 2, 4)]
if _DEV == "cpu":
    CASES = [(size, B, q) for (size, B, q) in CASES if size == "small"]


# The two forms of the core: one fused launch (the default), or the prep, state and norm launches (``split``).
FORMS = pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])


@FORMS
@pytest.mark.parametrize("size,B,q_len", CASES, ids=lambda x: str(x))
def test_kda_decode_core_matches_reference(size, B, q_len, split):
    kt = _kt()
    H, D, Fr = SIZES[size]
    for seed in (0, 1):
        c = make_case(H, D, Fr, B, q_len, seed=1000 * B + 10 * q_len + seed + (0 if size == "full" else 7),
                      device=_DEV)
        ref = reference(c, q_len)
        out = run_kernel(kt, c, q_len, split=split)
        errs = check(c, q_len, out, ref)
        print(size, B, q_len, seed, errs)


@FORMS
@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_kda_decode_core_several_steps(q_len, split):
    """Three consecutive steps on the same states (state and conv taps carried between steps)."""
    kt = _kt()
    H, D, Fr = SIZES["small"]
    c = make_case(H, D, Fr, 5, q_len, seed=77 + q_len, device=_DEV)
    ref_state = {n: x.detach().cpu().clone() for n, x in c.items()}
    for step in range(3):
        ref = reference({**ref_state, "packed": c["packed"].cpu()}, q_len)
        out = run_kernel(kt, c, q_len, split=split)
        check(c, q_len, out, ref)
        ref_state["conv_pool"], ref_state["rec_pool"] = ref[1], ref[2]
        c["packed"].copy_(torch.randn(c["packed"].shape).to(torch.bfloat16).to(c["packed"].device))


@FORMS
@pytest.mark.parametrize("q_len", [1, 2])
def test_kda_decode_core_zero_accepted_keeps_states(q_len, split):
    """A request with accepted = 0 commits no token: its conv taps and recurrent state stay as they
    were (as the reference), while the other requests commit as usual."""
    kt = _kt()
    H, D, Fr = SIZES["small"]
    c = make_case(H, D, Fr, 3, q_len, seed=41 + q_len, device=_DEV, padding=False)
    c["accepted"].copy_(torch.tensor([0, 1, q_len], dtype=torch.int32))
    slot = int(c["state_indices"][0])
    conv0, rec0 = c["conv_state"][slot].clone(), c["rec_state"][slot].clone()
    ref = reference(c, q_len)
    check(c, q_len, run_kernel(kt, c, q_len, split=split), ref)
    assert torch.equal(c["conv_state"][slot], conv0) and torch.equal(c["rec_state"][slot], rec0)


@pytest.mark.parametrize("w,q_len,split", [(2, 1, False), (3, 1, False), (8, 1, False), (2, 3, False),
                                           (3, 3, False), (8, 3, False), (2, 3, True), (8, 1, True)], ids=str)
def test_kda_decode_core_conv_widths(w, q_len, split):
    """Conv widths other than K3's 4 (the tap tile is padded to a power of two): as the reference."""
    kt = _kt()
    H, D, Fr = SIZES["small"]
    c = make_case(H, D, Fr, 5, q_len, seed=60 + w + q_len, device=_DEV, W=w)
    ref = reference(c, q_len)
    check(c, q_len, run_kernel(kt, c, q_len, split=split), ref)


@pytest.mark.skipif(_DEV == "cpu", reason="routing needs CUDA tensors")
def test_prepared_kda_core_routes_to_kernel_and_falls_back(caplog):
    """PreparedKda.core on CUDA: the Triton kernel for q_len <= 8; beyond, the stock KDA core op
    (its CUDA kernels), with the reason logged once."""
    kt = _kt()
    from dep_compile.ops.kda import PreparedKda  # noqa: PLC0415

    H, D, Fr = SIZES["small"]
    prep = PreparedKda(heads=H, head_dim=D, f_rank=Fr, lower_bound=LOWER_BOUND, norm_eps=NORM_EPS,
                       in_proj=None, o_proj=None)
    with fallback_log():  # this test's reason must be logged here, once
        for q_len in (2, 9, 9):
            c = make_case(H, D, Fr, 4, q_len, seed=5 + q_len, device=_DEV)
            ref = reference(c, q_len)
            with caplog.at_level("WARNING", logger="dep_compile.ops.fallbacks"):
                out = prep.core(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"], c["conv_w"],
                                c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                                c["state_indices"], c["accepted"], q_len)
            check(c, q_len, out, ref)
    why = kt.kda_decode_unsupported(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"],
                                    c["conv_w"], c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"],
                                    c["rec_state"], c["state_indices"], c["accepted"], 9)
    assert why is not None
    warnings = [r.getMessage() for r in caplog.records if "KDA layer" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0], warnings  # q_len 2: none; q_len 9 twice: logged once


def test_kda_split_form_runs_its_own_launches(monkeypatch):
    """The split form runs the prep and state kernels, not the fused one (a split silently dropped would pass every
    other split case), and names the heads its state launch cannot hold."""
    kt = _kt()
    H, D, Fr = SIZES["small"]
    c = make_case(H, D, Fr, 4, 2, seed=91, device=_DEV)
    ref = reference(c, 2)
    monkeypatch.setattr(kt, "_kda_decode_kernel", None)
    check(c, 2, run_kernel(kt, c, 2, split=True), ref)
    assert kt.split_unsupported(D, Fr) is None and kt.split_unsupported(128, None) is None
    assert "head dim 256 " in kt.split_unsupported(256, 128) and "head dim 8 " in kt.split_unsupported(8, 128)
    assert "rank 8 " in kt.split_unsupported(128, 8) and "rank 1024 " in kt.split_unsupported(128, 1024)
    assert kt.split_unsupported(128, kt.SPLIT_MAX_F_RANK) is None
    with pytest.raises(ValueError, match="rank 8 "):
        kt.kda_decode_core(c["q"], c["k"], c["v"], c["f_a"][:, :8], c["f_b_w"][:, :8], c["beta"], c["g_out"],
                           c["conv_w"], c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                           c["state_indices"], c["accepted"], 2, LOWER_BOUND, NORM_EPS, split=True)


def _split_from_q2(monkeypatch, kt, H, D, Fr):
    """(a PreparedKda of these sizes whose tactic gives the split form from q = 2, the ``split`` of each core launch
    it makes)."""
    from dep_compile import tactics  # noqa: PLC0415
    from dep_compile.ops.kda import PreparedKda  # noqa: PLC0415

    forms, launch = [], kt.kda_decode_core

    def spy(*args, split=False, **kw):
        forms.append(split)
        return launch(*args, split=split, **kw)

    monkeypatch.setattr(kt, "kda_decode_core", spy)
    monkeypatch.setattr(tactics, "KDA_SPLIT_FROM_Q", 2)
    prep = PreparedKda(heads=H, head_dim=D, f_rank=Fr, lower_bound=LOWER_BOUND, norm_eps=NORM_EPS,
                       in_proj=None, o_proj=None)
    return prep, forms


@pytest.mark.skipif(_DEV == "cpu", reason="routing needs CUDA tensors")
def test_prepared_kda_core_takes_the_split_form_from_its_tactic(monkeypatch):
    """PreparedKda.core runs the split form at steps of ``tactics.KDA_SPLIT_FROM_Q`` or more tokens a request and
    the fused kernel below, each matching the reference."""
    H, D, Fr = SIZES["small"]
    prep, forms = _split_from_q2(monkeypatch, _kt(), H, D, Fr)
    for q_len in (1, 2, 4):
        c = make_case(H, D, Fr, 4, q_len, seed=15 + q_len, device=_DEV)
        ref = reference(c, q_len)
        out = prep.core(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"], c["conv_w"], c["A_log"],
                        c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"], c["state_indices"],
                        c["accepted"], q_len)
        check(c, q_len, out, ref)
    assert forms == [False, True, True]


@pytest.mark.skipif(_DEV == "cpu", reason="routing needs CUDA tensors")
def test_prepared_kda_core_keeps_one_launch_for_an_f_rank_past_the_split_form(monkeypatch, caplog):
    """An F_B rank past ``SPLIT_MAX_F_RANK`` at a step the tactic gives the split form: the fused kernel runs (the
    reference's result), and the reason is logged once."""
    kt = _kt()
    H, D, Fr = 2, 16, 2 * kt.SPLIT_MAX_F_RANK
    prep, forms = _split_from_q2(monkeypatch, kt, H, D, Fr)
    with fallback_log():
        for seed in (31, 32):
            c = make_case(H, D, Fr, 4, 2, seed=seed, device=_DEV)
            ref = reference(c, 2)
            with caplog.at_level("WARNING", logger="dep_compile.ops.fallbacks"):
                out = prep.core(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"], c["conv_w"],
                                c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                                c["state_indices"], c["accepted"], 2)
            check(c, 2, out, ref)
    assert forms == [False, False]
    warnings = [r.getMessage() for r in caplog.records if "KDA layer" in r.getMessage()]
    assert len(warnings) == 1 and f"f rank {Fr} over" in warnings[0], warnings


@FORMS
@pytest.mark.skipif(_DEV == "cpu", reason="CUDA graphs")
def test_kda_decode_core_graph_capture(split):
    """Captured in a CUDA graph and replayed: same result as an eager launch on the same inputs (the split
    form's workspace allocated inside the capture)."""
    kt = _kt()
    H, D, Fr = SIZES["full"]
    c = make_case(H, D, Fr, 4, 2, seed=11, device=_DEV)
    conv0, rec0 = c["conv_pool"].clone(), c["rec_pool"].clone()
    eager = run_kernel(kt, c, 2, split=split)
    conv1, rec1 = c["conv_pool"].clone(), c["rec_pool"].clone()
    c["conv_pool"].copy_(conv0)
    c["rec_pool"].copy_(rec0)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            kt.kda_decode_core(c["q"], c["k"], c["v"], c["f_a"], c["f_b_w"], c["beta"], c["g_out"], c["conv_w"],
                               c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                               c["state_indices"], c["accepted"], 2, LOWER_BOUND, NORM_EPS, out=out, split=split)
    torch.cuda.current_stream().wait_stream(s)
    c["conv_pool"].copy_(conv0)
    c["rec_pool"].copy_(rec0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(c["conv_pool"], conv1) and torch.equal(c["rec_pool"], rec1)


@pytest.mark.parametrize("kw", [dict(num_warps=16), dict(fb=64), dict(fb=16)], ids=str)
@pytest.mark.parametrize("size,B,q_len", [("full", 4, 1), ("full", 16, 2), ("small", 16, 4), ("small_f128", 5, 1)],
                         ids=str)
def test_kda_decode_core_tuning_knobs(size, B, q_len, kw):
    """Every tuning knob matches the reference within the tolerances: 16 warps (4 is the default),
    F_B chunks of 64 and 16 columns (default 32; ``small_f128`` runs F_B in several chunks in
    the interpreter too)."""
    if _DEV == "cpu" and size == "full":
        pytest.skip("full size is slow in the interpreter (the GPU run covers it)")
    kt = _kt()
    H, D, Fr = SIZES[size]
    c = make_case(H, D, Fr, B, q_len, seed=3 + B + q_len + sum(kw.values()), device=_DEV)
    ref = reference(c, q_len)
    check(c, q_len, run_kernel(kt, c, q_len), ref)  # the defaults, then the knob on the states they left
    ref = reference(c, q_len)
    check(c, q_len, run_kernel(kt, c, q_len, **kw), ref)


@FORMS
@pytest.mark.parametrize("q_len", [1, 3])
def test_kda_decode_core_reads_a_precomputed_raw_gate(q_len, split):
    """``f_b_w`` None (an FP8 f_b_proj applied outside): the kernel reads f_a as the raw gate [T, H*D] and computes
    what it computes from the BF16 F_B, to the bit (the gate is the same BF16 tensor either way)."""
    kt = _kt()
    H, D, Fr = SIZES["small"]
    c = make_case(H, D, Fr, 4, q_len, seed=77 + q_len, device=_DEV)
    d = {n: x.clone() for n, x in c.items()}
    out = run_kernel(kt, c, q_len, split=split)
    g_raw = F.linear(d["f_a"].cpu(), d["f_b_w"].cpu()).to(_DEV)
    why = kt.kda_decode_unsupported(d["q"], d["k"], d["v"], g_raw, None, d["beta"], d["g_out"], d["conv_w"],
                                    d["A_log"], d["dt_bias"], d["o_norm_w"], d["conv_state"], d["rec_state"],
                                    d["state_indices"], d["accepted"], q_len)
    assert why is None, why
    got = kt.kda_decode_core(d["q"], d["k"], d["v"], g_raw, None, d["beta"], d["g_out"], d["conv_w"], d["A_log"],
                             d["dt_bias"], d["o_norm_w"], d["conv_state"], d["rec_state"], d["state_indices"],
                             d["accepted"], q_len, LOWER_BOUND, NORM_EPS, split=split)
    assert torch.equal(got, out)
    assert torch.equal(d["rec_state"], c["rec_state"]) and torch.equal(d["conv_state"], c["conv_state"])
