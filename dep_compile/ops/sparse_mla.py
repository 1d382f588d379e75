"""The sparse-MLA seam of the DSA core: FlashInfer's TRTLLM-gen sparse MLA decode where it imports
and supports the GPU and the layer, the Triton kernel of ``dsa_triton`` otherwise.

FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` with ``sparse_mla_top_k > 0`` runs on
SM 10.x (Blackwell) only; on the H200 (SM90) the Triton kernel runs. Facts used from FlashInfer's
documentation and vLLM's FlashInfer sparse backend: the query is ``[B, q, heads, L + R]``
(absorbed q_nope | q_rope), the cache ``[pages, 1, page, L + R]``, ``block_tables`` becomes the
selected cache rows ``[B, q, top_k]`` (page * page_size + offset), ``seq_lens`` the number of
valid rows of each token, latent 512 + RoPE 64 with q_nope 128 or 192, pages of 32 or 64 rows.
Each token is passed as its own request of one query (its selection already encodes what it
sees). K3's 96 heads are padded to 128 for the kernel (zero queries, outputs dropped).

The choice is made when the pass rewrites the layer (:func:`reserve_sparse_mla`), which also
allocates FlashInfer's workspace then, outside any CUDA graph or graph memory pool. A layer
rebuilt from its layer string in a process where no pass ran (a compile-cache hit) chooses and
allocates on its first step instead.

An FP8 latent cache (per-token scales, docs/fp8_latent_cache.md) always runs the Triton kernel:
FlashInfer's FP8 MLA cache is scaled per tensor.

The FlashInfer path has not run on hardware here (no SM 10.x GPU, no FlashInfer on the H200
image); its argument handling is tested on CPU against a stand-in implementing the documented
contract (tests/test_sparse_mla_seam.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import SPARSE_MLA_KERNELS, OptionError  # noqa: F401  (the choices, re-exported)
from .shapes import size_hint  # symbolic dims (dynamic=True) by their hints: the op decides again at run time

log = logging.getLogger(__name__)
FLASHINFER_HEADS = 128  # query heads the kernel is given: K3's 96 padded
FLASHINFER_WORKSPACE_BYTES = 128 << 20  # semaphores of its multi-block mode; zeroed once
_CHOSEN: dict = {}  # (device, option, layer shape) -> "triton" | "flashinfer"
_WORKSPACE: dict = {}  # device -> uint8 workspace


def flashinfer_mla_decode():
    """FlashInfer's MLA decode entry point, or the reason it does not import (a str)."""
    try:
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla  # noqa: PLC0415 - optional extra
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing at import
        return f"flashinfer does not import ({type(e).__name__}: {e})"
    return trtllm_batch_decode_with_kv_cache_mla


def flashinfer_unsupported(kv_cache: Tensor, *, heads: int, kv_lora: int, nope: int,
                           capability: tuple[int, int] | None = None) -> str | None:
    """Why FlashInfer's sparse MLA cannot run this layer on this GPU (None: it can); ``capability``:
    the GPU's (major, minor), default the cache's device's."""
    fn = flashinfer_mla_decode()
    if isinstance(fn, str):
        return fn
    if capability is None:
        if not kv_cache.is_cuda:
            return "not on CUDA"
        capability = torch.cuda.get_device_capability(kv_cache.device)
    major, minor = capability
    if major != 10:
        return f"SM{major}{minor}: FlashInfer's sparse MLA (TRTLLM-gen) runs on SM 10.x only"
    rope = size_hint(kv_cache.shape[-1]) - kv_lora
    if (kv_lora, rope) != (512, 64) or nope not in (128, 192):
        return f"latent {kv_lora} + rope {rope}, q_nope {nope}: the kernel takes 512 + 64 and q_nope 128 or 192"
    if heads > FLASHINFER_HEADS:
        return f"{heads} heads: more than the kernel's {FLASHINFER_HEADS}"
    if kv_cache.dtype == torch.float8_e4m3fn:  # PreparedDsa.latent_cache == "float8_e4m3fn"
        return ("FP8 latent cache with per-token scales: the kernel's FP8 cache takes one per-tensor scale "
                "(bmm1_scale / bmm2_scale)")
    if kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous():
        return "latent cache not a contiguous BF16 [pages, page, 576] tensor"
    if size_hint(kv_cache.shape[1]) not in (32, 64):
        return f"cache pages of {size_hint(kv_cache.shape[1])} rows: the kernel takes 32 or 64"
    return None


def choose_sparse_mla(option: str, kv_cache: Tensor, *, heads: int, kv_lora: int, nope: int) -> str:
    """The kernel a DSA step's sparse MLA runs on ("triton" or "flashinfer") under ``option``
    ("auto": FlashInfer where it can run, "triton", "flashinfer": an error where it cannot);
    decided once per device and layer shape, and logged."""
    key = (kv_cache.device, option, heads, kv_lora, nope, tuple(size_hint(d) for d in kv_cache.shape[1:]),
           kv_cache.dtype, kv_cache.is_contiguous())
    if key not in _CHOSEN:
        if option == "triton":
            kernel, note = "triton", " (asked for)"
        else:
            why = flashinfer_unsupported(kv_cache, heads=heads, kv_lora=kv_lora, nope=nope)
            if option == "flashinfer" and why is not None:
                raise OptionError(f"kimi_dep: sparse_mla='flashinfer' cannot run on {kv_cache.device}: {why}")
            kernel, note = ("flashinfer", "") if why is None else ("triton", f" (FlashInfer: {why})")
        log.info("kimi_dep DSA sparse MLA on %s: %s kernel%s", kv_cache.device, kernel, note)
        _CHOSEN[key] = kernel
    return _CHOSEN[key]


def _workspace(device: torch.device) -> Tensor:
    """FlashInfer's zeroed workspace on ``device``, allocated on first use."""
    if device not in _WORKSPACE:
        _WORKSPACE[device] = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACE[device]


def reserve_sparse_mla(option: str, kv_cache: Tensor, *, heads: int, kv_lora: int, nope: int) -> str:
    """:func:`choose_sparse_mla` at rewrite time (``kv_cache`` may be a fake tensor), allocating
    FlashInfer's workspace now where it is chosen: a step inside a CUDA graph then allocates
    nothing."""
    kernel = choose_sparse_mla(option, kv_cache, heads=heads, kv_lora=kv_lora, nope=nope)
    if kernel == "flashinfer":
        from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: PLC0415

        with unset_fake_temporarily():  # a real buffer, also inside Inductor's fake mode
            _workspace(kv_cache.device)
    return kernel


def flashinfer_sparse_mla(query: Tensor, kv_cache: Tensor, rows: Tensor, slot_mapping: Tensor, *, kv_lora: int,
                          nope: int, scale: float) -> Tensor:
    """Absorbed sparse MLA decode on FlashInfer: [T, H, L] BF16, as ``sparse_mla_decode_latent``.

    query: [T, H, L+R] BF16; kv_cache: [NB, BS, L+R] BF16, contiguous; rows: [T, K] int32 selected
    cache rows (block * BS + offset), ascending, -1 padded at the end; slot_mapping: [T]
    (-1 = padding token: output 0). A token with no selected row gets 0.
    """
    fn = flashinfer_mla_decode()
    T, H, LR = query.shape
    K = rows.shape[1]
    if T == 0:
        return query.new_empty(0, H, kv_lora)
    q = F.pad(query, (0, 0, 0, FLASHINFER_HEADS - H))  # [T, 128, L+R], zero heads appended
    valid = (rows >= 0).sum(-1, dtype=torch.int32)  # [T] selected rows per token
    out = fn(query=q.unsqueeze(1), kv_cache=kv_cache.unsqueeze(1), workspace_buffer=_workspace(query.device),
             qk_nope_head_dim=nope, kv_lora_rank=kv_lora, qk_rope_head_dim=LR - kv_lora,
             block_tables=rows.unsqueeze(1), seq_lens=valid, max_seq_len=K, sparse_mla_top_k=K,
             bmm1_scale=float(scale), bmm2_scale=1.0)  # [T, 1, 128, L]
    o = out.view(T, FLASHINFER_HEADS, kv_lora)[:, :H]
    keep = ((slot_mapping >= 0) & (valid > 0)).view(T, 1, 1)
    return o.masked_fill(~keep, 0)  # whatever the kernel leaves for a token with no row (NaN included)
