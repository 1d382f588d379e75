"""MXFP4 experts tiled in place (``Mxfp4Experts.tile_``): the checkpoint writer refuses their words and their scales
alone with the reason, and the way back it names (``untile_mxfp4``) writes the checkpoint's tensors exactly
(``init_weights``' refusal: ``tests/test_mxfp4.py``); a re-pack in place that runs out of memory midway leaves the
weights as they were, or, where they cannot be put back, refuses to run."""

from __future__ import annotations

import pytest
import torch

from dep_compile.integrations.checkpoint import checkpoint_tensors
from dep_compile.stock import build_model, preset, tile_experts_
from dep_compile.stock.moe import Mxfp4Experts
from dep_compile.stock.mxfp4_tiles import MixedLayoutError, Mxfp4Tiles, untile_mxfp4

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


# ---- a re-pack that fails midway (out of memory) leaves the weights as they were, or says it cannot -------------

def _fail_at(monkeypatch, name: str, expert: int, shape: tuple[int, int] | None = None):
    """Make ``mxfp4_tiles.<name>`` (one expert's re-pack) run out of memory at ``expert`` (of a weight whose expert
    is ``shape`` [N, K], any if None), after the real one for the experts before."""
    from dep_compile.stock import mxfp4_tiles

    real = getattr(mxfp4_tiles, name)

    def failing(w, e, *args):
        if e == expert and (shape is None or tuple(w.shape[1:]) == shape):
            raise torch.OutOfMemoryError(f"{name}: no memory for expert {e} (test)")
        return real(w, e, *args)

    monkeypatch.setattr(mxfp4_tiles, name, failing)


def _w2(cfg) -> tuple[int, int]:
    """An expert's w2 shape [latent, intermediate] (w13's is [2 intermediate, latent])."""
    return cfg.moe_latent_size, cfg.moe_intermediate


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items() if "experts" in k}


def test_tile_in_place_failing_midway_leaves_the_weight_as_it_was(monkeypatch):
    from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4
    from dep_compile.stock.mxfp4_tiles import tile_in_place, untile_in_place

    w = Mxfp4Weight(*random_mxfp4((4, 64, 128), torch.Generator().manual_seed(5), 0.05))
    held = Mxfp4Weight(w.packed.clone(), w.scale.clone())
    with monkeypatch.context() as mp:
        _fail_at(mp, "_tile_expert", 2)
        with pytest.raises(torch.OutOfMemoryError, match="expert 2"):
            tile_in_place(held, 32, 64)
    assert torch.equal(held.packed, w.packed) and torch.equal(held.scale, w.scale)  # experts 0, 1 put back
    t = tile_in_place(held, 32, 64)
    words, scales = t.words.clone(), t.scales.clone()
    with monkeypatch.context() as mp:
        _fail_at(mp, "_untile_expert", 3)
        with pytest.raises(torch.OutOfMemoryError, match="expert 3"):
            untile_in_place(t)
    assert torch.equal(t.words, words) and torch.equal(t.scales, scales)
    back = untile_in_place(t)
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scale, w.scale)


def test_tile_in_place_that_cannot_undo_says_which_experts_moved(monkeypatch):
    from dep_compile.stock.mxfp4 import Mxfp4Weight, random_mxfp4
    from dep_compile.stock.mxfp4_tiles import MixedLayoutError, tile_in_place

    w = Mxfp4Weight(*random_mxfp4((4, 64, 128), torch.Generator().manual_seed(6), 0.05))
    _fail_at(monkeypatch, "_tile_expert", 3)
    _fail_at(monkeypatch, "_untile_expert", 1)
    with pytest.raises(MixedLayoutError, match=r"failed at expert 3, then putting the experts back failed .*: "
                                               r"experts \[1, 2\] are rewritten"):
        tile_in_place(w, 32, 64)


def test_module_tile_failing_on_w2_puts_w13_back(monkeypatch, caplog):
    """w13 re-packed, then w2 runs out of memory: the module keeps the checkpoint's layout bit for bit, runs as
    before, and ``tile_experts_`` gives the reason."""
    cfg = _cfg()
    m = build_model(cfg, seed=1)
    before = _snapshot(m)
    x = torch.randn(3, cfg.moe_latent_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    wts = torch.rand(3, 2, generator=torch.Generator().manual_seed(1))
    experts = next(e for e in m.modules() if isinstance(e, Mxfp4Experts))
    want = experts(x, wts, ids)
    with monkeypatch.context() as mp:
        _fail_at(mp, "_tile_expert", 1, shape=_w2(cfg))
        reasons = tile_experts_(m, 32, 64)
    assert all(r.startswith("OutOfMemoryError while re-packing") for r in reasons.values()), reasons
    assert "keeps the checkpoint's MXFP4 layout: OutOfMemoryError while re-packing" in caplog.text
    after = _snapshot(m)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not experts.tiled and torch.equal(experts(x, wts, ids), want)


def _w13(cfg) -> tuple[int, int]:
    """An expert's w13 shape [2 intermediate, latent]."""
    return 2 * cfg.moe_intermediate, cfg.moe_latent_size


@pytest.mark.parametrize("shape,expert,reason", [
    (_w2, 1, r"w2: tile_in_place: failed at expert 1, then putting the experts back failed"),  # w2 mixed
    (_w2, 0, "w13 stays re-packed"),  # w2 clean, w13 cannot be put back
    (_w13, 2, r"w13: tile_in_place: failed at expert 2, then putting the experts back failed")])  # w13 mixed
def test_module_tile_that_cannot_undo_refuses_to_run(monkeypatch, shape, expert, reason):
    """Where the experts re-packed cannot be put back, the module says which weight, and refuses to run, to tile
    again and to be re-tiled by ``tile_experts_`` (which re-raises rather than log a layout it does not have)."""
    cfg = _cfg()
    m = build_model(cfg, seed=1)
    experts = next(e for e in m.modules() if isinstance(e, Mxfp4Experts))
    with monkeypatch.context() as mp:
        _fail_at(mp, "_tile_expert", expert, shape=shape(cfg))
        _fail_at(mp, "_untile_expert", 0)
        with pytest.raises(MixedLayoutError, match=reason):
            experts.tile_(32, 64)
    x = torch.randn(3, cfg.moe_latent_size).to(torch.bfloat16)
    with pytest.raises(MixedLayoutError, match="left in two layouts by a failed tile_"):
        experts(x, torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]]))
    with pytest.raises(MixedLayoutError, match=reason.split(":")[0]):
        experts.tile_(32, 64)
    with pytest.raises(MixedLayoutError):
        tile_experts_(m, 32, 64)


def test_rewrite_interrupted_between_a_slots_two_writes_puts_it_back():
    """An interrupt after a slot's codes are written and before its scales are: the slot comes back from its copy,
    the slots before it through ``undo``, and the interrupt is re-raised."""
    from dep_compile.stock.mxfp4_tiles import _rewrite

    codes, scales = torch.arange(12).view(4, 3), torch.arange(8).view(4, 2)
    before = (codes.clone(), scales.clone())

    class Interrupting:
        """``scales`` whose slot 2 cannot be written."""

        def __getitem__(self, e):
            return scales[e]

        def __setitem__(self, e, value):
            if e == 2:
                raise KeyboardInterrupt
            scales[e] = value

    with pytest.raises(KeyboardInterrupt):
        _rewrite("test", 4, lambda e: (codes[e] + 100, scales[e] + 100), (codes, Interrupting()),
                 lambda e: (codes[e] - 100, scales[e] - 100), (codes, scales))
    assert torch.equal(codes, before[0]) and torch.equal(scales, before[1])
