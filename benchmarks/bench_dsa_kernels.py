"""Tuning sweep of the Triton DSA kernels (``dep_compile.ops.dsa_triton``) at full K3.1 size.

    python benchmarks/bench_dsa_kernels.py [--tokens 1 16 64] [--context 4096 32768] [--kernels ...] [--out DIR]

For each (tokens, context) point (one token per request, block size 64) it times, with CUDA
events over CUDA-graph replays (medians, ``common.time_graph``), every listed configuration of

* ``index_logits`` (keys per step, steps per program, warps, pipeline stages),
* top-k: torch (``select_topk_positions``: topk + sort) against the one-launch radix select
  (``select_topk_triton``, chunk size, warps, radix digit width) and the many-programs-a-row one
  (``topk_triton.select_topk_chunked``: entries a program, warps, digit width), each first checked against torch
  (``topk_chunked``: torch and the many-programs sweep only, without the one-program configs' long compiles),
* ``sparse_mla_decode_latent`` over cache rows (heads per program, entries per step, warps,
  pipeline stages, splits of the selected entries), each first checked against the default,
* ``per_head`` (once per token count): ``absorb_query`` and ``uv_gate`` by the output columns
  a program computes,

and prints µs per configuration, the best, and the bytes each must move (keys at 132 B per
position; selected latents at 1152 B per entry) as TB/s. At small points the caches fit in
L2, so those TB/s are optimistic; the sweep picks configurations, the layer harness
(``bench_attention.py``) gives the numbers that count. Writes ``dsa_kernels.json``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import format_table, tbps, time_graph, write_json  # noqa: E402

H, L, R, HI, DI, TOPK, BS = 96, 512, 64, 32, 128, 2048, 64


def make_case(T: int, ctx: int, seed: int = 0) -> dict:
    """Random full-size inputs for T single-token requests of ``ctx`` tokens each."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    mb = -(-ctx // BS)
    nb = T * mb
    block_table = torch.randperm(nb, device=dev, generator=g).view(T, mb).to(torch.int32)
    seq = torch.full((T,), ctx, dtype=torch.int32, device=dev)
    pos = seq.long() - 1
    slots = block_table.long()[torch.arange(T, device=dev), pos // BS] * BS + pos % BS
    return dict(
        q_idx=torch.randn(T, HI, DI, device=dev, generator=g).to(torch.bfloat16),
        weights=torch.randn(T, HI, device=dev, generator=g).to(torch.bfloat16),
        index_cache=(torch.randn(nb, BS, DI, device=dev, generator=g) * 4).clamp(-8, 8).to(torch.float8_e4m3fn),
        index_scale=torch.rand(nb, BS, device=dev, generator=g) + 0.01,
        kv_cache=(torch.randn(nb, BS, L + R, device=dev, generator=g) * 0.5).to(torch.bfloat16),
        query=(torch.randn(T, H, L + R, device=dev, generator=g) * 0.2).to(torch.bfloat16),
        block_table=block_table, seq_lens=seq, slot_mapping=slots,
    )


def sweep(name: str, configs: list[dict], fn, nbytes: float, T: int, ctx: int, rotate: bool = False) -> list[dict]:
    """Time ``fn(**config)`` (``fn(i, **config)`` for the i-th launch with ``rotate``) for every
    config; print and return the rows."""
    rows = []
    for cfg in configs:
        try:
            us = time_graph(lambda i, cfg=cfg: fn(i, **cfg) if rotate else fn(**cfg), 24)["median_us"]
            rows.append(dict(kernel=name, tokens=T, context=ctx, config=cfg, us=us, tbps=tbps(nbytes, us)))
        except Exception as e:  # noqa: BLE001 - a config that does not compile (registers, smem) is skipped
            rows.append(dict(kernel=name, tokens=T, context=ctx, config=cfg, error=f"{type(e).__name__}: {e}"[:200]))
    best = min((r for r in rows if "us" in r), key=lambda r: r["us"], default=None)
    print(format_table([f"{name} T={T} ctx={ctx}", "µs", "TB/s"],
                       [[str(r["config"]), f"{r['us']:.1f}" if "us" in r else r["error"][:60],
                        f"{r['tbps']:.2f}" if "us" in r else "-"] for r in rows]), flush=True)
    if best:
        print(f"best {name}: {best['config']} {best['us']:.1f} µs", flush=True)
    return rows


def sweep_point(dt, T: int, ctx: int, kernels: set[str], quick: bool = False) -> list[dict]:
    """The sweeps of ``kernels`` at one (tokens, context) point (its tensors freed on return); ``quick``: top-k
    defaults and two chunk sizes only (each one-program config compiles for long at 128K), index logits 64 or 128
    positions a block, 16 blocks a program, 4 or 8 warps, 2-4 stages."""
    c = make_case(T, ctx)
    key_bytes = T * ctx * (DI + 4)
    logits_fn = lambda **k: dt.index_logits(c["q_idx"], c["weights"], c["index_cache"], c["index_scale"],  # noqa: E731
                                            c["block_table"], c["seq_lens"], c["slot_mapping"], 1, **k)
    results = []
    if "index_logits" in kernels:
        grid = [(b, s, w, ns) for b in (64, 128) for s in (1, 4, 16) for w in (4, 8) for ns in (2, 3)] if not quick \
            else [(b, 16, w, ns) for b in (64, 128) for w in (4, 8) for ns in (2, 3, 4)]  # around the full sweep's best
        results += sweep("index_logits", [dict(block_n=b, steps=s, num_warps=w, num_stages=ns) for b, s, w, ns in grid],
                         logits_fn, key_bytes, T, ctx)
    logits = logits_fn()
    topk_torch = lambda: dt.select_topk_positions(logits, TOPK)  # noqa: E731
    topk = topk_torch()
    assert torch.equal(dt.select_topk_triton(logits, TOPK), topk), "top-k kernels disagree"
    if kernels & {"topk", "topk_chunked"}:
        results += sweep("topk_torch", [{}], topk_torch, T * ctx * 4, T, ctx)
    if "topk" in kernels:
        # 4096-entry chunks re-read every pass, or the whole row held in registers (block >= row)
        resident = max(4096, 1 << (ctx - 1).bit_length())
        configs = [{}] if quick else [dict(block=b, num_warps=w, bits=bits) for b in sorted({4096, resident})
                                      for w in (8, 16, 32) for bits in (4, 8)]
        for cfg in configs:  # every variant selects the same entries
            assert torch.equal(dt.select_topk_triton(logits, TOPK, **cfg), topk), f"top-k {cfg} disagrees"
        results += sweep("topk_triton", configs, lambda **k: dt.select_topk_triton(logits, TOPK, **k), T * ctx * 4,
                         T, ctx)
    if kernels & {"topk", "topk_chunked"}:
        from dep_compile.ops.topk_triton import select_topk_chunked  # noqa: PLC0415 - CUDA only

        chunked = [dict(chunk=c, num_warps=w, bits=bits)
                   for c in ((2048, 4096) if quick else (1024, 2048, 4096, 8192, 16384))
                   for w in ((8,) if quick else (4, 8, 16)) for bits in ((8,) if quick else (4, 8)) if c // (32 * w) >= 1]
        for cfg in chunked:  # many programs a row: the same entries
            assert torch.equal(select_topk_chunked(logits, TOPK, **cfg), topk), f"chunked top-k {cfg} disagrees"
        results += sweep("topk_chunked", chunked, lambda **k: select_topk_chunked(logits, TOPK, **k), T * ctx * 4,
                         T, ctx)
    if "sparse_mla" not in kernels:
        return results
    rows = dt.physical_rows(topk, c["block_table"], 1, BS)
    ref = dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], topk, c["slot_mapping"], 1, L,
                                      192 ** -0.5).float()

    def mla_fn(physical=False, **k):
        return dt.sparse_mla_decode_latent(c["query"], c["kv_cache"], c["block_table"], rows if physical else topk,
                                           c["slot_mapping"], 1, L, 192 ** -0.5, physical=physical, **k)

    tiles = [(64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2)]  # the defaults and the runners-up (cache rows)
    configs = [dict(block_h=h, block_n=n, num_warps=w, num_stages=ns, physical=True, splits=sp)
               for h, n, w, ns in tiles for sp in (None, 1, 2, 4, 8, 32)]
    # shorter steps over the selected rows, deeper load pipelines (default splits)
    configs += [dict(block_h=h, block_n=n, num_warps=w, num_stages=ns, physical=True)
                for h, n, w, ns in ((64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 4), (64, 64, 8, 3), (32, 32, 4, 3))]
    for cfg in configs:  # every variant computes the same output
        try:
            got = mla_fn(**cfg).float()
        except Exception:  # noqa: BLE001 - does not compile (registers, smem): the sweep reports it
            continue
        err = float((got - ref).abs().max())
        assert err < 2e-2, f"sparse_mla {cfg}: max abs diff {err:.2e} from the default configuration"
    return results + sweep("sparse_mla", configs, mla_fn, T * min(ctx, TOPK) * (L + R) * 2, T, ctx)


def sweep_per_head(dt, T: int) -> list[dict]:
    """The per-head projections of the latent (context-free): W_UK absorb and W_UV + gate, by the
    columns a program computes, each first checked against one program a head. Eight copies of
    each 12.6 MB weight rotate (100 MB, past the 60 MB L2), as in the layer, where they stream."""
    g = torch.Generator(device="cuda").manual_seed(T)
    rn = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, o_lat, gate = rn(T, H, 192), rn(T, H, L), rn(T, H * 128)
    w_uk, w_uv = rn(8, H, 128, L) * 0.1, rn(8, H, 128, L) * 0.1
    weights = H * 128 * L * 2
    results = []
    for name, fn, knob, full, nbytes in (
            ("absorb", lambda i, **k: dt.absorb_query(q, w_uk[i % 8], **k), "block_l", L,
             weights + T * H * (192 + L + R) * 2),
            ("uv_gate", lambda i, **k: dt.uv_gate(o_lat, w_uv[i % 8], gate, **k), "block_v", 128,
             weights + T * H * (L + 2 * 128) * 2)):
        configs = [{knob: c} for c in (full, full // 2, full // 4, full // 8)]
        ref = fn(0, **configs[0])
        for cfg in configs[1:]:
            assert torch.equal(fn(0, **cfg), ref), f"{name} {cfg} differs from one program a head"
        results += sweep(name, configs, fn, nbytes, T, 0, rotate=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--kernels", nargs="+", default=["index_logits", "topk", "sparse_mla", "per_head"],
                    choices=["index_logits", "topk", "topk_chunked", "sparse_mla", "per_head"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="top-k: the defaults and two chunk sizes only; index logits: 12 tiles around the best")
    args = ap.parse_args()
    from dep_compile.ops import dsa_triton as dt  # noqa: PLC0415 - CUDA only

    results = []
    for T, ctx in itertools.product(args.tokens, args.context):
        results += sweep_point(dt, T, ctx, set(args.kernels), args.quick)
        torch.cuda.empty_cache()
    if "per_head" in args.kernels:
        for T in args.tokens:
            results += sweep_per_head(dt, T)
    write_json(os.path.join(args.out, "dsa_kernels.json"), {"results": results})


if __name__ == "__main__":
    main()
