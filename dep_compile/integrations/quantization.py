"""K3's ``quantization_config``: what it must say for MXFP4 routed experts, and compressed-tensors' MXFP4 to write them.

Kimi K3's ``config.json`` declares its routed experts as compressed-tensors ``mxfp4-pack-quantized``
(``text_config.quantization_config``; docs/mxfp4.md gives the sources). Reading needs no
compressed-tensors: :func:`experts_format` checks the declaration by hand. Writing calls
compressed-tensors 0.17 (the version vLLM 0.32 pins) so the bytes are its own, and imports it lazily.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dep_compile.stock.mxfp4 import GROUP

FORMAT = "mxfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
SCHEME = "MXFP4A16"  # weights-only MXFP4; the "MXFP4" preset also quantizes activations (W4A4)

# K3's text_config.quantization_config as it ships (docs/mxfp4.md, "The checkpoint")
K3_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": FORMAT,
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP, "num_bits": 4,
                "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                "symmetric": True, "type": "float", "zp_dtype": None,
            },
        }
    },
    "format": FORMAT,
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
    "quant_method": QUANT_METHOD,
    "quantization_status": "compressed",
}

# weights arguments that change what the stored bytes mean: required values; then those that may be absent
_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP, "symmetric": True,
            "dynamic": False}
_WEIGHTS_IF_SET = {"scale_dtype": "torch.uint8", "actorder": None, "block_structure": None, "zp_dtype": None}


class MissingExtra(ImportError):
    """An optional dependency is missing; the message names the extra that installs it."""


def _differs(where: str, got, want) -> ValueError:
    return ValueError(f"quantization_config.{where} is {got!r}; K3's MXFP4 experts need {want!r} (docs/mxfp4.md)")


def experts_format(qc: dict | None) -> str:
    """The ``K3Config.experts_format`` a ``quantization_config`` declares ("bf16" when None); ValueError for
    anything but K3's MXFP4 (weights-only ``mxfp4-pack-quantized``, E8M0 scales per 32 inputs)."""
    if qc is None:
        return "bf16"
    for key, want in (("quant_method", QUANT_METHOD), ("format", FORMAT), ("quantization_status", "compressed")):
        if qc.get(key) != want:
            raise _differs(key, qc.get(key), want)
    if qc.get("kv_cache_scheme") is not None:
        raise _differs("kv_cache_scheme", qc["kv_cache_scheme"], None)
    groups = qc.get("config_groups")
    if not groups:
        raise ValueError("quantization_config has no config_groups: it declares no weight format")
    for name, group in groups.items():
        if group.get("format", FORMAT) != FORMAT:
            raise _differs(f"config_groups.{name}.format", group["format"], FORMAT)
        for key in ("input_activations", "output_activations"):  # weights-only: the experts take BF16 activations
            if group.get(key) is not None:
                raise _differs(f"config_groups.{name}.{key}", group[key], None)
        weights = group.get("weights") or {}
        for key, want in _WEIGHTS.items():
            if weights.get(key) != want:
                raise _differs(f"config_groups.{name}.weights.{key}", weights.get(key), want)
        for key, want in _WEIGHTS_IF_SET.items():
            if weights.get(key, want) != want:
                raise _differs(f"config_groups.{name}.weights.{key}", weights[key], want)
    return "mxfp4"


def _compressed_tensors():
    """compressed-tensors' MXFP4 pieces: (the compressor, the MXFP4A16 scheme, calculate_qparams)."""
    try:
        from compressed_tensors.compressors import MXFP4PackedCompressor
        from compressed_tensors.quantization import preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams
    except ModuleNotFoundError as e:  # compressed-tensors 0.17 imports psutil without declaring it
        raise MissingExtra(f"writing MXFP4 experts needs compressed-tensors and psutil ({e.name} is missing): "
                           "pip install 'dep-compile[mxfp4]'", name=e.name) from e
    return MXFP4PackedCompressor, preset_name_to_scheme(SCHEME, ["Linear"]), calculate_qparams


def compress_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 of a BF16 ``w [..., N, K]``: (packed uint8 [..., N, K/2], E8M0 scales uint8
    [..., N, K/32])."""
    compressor, scheme, calculate_qparams = _compressed_tensors()
    flat = w.reshape(-1, w.shape[-1])
    groups = flat.unflatten(-1, (-1, GROUP))
    # its FP4 rounding is torch.compile'd: eager gives the same bytes without an Inductor compile
    with torch.compiler.set_stance("force_eager"):
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        out = compressor.compress({"weight": flat, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    return (out["weight_packed"].reshape(*w.shape[:-1], -1), out["weight_scale"].reshape(*w.shape[:-1], -1))


def compress_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' ``FP8_BLOCK`` of a BF16 ``w [N, K]``: (float8_e4m3fn [N, K], FP32 scales
    [ceil(N/128), ceil(K/128)]), one per 128 x 128 block (rows and inputs zero-padded to whole blocks)."""
    try:
        from compressed_tensors.compressors import FloatQuantizationCompressor
        from compressed_tensors.quantization import preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams
    except ModuleNotFoundError as e:
        raise MissingExtra(f"writing FP8 block weights needs compressed-tensors and psutil ({e.name} is missing): "
                           "pip install 'dep-compile[mxfp4]'", name=e.name) from e
    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    n, k = w.shape
    blocks = F.pad(w.float(), (0, -k % 128, 0, -n % 128)).unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    blocks = blocks.transpose(1, 2).flatten(2)  # [N/128, K/128, 128 * 128]
    scale, zero_point = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point},
                                               scheme)
    return out["weight"], out["weight_scale"]


__all__ = ["K3_QUANTIZATION_CONFIG", "FORMAT", "QUANT_METHOD", "SCHEME", "MissingExtra", "experts_format",
           "compress_mxfp4", "compress_fp8_block"]
