"""Stock attention layers: KDA (linear), MLA (full) and DSA (MLA + sparse-attention indexer)."""

from __future__ import annotations

import torch
from torch import nn

from .cache import LayerCache, StepMeta
from .config import K3Config
from .layers import RMSNorm, dense_linear


class KimiDeltaAttention(nn.Module):
    """KDA: packed in_proj -> split -> f_b -> kimi_k3.kda_core -> o_proj."""

    def __init__(self, config: K3Config):
        super().__init__()
        c = config
        H, D = c.kda_heads, c.kda_head_dim
        self.heads, self.head_dim, self.f_rank = H, D, c.kda_f_rank
        fmt = c.dense_format
        self.in_proj_qkvgfab = dense_linear(fmt, c.hidden_size, c.kda_in_rows, c.kda_in_segments)
        self.f_b_proj = dense_linear(fmt, c.kda_f_rank, H * D)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(3 * H * D, 1, c.kda_conv_width))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H * D, dtype=torch.float32))
        self.o_norm = RMSNorm(D, 1e-5)
        self.o_proj = dense_linear(fmt, H * D, c.hidden_size)
        self.lower_bound = c.kda_lower_bound

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: LayerCache) -> torch.Tensor:
        HD = self.heads * self.head_dim
        q, k, v, g, f_a, beta = self.in_proj_qkvgfab(x).split([HD, HD, HD, HD, self.f_rank, self.heads], dim=-1)
        g_raw = self.f_b_proj(f_a)
        o = torch.ops.kimi_k3.kda_core(
            q, k, v, g_raw, beta, g, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.o_norm.weight,
            cache.conv_state, cache.recurrent_state, meta.state_indices, meta.accepted,
            meta.q_len, self.lower_bound, self.o_norm.eps,
        )
        return self.o_proj(o)


class KimiMLAAttention(nn.Module):
    """MLA: fused [q_a | kv_a | gate] -> norms -> q_b -> kimi_k3.mla_decode -> sigmoid(gate) -> o_proj."""

    def __init__(self, config: K3Config):
        super().__init__()
        c = config
        self.heads, self.nope, self.rope = c.mla_heads, c.qk_nope_dim, c.qk_rope_dim
        self.q_lora, self.kv_lora, self.gate_width = c.q_lora_rank, c.kv_lora_rank, c.mla_gate_width
        self.scale = c.softmax_scale
        fmt = c.dense_format
        self.fused_qkv_a_g_proj = dense_linear(fmt, c.hidden_size, c.mla_fused_rows, c.mla_fused_segments)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.q_b_proj = dense_linear(fmt, c.q_lora_rank, c.mla_heads * c.qk_head_dim)
        # BF16 in every format: the attention ops read it as a matrix (vLLM's MLA dequantizes it at load too)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.mla_heads * (c.qk_nope_dim + c.v_head_dim), bias=False)
        self.o_proj = dense_linear(fmt, c.mla_heads * c.v_head_dim, c.hidden_size)

    def project(self, x: torch.Tensor):
        """x -> (normed q_a [T, q_lora], q [T, H, nope+rope], latent [T, kv_lora+rope], gate [T, H*v])."""
        q_a, kv_a, gate = self.fused_qkv_a_g_proj(x).split(
            [self.q_lora, self.kv_lora + self.rope, self.gate_width], dim=-1)
        q_a = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_a).view(x.shape[0], self.heads, self.nope + self.rope)
        c_kv, k_rope = kv_a.split([self.kv_lora, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_rope], dim=-1)
        return q_a, q, latent, gate

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [T, H*v] * sigmoid(gate) in FP32 -> o_proj."""
        return self.o_proj((o.float() * torch.sigmoid(gate.float())).to(o.dtype))

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: LayerCache) -> torch.Tensor:
        _, q, latent, gate = self.project(x)
        if cache.kv_scale is not None:  # FP8 latent cache with per-token scales
            o = torch.ops.kimi_k3.mla_decode_fp8(
                q, latent, self.kv_b_proj.weight, cache.kv_cache, cache.kv_scale, meta.slot_mapping,
                meta.block_table, meta.seq_lens, meta.q_len, self.scale, self.nope)
            return self.finish(o, gate)
        o = torch.ops.kimi_k3.mla_decode(
            q, latent, self.kv_b_proj.weight, cache.kv_cache, meta.slot_mapping, meta.block_table,
            meta.seq_lens, meta.q_len, self.scale, self.nope)
        return self.finish(o, gate)


class Indexer(nn.Module):
    """DSA's lightning indexer weights: wq_b, wk, weights_proj (or merged), key LayerNorm."""

    def __init__(self, config: K3Config, merged: bool = False):
        super().__init__()
        c = config
        self.heads, self.head_dim, self.topk, self.merged = c.index_heads, c.index_head_dim, c.index_topk, merged
        fmt = c.dense_format
        self.wq_b = dense_linear(fmt, c.q_lora_rank, c.index_heads * c.index_head_dim)
        if merged:
            self.wk_weights_proj = dense_linear(fmt, c.hidden_size, c.index_head_dim + c.index_heads,
                                                [c.index_head_dim, c.index_heads])
        else:
            self.wk = dense_linear(fmt, c.hidden_size, c.index_head_dim)
            self.weights_proj = dense_linear(fmt, c.hidden_size, c.index_heads)
        self.k_norm = nn.LayerNorm(c.index_head_dim, eps=1e-6)

    def keys_and_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (normed index keys [T, Di], head weights [T, Hi])."""
        if self.merged:
            k, w = self.wk_weights_proj(x).split([self.head_dim, self.heads], dim=-1)
        else:
            k, w = self.wk(x), self.weights_proj(x)
        k = nn.functional.layer_norm(k.float(), (self.head_dim,), self.k_norm.weight.float(),
                                     self.k_norm.bias.float(), self.k_norm.eps).to(x.dtype)
        return k, w


class KimiDSAAttention(KimiMLAAttention):
    """DSA (K3.1, inferred from DeepSeek V3.2 + K3's MLA): MLA whose decode attends only to the
    indexer's top-k tokens."""

    def __init__(self, config: K3Config, merged_indexer: bool = False):
        super().__init__(config)
        self.indexer = Indexer(config, merged_indexer)

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: LayerCache) -> torch.Tensor:
        q_a, q, latent, gate = self.project(x)
        idx = self.indexer
        q_idx = idx.wq_b(q_a).view(x.shape[0], idx.heads, idx.head_dim)
        k_idx, w_idx = idx.keys_and_weights(x)
        topk = torch.ops.kimi_k3.dsa_indexer(
            q_idx, w_idx, k_idx, cache.index_cache, cache.index_scale, meta.slot_mapping,
            meta.block_table, meta.seq_lens, meta.q_len, idx.topk)
        if cache.kv_scale is not None:  # FP8 latent cache with per-token scales
            o = torch.ops.kimi_k3.sparse_mla_decode_fp8(
                q, latent, self.kv_b_proj.weight, cache.kv_cache, cache.kv_scale, meta.slot_mapping,
                meta.block_table, topk, meta.q_len, self.scale, self.nope)
            return self.finish(o, gate)
        o = torch.ops.kimi_k3.sparse_mla_decode(
            q, latent, self.kv_b_proj.weight, cache.kv_cache, meta.slot_mapping, meta.block_table,
            topk, meta.q_len, self.scale, self.nope)
        return self.finish(o, gate)
