"""MLA: found and reported, never rewritten (K3's full-attention layers stay stock at DEP)."""

from __future__ import annotations

import torch

from dep_compile.debug.report import LayerMatch

from .base import Found, LayerPass, PassContext

MLA_DECODE = torch.ops.kimi_k3.mla_decode
MLA_DECODE_FP8 = torch.ops.kimi_k3.mla_decode_fp8  # on an FP8 latent cache with per-token scales


class MlaPass(LayerPass):
    """Lists each stock MLA layer in the report; the policy keeps it stock."""

    kind = "mla"
    anchors = (MLA_DECODE, MLA_DECODE_FP8)
    stock_op = "kimi_k3.mla_decode"

    def apply(self, ctx: PassContext, found: Found) -> LayerMatch:
        return LayerMatch(found.layer, found.module, self.kind, False, "policy: MLA layers stay stock", self.stock_op,
                          check="policy")
