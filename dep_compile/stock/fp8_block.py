"""FP8 block-scaled dense weights (compressed-tensors ``FP8_BLOCK``, W8A8) and the stock linear that runs them.

- **Weight** ``[N, K]``: ``weight`` float8 e4m3 and ``weight_scale`` FP32, one scale per 128 x 128 block
  (``W[n, k] = weight[n, k] * weight_scale[n // 128, k // 128]``), as compressed-tensors' ``FP8_BLOCK``
  scheme writes it (``strategy "block"``, ``block_structure [128, 128]``).
- **Packed weights** (several projections stacked along N, e.g. ``[q_a | kv_a | gate]``) keep each
  segment's own block grid: a segment of ``n`` rows owns ``ceil(n / 128)`` scale rows, stacked in segment
  order, so a block never spans two segments (K3.1's ``kv_a`` is 576 rows, ``wv`` 32, KDA's ``b`` 96).
- **Activations** (dynamic, ``strategy "group"``, ``group_size 128``), as vLLM's ``per_token_group_quant_fp8``:
  per row and group of 128 inputs, ``scale = max(amax, 1e-10) * (1 / 448)`` and ``x_q = clamp(x / scale,
  -448, 448)`` cast to e4m3 (round to nearest even).
- **Product** (vLLM's w8a8 block-scaled matmul): per 128-input block, the FP8 products summed in FP32,
  times the activation group's scale, times the weight block's scale, added in block order into an FP32
  accumulator; BF16 out.

An input width that is not a multiple of 128 (only the small presets' ``q_lora``, ``kv_lora`` and KDA
``f_rank``) ends in a shorter last group and block. ``fp8_block_linear`` is the readable reference: the
``kimi_k3::fp8_block_linear`` op runs it on CPU and CUDA.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BLOCK = 128  # weight block edge and activation group
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-10  # the smallest activation amax (vLLM's eps)


def blocks(n: int) -> int:
    """Blocks of 128 covering ``n``."""
    return -(-n // BLOCK)


def scale_shape(segments: list[int], k: int) -> tuple[int, int]:
    """``weight_scale``'s shape for a packed weight of these row segments and ``k`` inputs."""
    return sum(blocks(n) for n in segments), blocks(k)


def scale_rows(segments: list[int], device=None) -> Tensor:
    """Each weight row's scale row (int64 ``[N]``): a segment's rows use its own blocks."""
    rows, first = [], 0
    for n in segments:
        rows.append(first + torch.arange(n, device=device) // BLOCK)
        first += blocks(n)
    return torch.cat(rows)


@functools.lru_cache(maxsize=None)
def scale_row_index(segments: tuple[int, ...], device: torch.device) -> Tensor:
    """``scale_rows`` as int32 on ``device``, made once per layout and device (before any graph capture), for
    the CUDA kernels that read a packed weight's block scales row by row."""
    return scale_rows(list(segments), device).to(torch.int32)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (e4m3 codes [T, K], FP32 scales [T, ceil(K/128)]): per row and group of 128 inputs."""
    T, K = x.shape
    G = blocks(K)
    xg = F.pad(x.float(), (0, G * BLOCK - K)).view(T, G, BLOCK)  # zero padding leaves amax alone
    scale = xg.abs().amax(-1).clamp_min(EPS) * (1.0 / FP8_MAX)  # [T, G]
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, G * BLOCK)[:, :K], scale


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, segments: list[int]) -> Tensor:
    """x [T, K] BF16 @ the FP8 block-scaled weight [N, K]^T -> [T, N] BF16 (the module doc's arithmetic)."""
    xq, xs = quantize_activations(x)
    ws = weight_scale[scale_rows(segments, weight.device)]  # [N, G]
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for g in range(xs.shape[1]):
        k = slice(g * BLOCK, (g + 1) * BLOCK)
        part = xq[:, k].float() @ weight[:, k].float().t()  # exact FP8 products, FP32 sums
        out += part * xs[:, g, None] * ws[None, :, g]
    return out.to(torch.bfloat16)


def dequantize(weight: Tensor, weight_scale: Tensor, segments: list[int]) -> Tensor:
    """The FP32 weight [N, K] an FP8 block-scaled one stands for."""
    ws = weight_scale[scale_rows(segments, weight.device)].repeat_interleave(BLOCK, dim=1)[:, : weight.shape[1]]
    return weight.float() * ws


def check_weight(name: str, weight: Tensor, weight_scale: Tensor, segments: list[int]) -> None:
    """A clear ValueError naming ``name`` unless ``weight`` / ``weight_scale`` are FP8 block-scaled as described."""
    if weight.dtype != FP8 or weight_scale.dtype != torch.float32:
        raise ValueError(f"{name}: FP8 block weights need float8_e4m3fn codes and float32 scales, got "
                         f"{weight.dtype} / {weight_scale.dtype}")
    if weight.dim() != 2 or sum(segments) != weight.shape[0]:
        raise ValueError(f"{name}: weight {tuple(weight.shape)} is not [N, K] with N = {sum(segments)} "
                         f"(segments {segments})")
    want = scale_shape(segments, weight.shape[1])
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{name}: weight_scale {tuple(weight_scale.shape)} is not one per 128 x 128 block of "
                         f"{tuple(weight.shape)} (segments {segments}): {want} expected")


def random_fp8_block(n: int, k: int, segments: list[int], gen: torch.Generator, rms: float) -> tuple[Tensor, Tensor]:
    """Random (codes, scales) whose dequantized weight has about ``rms``: codes N(0, 1) * 64 cast to e4m3 (no
    saturation at 448 for a 7-sigma draw), block scales ``rms / 64`` times 2^U(-1, 1), so blocks differ."""
    codes = (torch.randn(n, k, generator=gen) * 64.0).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    rows, cols = scale_shape(segments, k)
    scale = rms / 64.0 * torch.exp2(torch.rand(rows, cols, generator=gen) * 2 - 1)
    return codes, scale.float()


class Fp8BlockLinear(nn.Module):
    """A bias-free linear whose weight is FP8 block-scaled: ``weight`` e4m3 [N, K], ``weight_scale`` FP32
    (one per 128 x 128 block of each row segment); forward is ``kimi_k3::fp8_block_linear``."""

    def __init__(self, in_features: int, out_features: int, segments: list[int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.segments = list(segments or [out_features])
        if sum(self.segments) != out_features:
            raise ValueError(f"segments {self.segments} do not add up to {out_features} rows")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(scale_shape(self.segments, in_features), dtype=torch.float32),
                                         requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # [T, K]: the decoder's case, one op node
            return torch.ops.kimi_k3.fp8_block_linear(x, self.weight, self.weight_scale, self.segments)
        y = torch.ops.kimi_k3.fp8_block_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale,
                                               self.segments)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, segments={self.segments}"


def dequantize_linears(model: nn.Module) -> nn.Module:
    """``model`` with every ``Fp8BlockLinear`` replaced, in place, by an ``nn.Linear`` holding its dequantized
    weight in FP32 (the model an FP8 checkpoint stands for, without activation quantization)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, Fp8BlockLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=False, device=m.weight.device)
            lin.weight = nn.Parameter(dequantize(m.weight, m.weight_scale, m.segments), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, lin)
    return model

