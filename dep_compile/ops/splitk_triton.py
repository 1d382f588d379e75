"""Split-K skinny GEMM for decode projections (Triton, SM90).

``out[M, N] = x[M, K] @ w[N, K]^T`` with BF16 operands, FP32 accumulation and one cast to
BF16 at the end. At decode batches (M = 1..64) the GEMM is bound by reading ``w`` once from
HBM, so the kernel is built to stream ``w`` at the memory's rate:

* the grid is ``(cdiv(N, block_n) * split_k, cdiv(M, block_m))``; program ``(t, mt)`` owns the
  ``block_n`` rows ``n0 = (t // split_k) * block_n`` of ``w`` and the K-slice
  ``t % split_k`` (``k_per_split`` columns, a multiple of ``block_k``); the ``split_k`` slices
  of one row tile are consecutive programs, so they run at the same time;
* each program streams its ``[block_n, k_per_split]`` slab of ``w`` through a
  ``num_stages``-deep software pipeline (cp.async, or TMA with ``use_tma``) and multiplies it
  by the matching ``x`` slab with the operands swapped (``acc[block_n, block_m] +=
  w_tile @ x_tile^T``), so that the wide weight tile is the MMA's M side and a batch of one
  row pads only to ``block_m = 16``;
* ``split_k == 1``: the program casts its accumulator and stores it;
  ``split_k > 1``: it stores its FP32 partial to ``partials[slice, M, N]`` in the workspace,
  then bumps the row tile's arrival counter (one ``atom.acq_rel.gpu`` after a CTA barrier);
  the program that arrives last sums the ``split_k`` partials **in slice order** (so the
  result is deterministic), casts once to BF16, stores ``out`` and resets the counter to 0.
  One launch, no memset, no second kernel: CUDA-graph capturable when a workspace is given.

Tensors (all on one CUDA device):

=============  ==========================  ===============================================
name           shape / dtype               notes
=============  ==========================  ===============================================
``x``          ``[M, K]`` bf16             ``x.stride(1) == 1``
``w``          ``[N, K]`` bf16             ``w.stride(1) == 1``; may be a row slice of a
                                           bigger packed weight (``w.stride(0) >= K``)
``out``        ``[M, N]`` bf16             ``out.stride(1) == 1``; fully overwritten
``workspace``  ``[numel]`` fp32            ``split_k > 1`` only; ``numel >=
                                           splitk_workspace_numel(M, N, tactic)``; the
                                           last ``n_tiles * m_tiles`` elements are int32
                                           arrival counters, zero before the first call
                                           and left zero by every call
=============  ==========================  ===============================================

Workspace layout (``S = split_k``, ``n_tiles = cdiv(N, block_n)``, ``m_tiles =
cdiv(M, block_m)``): ``workspace[0 : S*M*N]`` holds the partials, indexed
``s*M*N + m*N + n``; the counters sit at the very end of the buffer, ``workspace[numel -
n_tiles*m_tiles : numel]`` (viewed as int32). Partials never reach the counter zone of any
``M`` the buffer was sized for, so one workspace, made by :func:`splitk_workspace` for the
largest batch, serves every smaller batch and every tactic it was sized for; calls that share
it must be stream-ordered (not concurrent).

Measured on the H200 (docs/perf_projection.md): at Kimi K3's projections (N >= 7168) the best
tactic is ``split_k = 1`` (1.03-1.10x cuBLAS at 1-32 rows, 4.1-4.4 TB/s); ``use_tma`` is within
1 % of cp.async; ``pdl`` (with or without ``prefetch_k``) measured slower, so both stay off.
``num_stages`` is lowered where a stage would not fit in shared memory (``splitk_num_stages``).

The module imports Triton at import time: import it only where CUDA and Triton exist
(``import dep_compile`` never imports it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dep_compile.tactics import SplitK

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "splitk_buffers",
    "splitk_linear",
    "splitk_store",
    "splitk_partials",
    "splitk_workspace",
    "splitk_workspace_numel",
    "splitk_block_m",
    "splitk_grid",
    "splitk_k_per_split",
    "splitk_num_stages",
    "fp32_linear_oracle",
]

_MAX_BLOCK_M = 64
_SMEM_BYTES = 225 * 1024  # SM90 opt-in shared memory per block is 227 KiB; leave room for barriers
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def splitk_block_m(m: int) -> int:
    """The padded row block a batch of ``m`` rows runs with: 16, 32 or 64 (tl.dot needs >= 16)."""
    if m <= 16:
        return 16
    if m <= 32:
        return 32
    return _MAX_BLOCK_M


def splitk_num_stages(m: int, tactic: SplitK) -> int:
    """``tactic.num_stages``, lowered where the pipeline would not fit in shared memory at
    ``m`` rows (each stage holds a ``block_n x block_k`` tile of ``w`` and a ``block_m x
    block_k`` tile of ``x``, BF16)."""
    per_stage = (tactic.block_n + splitk_block_m(m)) * tactic.block_k * 2
    return max(1, min(tactic.num_stages, _SMEM_BYTES // per_stage))


def splitk_k_per_split(k: int, tactic: SplitK) -> int:
    """Columns of K each slice takes: a multiple of ``block_k``."""
    chunks = triton.cdiv(k, tactic.block_k)
    return triton.cdiv(chunks, tactic.split_k) * tactic.block_k


def splitk_grid(m: int, n: int, tactic: SplitK) -> tuple[int, int]:
    """Launch grid ``(cdiv(n, block_n) * split_k, cdiv(m, block_m))``."""
    return (triton.cdiv(n, tactic.block_n) * tactic.split_k, triton.cdiv(m, splitk_block_m(m)))


def _counter_numel(m: int, n: int, tactic: SplitK) -> int:
    grid = splitk_grid(m, n, tactic)
    return (grid[0] // tactic.split_k) * grid[1]


def splitk_workspace_numel(max_rows: int, n: int, tactic: SplitK) -> int:
    """FP32 elements of workspace a call with up to ``max_rows`` rows needs (0 if split_k == 1)."""
    if tactic.split_k == 1:
        return 0
    return tactic.split_k * max_rows * n + _counter_numel(max_rows, n, tactic)


def splitk_workspace(max_rows: int, n: int, tactics, device) -> torch.Tensor:
    """A zeroed workspace for batches of up to ``max_rows`` rows and every tactic given.

    ``tactics`` is one :class:`SplitK` or an iterable of them (e.g. a table's values; other
    entries are ignored). Allocate it once, outside graph capture, and pass it to every call.
    """
    if isinstance(tactics, SplitK):
        tactics = [tactics]
    numel = max([splitk_workspace_numel(max_rows, n, t) for t in tactics if isinstance(t, SplitK)], default=0)
    return torch.zeros(max(numel, 1), dtype=torch.float32, device=device)


@triton.jit
def _prefetch_rows_l2(row_ptrs, nbytes):
    """Bulk-prefetch ``nbytes`` (a multiple of 16) from each 16-byte-aligned row pointer into L2."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [row_ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def splitk_store(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_m, pid_n, pid_k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, PARTIALS_ONLY: tl.constexpr):
    """A program's epilogue: ``acc [BLOCK_N, BLOCK_M]`` (FP32, operands swapped) cast and stored to ``out``; with
    ``SPLIT_K > 1`` stored as this K-slice's partial, and the row tile's last program to arrive sums the
    partials in slice order, stores ``out`` and resets the counter (not with ``PARTIALS_ONLY``)."""
    out_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn = M.to(tl.int64) * N
        p_ptrs = part_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(p_ptrs + pid_k * mn, acc, mask=out_mask)
        if not PARTIALS_ONLY:
            # Every thread's partial is written before thread 0 releases the arrival.
            tl.debug_barrier()
            n_tiles = tl.num_programs(0) // SPLIT_K
            cnt = cnt_ptr + pid_m * n_tiles + pid_n
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sum
                    total += tl.load(p_ptrs + s * mn, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(
    x_ptr,  # [M, K] bf16
    w_ptr,  # [N, K] bf16 (pointer path)
    w_desc,  # TMA descriptor over [N, K], block [BLOCK_N, BLOCK_K] (TMA path)
    out_ptr,  # [M, N] bf16
    part_ptr,  # [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1)
    cnt_ptr,  # [m_tiles * n_tiles] int32 arrival counters (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    K_PER_SPLIT,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,  # with USE_PDL: columns of w per row to prefetch to L2 before waiting
    PARTIALS_ONLY: tl.constexpr = False,  # store the FP32 partials and stop: a consumer kernel sums them
    INTERPRET: tl.constexpr = False,  # Triton's CPU interpreter: its bf16 tl.dot is wrong, use fp32
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    if SPLIT_K > 1:
        pid_n = pid // SPLIT_K
        pid_k = pid % SPLIT_K
    else:
        pid_n = pid
        pid_k = 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # w rows are clamped rather than masked: the ragged last tile re-reads valid rows (L2 hits)
    # and its loads stay unmasked; stores are masked.
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)

    if USE_PDL:
        # Weights do not depend on the previous kernel: start pulling them before waiting.
        if PREFETCH_K > 0:
            nbytes = (tl.minimum(k_end - k_start, PREFETCH_K) * 2) // 16 * 16
            if nbytes > 0:
                _prefetch_rows_l2(w_ptr + rn * stride_wn + k_start, tl.full([BLOCK_N], 0, tl.int32) + nbytes)
        gdc_wait()
        gdc_launch_dependents()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_start + offs_k)[None, :]
    # x rows past M are masked, not clamped: a masked cp.async moves no bytes (M = 1 pads to 16).
    xmask = offs_m[:, None] < M
    for k in tl.range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=xmask, other=0.0)
            if USE_TMA:
                wt = w_desc.load([pid_n * BLOCK_N, k])
            else:
                wt = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            kmask = (k + offs_k) < K
            xt = tl.load(x_ptrs, mask=xmask & kmask[None, :], other=0.0)
            if USE_TMA:
                wt = w_desc.load([pid_n * BLOCK_N, k])
            else:
                wt = tl.load(w_ptrs, mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
        if INTERPRET:
            acc = tl.dot(wt.to(tl.float32), tl.trans(xt).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, tl.trans(xt), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    splitk_store(acc, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_m, pid_n, pid_k,
                 BLOCK_M, BLOCK_N, SPLIT_K, PARTIALS_ONLY)


def splitk_buffers(workspace, m: int, n: int, tactic: SplitK, out: torch.Tensor, fn: str):
    """(partials, arrival counters) of a ``split_k > 1`` call in ``workspace`` (checked; None: a zeroed one made
    for this call); for ``split_k == 1`` both are ``out`` (unused)."""
    if tactic.split_k == 1:
        return out, out
    need = splitk_workspace_numel(m, n, tactic)
    if workspace is None:
        workspace = torch.zeros(need, dtype=torch.float32, device=out.device)
    if workspace.dtype != torch.float32 or not workspace.is_contiguous() or workspace.numel() < need:
        raise ValueError(f"{fn}: workspace must be contiguous fp32 with >= {need} elements "
                         f"(got {workspace.dtype}, {workspace.numel()})")
    return workspace, workspace.view(torch.int32)[workspace.numel() - _counter_numel(m, n, tactic):]


def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, fn: str = "splitk_linear") -> tuple[int, int, int]:
    if x.dim() != 2 or w.dim() != 2 or out.dim() != 2:
        raise ValueError(f"{fn}: x, w, out must be 2-D, got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")
    m, k = x.shape
    n, kw = w.shape
    if kw != k or tuple(out.shape) != (m, n):
        raise ValueError(f"{fn}: shapes x{tuple(x.shape)} w{tuple(w.shape)} out{tuple(out.shape)} do not match")
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"{fn}: x, w and out need unit stride along their last dim")
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"{fn}: empty operand")
    return m, n, k


def splitk_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    tactic: SplitK,
    workspace: torch.Tensor | None = None,
    *,
    use_tma: bool = False,
    pdl: bool = False,
    prefetch_k: int = 0,
) -> torch.Tensor:
    """``out[M, N] = (x[M, K] @ w[N, K]^T)`` in FP32, cast once to ``out.dtype``; returns ``out``.

    ``workspace``: FP32, at least :func:`splitk_workspace_numel` ``(M, N, tactic)`` elements,
    with its counter zone zero (a fresh :func:`splitk_workspace` is); needed only when
    ``tactic.split_k > 1``. Without one a zeroed buffer is allocated per call (not for graphs).

    ``use_tma``: load ``w`` through a host TMA descriptor instead of cp.async.
    ``pdl``: launch as a programmatic dependent launch; the program waits for the previous
    kernel (``griddepcontrol.wait``) before touching ``x``, ``out`` or the workspace, after
    optionally prefetching the first ``prefetch_k`` columns of its ``w`` slab into L2.
    """
    m, n, k = _check(x, w, out)
    bm = splitk_block_m(m)
    split_k = tactic.split_k
    k_per_split = splitk_k_per_split(k, tactic)
    grid = splitk_grid(m, n, tactic)
    parts, counters = splitk_buffers(workspace, m, n, tactic, out, "splitk_linear")
    if pdl and (w.stride(0) % 8 != 0 or w.data_ptr() % 16 != 0):
        prefetch_k = 0
    w_desc = None
    if use_tma:
        if TensorDescriptor is None:
            raise RuntimeError("splitk_linear: this Triton has no host TensorDescriptor")
        w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [tactic.block_n, tactic.block_k])
    _splitk_kernel[grid](
        x,
        w,
        w_desc,
        out,
        parts,
        counters,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        k_per_split,
        BLOCK_M=bm,
        BLOCK_N=tactic.block_n,
        BLOCK_K=tactic.block_k,
        SPLIT_K=split_k,
        EVEN_K=(k % tactic.block_k == 0),
        USE_TMA=bool(use_tma),
        USE_PDL=bool(pdl),
        PREFETCH_K=int(prefetch_k) if pdl else 0,
        INTERPRET=_INTERPRET,
        num_warps=tactic.num_warps,
        num_stages=splitk_num_stages(m, tactic),
        launch_pdl=bool(pdl),
    )
    return out


def splitk_partials(x: torch.Tensor, w: torch.Tensor, tactic: SplitK) -> torch.Tensor:
    """The ``tactic.split_k`` FP32 partial products ``[S, M, N]`` of ``x[M, K] @ w[N, K]^T``, one per
    K-slice, for a consumer kernel to sum in slice order (no workspace, no counters)."""
    parts = torch.empty(tactic.split_k, x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    m, n, k = _check(x, w, parts[0], "splitk_partials")
    _splitk_kernel[splitk_grid(m, n, tactic)](
        x, w, None, parts, parts, parts, m, n, k, x.stride(0), w.stride(0), n, splitk_k_per_split(k, tactic),
        BLOCK_M=splitk_block_m(m), BLOCK_N=tactic.block_n, BLOCK_K=tactic.block_k, SPLIT_K=tactic.split_k,
        EVEN_K=(k % tactic.block_k == 0), USE_TMA=False, USE_PDL=False, PREFETCH_K=0, PARTIALS_ONLY=True,
        INTERPRET=_INTERPRET, num_warps=tactic.num_warps, num_stages=splitk_num_stages(m, tactic),
    )
    return parts


def fp32_linear_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The FP32 reference ``x.float() @ w.float().T`` ([M, N] fp32) the kernel is checked against."""
    return torch.mm(x.float(), w.float().t())
