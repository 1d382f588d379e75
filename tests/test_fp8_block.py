"""FP8 block-scaled dense projections (``K3Config.dense_format = "fp8_block"``, ``dep_compile/stock/fp8_block.py``).

- The format against compressed-tensors' ``FP8_BLOCK`` (its compressor writes what we read; our dequantization
  equals its decompression) and the activation rule against vLLM's (scale ``amax / 448``, codes cast to e4m3).
- ``kimi_k3::fp8_block_linear``: the reference against an independent FP64 computation, segment edges (a packed
  weight computes what its segments do apart, to the bit), bad weights refused by name, the fake kernel.
- The decoder in that format: every preset builds with FP8 projections where the issue lists them, and kimi_dep
  rewrites each DSA, KDA and MoE layer (``[fp8_block]``), exact against stock FP8 eager over several decode and
  verify steps on CPU.
"""

from __future__ import annotations

import pytest
import torch

from dep_compile.debug.parity import fp32_truth
from dep_compile.memory import weight_bytes
from dep_compile.stock import KimiCache, build_model, preset
from dep_compile.stock.fp8_block import (BLOCK, FP8, FP8_MAX, Fp8BlockLinear, check_weight, dequantize,
                                         dequantize_linears, fp8_block_linear, quantize_activations,
                                         random_fp8_block, scale_rows, scale_shape)

from helpers import run_pair

SEGMENTS = [576, 32, 96, 130]  # K3.1's kv_a and wv, KDA's b, one block and a row: no edge on a 128 multiple


def _weight(segments, k, seed=0):
    return random_fp8_block(sum(segments), k, segments, torch.Generator().manual_seed(seed), k ** -0.5)


def test_activation_rule_is_vllms():
    """Per row and 128 inputs: scale = max(amax, 1e-10) / 448, codes = x / scale cast to e4m3; a zero group
    keeps zero codes; a short last group (K = 200) scales by its own 72 inputs."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[1, :128] = 0
    q, s = quantize_activations(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (3, 2)
    for t in range(3):
        for g, cols in enumerate((slice(0, 128), slice(128, 200))):
            amax = x[t, cols].float().abs().max().clamp_min(1e-10)
            assert torch.equal(s[t, g], amax * (1.0 / FP8_MAX))
            assert torch.equal(q[t, cols], (x[t, cols].float() / s[t, g]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    assert not q[1, :128].float().any()
    assert float(q.float().abs().max()) == FP8_MAX  # a group's largest value lands on 448


def test_compressed_tensors_writes_what_we_read():
    """compressed-tensors' FP8_BLOCK compression of a BF16 weight: our shapes and dtypes, and our dequantization
    equals its decompression, to the bit; each block's scale is its amax / 448."""
    pytest.importorskip("compressed_tensors", reason="the dev extra installs compressed-tensors")
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    from dep_compile.integrations.quantization import compress_fp8_block

    w = torch.randn(384, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    q, s = compress_fp8_block(w)
    check_weight("w", q, s, [384])
    theirs = FloatQuantizationCompressor.decompress({"weight": q, "weight_scale": s},
                                                    preset_name_to_scheme("FP8_BLOCK", ["Linear"]))["weight"]
    assert torch.equal(dequantize(q, s, [384]), theirs.float())
    amax = w.float().unflatten(0, (3, BLOCK)).unflatten(2, (2, BLOCK)).abs().amax((1, 3))
    assert torch.equal(s, amax / FP8_MAX)


def test_reference_against_fp64():
    """The reference computes sum over blocks of (FP8 products) * activation scale * block scale: within FP32
    rounding of the same sum in FP64."""
    w, s = _weight(SEGMENTS, 300)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = torch.ops.kimi_k3.fp8_block_linear(x, w, s, SEGMENTS)
    xq, xs = quantize_activations(x)
    xd = xq.double() * xs.double().repeat_interleave(BLOCK, dim=1)[:, :300]
    want = (xd @ dequantize(w, s, SEGMENTS).double().t())
    assert got.dtype == torch.bfloat16 and got.shape == (5, sum(SEGMENTS))
    assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-6 * float(want.abs().max()))
    assert float((got.double() - want).norm() / want.norm()) < 2e-3  # BF16 output rounding


def test_segments_keep_their_own_blocks():
    """A packed weight [576 | 32 | 96 | 130] computes exactly what its four segments do as separate weights:
    every row takes its own segment's block scale at the edges."""
    w, s = _weight(SEGMENTS, 256, seed=4)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    packed = torch.ops.kimi_k3.fp8_block_linear(x, w, s, SEGMENTS)
    parts, row, srow = [], 0, 0
    for n in SEGMENTS:
        rows = -(-n // BLOCK)
        parts.append(fp8_block_linear(x, w[row:row + n], s[srow:srow + rows], [n]))
        row, srow = row + n, srow + rows
    assert torch.equal(packed, torch.cat(parts, dim=1))
    rows = scale_rows(SEGMENTS)
    assert [int(rows[i]) for i in (575, 576, 607, 608, 704)] == [4, 5, 5, 6, 7]  # kv_a's last, wv, b, the last
    assert scale_shape(SEGMENTS, 256) == (5 + 1 + 1 + 2, 2)


def test_one_scale_shift_changes_only_its_block():
    """A mutant: one block's scale doubled moves exactly that block's rows (the segment-edge test can fail)."""
    w, s = _weight(SEGMENTS, 256, seed=6)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    base = fp8_block_linear(x, w, s, SEGMENTS)
    s2 = s.clone()
    s2[5, 1] *= 2  # wv's block (rows 576 .. 607), inputs 128 .. 255
    moved = (fp8_block_linear(x, w, s2, SEGMENTS) != base).any(0).nonzero().flatten()
    assert moved.min() >= 576 and moved.max() < 608 and len(moved) > 16


@pytest.mark.parametrize("bad, match", [
    (lambda w, s: (w.float(), s), "float8_e4m3fn codes"),
    (lambda w, s: (w, s.bfloat16()), "float32 scales"),
    (lambda w, s: (w, s[:-1]), "not one per 128 x 128 block"),
    (lambda w, s: (w, s.t()), "not one per 128 x 128 block"),
    (lambda w, s: (w[:-1], s), "segments"),
])
def test_bad_weights_are_refused(bad, match):
    w, s = _weight(SEGMENTS, 256)
    bw, bs = bad(w, s)
    with pytest.raises(ValueError, match=match):
        torch.ops.kimi_k3.fp8_block_linear(torch.ones(1, 256, dtype=torch.bfloat16), bw, bs, SEGMENTS)


def test_opcheck():
    """The fake kernel and dispatch (opcheck's schema test perturbs inputs with ops float8 lacks on CPU)."""
    w, s = _weight([64, 200], 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    torch.library.opcheck(torch.ops.kimi_k3.fp8_block_linear.default, (x, w, s, [64, 200]),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


FP8_PROJECTIONS = {  # module leaf names in FP8 in every layer kind that has them
    "kda": {"in_proj_qkvgfab", "f_b_proj", "o_proj"},
    "mla": {"fused_qkv_a_g_proj", "q_b_proj", "o_proj"},
    "dsa": {"fused_qkv_a_g_proj", "q_b_proj", "o_proj", "wq_b", "wk", "weights_proj"},
    "moe": {"routed_expert_down_proj", "routed_expert_up_proj", "gate_up_proj", "down_proj"},
}


@pytest.mark.parametrize("name", ["k31-small", "mixed-small"])
def test_decoder_projections_in_fp8(name):
    """The listed projections are Fp8BlockLinear (packed ones with their segments); the router, kv_b, the dense
    first layer's MLP, embeddings and lm_head stay BF16."""
    cfg = preset(name, dense_format="fp8_block")
    model = build_model(cfg, seed=0)
    for i, layer in enumerate(model.model.layers):
        kind = cfg.layer_kind(i)
        fp8 = {n.rsplit(".", 1)[-1] for n, m in layer.self_attn.named_modules() if isinstance(m, Fp8BlockLinear)}
        assert fp8 == FP8_PROJECTIONS[kind], (i, kind, fp8)
        assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16 if kind != "kda" else True
        mlp = {n.rsplit(".", 1)[-1] for n, m in layer.mlp.named_modules() if isinstance(m, Fp8BlockLinear)}
        assert mlp == (FP8_PROJECTIONS["moe"] if i >= cfg.first_k_dense else set()), (i, mlp)
    attn = next(l.self_attn for i, l in enumerate(model.model.layers) if cfg.layer_kind(i) == "dsa")
    assert attn.fused_qkv_a_g_proj.segments == [cfg.q_lora_rank, cfg.latent_dim, cfg.mla_gate_width]
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name, q", [("k31-small", 1), ("mixed-small", 3)])  # decode; verify with MLA, DSA, KDA
def test_kimi_dep_rewrites_fp8_layers_exactly(name, q):
    """Every DSA / KDA / MoE layer with FP8 block-scaled projections is rewritten, reported with its format and
    observed by its probe (MLA stays stock by policy), and the compiled model equals stock FP8 eager on logits and
    every cache over 3 steps: on CPU the packed projections run stock's FP8 arithmetic, row for row."""
    cfg = preset(name, dense_format="fp8_block")
    r = run_pair(cfg, steps=3, q=q)
    assert r.logits_err == 0.0 and r.cache_err == 0.0, (r.logits_err, r.cache_errs)
    for m in r.report.layers:
        if m.kind == "mla":
            assert m.op == "kimi_k3.mla_decode"
        else:
            assert m.op.endswith("[fp8_block]") and m.validation.startswith("probe"), (m.layer, m.kind, m.op, m.reason)


def test_fp32_truth_dequantizes_fp8_projections():
    """The parity yardstick's FP32 truth of an FP8 model runs its dequantized weights: its logits are those of an
    FP32 copy with every Fp8BlockLinear replaced by the dequantized nn.Linear."""
    cfg = preset("k31-small", dense_format="fp8_block")
    model = build_model(cfg, seed=0)
    start = KimiCache.allocate(cfg, num_slots=4, num_blocks=24, block_size=4, seed=1)
    logits, states = fp32_truth(model, start, steps=1, verify=1, rows=2, q=2)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all() and len(states) == 2
    lin = dequantize_linears(build_model(cfg, seed=0).float())
    assert not any(isinstance(m, Fp8BlockLinear) for m in lin.modules())
    assert lin.model.layers[3].self_attn.q_b_proj.weight.dtype == torch.float32


def test_memory_counts_fp8_projections():
    """The memory command's FP8 dense bytes: BF16 minus one byte per FP8 weight, plus four per block scale."""
    cfg = preset("k31-small")
    bf16, experts = weight_bytes(cfg, "bf16")
    fp8, experts8 = weight_bytes(cfg, "fp8_block")
    model = build_model(cfg.replace(dense_format="fp8_block"), seed=0)
    mods = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert experts8 == experts
    assert fp8 == bf16 - sum(m.weight.numel() for m in mods) + 4 * sum(m.weight_scale.numel() for m in mods)


# ---- checkpoints: make-checkpoint --dense fp8_block, the loader, and checkpoints that lie ------------------------

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """k31-small with MXFP4 experts and FP8 block dense projections, as `make-checkpoint` writes it."""
    pytest.importorskip("compressed_tensors", reason="the dev extra installs compressed-tensors")
    pytest.importorskip("safetensors", reason="the dev extra installs safetensors")
    from dep_compile.__main__ import main

    d = tmp_path_factory.mktemp("fp8") / "k31"
    assert main(["make-checkpoint", "--preset", "k31-small", "--experts", "mxfp4", "--dense", "fp8_block",
                 str(d)]) == 0
    return d


def _tensors(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_checkpoint_round_trip(fp8_checkpoint):
    """Each FP8 part in the file is compressed-tensors' FP8_BLOCK of the BF16 model's part; the loader stacks
    the parts' weights and block rows into the packed modules (kv_a's 48 rows keep their own block), and the
    loaded model's logits stay near the BF16 model's."""
    from dep_compile.integrations.checkpoint import checkpoint_tensors, config_from_hf, hf_config, load_stock_model
    from dep_compile.integrations.quantization import compress_fp8_block

    cfg = preset("k31-small")
    bf16 = checkpoint_tensors(build_model(cfg, seed=0).state_dict(), cfg)
    file = _tensors(fp8_checkpoint)
    kv_a = "model.layers.3.self_attn.kv_a_proj_with_mqa"
    want_w, want_s = compress_fp8_block(bf16[f"{kv_a}.weight"])
    assert torch.equal(file[f"{kv_a}.weight"].view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(file[f"{kv_a}.weight_scale"], want_s)
    assert file["model.layers.3.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    model = load_stock_model(fp8_checkpoint)
    assert (model.config.experts_format, model.config.dense_format) == ("mxfp4", "fp8_block")
    fused = model.model.layers[3].self_attn.fused_qkv_a_g_proj
    q_a = cfg.q_lora_rank
    assert torch.equal(fused.weight[q_a:q_a + cfg.latent_dim].view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(fused.weight_scale[blocks_of(q_a):blocks_of(q_a) + 1], want_s)
    for e, d in (("mxfp4", "fp8_block"), ("bf16", "fp8_block")):
        text = hf_config(cfg.replace(experts_format=e, dense_format=d))["text_config"]
        got = config_from_hf(text)
        assert (got.experts_format, got.dense_format) == (e, d)
    ids = torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(9))
    ref, out = build_model(cfg, seed=0).model.embed_tokens(ids), model.model.embed_tokens(ids)
    assert torch.equal(ref, out)  # the embedding stays BF16


def blocks_of(rows: int) -> int:
    return -(-rows // BLOCK)


def _lie(d, tmp_path, edit):
    """A copy of checkpoint ``d`` whose tensors ``edit`` changed."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "lie"
    shutil.copytree(d, out)
    tensors = _tensors(d)
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


Q_B = "model.layers.3.self_attn.q_b_proj"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({f"{Q_B}.weight": t[f"{Q_B}.weight"].float().bfloat16()}),
     f"{Q_B}.weight is torch.bfloat16; the quantization_config declares FP8 block dense projections"),
    (lambda t: t.update({f"{Q_B}.weight_scale": torch.ones(1, 2)}),
     f"{Q_B}.weight_scale: shape \\(1, 2\\), expected \\(2, 1\\)"),  # scales transposed
    (lambda t: t.update({f"{Q_B}.weight_scale": t[f"{Q_B}.weight_scale"].bfloat16()}),
     f"{Q_B}.weight_scale is torch.bfloat16; FP8 block scales are float32"),
    (lambda t: t.pop(f"{Q_B}.weight_scale"), f"lacks 1 tensors: {Q_B}.weight_scale"),
])
def test_checkpoints_that_lie_are_refused(fp8_checkpoint, tmp_path, edit, match):
    from dep_compile.integrations.checkpoint import load_stock_model

    with pytest.raises(ValueError, match=match):
        load_stock_model(_lie(fp8_checkpoint, tmp_path, edit))


def test_deepseek_scale_inv_name_is_read(fp8_checkpoint, tmp_path):
    """DeepSeek's FP8 checkpoints name the block scales ``weight_scale_inv``: the same tensor, loaded as such."""
    from dep_compile.integrations.checkpoint import load_stock_model

    def rename(t):
        for n in [n for n in t if n.endswith(".weight_scale") and t[n].dtype == torch.float32]:
            t[n + "_inv"] = t.pop(n)

    a, b = load_stock_model(fp8_checkpoint), load_stock_model(_lie(fp8_checkpoint, tmp_path, rename))
    assert all(torch.equal(p.view(torch.uint8) if p.dtype == FP8 else p, q.view(torch.uint8) if q.dtype == FP8 else q)
               for p, q in zip(a.state_dict().values(), b.state_dict().values()))
