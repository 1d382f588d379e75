"""The op's layer string rebuilds its prepared object in a process where no pass ran (cache hits)."""

from __future__ import annotations

import subprocess
import sys

from dep_compile.ops import registry
from dep_compile.ops.kda import PreparedKda
from dep_compile.ops.projection import DepProjection
from dep_compile.tactics import CUBLAS, SplitK


def _prepared():
    return PreparedKda(heads=96, head_dim=128, f_rank=128, lower_bound=-5.0, norm_eps=1e-5,
                       in_proj=DepProjection("kda_in_proj", {32: SplitK(1, 64, 128, 4, 4), 64: CUBLAS}),
                       o_proj=DepProjection("o_proj", {}))


def test_layer_string_round_trips():
    p = _prepared()
    key = registry.register("model.layers.0.self_attn", p)
    assert key.startswith("model.layers.0.self_attn#")
    registry._PREPARED.clear()  # as in a fresh process that loaded cached code
    rebuilt = registry.lookup(key)
    assert rebuilt == p and rebuilt.in_proj.tactic(16) == SplitK(1, 64, 128, 4, 4)
    assert rebuilt.in_proj.tactic(64) == CUBLAS and rebuilt.in_proj.tactic(65) == CUBLAS


def test_rebuilt_in_a_fresh_process():
    key = registry.register("model.layers.0.self_attn", _prepared())
    code = f"from dep_compile.ops import registry; p = registry.lookup({key!r}); print(p.heads, p.in_proj.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["96", "kda_in_proj"]


def test_every_prepared_class_is_registered_by_importing_the_ops():
    """Importing ``dep_compile.ops`` (any module of it) registers every prepared class; the registry itself
    imports no op module (no import circle)."""
    code = ("from dep_compile.ops import registry; "
            "print(' '.join(sorted(c.__name__ for c in registry.prepared_classes())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["DepProjection", "EpMoeLayer", "PreparedDsa", "PreparedKda", "SplitK"]
