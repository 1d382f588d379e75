"""A CPU simulator for the few PTX instructions the experts kernels inline (``tl.inline_asm_elementwise``
strings), so their integer and BF16 semantics are checked without a GPU.

Each ``$i`` operand and named register is a uint32 array; ``fma.rn.bf16x2`` runs per 16-bit lane in FP32 and
rounds once to BF16 (exact for the kernels' operands: BF16 x BF16 products fit FP32's significand and stay
above its subnormal range). Anything else raises, so a new instruction cannot be skipped silently.
"""

from __future__ import annotations

import numpy as np
import torch

MASK = np.uint64(0xFFFFFFFF)


def _bf16x2_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Both BF16 lanes of ``a * b + c``, one rounding to BF16 (round to nearest even, subnormals kept)."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        lanes = [torch.from_numpy(((v >> shift) & 0xFFFF).astype(np.int32) << 16).view(torch.float32)
                 for v in (a, b, c)]
        r = (lanes[0] * lanes[1] + lanes[2]).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
        out |= r.astype(np.uint32) << shift
    return out


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """prmt.b32 default mode: byte i of the result is byte ``sel`` nibble i of {b, a} (a bytes 0-3, b 4-7)."""
    pool = (a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32)))
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        if s > 7:
            raise NotImplementedError("prmt sign-replicate selectors")
        out |= (((pool >> np.uint64(8 * s)) & np.uint64(0xFF)).astype(np.uint32)) << np.uint32(8 * i)
    return out


def run_ptx(src: str, inputs: dict[int, np.ndarray], outputs: int) -> list[np.ndarray]:
    """Run ``src`` (operands ``$0 .. $outputs-1`` written, the rest read from ``inputs``) on uint32 arrays."""
    regs: dict[str, np.ndarray] = {f"${i}": np.asarray(v, dtype=np.uint32) for i, v in inputs.items()}
    shape = next(iter(regs.values())).shape

    def val(tok: str) -> np.ndarray:
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)

    for line in src.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *ops = [t.strip() for t in args.split(",")]
        v = [val(t) for t in ops] if op != "prmt.b32" else [val(ops[0]), val(ops[1])]
        if op == "mov.b32":
            r = v[0].copy()
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = (v[0].astype(np.uint64) << v[1].astype(np.uint64) & MASK).astype(np.uint32)
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shf.l.wrap.b32":  # funnel shift left of {hi = v[1], lo = v[0]}: the high word out
            n = v[2].astype(np.uint64) & np.uint64(31)
            wide = (v[1].astype(np.uint64) << np.uint64(32)) | v[0].astype(np.uint64)
            r = ((wide << n) >> np.uint64(32) & MASK).astype(np.uint32)
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], int(ops[2], 0))
        elif op == "fma.rn.bf16x2":
            r = _bf16x2_fma(*v)
        else:
            raise NotImplementedError(f"ptx_sim: {op}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(outputs)]
