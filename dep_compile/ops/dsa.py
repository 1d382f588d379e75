"""The rewritten DSA layer: one packed [q_a | kv_a | gate | wk | wv] projection -> PreparedDsa core -> o_proj.

Two ops: ``kimi_dep::dsa_attention`` (BF16 latent cache) and ``kimi_dep::dsa_attention_fp8`` (FP8 e4m3
latent cache with one power-of-two scale per token in ``kv_scale [NB, BS]``, docs/fp8_latent_cache.md);
``PreparedDsa.latent_cache`` carries the format the pass matched.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..stock import ops as stock_ops
from ..stock.reference.mla import split_kv_b
from .dense import dense_linear, dense_weight
from .fallbacks import log_fallback
from .packing import packed_rows
from .projection import DepProjection
from .registry import lookup, prepared
from .streams import side_stream


@prepared
@dataclasses.dataclass
class PreparedDsa:
    """Sizes, norms' eps and projections of one DSA layer, prepared once at compile time."""

    heads: int
    nope: int
    rope: int
    q_lora: int
    kv_lora: int
    gate_width: int
    index_heads: int
    index_dim: int
    topk: int
    scale: float
    q_a_eps: float
    kv_a_eps: float
    k_norm_eps: float
    projection: DepProjection
    o_proj: DepProjection
    sparse_mla: str = "auto"  # the sparse-MLA kernel: "auto" | "triton" | "flashinfer" (ops.sparse_mla)
    latent_cache: str = "bfloat16"  # the latent cache format: "bfloat16" | "float8_e4m3fn" (with kv_scale)

    @property
    def split_sizes(self) -> list[int]:
        return [self.q_lora, self.kv_lora + self.rope, self.gate_width, self.index_dim, self.index_heads]

    def split_query(self, q_a, kv_a, q_a_norm_w, kv_a_norm_w, q_b_w, wq_b_w):
        """MLA side (q_a norm, q_b) and indexer side (wq_b) of the query, plus the latent entry."""
        T = q_a.shape[0]
        q_a = F.rms_norm(q_a.float(), (self.q_lora,), q_a_norm_w.float(), self.q_a_eps).to(q_a.dtype)
        q = dense_linear(q_a, q_b_w).view(T, self.heads, self.nope + self.rope)
        c_kv, k_rope = kv_a.split([self.kv_lora, self.rope], -1)
        c_kv = F.rms_norm(c_kv.float(), (self.kv_lora,), kv_a_norm_w.float(), self.kv_a_eps).to(kv_a.dtype)
        q_idx = dense_linear(q_a, wq_b_w).view(T, self.index_heads, self.index_dim)
        return q, torch.cat([c_kv, k_rope], -1), q_idx

    def core_torch(self, q_a, kv_a, gate, k_idx, w_idx, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w,
                   k_norm_b, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens,
                   q_len: int, kv_scale: Tensor | None = None) -> Tensor:
        """Everything between the two projections, as stock computes it: [T, H*v] BF16 (gated).

        The stock ops themselves (the readable references on CPU, their batched torch code on CUDA).
        """
        q, latent, q_idx = self.split_query(q_a, kv_a, q_a_norm_w, kv_a_norm_w, q_b_w, wq_b_w)
        k_idx = F.layer_norm(k_idx.float(), (self.index_dim,), k_norm_w.float(), k_norm_b.float(),
                             self.k_norm_eps).to(k_idx.dtype)
        topk = stock_ops.dsa_indexer(q_idx, w_idx, k_idx, index_cache, index_scale, slot_mapping, block_table,
                                     seq_lens, q_len, self.topk)
        if kv_scale is None:
            o = stock_ops.sparse_mla_decode(q, latent, kv_b_w, kv_cache, slot_mapping, block_table, topk, q_len,
                                            self.scale, self.nope)
        else:
            o = stock_ops.sparse_mla_decode_fp8(q, latent, kv_b_w, kv_cache, kv_scale, slot_mapping, block_table,
                                                topk, q_len, self.scale, self.nope)
        return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)

    def core_triton(self, q_a, kv_a, gate, k_idx, w_idx, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w,
                    k_norm_b, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens,
                    q_len: int, kv_scale: Tensor | None = None) -> Tensor:
        """The same on the Triton kernels (``dsa_triton``): [T, H*v] BF16 (gated).

        main: q_a norm -+-> key insert -+-> q_b GEMM -> latent insert -> W_UK absorb ---> sparse MLA -> W_UV + gate
        side:           +-> wq_b GEMM --+-> logits -> top-k --------------------------^
        The indexer chain (small, latency-bound kernels) runs on a side stream beside the
        weight-bound q_b GEMM; the key insert, which needs no query, runs on the main stream
        beside the wq_b GEMM (the indexer chain is the longer one: docs/perf.md). Events order
        the streams (graph-capturable: fork from and join to the capturing stream); tensors
        crossing streams are recorded on the stream that reads them. The sparse MLA is a
        split-KV kernel over the selected latents, or FlashInfer's where it runs (ops.sparse_mla).
        An FP8 latent cache (``kv_scale`` given) is quantized by the latent insert and dequantized
        in the sparse MLA's loads (checked in Triton's interpreter only, not yet run on the H200).
        """
        from .dsa_triton import (absorb_query, index_key_insert, index_logits, latent_insert, select_rows,
                                 sparse_mla_decode_latent, uv_gate)
        from .norm_triton import rms_norm_fused
        from .sparse_mla import choose_sparse_mla, flashinfer_sparse_mla

        T = q_a.shape[0]
        main = torch.cuda.current_stream()
        side = side_stream(q_a.device)
        q_a = rms_norm_fused(q_a, q_a_norm_w, self.q_a_eps)
        forked, inserted = torch.cuda.Event(), torch.cuda.Event()
        forked.record(main)
        index_key_insert(k_idx, k_norm_w, k_norm_b, self.k_norm_eps, index_cache, index_scale, slot_mapping)
        inserted.record(main)
        with torch.cuda.stream(side):
            side.wait_event(forked)
            q_idx = dense_linear(q_a, wq_b_w).view(T, self.index_heads, self.index_dim)
            side.wait_event(inserted)
            logits = index_logits(q_idx, w_idx, index_cache, index_scale, block_table, seq_lens, slot_mapping,
                                  q_len)
            # [T, topk] int32: the cache rows of the selected positions (ascending), -1 padded
            rows = select_rows(logits, self.topk, block_table, q_len, kv_cache.shape[1])
            selected = torch.cuda.Event()
            selected.record(side)
        for t in (q_a, w_idx):
            t.record_stream(side)
        q = dense_linear(q_a, q_b_w).view(T, self.heads, self.nope + self.rope)
        latent_insert(kv_a, kv_a_norm_w, self.kv_a_eps, kv_cache, slot_mapping, kv_scale=kv_scale)
        w_uk, w_uv = split_kv_b(kv_b_w, self.heads, self.nope)  # [H, nope, L], [H, v, L]
        query = absorb_query(q, w_uk)  # [T, H, L+R] BF16
        main.wait_event(selected)
        rows.record_stream(main)
        if choose_sparse_mla(self.sparse_mla, kv_cache, heads=self.heads, kv_lora=self.kv_lora,
                             nope=self.nope) == "flashinfer":
            o_lat = flashinfer_sparse_mla(query, kv_cache, rows, slot_mapping, kv_lora=self.kv_lora, nope=self.nope,
                                          scale=self.scale)
        else:
            o_lat = sparse_mla_decode_latent(query, kv_cache, block_table, rows, slot_mapping, q_len, self.kv_lora,
                                             self.scale, block_n=min(64, self.topk), physical=True,
                                             kv_scale=kv_scale)
        return uv_gate(o_lat, w_uv, gate)  # o_lat: [T, H, L] BF16

    def runs_triton(self, kv_cache: Tensor, index_cache: Tensor, kv_scale: Tensor | None = None) -> bool:
        """Whether this step runs the Triton kernels: on CUDA, unless a shape they do not support
        (then the stock ops' torch code runs, and the reason is logged once per process)."""
        if not kv_cache.is_cuda:
            return False
        from .dsa_triton import dsa_triton_unsupported

        why = dsa_triton_unsupported(kv_cache, index_cache, index_heads=self.index_heads, index_dim=self.index_dim,
                                     kv_lora=self.kv_lora, nope=self.nope, v_dim=self.gate_width // self.heads,
                                     topk=self.topk, block_n=min(64, self.topk), kv_scale=kv_scale)
        if why is not None:
            log_fallback("DSA", why, "the stock ops' torch code")
        return why is None

    def check_latent_cache(self, kv_cache: Tensor, kv_scale: Tensor | None) -> None:
        """The latent cache is in the format this layer was prepared for (a clear error otherwise)."""
        if self.latent_cache == "float8_e4m3fn":
            ok = (kv_scale is not None and kv_cache.dtype == torch.float8_e4m3fn and kv_scale.dtype == torch.float32
                  and kv_scale.shape == kv_cache.shape[:2])
        else:
            ok = kv_scale is None and kv_cache.dtype == torch.bfloat16
        if not ok:
            raise ValueError(f"kimi_dep DSA layer prepared for a {self.latent_cache} latent cache got {kv_cache.dtype} "
                             f"{list(kv_cache.shape)} with kv_scale "
                             f"{None if kv_scale is None else (kv_scale.dtype, list(kv_scale.shape))}")

    def forward(self, x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b, o_proj_w,
                kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len: int,
                kv_scale: Tensor | None = None, scales: list[Tensor] = ()) -> Tensor:
        """``scales``: FP8 block-scaled projections' scales, [*proj_ws', q_b, wq_b, o_proj] (empty: BF16 weights)."""
        self.check_latent_cache(kv_cache, kv_scale)
        n = len(proj_ws)
        s = list(scales) or [None] * (n + 3)
        packed = packed_rows(proj_ws, "DSA projection")  # [q_a | kv_a | gate | wk | wv] rows
        packed_s = packed_rows(s[:n], "DSA projection scales") if scales else None
        parts = self.projection(x, packed, packed_s).split(self.split_sizes, -1)  # q_a, kv_a, gate, k_idx, w_idx
        core = self.core_triton if self.runs_triton(kv_cache, index_cache, kv_scale) else self.core_torch
        o = core(*parts, q_a_norm_w, kv_a_norm_w, dense_weight(q_b_w, s[n]), kv_b_w, dense_weight(wq_b_w, s[n + 1]),
                 k_norm_w, k_norm_b, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len,
                 kv_scale)
        return self.o_proj(o, o_proj_w, s[n + 2])


@torch.library.custom_op("kimi_dep::dsa_attention", mutates_args=("kv_cache", "index_cache", "index_scale"))
def dsa_attention(
    x: Tensor, proj_ws: list[Tensor], q_a_norm_w: Tensor, kv_a_norm_w: Tensor, q_b_w: Tensor, kv_b_w: Tensor,
    wq_b_w: Tensor, k_norm_w: Tensor, k_norm_b: Tensor, o_proj_w: Tensor, kv_cache: Tensor, index_cache: Tensor,
    index_scale: Tensor, slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, q_len: int, layer: str,
    scales: list[Tensor],
) -> Tensor:
    """A whole DSA attention layer at TP1: x [T, hidden] -> [T, hidden]; mutates the three caches.

    proj_ws: the row blocks of the packed projection, [fused_qkv_a_g, wk, weights_proj] (or
    [fused, wk_weights_proj]), adjacent views of one [q_lora + kv_lora + rope + H*v + Di + Hi,
    hidden] tensor (14560 rows at full size) once packed (dep_compile.ops.packing);
    caches and metadata as ``kimi_k3::dsa_indexer`` / ``kimi_k3::sparse_mla_decode``.
    FP8 block-scaled projections: the weights are e4m3 codes and ``scales`` their FP32 block scales, in the
    order [*proj_ws, q_b, wq_b, o_proj] (``stock/fp8_block.py``); empty for BF16 weights.
    """
    return lookup(layer).forward(x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b,
                                 o_proj_w, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens,
                                 q_len, scales=scales)


@dsa_attention.register_fake
def _(x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b, o_proj_w, kv_cache,
      index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len, layer, scales):
    return x.new_empty(x.shape[0], o_proj_w.shape[0])


@torch.library.custom_op("kimi_dep::dsa_attention_fp8",
                         mutates_args=("kv_cache", "kv_scale", "index_cache", "index_scale"))
def dsa_attention_fp8(
    x: Tensor, proj_ws: list[Tensor], q_a_norm_w: Tensor, kv_a_norm_w: Tensor, q_b_w: Tensor, kv_b_w: Tensor,
    wq_b_w: Tensor, k_norm_w: Tensor, k_norm_b: Tensor, o_proj_w: Tensor, kv_cache: Tensor, kv_scale: Tensor,
    index_cache: Tensor, index_scale: Tensor, slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor,
    q_len: int, layer: str, scales: list[Tensor],
) -> Tensor:
    """``dsa_attention`` on an FP8 e4m3 latent cache ``kv_cache [NB, BS, L+R]`` with per-token
    power-of-two scales ``kv_scale [NB, BS]`` FP32; mutates the four caches."""
    return lookup(layer).forward(x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b,
                                 o_proj_w, kv_cache, index_cache, index_scale, slot_mapping, block_table, seq_lens,
                                 q_len, kv_scale, scales)


@dsa_attention_fp8.register_fake
def _(x, proj_ws, q_a_norm_w, kv_a_norm_w, q_b_w, kv_b_w, wq_b_w, k_norm_w, k_norm_b, o_proj_w, kv_cache, kv_scale,
      index_cache, index_scale, slot_mapping, block_table, seq_lens, q_len, layer, scales):
    return x.new_empty(x.shape[0], o_proj_w.shape[0])
