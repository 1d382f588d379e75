"""MXFP4 experts tiled in place (``Mxfp4Experts.tile_``): the checkpoint writer refuses their words and their scales
alone with the reason, and the way back it names (``untile_mxfp4``) writes the checkpoint's tensors exactly
(``init_weights``' refusal: ``tests/test_mxfp4.py``)."""

from __future__ import annotations

import pytest
import torch

from dep_compile.integrations.checkpoint import checkpoint_tensors
from dep_compile.stock import build_model, preset, tile_experts_
from dep_compile.stock.moe import Mxfp4Experts
from dep_compile.stock.mxfp4_tiles import Mxfp4Tiles, untile_mxfp4

TILED = r"experts\.w13_weight_(packed|scale) is torch\.int(32|16): the MXFP4 experts are tiled"


def _cfg():
    return preset("k31-small", num_layers=4, experts_format="mxfp4")


def _tiled(cfg):
    m = build_model(cfg, seed=1)
    assert all(why is None for why in tile_experts_(m, 32, 64).values())  # k31-small's experts: 32 x 64 tiles
    return m


def test_checkpoint_tensors_refuses_tiled_experts():
    """The whole state dict, and its tile scales alone, are refused naming the tensor and the way back."""
    cfg = _cfg()
    state = _tiled(cfg).state_dict()
    with pytest.raises(ValueError, match=r"checkpoint_tensors: model\.layers\.1\.mlp\." + TILED + r" .*untile_mxfp4"):
        checkpoint_tensors(state, cfg)
    scales = {k: v for k, v in state.items() if k.endswith("w13_weight_scale")}
    with pytest.raises(ValueError, match=r"w13_weight_scale is torch\.int16: the MXFP4 experts are tiled"):
        checkpoint_tensors(scales, cfg)


def test_untile_mxfp4_gives_the_checkpoint_tensors_back():
    """The way back the refusal names: the tiled model's experts untiled write the same tensors as before tiling."""
    cfg = _cfg()
    m = _tiled(cfg)
    state = m.state_dict()
    for name, e in m.named_modules():
        if isinstance(e, Mxfp4Experts):
            for w in ("w13", "w2"):
                packed, scale = f"{name}.{w}_weight_packed", f"{name}.{w}_weight_scale"
                state[packed], state[scale] = untile_mxfp4(Mxfp4Tiles(state[packed], state[scale]))
    want = checkpoint_tensors(build_model(cfg, seed=1).state_dict(), cfg)
    got = checkpoint_tensors(state, cfg)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
