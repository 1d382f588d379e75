"""The parity check of one KDA core step against ``kda_core_ref``, shared by the KDA kernel tests.

Tolerances (the device paths differ from the reference only in FP32 summation order, exp /
sigmoid / rsqrt implementations, and the BF16 roundings those can flip by one ulp):
output finite, padding rows exactly 0, relative Frobenius error <= ``OUT_REL`` and max abs
<= ``OUT_ABS`` (outputs are O(1); one BF16 ulp at 4 is 0.03); recurrent state relative error
<= ``STATE_REL`` per live slot, every other slot and the spare layer bit-identical; conv state
bit-identical everywhere.
"""

from __future__ import annotations

import torch

OUT_REL, OUT_ABS, STATE_REL = 1e-2, 0.05, 1e-3


def assert_kda_step(c: dict, q_len: int, out: torch.Tensor, ref: tuple) -> dict[str, float]:
    """Assert the tolerances above for one step's output and the pools in ``c`` (``conv_pool``,
    ``rec_pool``: [slots, 2 layers, ...], layer 1 live) against ``ref = (out, conv_pool,
    rec_pool)``; returns the measured errors."""
    ref_out, ref_conv, ref_rec = ref
    got = out.float().cpu()
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} outputs not written / not finite"
    slots = c["state_indices"].cpu().tolist()
    for b, s in enumerate(slots):
        if s < 0:
            assert (got[b * q_len:(b + 1) * q_len] == 0).all(), "padding rows must be 0"
    refo = ref_out.float()
    rel = float((got - refo).norm() / refo.norm().clamp_min(1e-30))
    mx = float((got - refo).abs().max())
    assert rel <= OUT_REL and mx <= OUT_ABS, f"output rel {rel:.2e} max {mx:.2e}"
    conv = c["conv_pool"].cpu()
    assert torch.equal(conv, ref_conv), f"conv state differs in {int((conv != ref_conv).sum())} elements"
    rec = c["rec_pool"].cpu()
    st_rel = 0.0
    for s in range(rec.shape[0]):
        if s in slots:
            assert torch.isfinite(rec[s, 1]).all(), f"state of slot {s} not finite"
            e = float((rec[s, 1] - ref_rec[s, 1]).norm() / ref_rec[s, 1].norm())
            assert e <= STATE_REL, f"state of slot {s}: rel {e:.2e}"  # (a NaN fails here too)
            st_rel = max(st_rel, e)
            assert torch.equal(rec[s, 0], ref_rec[s, 0]), f"spare layer of slot {s} touched"
        else:
            assert torch.equal(rec[s], ref_rec[s]), f"slot {s} (not live) touched"
    return {"out_rel": rel, "out_max": mx, "state_rel": st_rel}
