"""K3's ``quantization_config``: what it must say for MXFP4 routed experts and FP8 block dense projections, and
compressed-tensors' compressors to write them.

Kimi K3's ``config.json`` declares its routed experts as compressed-tensors ``mxfp4-pack-quantized``
(``text_config.quantization_config``; docs/mxfp4.md gives the sources). The derived FP8 checkpoints add the dense
projections as ``float-quantized`` FP8 with 128 x 128 block scales and dynamic per-128 activation groups
(compressed-tensors' ``FP8_BLOCK`` scheme; the config's top-level format is then ``mixed-precision``). Reading
needs no compressed-tensors: :func:`weight_formats` checks the declaration by hand. Writing calls
compressed-tensors 0.17 (the version vLLM 0.32 pins) so the bytes are its own, and imports it lazily.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dep_compile.stock.fp8_block import BLOCK
from dep_compile.stock.mxfp4 import GROUP

FORMAT = "mxfp4-pack-quantized"
FP8_FORMAT = "float-quantized"  # compressed-tensors' format of FP8 weights (FP8_BLOCK among them)
MIXED_FORMAT = "mixed-precision"  # the top-level format of a config whose groups differ
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

# The dense projections' group in an FP8-dense checkpoint, as compressed-tensors' FP8_BLOCK scheme writes it
FP8_BLOCK_GROUP = {
    "format": FP8_FORMAT,
    "input_activations": {
        "actorder": None, "block_structure": None, "dynamic": True, "group_size": 128, "num_bits": 8,
        "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": "group", "symmetric": True,
        "type": "float", "zp_dtype": None,
    },
    "output_activations": None,
    # every projection but MLA's kv_b, the shared experts, the latent down / up (K3Config.dense_format)
    "targets": ["re:.*self_attn\\.(?!kv_b_proj).*_proj$", "re:.*self_attn\\.indexer\\.(wq_b|wk|weights_proj)$",
                "re:.*shared_experts\\.(gate|up|down)_proj$", "re:.*routed_expert_(down|up)_proj$"],
    "weights": {
        "actorder": None, "block_structure": [128, 128], "dynamic": False, "group_size": None, "num_bits": 8,
        "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "block",
        "symmetric": True, "type": "float", "zp_dtype": None,
    },
}

# arguments that change what the stored bytes mean, per group format: required values; then those that may be absent
_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP, "symmetric": True,
            "dynamic": False}
_WEIGHTS_IF_SET = {"scale_dtype": "torch.uint8", "actorder": None, "block_structure": None, "zp_dtype": None}
_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                "symmetric": True, "dynamic": False}
_FP8_INPUTS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "symmetric": True,
               "dynamic": True}


def quantization_config(experts: str, dense: str) -> dict | None:
    """The ``quantization_config`` of a checkpoint with these formats (None when both are BF16)."""
    if experts == "bf16" and dense == "bf16":
        return None
    qc = copy.deepcopy(K3_QUANTIZATION_CONFIG)
    if dense == "fp8_block":
        qc["config_groups"]["group_1"] = copy.deepcopy(FP8_BLOCK_GROUP)
        qc["format"] = MIXED_FORMAT
        qc["ignore"] = [i for i in qc["ignore"] if i not in ("re:.*self_attn.*", "re:.*shared_experts.*")]
        if experts == "mxfp4":
            qc["config_groups"]["group_0"]["targets"] = ["re:.*experts\\.\\d+\\.w[123]$"]
        else:
            del qc["config_groups"]["group_0"]
            qc["format"] = FP8_FORMAT
    return qc


class MissingExtra(ImportError):
    """An optional dependency is missing; the message names the extra that installs it."""


def _differs(where: str, got, want) -> ValueError:
    return ValueError(f"quantization_config.{where} is {got!r}; K3's MXFP4 experts need {want!r} (docs/mxfp4.md)")


def _fp8_differs(where: str, got, want) -> ValueError:
    return ValueError(f"quantization_config.{where} is {got!r}; FP8 block dense projections need {want!r} "
                      "(compressed-tensors' FP8_BLOCK: 128 x 128 weight blocks, dynamic activation groups of 128)")


def _check_args(where: str, args: dict | None, required: dict, if_set: dict, differs) -> None:
    """``differs(...)`` raised unless ``args`` has every ``required`` value and, where set, the ``if_set`` ones."""
    args = args or {}
    for key, want in required.items():
        if args.get(key) != want:
            raise differs(f"{where}.{key}", args.get(key), want)
    for key, want in if_set.items():
        if args.get(key, want) != want:
            raise differs(f"{where}.{key}", args[key], want)


def weight_formats(qc: dict | None) -> tuple[str, str]:
    """(``K3Config.experts_format``, ``K3Config.dense_format``) a ``quantization_config`` declares (both "bf16" when
    None); ValueError for anything but K3's MXFP4 experts (weights-only ``mxfp4-pack-quantized``, E8M0 scales per
    32 inputs) and FP8 block dense projections (``float-quantized``, 128 x 128 weight blocks, dynamic activation
    groups of 128), each at most once."""
    if qc is None:
        return "bf16", "bf16"
    for key, want in (("quant_method", QUANT_METHOD), ("quantization_status", "compressed")):
        if qc.get(key) != want:
            raise _differs(key, qc.get(key), want)
    if qc.get("format") not in (FORMAT, FP8_FORMAT, MIXED_FORMAT):
        raise _differs("format", qc.get("format"), FORMAT)
    if qc.get("kv_cache_scheme") is not None:
        raise _differs("kv_cache_scheme", qc["kv_cache_scheme"], None)
    groups = qc.get("config_groups")
    if not groups:
        raise ValueError("quantization_config has no config_groups: it declares no weight format")
    experts = dense = "bf16"
    for name, group in groups.items():
        fmt = group.get("format", qc["format"])
        if fmt == FORMAT and experts == "bf16":
            for key in ("input_activations", "output_activations"):  # weights-only: the experts take BF16 inputs
                if group.get(key) is not None:
                    raise _differs(f"config_groups.{name}.{key}", group[key], None)
            _check_args(f"config_groups.{name}.weights", group.get("weights"), _WEIGHTS, _WEIGHTS_IF_SET, _differs)
            experts = "mxfp4"
        elif fmt == FP8_FORMAT and dense == "bf16":
            _check_args(f"config_groups.{name}.weights", group.get("weights"), _FP8_WEIGHTS, {}, _fp8_differs)
            _check_args(f"config_groups.{name}.input_activations", group.get("input_activations"), _FP8_INPUTS, {},
                        _fp8_differs)
            if group.get("output_activations") is not None:
                raise _fp8_differs(f"config_groups.{name}.output_activations", group["output_activations"], None)
            dense = "fp8_block"
        else:
            raise ValueError(f"quantization_config.config_groups.{name}.format is {fmt!r}: expected one "
                             f"{FORMAT!r} group (the routed experts) and at most one {FP8_FORMAT!r} group (the dense "
                             "projections)")
    return experts, dense


def _compressed_tensors(compressor: str, scheme: str, what: str):
    """compressed-tensors' pieces for ``scheme``: (the ``compressor`` class, the preset scheme, calculate_qparams);
    MissingExtra naming ``what`` is being written when the package (or psutil) is missing."""
    try:
        import compressed_tensors.compressors as compressors
        from compressed_tensors.quantization import preset_name_to_scheme
        from compressed_tensors.quantization.utils import calculate_qparams
    except ModuleNotFoundError as e:  # compressed-tensors 0.17 imports psutil without declaring it
        raise MissingExtra(f"writing {what} needs compressed-tensors and psutil ({e.name} is missing): "
                           "pip install 'dep-compile[mxfp4]'", name=e.name) from e
    return getattr(compressors, compressor), preset_name_to_scheme(scheme, ["Linear"]), calculate_qparams


def compress_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 of a BF16 ``w [..., N, K]``: (packed uint8 [..., N, K/2], E8M0 scales uint8
    [..., N, K/32])."""
    compressor, scheme, calculate_qparams = _compressed_tensors("MXFP4PackedCompressor", SCHEME, "MXFP4 experts")
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
    compressor, scheme, calculate_qparams = _compressed_tensors("FloatQuantizationCompressor", "FP8_BLOCK",
                                                                "FP8 block weights")
    n, k = w.shape
    blocks = F.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK)).unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))
    blocks = blocks.transpose(1, 2).flatten(2)  # [N/128, K/128, 128 * 128]
    scale, zero_point = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    return out["weight"].contiguous(), out["weight_scale"].contiguous()


__all__ = ["K3_QUANTIZATION_CONFIG", "FP8_BLOCK_GROUP", "FORMAT", "FP8_FORMAT", "MIXED_FORMAT", "QUANT_METHOD",
           "SCHEME", "MissingExtra", "weight_formats", "quantization_config", "compress_mxfp4",
           "compress_fp8_block"]
