#!/usr/bin/env python3
"""The SM90 machine code of kimi_dep's hottest Triton loops, compiled on a CPU: each loop's instruction mix.

Triton compiles for a GPU target without a GPU, and its wheel carries ``ptxas`` and ``cuobjdump``, so the SASS
that an H200 runs can be read here: how many instructions a loop step issues, and of which kind (the ALU pipe's
logic ops and shifts, the FMA pipe's, loads, barriers). docs/perf.md quotes these counts where it predicts a
kernel change. The launch's specializations are reproduced (16-byte-aligned pointers and strides). The GPU image
runs Triton 3.6: to read its code, install that Triton beside this one and put it first on the path::

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36:. python3 benchmarks/sass_mix.py attn_res experts_gemm1

Kernels (K3 shapes): ``attn_res`` (the fused AttnRes -> RMSNorm reading its bank rows, 16 warps), ``attn_res_part``
(its bank rows' part computed a point early, option attn_res_ahead), ``experts_gemm1`` (the MXFP4 routed
experts' gate / up GEMM on tiles, default tactic, 32-row passes), ``kda_core`` (the fused KDA decode core at a
4-token verify step), ``kda_prep`` and ``kda_state`` (the split KDA core's two launches, the same step) and
``sparse_mla`` (the DSA layer's sparse MLA at 64 tokens, the default tile). Each kernel's tensor-core layouts are listed too: a wgmma
layout whose warps along M cover more rows than the tile has computes that tile once a warpgroup.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dep_compile.stock.config import PRESETS  # noqa: E402


def compile_sm90(kernel, signature: dict, constexprs: dict, unaligned=(), **options):
    """``kernel`` compiled for SM90 with ``signature`` (name -> Triton type) and ``constexprs``; pointers and
    ``stride*`` arguments (but those named in ``unaligned``) marked 16-byte aligned, as a launch with such tensors
    specializes them."""
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    aligned = [n for n in names if (sig[n].startswith("*") or n.startswith("stride")) and n not in unaligned]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass(compiled) -> str:
    """The cubin's SASS, by the ``cuobjdump`` Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


def loops(listing: str) -> list[collections.Counter]:
    """The instruction mix (full opcode -> count) of each loop: the code from a backward branch's target to it
    (an outer loop's mix holds its inner loops' code once)."""
    code = []  # (address, opcode)
    for line in listing.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2), m.group(3)))
    found = []
    for addr, op, rest in code:
        target = re.match(r"\s*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            found.append(collections.Counter(o for a, o, _ in code if lo <= a <= addr))
    return found


def attn_res(part: bool = False, **ones):
    """The fused AttnRes -> RMSNorm kernel at K3's hidden size (``part``: the point merging its bank part; ``ones``:
    integer arguments given as 1, which a launch specializes to constants)."""
    from dep_compile.stock import attn_res_cuda as A  # noqa: PLC0415

    D = PRESETS["k3"].hidden_size
    block_d, num_warps = A.launch_shape(D)
    sig = dict(prefix_ptr="*bf16", bank_ptr="*bf16", delta_ptr="*bf16", query_ptr="*bf16", norm_w_ptr="*bf16",
               part_ptr="*fp32", out_ptr="*bf16", stride_p="i32", stride_bs="i32", stride_bt="i32", stride_dl="i32",
               stride_pt="i32", stride_o="i32", num_blocks="i32", write_slot="i32", eps="fp32", norm_eps="fp32")
    sig = {n: t for n, t in sig.items() if n not in ones}
    return compile_sm90(A._attn_res_kernel, sig, dict(D=D, BLOCK_D=block_d, UNROLL=A.UNROLL, NORM=True, PART=part,
                                                     **ones), num_warps=num_warps)


def attn_res_part():
    """The AttnRes bank part (option attn_res_ahead: the next point's bank rows, off the step's path) at K3's size."""
    from dep_compile.stock import attn_res_cuda as A  # noqa: PLC0415

    D = PRESETS["k3"].hidden_size
    block_d, num_warps = A.launch_shape(D)
    sig = dict(bank_ptr="*bf16", query_ptr="*bf16", part_ptr="*fp32", stride_bs="i32", stride_bt="i32",
               stride_pt="i32", num_blocks="i32", write_slot="i32", eps="fp32")
    return compile_sm90(A._attn_res_part_kernel, sig, dict(D=D, BLOCK_D=block_d, UNROLL=A.UNROLL), num_warps=num_warps)


def experts_gemm1():
    """The MXFP4 routed experts' GEMM1 on tiles at K3's shapes, the default tactic, 64 tokens (32-row passes)."""
    from dep_compile.ops import experts_triton as X  # noqa: PLC0415

    cfg, t = PRESETS["k3"], X.DEFAULT_MXFP4_TACTIC
    lat, inter = cfg.moe_latent_size, cfg.moe_intermediate
    bm = X.experts_block_m(64)
    pipe = X._pipeline(2 * t.block_n1, bm, max(bm, X.BIG_M), t, True)
    sig = dict(x_ptr="*bf16", w13_ptr="*i32", s13_ptr="*i16", act_ptr="*bf16", part_ptr="*fp32", order_ptr="*i32",
               slot_ptr="*i32", meta_ptr="*i32", stride_x="i32", stride_we="i64", stride_wn="i64", stride_se="i64",
               stride_sn="i64", K_TOP="i32", beta="fp32", beta_lin="fp32")
    consts = dict(LAT=lat, INTER=inter, BLOCK_M=bm, BIG_M=max(bm, X.BIG_M), SMALL_TAIL=t.small_tail,
                  BLOCK_N=t.block_n1, BLOCK_K=t.block_k,
                  STAGES=pipe["STAGES"], BIG_STAGES=pipe["BIG_STAGES"], MXFP4=True, PTX=True, TILES=True,
                  INTERPRET=False, N_TILES=triton.cdiv(inter, t.block_n1), STEPS=triton.cdiv(lat, t.block_k),
                  SLOTS=t.fill * X.INTERPRETER_SMS, S_MAX=t.split_k, ROWS=X.SPLIT_ROWS)
    return compile_sm90(X._gemm1_kernel, sig, consts, num_warps=t.num_warps, num_stages=pipe["num_stages"],
                        maxnreg=t.maxnreg)


def kda_core(q_len: int = 4):
    """The fused KDA decode core (one program a request's head: conv, gates, delta rule, gated norm) at K3's size,
    a verify step of ``q_len`` tokens, 4 warps (the default)."""
    from dep_compile.ops import kda_triton as K  # noqa: PLC0415

    cfg = PRESETS["k3"]
    H, D = cfg.kda_heads, cfg.kda_head_dim
    sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*bf16", fa_ptr="*bf16", beta_ptr="*bf16",
               fbw_ptr="*bf16", cw_ptr="*bf16", alog_ptr="*fp32", dtb_ptr="*fp32", onw_ptr="*bf16",
               cs_ptr="*bf16", st_ptr="*fp32", idx_ptr="*i32", acc_ptr="*i32", out_ptr="*bf16",
               stride_q="i32", stride_k="i32", stride_v="i32", stride_g="i32", stride_fa="i32", stride_beta="i32",
               stride_fbw="i32", stride_cw_c="i32", stride_cw_w="i32", stride_cs_s="i32", stride_cs_w="i32",
               stride_st_s="i32", stride_st_h="i32", stride_out="i32", lower_bound="fp32", norm_eps="fp32")
    consts = dict(H=H, D=D, F=cfg.kda_f_rank, W=cfg.kda_conv_width, WP=triton.next_power_of_2(cfg.kda_conv_width),
                  Q_LEN=q_len, ST_V=D, ST_K=1, FB=32, GRAW=False)
    return compile_sm90(K._kda_decode_kernel, sig, consts, num_warps=4)


def kda_state(q_len: int = 4):
    """The split KDA core's state launch (the delta rule over the prep launch's workspace, a quarter of a head's
    rows a program) at K3's size, a verify step of ``q_len`` tokens, with its launch's warps and register cap."""
    from dep_compile.ops import kda_triton as K  # noqa: PLC0415

    cfg = PRESETS["k3"]
    H, D = cfg.kda_heads, cfg.kda_head_dim
    sig = dict(xs_ptr="*bf16", dec_ptr="*fp32", sc_ptr="*fp32", st_ptr="*fp32", idx_ptr="*i32", acc_ptr="*i32",
               ow_ptr="*fp32", ss_ptr="*fp32", stride_st_s="i32", stride_st_h="i32")
    consts = dict(H=H, D=D, Q_LEN=q_len, ST_V=D, ST_K=1, R=K.STATE_ROW_PARTS)
    return compile_sm90(K._kda_state_kernel, sig, consts, **K.STATE_LAUNCH)


def kda_prep(q_len: int = 4):
    """The split KDA core's prep launch (conv, F_B as one product, norms, decay, beta, the new conv taps) at K3's
    size, a verify step of ``q_len`` tokens: ``PREP_ROWS`` token rows a program, 4 warps."""
    from dep_compile.ops import kda_triton as K  # noqa: PLC0415

    cfg = PRESETS["k3"]
    sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", fa_ptr="*bf16", beta_ptr="*bf16", fbw_ptr="*bf16",
               cw_ptr="*bf16", alog_ptr="*fp32", dtb_ptr="*fp32", cs_ptr="*bf16", idx_ptr="*i32", acc_ptr="*i32",
               xs_ptr="*bf16", dec_ptr="*fp32", sc_ptr="*fp32", B="i32", stride_q="i32", stride_k="i32",
               stride_v="i32", stride_fa="i32", stride_beta="i32", stride_fbw="i32", stride_cw_c="i32",
               stride_cw_w="constexpr", stride_cs_s="i32", stride_cs_w="i32", lower_bound="fp32")
    consts = dict(H=cfg.kda_heads, D=cfg.kda_head_dim, F=cfg.kda_f_rank, W=cfg.kda_conv_width,
                  WP=triton.next_power_of_2(cfg.kda_conv_width), Q_LEN=q_len, QP=triton.next_power_of_2(q_len),
                  RB=K.prep_requests(q_len), GRAW=False, F32=False,
                  stride_cw_w=1)  # conv_w [3 HD, W] contiguous: the launch makes its unit stride a constant
    return compile_sm90(K._kda_prep_kernel, sig, consts, unaligned=("stride_cw_c",), num_warps=4)  # W: not 16-aligned


def sparse_mla(tokens: int = 64):
    """The sparse MLA decode over cache rows (``physical``) at K3's size with the tile its wrapper picks for
    ``tokens`` step tokens, one split (the 64-token default)."""
    from dep_compile.ops import dsa_triton as M  # noqa: PLC0415

    cfg = PRESETS["k3"]
    tile = M.sparse_mla_tile(tokens, physical=True)
    sig = dict(q_ptr="*bf16", kv_ptr="*bf16", bt_ptr="*i32", idx_ptr="*i32", slot_ptr="*i32", o_ptr="*bf16",
               m_ptr="*fp32", l_ptr="*fp32", ks_ptr="*fp32", stride_q_t="i32", stride_q_h="i32",
               stride_kv_blk="i32", stride_kv_off="i32", stride_bt="i32", stride_idx="i32", stride_o_t="i32",
               stride_o_s="i32", stride_o_h="i32", stride_ml_t="i32", stride_ml_s="i32", stride_ks_blk="i32",
               stride_ks_off="i32", scale="fp32")
    consts = dict(Q_LEN=1, H=cfg.mla_heads, L=cfg.kv_lora_rank, R=cfg.qk_rope_dim, BS=64,
                  BLOCK_H=tile["block_h"], BLOCK_N=64, CHUNK=cfg.index_topk, PHYS=True, DIRECT=True, F32=False,
                  FP8=False)
    return compile_sm90(M._sparse_mla_kernel, sig, consts, num_warps=tile["num_warps"],
                        num_stages=tile["num_stages"])


def mma_layouts(compiled) -> list[str]:
    """The tensor-core layouts of ``compiled``'s dots (TTGIR ``nvidia_mma``: version, warps, instruction shape)."""
    return re.findall(r"#ttg\.nvidia_mma<\{(.*?)\}>", compiled.asm["ttgir"])


KERNELS = {"attn_res": attn_res, "attn_res_part": attn_res_part, "experts_gemm1": experts_gemm1,
           "kda_core": kda_core, "kda_prep": kda_prep, "kda_state": kda_state, "sparse_mla": sparse_mla}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="+", choices=sorted(KERNELS))
    ap.add_argument("--top", type=int, default=24, help="opcodes listed a loop")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, SM90")
    for name in args.kernels:
        compiled = KERNELS[name]()
        listing = sass(compiled)
        spills = len(re.findall(r"\b(?:LDL|STL)\b", listing))
        print(f"\n{name}: {spills} local-memory (spill) instructions, {compiled.metadata.shared} B of shared memory")
        for layout in mma_layouts(compiled):
            print(f"  mma layout: {layout}")
        for i, mix in enumerate(loops(listing)):
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top))
            print(f"  loop {i}: {sum(mix.values())} instructions a step; {top}")


if __name__ == "__main__":
    main()
