"""Matching cost grows linearly with layer count, validation stays a small constant (pattern-only mode on a CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compile_cost import measure  # noqa: E402


def test_pass_time_linear_in_layers():
    measure(4, inductor=False, validate=True)  # warm imports and op registration
    p16, v16, t16, k16 = measure(16, inductor=False, validate=True)
    p64, v64, t64, k64 = measure(64, inductor=False, validate=True)
    assert (k16, k64) == (2 * 16 - 1, 2 * 64 - 1)  # every attention layer and every MoE (layer 0 is dense)
    per16, per64 = p16 / 16, p64 / 64
    # linear: per-layer pass time at 64 layers within 2.5x of that at 16 (quadratic would be 4x)
    assert per64 < 2.5 * per16, (per16, per64)
    assert p64 < 0.5 * t64  # the passes are a minority of the compile even without Inductor
    # translation validation: one probe per layer structure, so its cost does not grow with depth
    assert 0 < v64 < 0.1 * t64 and v64 < 4 * v16, (v16, v64, t64)
