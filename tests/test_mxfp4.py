"""MXFP4 routed experts as K3 ships them: the format against compressed-tensors, the stock op against the
BF16 experts on the dequantized weights, the rewrite exact on CPU, and what the MoE pass refuses.

compressed-tensors (0.17, the version vLLM 0.32 pins) is the format's authority: its compressor packs,
its decompressor is what our dequantizer must equal, on every byte and scale. Its FP4 rounding is
``torch.compile``d; ``TORCHDYNAMO_DISABLE`` is not needed for the small tensors here.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.integrations.quantization import compress_mxfp4
from dep_compile.stock import build_model, preset
from dep_compile.stock.mxfp4 import E2M1, GROUP, Mxfp4Weight, dequantize, random_mxfp4, unpack_codes
from dep_compile.stock.mxfp4_tiles import MixedLayoutError

from helpers import run_pair

ct = pytest.importorskip("compressed_tensors", reason="the dev extra installs compressed-tensors")
BETA, BETA_LIN = 4.0, 25.0


def _ct_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]


def test_every_code_byte_and_scale_dequantizes_as_compressed_tensors_does():
    """All 256 bytes (both nibbles, every E2M1 code) under scales 2^-10 .. 2^5: bit-equal to its decompressor."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(16, 1)  # [16, 256]: K = 512
    scale = (117 + torch.arange(16)).to(torch.uint8)[:, None].repeat(1, 512 // GROUP)
    ours, theirs = dequantize(packed, scale), _ct_decompress(packed, scale)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))  # -0 too
    assert torch.equal(unpack_codes(packed[:1, :8])[0], torch.tensor([0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0]))
    assert [float(v) for v in dequantize(torch.tensor([[0x10 * c + c for c in range(16)]], dtype=torch.uint8),
                                          torch.tensor([[127]], dtype=torch.uint8))[0, ::2]] == list(E2M1)


@pytest.mark.parametrize("seed", [0, 1])
def test_compressed_tensors_round_trip(seed):
    """compressed-tensors packs a random BF16 weight; our dequantizer reads its bytes back exactly as it does."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(64, 256, generator=g) * 0.05 * (1 + 3 * torch.rand(64, 1, generator=g))).to(torch.bfloat16)
    packed, scale = compress_mxfp4(w)
    assert packed.dtype == scale.dtype == torch.uint8 and packed.shape == (64, 128) and scale.shape == (64, 8)
    deq = dequantize(packed, scale)
    assert torch.equal(deq.view(torch.int16), _ct_decompress(packed, scale).view(torch.int16))
    assert (deq.float() - w.float()).norm() / w.float().norm() < 0.2  # 4-bit weights: ~11 % seen


def _experts_case(T=6, E=8, lat=64, inter=32, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, lat, generator=g).to(torch.bfloat16)
    w13 = Mxfp4Weight(*random_mxfp4((E, 2 * inter, lat), g, lat ** -0.5))
    w2 = Mxfp4Weight(*random_mxfp4((E, lat, inter), g, inter ** -0.5))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return x, w13, w2, w, ids


def test_stock_op_is_the_bf16_experts_on_the_dequantized_weights():
    """The contract: dequantize (exact in BF16), then today's routed experts; bit-equal on CPU."""
    x, w13, w2, w, ids = _experts_case()
    got = torch.ops.kimi_k3.routed_experts_mxfp4(x, *w13, *w2, w, ids, 0, 1, BETA, BETA_LIN)
    want = torch.ops.kimi_k3.routed_experts(x, w13.dequantize(), w2.dequantize(), w, ids, 0, 1, BETA, BETA_LIN)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and got.abs().max() > 0.05
    # a scale of another expert, or swapped nibbles, changes the result (the test can fail)
    rolled = Mxfp4Weight(w13.packed, w13.scale.roll(1, 0))
    assert not torch.equal(got, torch.ops.kimi_k3.routed_experts_mxfp4(x, *rolled, *w2, w, ids, 0, 1, BETA, BETA_LIN))
    swapped = Mxfp4Weight((w2.packed << 4) | (w2.packed >> 4), w2.scale)
    assert not torch.equal(got, torch.ops.kimi_k3.routed_experts_mxfp4(x, *w13, *swapped, w, ids, 0, 1, BETA, BETA_LIN))


def test_stock_op_checks_its_weights():
    x, w13, w2, w, ids = _experts_case()
    op = torch.ops.kimi_k3.routed_experts_mxfp4
    with pytest.raises(ValueError, match="packed weights are torch.float32, not uint8"):
        op(x, w13.packed.float(), w13.scale, *w2, w, ids, 0, 1, BETA, BETA_LIN)
    with pytest.raises(ValueError, match="do not tile"):
        op(x, *w13, w2.packed, w2.scale[..., :-1], w, ids, 0, 1, BETA, BETA_LIN)
    torch.library.opcheck(op, (x, *w13, *w2, w, ids, 0, 1, BETA, BETA_LIN))


def _mxfp4(name="k31-small", **kw):
    return preset(name, num_layers=4, experts_format="mxfp4", **kw)


def test_full_presets_ship_mxfp4_experts():
    assert preset("k3").experts_format == preset("k31").experts_format == "mxfp4"
    assert preset("k31-small").experts_format == "bf16"
    with pytest.raises(ValueError, match="experts_format 'fp4'"):
        preset("k3-small", experts_format="fp4")
    m = build_model(_mxfp4(), seed=0)
    e = m.model.layers[1].mlp.experts
    assert e.w13_weight_packed.shape == (64, 128, 64) and e.w13_weight_scale.shape == (64, 128, 4)
    assert e.w2_weight_packed.shape == (64, 128, 32) and e.w2_weight_scale.shape == (64, 128, 2)
    rms = Mxfp4Weight(e.w13_weight_packed, e.w13_weight_scale).dequantize().float().pow(2).mean().sqrt()
    assert 0.5 * 128 ** -0.5 < rms < 1.5 * 128 ** -0.5  # the BF16 experts' scale


@pytest.mark.parametrize("q", [1, 2])
def test_rewrite_exact_on_cpu(q):
    """k31-small with MXFP4 experts: every MoE becomes kimi_dep.moe_mxfp4, logits and caches bit-equal to eager
    over several decode / verify steps (cuBLAS tactics: the rewrite's contract on CPU is exact)."""
    accepted = None if q == 1 else (lambda i, b: [1 + (i + r) % q for r in range(b)])
    r = run_pair(_mxfp4(), steps=4, batch=3, q=q, accepted=accepted)
    moe = r.report.rewritten("moe")
    assert len(moe) == 3 and all(m.op == "kimi_dep.moe_mxfp4" and m.validation.startswith("probe") for m in moe), \
        r.report.table()
    assert r.report.num_rewritten == 7 and r.logits_err == 0.0 and r.cache_err == 0.0


def test_validation_catches_a_kernel_that_reads_nibbles_the_other_way(monkeypatch):
    """The probe draws random codes and scales: a replacement that swaps the nibbles is left stock."""
    from dep_compile.ops import moe as moe_op

    real = moe_op.as_mxfp4
    monkeypatch.setattr(moe_op, "as_mxfp4", lambda what, p, s: real(what, (p << 4) | (p >> 4), s))
    r = run_pair(_mxfp4(), steps=2, batch=2)
    bad = r.report.stock("moe")
    assert len(bad) == 3 and all(m.check == "semantic" for m in bad), r.report.table()
    assert r.logits_err == 0.0 and r.cache_err == 0.0


# ---- tiles made at load time (stock/mxfp4_tiles.py): the checkpoint's bytes re-packed in place -------------------

@pytest.mark.parametrize("E, N, K, bn, bk", [(3, 128, 256, 64, 128), (2, 64, 128, 16, 32), (2, 96, 192, 32, 64),
                                             (2, 32, 96, 16, 32)])  # 3 scales a row: flat views
def test_tiles_made_in_place_round_trip(E, N, K, bn, bk):
    """``tile_in_place`` writes ``tile_mxfp4``'s tiles into the codes' and scales' own storage, and
    ``untile_mxfp4`` gives back the checkpoint's bytes exactly."""
    from dep_compile.stock.mxfp4_tiles import Mxfp4Tiles, tile_in_place, tile_mxfp4, untile_mxfp4

    w = Mxfp4Weight(*random_mxfp4((E, N, K), torch.Generator().manual_seed(E + N), 0.05))
    copy = tile_mxfp4(w, bn, bk)
    held = Mxfp4Weight(w.packed.clone(), w.scale.clone())
    t = tile_in_place(held, bn, bk)
    assert isinstance(t, Mxfp4Tiles) and (t.block_n, t.block_k, t.shape) == (bn, bk, w.shape)
    assert t.words.data_ptr() == held.packed.data_ptr() and t.scales.data_ptr() == held.scale.data_ptr()
    assert torch.equal(t.words, copy.words) and torch.equal(t.scales, copy.scales)
    back = untile_mxfp4(t)
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scale, w.scale)
    assert not torch.equal(t.words.view(torch.uint8).view(w.packed.shape), w.packed)  # the bytes did move


def test_tiles_refuse_what_they_cannot_hold():
    from dep_compile.stock.mxfp4_tiles import check_tiles, tile_in_place

    w = Mxfp4Weight(*random_mxfp4((2, 64, 128), torch.Generator().manual_seed(3), 0.05))
    with pytest.raises(ValueError, match="does not tile"):
        tile_in_place(w, 64, 256)
    with pytest.raises(ValueError, match="not contiguous"):
        tile_in_place(Mxfp4Weight(w.packed[:, ::2], w.scale[:, ::2]), 16, 128)
    with pytest.raises(ValueError, match="int32 words and int16 scales"):
        check_tiles("w", w.packed, w.scale)
    t = tile_in_place(Mxfp4Weight(w.packed.clone(), w.scale.clone()), 32, 64)
    with pytest.raises(ValueError, match="do not fit words"):
        check_tiles("w", t.words, t.scales[..., :1])


def test_stock_op_reads_tiles_as_the_checkpoint_layout():
    """The stock op on tiles: bit-equal to it on the checkpoint's layout; mislabelled tiles (rows n and n + 8
    traded) change the result, so the check can fail."""
    from dep_compile.stock.mxfp4_tiles import tile_mxfp4

    x, w13, w2, w, ids = _experts_case()
    op = torch.ops.kimi_k3.routed_experts_mxfp4
    want = op(x, *w13, *w2, w, ids, 0, 1, BETA, BETA_LIN)
    t13, t2 = tile_mxfp4(w13, 32, 64), tile_mxfp4(w2, 32, 32)
    assert torch.equal(op(x, *t13, *t2, w, ids, 0, 1, BETA, BETA_LIN), want)
    assert torch.equal(op(x, *t13, *w2, w, ids, 0, 1, BETA, BETA_LIN), want)  # one of each: still the same weights
    traded = t13._replace(words=((t13.words >> 16) & 0xFFFF) | (t13.words << 16))
    assert not torch.equal(op(x, *traded, *t2, w, ids, 0, 1, BETA, BETA_LIN), want)
    torch.library.opcheck(op, (x, *t13, *t2, w, ids, 0, 1, BETA, BETA_LIN))
    with pytest.raises(ValueError, match="do not fit words"):
        op(x, t13.words, t13.scales[..., :1], *t2, w, ids, 0, 1, BETA, BETA_LIN)


def _tiled_model(cfg, block_n=32, block_k=64):
    from dep_compile.stock import tile_experts_

    m = build_model(cfg, seed=1)
    assert all(why is None for why in tile_experts_(m, block_n, block_k).values())
    return m


def test_tile_experts_keeps_the_checkpoint_layout_where_it_cannot_tile(caplog):
    """k31-small's 64-input experts do not tile into 128-input steps: every module says so and keeps its bytes."""
    from dep_compile.stock import tile_experts_

    m = build_model(_mxfp4(), seed=1)
    before = m.model.layers[1].mlp.experts.w13_weight_packed.clone()
    reasons = tile_experts_(m)  # the load-time default, 64 x 128
    assert len(reasons) == 3 and all("does not tile" in why for why in reasons.values()), reasons
    assert torch.equal(m.model.layers[1].mlp.experts.w13_weight_packed, before)
    assert "keeps the checkpoint's MXFP4 layout" in caplog.text


def test_rewrite_exact_on_tiles_made_at_load_time():
    """k31-small with its experts tiled in place: every MoE becomes kimi_dep.moe_mxfp4 on the tiles (the report
    says so), logits and caches bit-equal to eager over verify steps, and eager on tiles equals eager on the
    checkpoint's layout (the experts module)."""
    cfg = _mxfp4()
    accepted = lambda i, b: [1 + (i + r) % 2 for r in range(b)]  # noqa: E731
    r = run_pair(cfg, model=_tiled_model(cfg), steps=4, batch=3, q=2, accepted=accepted)
    moe = r.report.rewritten("moe")
    assert len(moe) == 3 and all(m.op == "kimi_dep.moe_mxfp4[tiles 32x64]" and m.validation.startswith("probe")
                                 for m in moe), r.report.table()
    assert r.report.num_rewritten == 7 and r.logits_err == 0.0 and r.cache_err == 0.0
    tiled, plain = _tiled_model(cfg).model.layers[1].mlp.experts, build_model(cfg, seed=1).model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, cfg.moe_latent_size, generator=g).to(torch.bfloat16)
    ids, w = torch.randint(0, plain.num_local, (5, 4), generator=g), torch.rand(5, 4, generator=g)
    assert tiled.tiled and not plain.tiled and torch.equal(tiled(x, w, ids), plain(x, w, ids))


def test_the_pass_refuses_tiles_the_kernels_cannot_read():
    """Tiles of two block_k (w13 in 64-input steps, w2 in 32), and tiles beside the checkpoint's layout: left
    stock with the reason, exact against eager."""
    from dep_compile.stock.mxfp4_tiles import tile_in_place

    cfg = _mxfp4()
    for case in ("two block_k", "mixed"):
        m = build_model(cfg, seed=1)
        for layer in m.model.layers[1:]:
            e = layer.mlp.experts
            t = tile_in_place(Mxfp4Weight(e.w13_weight_packed, e.w13_weight_scale), 32, 64)
            e.w13_weight_packed.data, e.w13_weight_scale.data = t
            if case == "two block_k":
                t = tile_in_place(Mxfp4Weight(e.w2_weight_packed, e.w2_weight_scale), 32, 32)
                e.w2_weight_packed.data, e.w2_weight_scale.data = t
        r = run_pair(cfg, model=m, steps=2, batch=2)
        stock = r.report.stock("moe")
        want = "one block_k" if case == "two block_k" else "different MXFP4 layouts"
        assert len(stock) == 3 and all(want in s.reason for s in stock), r.report.table()
        assert r.logits_err == 0.0 and r.cache_err == 0.0


def test_validation_catches_a_kernel_that_reads_tile_rows_the_other_way(monkeypatch):
    """The probe draws random tiles: a replacement that trades rows n and n + 8 of every tile is left stock."""
    from dep_compile.ops import moe as moe_op

    real = moe_op.as_mxfp4

    def traded(what, packed, scale):
        w = real(what, packed, scale)
        return w._replace(words=((w.words >> 16) & 0xFFFF) | (w.words << 16)) if packed.dtype == torch.int32 else w

    monkeypatch.setattr(moe_op, "as_mxfp4", traded)
    cfg = _mxfp4()
    r = run_pair(cfg, model=_tiled_model(cfg), steps=2, batch=2)
    bad = r.report.stock("moe")
    assert len(bad) == 3 and all(m.check == "semantic" for m in bad), r.report.table()
    assert r.logits_err == 0.0 and r.cache_err == 0.0


def _misaligned(t: torch.Tensor, mid_word: bool) -> torch.Tensor:
    """A copy of uint8 ``t`` not at a word: at an odd address, or (``mid_word``) at a word-aligned address that is
    not a word of its storage (a buffer whose storage starts mid-word), which ``view(torch.int32)`` refuses."""
    if not mid_word:
        return torch.empty(t.numel() + 1, dtype=torch.uint8)[1:].view(t.shape).copy_(t)
    buf = bytearray(t.numel() + 8)
    start = 1 + (torch.frombuffer(buf, dtype=torch.uint8).data_ptr() % 4 == 3)  # the storage starts mid-word
    storage = torch.frombuffer(buf, dtype=torch.uint8, offset=start)
    skip = -storage.data_ptr() % 4  # 1..3: word-aligned address, offset not a multiple of 4
    out = storage[skip:skip + t.numel()].view(t.shape).copy_(t)
    assert out.data_ptr() % 4 == 0 and out.storage_offset() % 4
    return out


@pytest.mark.parametrize("mid_word", [False, True])
def test_tile_is_all_or_nothing(mid_word):
    """A module whose w2 cannot be tiled in place (codes at an odd address, or at a word-aligned address that is no
    word of their storage) keeps both weights bit for bit; a module with one weight tiled says so."""
    from dep_compile.stock.moe import Mxfp4Experts

    e = build_model(_mxfp4(), seed=1).model.layers[1].mlp.experts
    assert isinstance(e, Mxfp4Experts)
    before = [t.clone() for t in (e.w13_weight_packed, e.w13_weight_scale, e.w2_weight_packed, e.w2_weight_scale)]
    e.w2_weight_packed.data = _misaligned(e.w2_weight_packed, mid_word)
    with pytest.raises(ValueError, match="tile_: w2: codes or scales not aligned"):
        e.tile_(32, 64)
    now = (e.w13_weight_packed, e.w13_weight_scale, e.w2_weight_packed, e.w2_weight_scale)
    assert all(torch.equal(a, b) for a, b in zip(now, before)) and not e.tiled
    e.w2_weight_packed.data = before[2].clone()
    e.tile_(16, 32)
    assert e.tiled and e.w13_weight_packed.shape[-2:] == (32, 2)
    e.w2_weight_packed.data = before[2]
    with pytest.raises(MixedLayoutError, match="different layouts"):
        e.tiled


def test_tiled_experts_refuse_the_checkpoint_writer_and_init_weights():
    """A model whose experts are tiles: the checkpoint writer and init_weights refuse with the reason (they would
    write or draw the checkpoint's layout over words)."""
    from dep_compile.integrations.checkpoint import checkpoint_tensors
    from dep_compile.stock.model import init_weights

    cfg = _mxfp4()
    m = _tiled_model(cfg)
    with pytest.raises(ValueError, match="experts are tiled"):
        checkpoint_tensors(m.state_dict(), cfg)
    with pytest.raises(ValueError, match="experts are tiled"):
        init_weights(m)
    assert any(".experts.0.w1.weight_packed" in k for k in checkpoint_tensors(build_model(cfg, seed=1).state_dict(),
                                                                              cfg))


def test_tile_scales_out_of_range_stay_stock():
    """A tile scale byte the readers disagree on (255: E8M0 129, 2^2 on the CPU, another value on each GPU path)
    leaves the MoE stock with the reason at compile time; exact against eager."""
    cfg = _mxfp4()
    m = _tiled_model(cfg)
    for layer in m.model.layers[1:]:
        layer.mlp.experts.w2_weight_scale.data[0, 0, 0, 0, 0] = 127 - 256 * 256 + (255 << 8)  # bytes 127, 255
    r = run_pair(cfg, model=m, steps=2, batch=2)
    stock = r.report.stock("moe")
    assert len(stock) == 3 and all("outside 126..254" in s.reason for s in stock), r.report.table()
    assert r.logits_err == 0.0 and r.cache_err == 0.0


@pytest.mark.parametrize("low, high, seen", [(126, 254, None), (125, 200, "125..254"), (126, 255, "126..255"),
                                             (0, 130, "0..254")])
def test_tile_scale_range_is_what_tile_mxfp4_writes(low, high, seen):
    """``scale_range_why`` accepts the bytes ``tile_mxfp4`` writes for E8M0 0 .. SCALE_MAX (126 .. 254, either byte
    of a pair) and names the range it saw otherwise."""
    from dep_compile.stock.mxfp4_tiles import scale_range_why, tile_mxfp4

    w = Mxfp4Weight(*random_mxfp4((1, 32, 64), torch.Generator().manual_seed(5), 0.05))
    w.scale[0, 0, 0], w.scale[0, 8, 1] = 0, 128  # E8M0 0 and SCALE_MAX: bytes 126 and 254
    t = tile_mxfp4(w, 32, 64)
    assert scale_range_why(t) is None
    t.scales[0, 0, 0, 3, 1] = (high << 8 | low) - (1 << 16 if high >= 128 else 0)  # row 3's byte low, row 11's high
    why = scale_range_why(t)
    assert why is None if seen is None else f"tile scale bytes {seen} outside 126..254" in why


def test_random_tiles_are_tiles_of_random_weights():
    """The probe's tiles, drawn as stored: words of every code, scale bytes s + 126 in random_mxfp4's range, and
    they untile to a valid checkpoint weight of the right RMS."""
    from dep_compile.stock.mxfp4_tiles import random_tiles, scale_range_why, untile_mxfp4

    t = random_tiles((2, 64, 128), 32, 64, torch.Generator().manual_seed(0), 128 ** -0.5)
    assert (t.block_n, t.block_k, tuple(t.shape)) == (32, 64, (2, 64, 128)) and scale_range_why(t) is None
    w = untile_mxfp4(t)
    assert set(unpack_codes(w.packed).unique().tolist()) == set(range(16))
    rms = float(dequantize(w.packed, w.scale, torch.float32).pow(2).mean().sqrt())
    assert 128 ** -0.5 / 1.5 < rms < 128 ** -0.5 * 1.5
