"""AttnRes: the stock op's Triton kernel, the fused ``kimi_dep::attn_res_norm`` op and the pass that makes it.

* CPU: the fused op is the stock composition (``kimi_k3::attn_res`` then stock's RMSNorm) bit for
  bit, prefix and bank included, over several chained steps; the pass fuses every AttnRes -> RMSNorm
  pair of the small decoders (Dynamo and post-grad graphs) and the decoder stays bit-exact against
  stock eager on logits and every cache; near misses stay stock with their reason. With option
  ``attn_res_ahead`` the pass links consecutive points (each computing the next one's bank part), refuses
  the pairs it must with their reason, every part given is taken, and the decoder agrees with stock.
* Kernels (marked ``cuda``; ``TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs them at small sizes in
  Triton's interpreter) against the reference run on CPU copies of the same inputs: small (D = 200,
  T = 1 / 3, num_blocks 0-4, write_slot -1, inside and past the sources) and, CUDA only, full size
  (D = 7168, 16 bank slots, T = 1 / 64, num_blocks 0-8, write_slot -1, num_blocks - 1 and num_blocks),
  both at 2 and 4 bank rows per load, and both ops replayed in a CUDA graph. Bounds: prefix
  and bank bit-identical (one FP32 add rounded once, as the reference); the mix within one BF16
  rounding of the reference, ``|d| <= 2^-7 |ref| + 2^-16 max|ref|`` (the FP32 sums run in another
  order and can flip the final rounding by one ulp; the absolute term covers cancellation) and at
  least 95 % of elements bit-identical; the fused norm within two roundings (``2^-6 |ref|`` plus
  the same absolute term), since a one-ulp flip of the mix moves the normalized value too.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

import dep_compile.ops.attn_res  # noqa: F401  (registers kimi_dep::attn_res_norm)
from dep_compile.debug.parity import decisive_routing
from dep_compile.passes.manager import DepPostGradPass
from dep_compile.stock import build_model, preset
from dep_compile.stock import ops as stock_ops
from dep_compile.stock.layers import RMSNorm
from dep_compile.stock.model import KimiDecoderLayer, KimiK3Model
from dep_compile.stock.reference.attn_res import attn_res_ref, bank_part_ref, merge_part_ref

from helpers import CUBLAS_ONLY, assert_agrees, compare_steps, fallback_log, run_pair
from triton_device import ON_CPU, TRITON_DEV, device_test, ulps, use_triton

BF16 = torch.bfloat16
EPS, NORM_EPS = 1e-5, 0.05  # distinct, so a swapped eps shows (0.05 moves a norm of O(1) rows by ~2.5 %)


def _inputs(T, D, NB, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(BF16).to(device)  # noqa: E731
    return dict(prefix=r(T, D), bank=r(NB, T, D), query=r(D, scale=0.5), norm_w=(1 + r(D, scale=0.2).float()).to(BF16),
                deltas=[r(T, D) for _ in range(4)])


# ---- CPU: the op ------------------------------------------------------------------------------

SCHEDULE = [(1, 0), (1, -1), (2, 1), (2, -1)]  # (num_blocks, write_slot) of 4 chained points (block size 2)


def test_fused_op_is_the_stock_composition_bit_exact_over_steps():
    norm = RMSNorm(96, NORM_EPS)
    x = _inputs(3, 96, 3, seed=0)
    norm.weight.data = x["norm_w"]
    p1, b1 = x["prefix"].clone(), x["bank"].clone()
    p2, b2 = x["prefix"].clone(), x["bank"].clone()
    for (nb, ws), delta in zip(SCHEDULE, x["deltas"]):
        ref = norm(torch.ops.kimi_k3.attn_res(p1, b1, delta, x["query"], EPS, nb, ws))
        got = torch.ops.kimi_dep.attn_res_norm(p2, b2, delta, x["query"], x["norm_w"], EPS, nb, ws, NORM_EPS)
        assert torch.equal(got, ref) and torch.equal(p2, p1) and torch.equal(b2, b1)
    assert not torch.equal(p1, x["prefix"]) and not torch.equal(b1[1], x["bank"][1])  # the steps wrote state


def test_opcheck():
    x = _inputs(2, 64, 2, seed=1)
    torch.library.opcheck(torch.ops.kimi_dep.attn_res_norm.default,
                          (x["prefix"], x["bank"], x["deltas"][0], x["query"], x["norm_w"], EPS, 2, 1, NORM_EPS))


def test_opcheck_linked():
    x = _inputs(2, 64, 3, seed=1)
    torch.library.opcheck(torch.ops.kimi_dep.attn_res_norm.default,
                          (x["prefix"], x["bank"], x["deltas"][0], x["query"], x["norm_w"], EPS, 2, 1, NORM_EPS),
                          dict(next_query=x["norm_w"], next_num_blocks=2, next_write_slot=-1, part_in=0, part_out=1))


@pytest.mark.parametrize("num_blocks,write_slot", [(0, -1), (1, 0), (3, -1), (3, 2), (2, 3), (4, 0), (4, 1)])
def test_bank_part_then_merge_is_the_point_within_a_rounding(num_blocks, write_slot):
    """The split the CUDA op runs (the bank slots the point does not write summed first, then merged with its
    prefix) is the point's mix within one BF16 rounding; a part over the wrong slots is not."""
    x = _inputs(5, 96, 4, seed=num_blocks)
    p, b = x["prefix"].clone(), x["bank"].clone()
    part = bank_part_ref(b, x["query"], EPS, num_blocks, write_slot)  # before the point: its slots are final
    ref = attn_res_ref(p, b, x["deltas"][0], x["query"], EPS, num_blocks, write_slot)
    _check_mix(merge_part_ref(p, part, x["query"], EPS, num_blocks, write_slot), ref)
    if num_blocks >= 2 and write_slot != num_blocks - 1:
        wrong = bank_part_ref(b, x["query"], EPS, num_blocks - 1, write_slot)  # one slot short
        assert not torch.equal(merge_part_ref(p, wrong, x["query"], EPS, num_blocks, write_slot), ref)


def test_a_stale_bank_part_is_logged_on_the_cpu():
    """A point handed a bank part computed before the bank changed (a link the pass should have refused) logs it
    as stale and still computes the stock composition; a fresh part is taken silently."""
    from dep_compile.ops import attn_res as op_module  # noqa: PLC0415

    x = _inputs(3, 64, 3, seed=4)
    p, b = x["prefix"].clone(), x["bank"].clone()
    p_ref, b_ref = p.clone(), b.clone()
    op = torch.ops.kimi_dep.attn_res_norm
    for stale in (False, True):
        op(p, b, x["deltas"][0], x["query"], x["norm_w"], EPS, 2, 1, NORM_EPS, next_query=x["query"],
           next_num_blocks=3, next_write_slot=-1, part_out=7)  # the next point's part: slots 0, 1, 2
        ref = attn_res_ref(p_ref, b_ref, x["deltas"][0], x["query"], EPS, 2, 1)
        if stale:  # a write into slot 2 between the points, which the part read
            b[2].add_(1.0)
            b_ref[2].add_(1.0)
        with fallback_log() as logged:
            got = op(p, b, x["deltas"][1], x["query"], x["norm_w"], EPS, 3, -1, NORM_EPS, part_in=7)
        ref = attn_res_ref(p_ref, b_ref, x["deltas"][1], x["query"], EPS, 3, -1)
        want = F.rms_norm(ref.float(), (64,), x["norm_w"].float(), NORM_EPS).to(BF16)
        assert torch.equal(got, want) and torch.equal(p, p_ref) and torch.equal(b, b_ref)
        assert ([m for m in logged if "bank part 7 is stale" in m] == list(logged) and logged) if stale else not logged, \
            logged
        assert not op_module._PARTS


def test_a_point_left_no_part_logs_it():
    """A linked point whose giver left nothing under its link (a giver that never ran) says so and reads its bank."""
    x = _inputs(3, 64, 3, seed=5)
    p, b = x["prefix"].clone(), x["bank"].clone()
    with fallback_log() as logged:
        got = torch.ops.kimi_dep.attn_res_norm(p, b, x["deltas"][0], x["query"], x["norm_w"], EPS, 2, -1, NORM_EPS,
                                               part_in=3)
    ref = attn_res_ref(x["prefix"].clone(), x["bank"].clone(), x["deltas"][0], x["query"], EPS, 2, -1)
    assert torch.equal(got, F.rms_norm(ref.float(), (64,), x["norm_w"].float(), NORM_EPS).to(BF16))
    assert [m for m in logged if "no bank part was left under link 3" in m] == list(logged) and logged, logged


# ---- CPU: the pass on whole decoders ------------------------------------------------------------

AHEAD = {"attn_res_ahead": True}


def _assert_all_fused(report, cfg, ahead=False):
    assert len(report.points) == 2 * cfg.num_layers, report.table()
    assert all(m.rewritten and m.op == "kimi_dep.attn_res_norm" and m.validation.startswith("probe")
               for m in report.points), report.table()
    assert f"{2 * cfg.num_layers} of {2 * cfg.num_layers} points fused" in report.table()
    pairs = 2 * cfg.num_layers - 1 if ahead else 0  # each point but the first takes its bank part from the one before
    assert report.points_linked == pairs and not report.link_refusals, report.table()
    assert (f"on a side stream (CUDA): {pairs} of {pairs} consecutive pairs" in report.table()) == ahead


@pytest.mark.parametrize("name,q", [("k31-small", 1), ("mixed-small", 2)])
def test_pass_fuses_every_pair_and_stays_bit_exact(name, q):
    cfg = preset(name)
    accepted = None if q == 1 else (lambda i, b: [1 + (i + r) % q for r in range(b)])
    before = counters["kimi_dep"]["attn_res_rewritten"]
    r = run_pair(cfg, steps=4, batch=3, q=q, accepted=accepted)
    _assert_all_fused(r.report, cfg)
    assert counters["kimi_dep"]["attn_res_rewritten"] - before == 2 * cfg.num_layers
    assert r.logits_err == 0.0 and r.cache_err == 0.0, r.cache_errs


class RecordingPass(DepPostGradPass):
    """The post-grad pass, counting the kimi_k3 / kimi_dep ops left in the graph."""

    def __call__(self, graph):
        super().__call__(graph)
        af = torch.ops.higher_order.auto_functionalized_v2
        self.ops = collections.Counter(str(getattr(t, "overloadpacket", t)) for t in (
            n.args[0] if n.target is af else n.target for n in graph.nodes) if str(t).startswith("kimi_"))


def test_post_grad_fuses_every_pair():
    cfg = preset("k31-small", num_layers=4)
    model = decisive_routing(build_model(cfg, seed=1))
    pass_ = RecordingPass(CUBLAS_ONLY)
    with inductor_config.patch(post_grad_custom_post_pass=pass_, force_disable_caches=True):
        r = compare_steps(cfg, model, torch.compile(model, fullgraph=True, dynamic=False), steps=4, batch=2)
    _assert_all_fused(r.report, cfg)
    assert pass_.ops["kimi_dep.attn_res_norm"] == 8 and "kimi_k3.attn_res" not in pass_.ops, pass_.ops
    # Inductor fuses the glue around the ops (the final norm, residual adds): an ulp here and there,
    # which a near-tied router would amplify, hence decisive routing (tests/helpers.agreement_failures)
    assert_agrees(r, "post-grad AttnRes", inductor=True)


# ---- near misses: each left stock with its reason, the rest fused, the decoder still exact ----------

class LayerNormAfterAttnRes(torch.nn.Module):
    """A LayerNorm (FP32 math, BF16 out) where stock has the RMSNorm."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.ones(dim)), torch.nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class Bf16RMSNorm(RMSNorm):
    """The RMSNorm computed in BF16, not FP32."""

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class OutputReadTwice(KimiDecoderLayer):
    """The attention AttnRes output is also added to the attention output (a second reader)."""

    def forward(self, prefix, bank, delta, meta, cache):
        h = self.attn_res(prefix, bank, delta)
        delta = self.self_attn(self.input_layernorm(h), meta, cache) + h
        h = self.mlp_res(prefix, bank, delta)
        return self.mlp(self.post_attention_layernorm(h))


def _layernorm(model):
    old = model.model.layers[1].input_layernorm
    new = LayerNormAfterAttnRes(old.weight.shape[0], old.eps)
    new.weight.data = old.weight.data.clone()
    new.bias.data = torch.randn(new.bias.shape, generator=torch.Generator().manual_seed(0)).to(BF16) * 0.1
    model.model.layers[1].input_layernorm = new


def _bf16_norm(model):
    model.model.layers[1].input_layernorm.__class__ = Bf16RMSNorm


def _read_twice(model):
    model.model.layers[1].__class__ = OutputReadTwice


NEAR_MISSES = {
    "layernorm": (_layernorm, "not read by an RMSNorm"),
    "bf16_norm": (_bf16_norm, "not FP32"),
    "output_read_twice": (_read_twice, "the AttnRes output has 2 readers"),
}


@pytest.mark.parametrize("variant", sorted(NEAR_MISSES))
def test_near_miss_stays_stock_with_reason(variant):
    cfg = preset("k31-small", num_layers=2)
    model = build_model(cfg, seed=1)
    change, reason = NEAR_MISSES[variant]
    change(model)
    r = run_pair(cfg, model=model, steps=3, batch=2)
    rep = r.report
    (miss,) = rep.stock_points()
    assert miss.module == "model.layers.1.attn_res" and reason in miss.reason and miss.check == "structure", rep.table()
    assert miss in rep.near_misses() and f"stock model.layers.1.attn_res: {miss.reason}" in rep.table()
    assert sum(m.rewritten for m in rep.points) == 3
    assert r.logits_err == 0.0 and r.cache_err == 0.0, r.cache_errs


# ---- option attn_res_ahead: consecutive points linked (on the CPU the same split as the CUDA kernels) --------

class ViewWriteBetween(KimiDecoderLayer):
    """Between its two points, writes bank slot 0 through ``self.view``, a view of the bank the model made before
    any point (so the write's node does not read the bank node itself)."""

    def forward(self, prefix, bank, delta, meta, cache):
        h = self.attn_res(prefix, bank, delta)
        delta = self.self_attn(self.input_layernorm(h), meta, cache)
        self.view.mul_(0.5)
        h = self.mlp_res(prefix, bank, delta)
        return self.mlp(self.post_attention_layernorm(h))


class BankViewModel(KimiK3Model):
    """The stock model, handing each layer a view of the bank's slot 0 made right after the bank."""

    def forward(self, input_ids, meta, cache):
        c = self.config
        delta = self.embed_tokens(input_ids)
        prefix = torch.zeros_like(delta)
        bank = delta.new_empty(c.attn_res_blocks, input_ids.shape[0], c.hidden_size)
        view = bank[0]
        for layer, layer_cache in zip(self.layers, cache.layers):
            layer.view = view
            delta = layer(prefix, bank, delta, meta, layer_cache)
        return self.norm((prefix.float() + delta.float()).to(delta.dtype))


def _view_write(model):
    model.model.__class__ = BankViewModel
    model.model.layers[1].__class__ = ViewWriteBetween


def _other_eps(model):
    model.model.layers[1].attn_res.eps = 2 * model.config.rms_eps


LINK_VARIANTS = {  # model change -> (pairs linked, pairs refused, the reason each refused pair gives, options)
    "stock": (None, 7, 0, "", {}),
    "stock_point_between": (_bf16_norm, 5, 1, "read or write the bank", {}),  # layer 1's first point stays stock
    "view_write_between": (_view_write, 6, 1, "read or write the bank", {}),
    "other_eps": (_other_eps, 5, 2, "their eps differ", {}),
    "partition_op_between": (None, 3, 4, "a CUDA-graph partition point between them: ", {"inductor_config": {
        "custom_should_partition_ops": ["kimi_dep::kda_attention", "kimi_dep::dsa_attention"]}}),
}


@pytest.fixture(autouse=True)
def _no_parts_left():
    """Each test starts and ends with no bank part handed over (a call made by hand may leave one)."""
    from dep_compile.ops import attn_res as op_module  # noqa: PLC0415

    op_module._PARTS.clear()
    yield
    op_module._PARTS.clear()


@pytest.mark.parametrize("variant", sorted(LINK_VARIANTS))
def test_linked_points_take_every_part_and_stay_exact(variant):
    """With attn_res_ahead, each pair of consecutive fused points that may share a bank part is linked, every part
    given is taken and found fresh (none refused or stale at run time), the others say why; the decoder is exact
    against stock over several steps (a linked point on the CPU computes the stock composition and checks its
    part), and a link that should have been refused would be logged stale (the view write)."""
    from dep_compile.ops import attn_res as op_module  # noqa: PLC0415

    cfg = preset("k31-small", num_layers=4)
    change, linked, refused, reason, extra = LINK_VARIANTS[variant]
    model = decisive_routing(build_model(cfg, seed=1))
    if change is not None:
        change(model)
    with fallback_log() as logged:
        r = run_pair(cfg, model=model, steps=3, batch=2, options={**AHEAD, **extra})
    rep = r.report
    assert rep.points_linked == linked and len(rep.link_refusals) == refused, rep.table()
    assert all(reason in x for x in rep.link_refusals), rep.table()
    assert not logged and not op_module._PARTS, (logged, op_module._PARTS)  # every part taken, none refused
    assert r.logits_err == 0.0 and r.cache_err == 0.0, (variant, r.logits_err, r.cache_errs)


def test_post_grad_links_and_agrees():
    cfg = preset("k31-small", num_layers=4)
    model = decisive_routing(build_model(cfg, seed=1))
    pass_ = RecordingPass({**CUBLAS_ONLY, **AHEAD})
    with inductor_config.patch(post_grad_custom_post_pass=pass_, force_disable_caches=True):
        r = compare_steps(cfg, model, torch.compile(model, fullgraph=True, dynamic=False), steps=4, batch=2)
    _assert_all_fused(r.report, cfg, ahead=True)
    assert_agrees(r, "post-grad linked AttnRes", inductor=True)


def test_fp32_model_points_stay_stock():
    cfg = preset("k31-small", num_layers=2)
    r = run_pair(cfg, model=build_model(cfg, seed=1, dtype=torch.float32), steps=2, batch=2)
    assert len(r.report.stock_points()) == 4 and not any(m.rewritten for m in r.report.points)
    assert all("float32, not bfloat16" in m.reason for m in r.report.stock_points()), r.report.table()
    assert "0 of 4 points fused" in r.report.table() and r.logits_err == 0.0 and r.cache_err == 0.0


def test_norm_eps_is_threaded_and_a_wrong_eps_fails_validation(monkeypatch):
    """A norm whose eps differs from AttnRes's is fused with its own eps (exact); a pass that fed it
    AttnRes's eps instead is caught by the translation-validation probe."""
    cfg = preset("k31-small", num_layers=2)
    model = build_model(cfg, seed=1)
    model.model.layers[1].input_layernorm.eps = 0.25  # mean square ~1: an eps the probe can see
    r = run_pair(cfg, model=model, steps=3, batch=2)
    assert all(m.rewritten for m in r.report.points) and r.logits_err == 0.0 and r.cache_err == 0.0

    import dep_compile.passes.attn_res as attn_res_pass

    real = attn_res_pass.match_rms_norm
    torch._dynamo.reset()  # compile again, through the patched pass
    monkeypatch.setattr(attn_res_pass, "match_rms_norm", lambda *a: (*real(*a)[:2], EPS))  # the bug: AttnRes's eps
    r = run_pair(cfg, model=model, steps=2, batch=2)
    (miss,) = r.report.stock_points()
    assert miss.module == "model.layers.1.attn_res" and miss.check == "semantic", r.report.table()
    assert miss.reason.startswith("semantic check failed") and "output max" in miss.reason
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_kinds_option_names_the_glue():
    """``kinds`` without "attn_res" leaves every point stock (a policy row each), with "attn_res" fuses them."""
    cfg = preset("k31-small", num_layers=2)
    r = run_pair(cfg, steps=2, batch=2, options={"kinds": ("kda", "attn_res")})
    _assert_all_fused(r.report, cfg)
    torch._dynamo.reset()
    r = run_pair(cfg, steps=2, batch=2, options={"kinds": ("kda",)})
    assert len(r.report.points) == 2 * cfg.num_layers and not any(m.rewritten for m in r.report.points)
    assert all(m.reason.startswith("policy: kind 'attn_res'") for m in r.report.points), r.report.table()
    assert r.logits_err == 0.0 and r.cache_err == 0.0


# ---- kernels: Triton's interpreter (small) or CUDA (full size) -------------------------------------

def _kernels():
    use_triton()
    from dep_compile.stock import attn_res_cuda  # noqa: PLC0415 - imports Triton

    return attn_res_cuda


def _check_mix(got, ref):
    scale = ref.float().abs().max().item()
    d = (got.float().cpu() - ref.float()).abs()
    assert (d <= 2 ** -7 * ref.float().abs() + 2 ** -16 * scale).all(), ulps(got, ref).max()
    assert (got.cpu() == ref).float().mean() >= 0.95


def _check_normed(got, ref):
    scale = ref.float().abs().max().item()
    d = (got.float().cpu() - ref.float()).abs()
    assert (d <= 2 ** -6 * ref.float().abs() + 2 ** -16 * scale).all(), ulps(got, ref).max()


def _on_device(x: dict) -> dict:
    """``_inputs`` moved to the kernels' device (the deltas list too)."""
    return {n: [d.to(TRITON_DEV) for d in v] if isinstance(v, list) else v.to(TRITON_DEV) for n, v in x.items()}


def _run_kernel_case(T, D, NB, num_blocks, write_slot, seed, unroll):
    k = _kernels()
    x = _inputs(T, D, NB, seed)
    dev = _on_device(x)
    p_ref, b_ref = x["prefix"].clone(), x["bank"].clone()
    p_k, b_k = dev["prefix"].clone(), dev["bank"].clone()
    p_f, b_f = dev["prefix"].clone(), dev["bank"].clone()
    delta = x["deltas"][0]
    ref = attn_res_ref(p_ref, b_ref, delta, x["query"], EPS, num_blocks, write_slot)
    ref_n = F.rms_norm(ref.float(), (D,), x["norm_w"].float(), NORM_EPS).to(BF16)
    d_dev = dev["deltas"][0]
    assert k.unsupported(p_k, b_k, d_dev, dev["query"], num_blocks, write_slot) is None
    got = k.attn_res_cuda(p_k, b_k, d_dev, dev["query"], EPS, num_blocks, write_slot, unroll=unroll)
    got_n = k.attn_res_norm_cuda(p_f, b_f, d_dev, dev["query"], dev["norm_w"], EPS, num_blocks, write_slot, NORM_EPS,
                                 unroll=unroll)
    for p, b in ((p_k, b_k), (p_f, b_f)):
        assert torch.equal(p.cpu(), p_ref) and torch.equal(b.cpu(), b_ref)
    _check_mix(got, ref)
    _check_normed(got_n, ref_n)


SMALL_CASES = [(T, nb, ws) for T in (1, 3) for nb, ws in ((0, -1), (1, 0), (3, -1), (3, 2), (2, 3), (4, 0))]


def _run_part_case(T, D, NB, num_blocks, write_slot, seed, unroll):
    """The bank part kernel against ``bank_part_ref``, and the point kernel merging it against the reference."""
    k = _kernels()
    x = _inputs(T, D, NB, seed)
    dev = _on_device(x)
    p_ref, b_ref = x["prefix"].clone(), x["bank"].clone()
    part_ref = bank_part_ref(b_ref, x["query"], EPS, num_blocks, write_slot)
    ref = attn_res_ref(p_ref, b_ref, x["deltas"][0], x["query"], EPS, num_blocks, write_slot)
    ref_n = F.rms_norm(ref.float(), (D,), x["norm_w"].float(), NORM_EPS).to(BF16)
    p_k, b_k = dev["prefix"].clone(), dev["bank"].clone()
    assert k.part_unsupported(b_k, dev["query"], num_blocks, write_slot) is None
    part = k.attn_res_bank_part_cuda(b_k, dev["query"], EPS, num_blocks, write_slot, unroll=unroll)
    assert part.shape == (T, D + k.PART_EXTRA) and part.dtype == torch.float32
    got, want = part[:, :D + 2].cpu(), part_ref[:, :D + 2]
    assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-5,
                                                                      atol=1e-5 * want[:, :D].abs().max().item())
    # the point must not read the slots its part covers: poison them (logits of ~1e4 if read)
    covered = [s for s in range(num_blocks) if s != write_slot]
    b_k[covered] = 99.0
    b_ref[covered] = 99.0
    got_n = k.attn_res_norm_cuda(p_k, b_k, dev["deltas"][0], dev["query"], dev["norm_w"], EPS, num_blocks, write_slot, NORM_EPS,
                                 unroll=unroll, part=part)
    assert torch.equal(p_k.cpu(), p_ref) and torch.equal(b_k.cpu(), b_ref)
    _check_normed(got_n, ref_n)


@device_test
@pytest.mark.parametrize("T,num_blocks,write_slot", SMALL_CASES)
def test_bank_part_kernels_small(T, num_blocks, write_slot):
    _run_part_case(T, 200, 4, num_blocks, write_slot, seed=10 * T + num_blocks, unroll=2)


@device_test
@pytest.mark.parametrize("unroll", [2, 4])
@pytest.mark.parametrize("T,num_blocks,write_slot", SMALL_CASES)
def test_kernels_small(T, num_blocks, write_slot, unroll):
    _run_kernel_case(T, 200, 4, num_blocks, write_slot, seed=10 * T + num_blocks, unroll=unroll)  # D not a power of 2


@pytest.mark.cuda
@pytest.mark.skipif(ON_CPU, reason="full size on CUDA only")
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("num_blocks", range(9))
def test_kernels_full_size(T, num_blocks):
    for write_slot in sorted({-1, max(num_blocks - 1, 0), num_blocks}):
        for unroll in (2, 4):
            _run_kernel_case(T, 7168, 16, num_blocks, write_slot, seed=T + num_blocks, unroll=unroll)


@pytest.mark.cuda
@pytest.mark.skipif(ON_CPU, reason="full size on CUDA only")
@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("num_blocks", [0, 1, 4, 8])
def test_bank_part_kernels_full_size(T, num_blocks):
    for write_slot in sorted({-1, max(num_blocks - 1, 0), num_blocks}):
        _run_part_case(T, 7168, 16, num_blocks, write_slot, seed=T + num_blocks, unroll=2)


@device_test
def test_kernel_chained_steps_and_unsupported_calls():
    """Four chained points through both CUDA entries (the ops), prefix and bank bit-exact after each."""
    _kernels()
    x = _inputs(3, 200, 3, seed=5)
    dev = _on_device(x)
    p_ref, b_ref, p_k, b_k = x["prefix"].clone(), x["bank"].clone(), dev["prefix"].clone(), dev["bank"].clone()
    from dep_compile.stock.attn_res_cuda import attn_res_cuda, unsupported  # noqa: PLC0415

    for (nb, ws), delta, d_dev in zip(SCHEDULE, x["deltas"], dev["deltas"]):
        ref = attn_res_ref(p_ref, b_ref, delta, x["query"], EPS, nb, ws)
        got = attn_res_cuda(p_k, b_k, d_dev, dev["query"], EPS, nb, ws)
        assert torch.equal(p_k.cpu(), p_ref) and torch.equal(b_k.cpu(), b_ref)
        _check_mix(got, ref)
    assert "num_blocks" in unsupported(p_k, b_k, p_k, dev["query"], 4, -1)
    assert "stride" in unsupported(p_k.t().contiguous().t(), b_k, p_k, dev["query"], 1, -1)


@pytest.mark.cuda
@pytest.mark.skipif(ON_CPU, reason="CUDA graphs")
def test_ops_on_cuda_graph_capture_and_replay():
    """Both ops dispatch to the kernels on CUDA and replay in a CUDA graph (no host sync)."""
    x = _inputs(64, 7168, 16, seed=3, device="cuda")
    p, b, delta = x["prefix"].clone(), x["bank"].clone(), x["deltas"][0]
    out = {}

    def step():
        out["mix"] = torch.ops.kimi_k3.attn_res(p, b, delta, x["query"], EPS, 5, 4)
        out["normed"] = torch.ops.kimi_dep.attn_res_norm(p, b, delta, x["query"], x["norm_w"], EPS, 5, -1, NORM_EPS)

    p0, b0 = p.clone(), b.clone()
    side = torch.cuda.Stream()  # compile the kernels outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), fallback_log() as logged:
        step()
    torch.cuda.current_stream().wait_stream(side)
    assert not logged and not stock_ops._LOGGED, (logged, stock_ops._LOGGED)  # the kernels ran, not references
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    p.copy_(p0)
    b.copy_(b0)
    graph.replay()
    torch.cuda.synchronize()
    pr, br = p0.cpu(), b0.cpu()
    mix = attn_res_ref(pr, br, delta.cpu(), x["query"].cpu(), EPS, 5, 4)
    h = attn_res_ref(pr, br, delta.cpu(), x["query"].cpu(), EPS, 5, -1)
    normed = F.rms_norm(h.float(), (7168,), x["norm_w"].cpu().float(), NORM_EPS).to(BF16)
    assert torch.equal(p.cpu(), pr) and torch.equal(b.cpu(), br)
    _check_mix(out["mix"], mix)
    _check_normed(out["normed"], normed)


def _linked_points(p, b, x, deltas, schedule, stale=None):
    """``schedule``'s points through the op, each computing the next one's bank part (links 0, 1, ...); ``stale``:
    the index of a point told a wrong schedule for its successor's part. Returns the normalized outputs."""
    outs = []
    for i, ((nb, ws), delta) in enumerate(zip(schedule, deltas)):
        nxt = dict(next_query=x["query"], next_num_blocks=schedule[i + 1][0] + (i == stale),
                   next_write_slot=schedule[i + 1][1], part_out=i) if i + 1 < len(schedule) else {}
        outs.append(torch.ops.kimi_dep.attn_res_norm(p, b, delta, x["query"], x["norm_w"], EPS, nb, ws, NORM_EPS,
                                                     part_in=i - 1, **nxt))
    return outs


LINKED_SCHEDULE = [(1, 0), (1, -1), (2, 1), (2, -1), (3, -1), (4, 3), (4, -1)]


@pytest.mark.cuda
@pytest.mark.skipif(ON_CPU, reason="CUDA streams and graphs")
def test_linked_points_on_cuda_eager_and_graph_replay(monkeypatch):
    """Points linked as the pass links them: each takes its bank part from the side stream (a part computed from a
    wrong schedule is refused and logged), in eager steps and a CUDA-graph replay, against the reference chain;
    prefix and bank bit-exact. Each part kernel starts ~1 ms late on its stream, so a taker that did not wait for
    the side stream would read an unwritten part."""
    from dep_compile.ops import attn_res as op_module  # noqa: PLC0415
    from dep_compile.stock import attn_res_cuda  # noqa: PLC0415

    part_kernel = attn_res_cuda.attn_res_bank_part_cuda

    def late_part(*args, **kwargs):
        torch.cuda._sleep(2_000_000)  # cycles, on the side stream the giver launches on
        return part_kernel(*args, **kwargs)

    monkeypatch.setattr(attn_res_cuda, "attn_res_bank_part_cuda", late_part)

    x = _inputs(64, 7168, 8, seed=4, device="cuda")
    deltas = [torch.randn(64, 7168, generator=torch.Generator().manual_seed(i)).to(BF16).cuda()
              for i in range(len(LINKED_SCHEDULE))]
    p0, b0 = x["prefix"].clone(), x["bank"].clone()
    pr, br = p0.cpu(), b0.cpu()
    refs = []
    for (nb, ws), delta in zip(LINKED_SCHEDULE, deltas):
        h = attn_res_ref(pr, br, delta.cpu(), x["query"].cpu(), EPS, nb, ws)
        refs.append(F.rms_norm(h.float(), (7168,), x["norm_w"].cpu().float(), NORM_EPS).to(BF16))

    def check(outs, p, b):
        assert torch.equal(p.cpu(), pr) and torch.equal(b.cpu(), br)
        for got, ref in zip(outs, refs):
            _check_normed(got, ref)

    p, b = p0.clone(), b0.clone()
    with fallback_log() as logged:
        outs = _linked_points(p, b, x, deltas, LINKED_SCHEDULE)
        torch.cuda.synchronize()
    assert not logged and not op_module._PARTS, (logged, op_module._PARTS)  # every part given was taken
    check(outs, p, b)
    p, b = p0.clone(), b0.clone()
    with fallback_log() as logged:
        outs = _linked_points(p, b, x, deltas, LINKED_SCHEDULE, stale=2)
        torch.cuda.synchronize()
    assert any("computed from other inputs" in m for m in logged), logged
    check(outs, p, b)
    graph, box = torch.cuda.CUDAGraph(), {}
    p, b = p0.clone(), b0.clone()
    with torch.cuda.graph(graph):
        box["outs"] = _linked_points(p, b, x, deltas, LINKED_SCHEDULE)
    p.copy_(p0)
    b.copy_(b0)
    graph.replay()
    torch.cuda.synchronize()
    check(box["outs"], p, b)
