"""Stock latent MoE: router | latent down-proj -> routed experts -> latent RMSNorm -> up-proj, + shared expert."""

from __future__ import annotations

import logging
from typing import NoReturn

import torch
from torch import nn

from .config import K3Config
from .layers import RMSNorm, Router, SiTUMLP, dense_linear
from .mxfp4 import GROUP, Mxfp4Weight
from .mxfp4_tiles import LOAD_TILE, MixedLayoutError, Mxfp4Tiles, in_place_why, tile_in_place, untile_in_place

log = logging.getLogger(__name__)


class _Experts(nn.Module):
    """Where a module's routed experts sit: ``num_local`` experts from ``expert_start`` (default: all);
    ``ep_size`` the EP group they are sharded over (default: the experts / ``num_local``; 1 runs these
    experts alone, with no dispatch: ids owned elsewhere add nothing, as one rank's share in a benchmark)."""

    def __init__(self, config: K3Config, num_local: int | None, expert_start: int, ep_size: int | None):
        super().__init__()
        self.num_local = num_local or config.n_routed_experts
        self.expert_start = expert_start
        self.ep_size = ep_size or config.n_routed_experts // self.num_local  # > 1: sharded over an EP group
        self.beta, self.beta_lin = config.situ_beta, config.situ_beta_lin


class FusedExperts(_Experts):
    """The routed experts' BF16 weights (vLLM FusedMoE names): w13 [E, 2I, Lat], w2 [E, Lat, I]."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_start: int = 0,
                 ep_size: int | None = None):
        super().__init__(config, num_local, expert_start, ep_size)
        E = self.num_local
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * config.moe_intermediate, config.moe_latent_size))
        self.w2_weight = nn.Parameter(torch.empty(E, config.moe_latent_size, config.moe_intermediate))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.kimi_k3.routed_experts(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_start, self.ep_size, self.beta,
            self.beta_lin)


class Mxfp4Experts(_Experts):
    """The routed experts as K3 ships them (``stock/mxfp4.py``; vLLM's compressed-tensors names):
    ``w13_weight_packed [E, 2I, Lat/2]`` and ``w2_weight_packed [E, Lat, I/2]`` uint8 E2M1 codes,
    ``w13_weight_scale [E, 2I, Lat/32]`` and ``w2_weight_scale [E, Lat, I/32]`` uint8 E8M0 scales; after
    ``tile_``, the same storage as int32 / int16 tiles (``stock/mxfp4_tiles.py``)."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_start: int = 0,
                 ep_size: int | None = None):
        super().__init__(config, num_local, expert_start, ep_size)
        E, I, L = self.num_local, config.moe_intermediate, config.moe_latent_size
        if I % GROUP or L % GROUP:
            raise ValueError(f"MXFP4 experts need the latent ({L}) and intermediate ({I}) widths divisible by {GROUP}")
        u8 = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)  # noqa: E731
        self.w13_weight_packed, self.w13_weight_scale = u8(E, 2 * I, L // 2), u8(E, 2 * I, L // GROUP)
        self.w2_weight_packed, self.w2_weight_scale = u8(E, L, I // 2), u8(E, L, I // GROUP)
        self.broken: str | None = None  # why a failed ``tile_`` left the weights unusable

    @property
    def tiled(self) -> bool:
        """Whether the weights are held as tiles (``tile_``); ``MixedLayoutError`` where only one of w13 / w2 is."""
        w13, w2 = self.w13_weight_packed.dtype == torch.int32, self.w2_weight_packed.dtype == torch.int32
        if w13 != w2:
            raise MixedLayoutError("Mxfp4Experts: w13 and w2 are in different layouts (tiles and the checkpoint's)")
        return w13

    @torch.no_grad()
    def tile_(self, block_n: int = LOAD_TILE[0], block_k: int = LOAD_TILE[1]) -> None:
        """Re-pack w13 and w2 into ``block_n`` x ``block_k`` tiles in their own storage (no copy: what kimi_dep's
        experts kernel reads); ValueError with the reason where either cannot be, leaving both as they were. A
        failure midway (out of memory, an interrupt) is re-raised with both as they were, or, where they cannot be
        put back, as ``MixedLayoutError`` with ``broken`` set (``forward`` and ``tile_`` then raise: build the
        module again)."""
        if self.broken:
            raise MixedLayoutError(self.broken)
        if self.tiled:
            return
        inter = self.w13_weight_packed.shape[1] // 2
        w13 = Mxfp4Weight(self.w13_weight_packed, self.w13_weight_scale)
        w2 = Mxfp4Weight(self.w2_weight_packed, self.w2_weight_scale)
        if inter % block_n:
            raise ValueError(f"tile_: the up half starts inside a {block_n}-row tile ({inter} gate rows)")
        for name, w in (("w13", w13), ("w2", w2)):
            why = in_place_why(w, block_n, block_k)
            if why:
                raise ValueError(f"tile_: {name}: {why}")
        # both checked: no step below refuses. Each re-pack is all or nothing (a failure midway puts its experts
        # back) and w2's failing puts w13 back, so the module stays in one layout or refuses to run
        try:
            t13 = tile_in_place(w13, block_n, block_k)
        except MixedLayoutError as err:
            self._break(f"w13: {err}", err)
        try:
            t2 = tile_in_place(w2, block_n, block_k)
        except BaseException as err:
            if isinstance(err, MixedLayoutError):
                self._break(f"w2: {err}", err)
            try:
                untile_in_place(t13)
            except BaseException as undo:
                self._break(f"w13: {undo}" if isinstance(undo, MixedLayoutError) else
                            f"w13 stays re-packed (putting it back failed: {undo!r}), w2 does not", undo)
            raise
        self.broken = "interrupted while the parameters took the tiles"  # until both have
        for name, tiles in (("w13", t13), ("w2", t2)):
            getattr(self, f"{name}_weight_packed").data, getattr(self, f"{name}_weight_scale").data = tiles
        self.broken = None

    def _break(self, why: str, cause: BaseException) -> NoReturn:
        """Mark the module unusable (``broken``) and raise ``MixedLayoutError`` saying why."""
        self.broken = why
        raise MixedLayoutError(f"{why}; build the module again") from cause

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise MixedLayoutError(f"Mxfp4Experts: the weights were left in two layouts by a failed tile_ ({self.broken}); "
                                   "build the module again")
        return torch.ops.kimi_k3.routed_experts_mxfp4(
            x, self.w13_weight_packed, self.w13_weight_scale, self.w2_weight_packed, self.w2_weight_scale,
            topk_weights, topk_ids, self.expert_start, self.ep_size, self.beta, self.beta_lin)


EXPERTS = {"bf16": FusedExperts, "mxfp4": Mxfp4Experts}  # K3Config.experts_format -> the experts module


def tile_experts_(model: nn.Module, block_n: int = LOAD_TILE[0], block_k: int = LOAD_TILE[1]) -> dict[str, str | None]:
    """``Mxfp4Experts.tile_`` on every MXFP4 experts module of ``model``: {module name: None, or why it stays in
    the checkpoint's layout} (logged)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Mxfp4Experts):
            try:
                m.tile_(block_n, block_k)
                out[name] = None
            except MixedLayoutError:
                raise
            except Exception as e:  # tile_ left the module as it was: a refusal, or a failure midway put back
                out[name] = str(e) if isinstance(e, ValueError) else f"{type(e).__name__} while re-packing ({e})"
                log.warning("dep_compile: %s keeps the checkpoint's MXFP4 layout: %s", name, out[name])
    return out


def stock_routed_experts(x, w13, w2, topk_weights, topk_ids, expert_start: int, ep_size: int, beta: float,
                         beta_lin: float) -> torch.Tensor:
    """The stock routed-experts op for ``w13`` / ``w2`` as BF16 tensors, ``Mxfp4Weight`` or ``Mxfp4Tiles`` pairs:
    [T, Lat]."""
    if isinstance(w13, (Mxfp4Weight, Mxfp4Tiles)):
        return torch.ops.kimi_k3.routed_experts_mxfp4(x, *w13, *w2, topk_weights, topk_ids, expert_start, ep_size,
                                                      beta, beta_lin)
    return torch.ops.kimi_k3.routed_experts(x, w13, w2, topk_weights, topk_ids, expert_start, ep_size, beta, beta_lin)


class KimiMoE(nn.Module):
    """K3's latent MoE block; ``shared_intermediate = 0`` builds it without a shared expert."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_start: int = 0,
                 ep_size: int | None = None):
        super().__init__()
        c = config
        self.gate = Router(c)
        self.routed_expert_down_proj = dense_linear(c.dense_format, c.hidden_size, c.moe_latent_size)
        self.experts = EXPERTS[c.experts_format](c, num_local, expert_start, ep_size)
        self.routed_expert_norm = RMSNorm(c.moe_latent_size, c.rms_eps)
        self.routed_expert_up_proj = dense_linear(c.dense_format, c.moe_latent_size, c.hidden_size)
        self.shared_experts = SiTUMLP(c, c.hidden_size, c.shared_intermediate, c.dense_format) \
            if c.shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        latent = self.routed_expert_down_proj(x)
        routed = self.experts(latent, topk_weights, topk_ids)
        out = self.routed_expert_up_proj(self.routed_expert_norm(routed))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
