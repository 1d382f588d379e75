"""Reference KDA core: causal conv, decay gate, L2 norms, delta rule on an FP32 state, gated RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import l2_normalize, rms_norm


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, accepted: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (SiLU) of one request's tokens.

    x: [q, C] new tokens; conv_state: [W-1, C] the previous taps; weight: [C, W].
    Returns (y [q, C] BF16, the new state [W-1, C]: the last W-1 taps after ``accepted`` tokens).
    """
    width = weight.shape[1]
    window = torch.cat([conv_state.float(), x.float()], 0)  # [W-1+q, C]
    taps = window.unfold(0, width, 1)  # [q, C, W]
    y = F.silu((taps * weight.float()).sum(-1)).to(x.dtype)
    new_state = window[accepted : accepted + width - 1]
    return y, new_state.to(conv_state.dtype)


def decay_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Log-decay per channel: lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)).

    g_raw: [q, H, D]; A_log: [H]; dt_bias: [H*D]. Returns FP32 [q, H, D] in (lower_bound, 0).
    """
    H, D = g_raw.shape[-2:]
    a = torch.exp(A_log.float()).view(H, 1)
    return lower_bound * torch.sigmoid(a * (g_raw.float() + dt_bias.float().view(H, D)))


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, accepted: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token by token, in FP32.

    q, k: [q, H, Dk] (normalized); v: [q, H, Dv]; log_decay: [q, H, Dk]; beta: [q, H];
    state: [H, Dv, Dk]. Per token: S <- S diag(exp(g)); S <- S + beta (v - S k) k^T; o = S q.
    Returns (o [q, H, Dv] FP32, the state after ``accepted`` tokens).
    """
    S = state.float().clone()
    committed = S
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(log_decay[t]).unsqueeze(1)
        pred = torch.einsum("hvk,hk->hv", S, k[t])
        S = S + beta[t].view(-1, 1, 1) * torch.einsum("hv,hk->hvk", v[t].float() - pred, k[t])
        outs.append(torch.einsum("hvk,hk->hv", S, q[t]))
        if t + 1 == accepted:
            committed = S
    return torch.stack(outs), committed


def kda_core_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor, beta: torch.Tensor,
    g_out: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    o_norm_weight: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    state_indices: torch.Tensor, accepted: torch.Tensor, q_len: int, lower_bound: float, norm_eps: float,
) -> torch.Tensor:
    """The KDA core for a decode (q_len = 1) or uniform verify step; mutates both states.

    q, k, v, g_raw, g_out: [T, H*D] BF16 with T = B * q_len (q, k, v before the conv);
    beta: [T, H] logits; conv_weight: [3*H*D, W]; A_log: [H]; dt_bias: [H*D];
    o_norm_weight: [D]; conv_state: [S, W-1, 3*H*D] BF16; recurrent_state: [S, H, D, D] FP32
    (value-major); state_indices: [B] (-1 = padding: no state touched, output 0);
    accepted: [B] in 1..q_len, the tokens whose state is committed. Returns [T, H*D] BF16.
    """
    T, HD = q.shape
    H = beta.shape[1]
    D = HD // H
    B = T // q_len
    out = torch.zeros(T, HD, dtype=q.dtype, device=q.device)
    for b in range(B):
        slot = int(state_indices[b])
        if slot < 0:
            continue
        rows = slice(b * q_len, (b + 1) * q_len)
        acc = int(accepted[b])
        x = torch.cat([q[rows], k[rows], v[rows]], -1)  # [q, 3HD]
        y, new_conv = causal_conv_step(x, conv_state[slot], conv_weight, acc)
        conv_state[slot].copy_(new_conv)
        qc, kc, vc = (t.reshape(q_len, H, D) for t in y.split(HD, -1))
        qn = l2_normalize(qc) * D ** -0.5
        kn = l2_normalize(kc)
        gate = decay_gate(g_raw[rows].reshape(q_len, H, D), A_log, dt_bias, lower_bound)
        o, new_state = delta_rule(qn, kn, vc, gate, torch.sigmoid(beta[rows].float()), recurrent_state[slot], acc)
        recurrent_state[slot].copy_(new_state)
        o = rms_norm(o, o_norm_weight, norm_eps) * torch.sigmoid(g_out[rows].float().view(q_len, H, D))
        out[rows] = o.reshape(q_len, HD).to(q.dtype)
    return out
