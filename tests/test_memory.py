"""Bytes per GPU at DEP (dep_compile/memory.py): checked against the stock decoder's own tensors at a small size,
and against K3's published sizes at full size."""

from __future__ import annotations

import pytest

from dep_compile.__main__ import main
from dep_compile.memory import GB, H200_BYTES, RESERVE_BYTES, cache_bytes, rank_memory, weight_bytes
from dep_compile.stock import KimiCache, build_model, preset

# K3's config.json: linear_attn_config.kda_layers (1-based); the other 24 layers are full attention (4, 8, ..., 92, 93)
K3_KDA_LAYERS = tuple(n for n in range(1, 92) if n % 4)


def test_full_presets_have_k3s_layer_schedule():
    for name, full in (("k3", "mla"), ("k31", "dsa")):
        cfg = preset(name)
        kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
        assert cfg.kda_layers == K3_KDA_LAYERS and kinds.count("kda") == 69 and kinds.count(full) == 24
        assert kinds[91] == kinds[92] == full and sum(cfg.is_moe(i) for i in range(93)) == 92
    assert [preset("k31", num_layers=4).layer_kind(i) for i in range(4)] == ["kda", "kda", "kda", "dsa"]


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_weight_bytes_are_the_models(experts):
    """At a small size the split equals the bytes of a built model's parameters."""
    cfg = preset("k31-small", experts_format=experts)
    model = build_model(cfg)
    nbytes = lambda pred: sum(p.nbytes for n, p in model.named_parameters() if pred(n))  # noqa: E731
    assert weight_bytes(cfg) == (nbytes(lambda n: ".experts." not in n), nbytes(lambda n: ".experts." in n))
    assert rank_memory(cfg, 16, 64).experts * 16 == weight_bytes(cfg)[1]


@pytest.mark.parametrize("latent", ["bfloat16", "float8_e4m3fn"])
def test_cache_bytes_are_the_caches(latent):
    """One request's caches at a context: what KimiCache allocates for one slot and that many tokens' blocks."""
    cfg = preset("mixed-small", latent_cache_dtype=latent)  # KDA, MLA and DSA layers
    cache = KimiCache.allocate(cfg, num_slots=1, num_blocks=6, block_size=8, seed=None)
    want = sum(t.nbytes for lc in cache.layers for t in lc.tensors().values())
    assert sum(cache_bytes(cfg, 48).values()) == want and cache_bytes(cfg, 48)["index"] > 0


def test_k3_at_dep():
    """Full size: non-expert weights 113.5 GB (the public K3 checkpoint listing sums to 105.73 GiB = 113.5 GB of text
    weights besides the experts); MXFP4 experts 1446.5 GB in all (the listing: 1347.1 GiB); 56 experts a layer a rank
    at DEP16, 28 at DEP32; caches 6.3 MB of KDA state a layer and 1152 bytes a token a MLA layer."""
    cfg = preset("k3")
    non_expert, experts = weight_bytes(cfg)
    assert round(non_expert / GB, 1) == 113.5 and round(experts / GB, 1) == 1446.5
    assert experts == 92 * 896 * (2 * 3072 * (3584 // 2 + 3584 // 32) + 3584 * (3072 // 2 + 3072 // 32))
    assert weight_bytes(cfg.replace(experts_format="bf16"))[1] == 92 * 896 * 3 * 3072 * 3584 * 2
    dep16, dep32 = rank_memory(cfg, 16, 4096), rank_memory(cfg, 32, 4096)
    assert round(dep16.weights / GB) == 204 and round(dep32.weights / GB) == 159  # docs/design.md: ~205, ~160
    assert cache_bytes(cfg, 4096) == {"kda": 69 * (96 * 128 * 128 * 4 + 3 * 36864 * 2), "latent": 24 * 4096 * 576 * 2,
                                      "index": 0}
    assert cache_bytes(preset("k31"), 4096)["index"] == 24 * 4096 * (128 + 4)
    assert dep32.requests(170 * GB) == (170 * GB - dep32.weights) // dep32.cache_per_request > 0
    assert dep32.requests(150 * GB) == 0
    fp8 = rank_memory(cfg, 32, 4096, "fp8_block")
    assert fp8.requests(140 * GB) == (140 * GB - fp8.weights) // fp8.cache_per_request > 0


def test_memory_command(capsys):
    assert main(["memory", "--preset", "k3", "--dep", "16", "32", "--experts", "mxfp4", "--hbm-gb", "170",
                 "--reserve-gb", "5"]) == 0
    out = capsys.readouterr().out
    assert "93 layers (69 KDA, 24 MLA, 0 DSA), 92 MoE layers x 896 routed experts" in out
    assert "| 16 | mxfp4 | bf16 | 113.5 | 90.4 | 203.9 | -38.9 | does not fit |" in out
    assert "fits: " in out and "DEP32 mxfp4 experts + bf16 dense (" in out
    assert main(["memory", "--dep", "12"]) == 2 and "DEP 12 does not divide the 896" in capsys.readouterr().err
    # FP8 block-scaled dense projections (issue #28's format): on an H200, only DEP32 with MXFP4 experts fits
    assert main(["memory", "--dep", "16", "32", "--experts", "mxfp4", "--dense", "fp8_block"]) == 0
    out = capsys.readouterr().out
    assert "| 32 | mxfp4 | fp8_block | 60.7 | 45.2 | 105.9 |" in out and "| 16 | mxfp4 | fp8_block | 60.7 | 90.4 |" in out
    row32 = next(line for line in out.splitlines() if line.startswith("| 32 | mxfp4 | fp8_block"))
    assert row32.endswith("| 60 | bfloat16 | 0.563 |"), row32  # MXFP4 tiles made in place: no copy to hold
    assert "fits: DEP32 mxfp4 experts + fp8_block dense (" in out and "DEP16" not in out.split("fits:")[1]
    with pytest.raises(SystemExit):
        main(["memory", "--dense", "fp4"])
    # the latent cache in FP8 (issue #29): 576 + 4 bytes a row instead of 1152, so more requests fit at long context
    assert main(["memory", "--preset", "k31", "--dep", "32", "--context", "32768", "--experts", "mxfp4", "--dense",
                 "fp8_block", "--latent-cache", "bfloat16", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    bf16, fp8 = (rank_memory(preset("k31", latent_cache_dtype=lat), 32, 32768, "fp8_block")
                 for lat in ("bfloat16", "float8_e4m3fn"))
    assert bf16.cache_per_request - fp8.cache_per_request == 24 * 32768 * (1152 - 580)  # 24 DSA layers
    usable = H200_BYTES - RESERVE_BYTES
    assert f"| {bf16.requests(usable)} | bfloat16 | 1.459 |" in out and f"| {fp8.requests(usable)} | float8_e4m3fn |" in out
    assert fp8.requests(usable) > bf16.requests(usable) and "+ float8_e4m3fn latent cache (" in out
