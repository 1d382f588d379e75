#!/usr/bin/env python3
"""Op-level benchmark of the Triton KDA decode core (``dep_compile.ops.kda_triton``).

Kimi K3 full size (H=96, D=128, F=128, conv width 4), decode (q_len = 1; ``--q 2``/``4``: verify steps, each
request accepting a random 1..q of its tokens) at B in {1, 4, 16, 64} requests. For every B it

1. checks every variant against ``kda_core_ref`` on the GPU (same inputs, cloned states):
   output rel. Frobenius error, committed-state rel. error, conv state bit-equality;
2. times each kernel variant (``VARIANTS``: warps, F_B chunk, the split form, F_B as a GEMM before the core) with
   CUDA-graph replays
   (``benchmarks/common.time_graph``), rotating over enough "layer copies" (states, conv
   states, f_b_w, conv_w, inputs) that their total exceeds twice the L2, medians;
3. if ``fla-core`` imports, times ``fla.ops.kda`` fused recurrent decode (in-kernel gate, L2
   norm, beta sigmoid, state indices, FP32 state in place, V-first state layout) over the same
   rotation (a request's q tokens one sequence). fla's kernel covers the recurrence only (no conv, no F_B GEMM,
   no gated norm).

Reported: µs per launch (the split form: both launches), state traffic TB/s (state read + written: 2 x 6 MiB per
request; the split form's workspace, 2 x 1296 bytes a token a head, is not counted),
all-bytes TB/s (state + f_b_w + conv state + inputs/outputs), the state floor at 4.33 TB/s.
Writes ``kda_core.json`` and the plot ``kda_core.png`` to ``--out`` (default ``$OUT`` or ``.``).

Run from the repository root on a CUDA machine::

    python3 benchmarks/bench_kda_core.py --out $OUT [--q 4]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import common  # noqa: E402

H, D, FR, W = 96, 128, 128, 4
HD = H * D
LOWER_BOUND, NORM_EPS = -5.0, 1e-5
BATCHES = (1, 4, 16, 64)
VARIANTS = {  # name -> launcher kwargs
    "w4": dict(num_warps=4),
    "w4_fb64": dict(num_warps=4, fb=64),
    "w8": dict(num_warps=8),
    "split": dict(split=True),  # prep launch + state launch (kda_decode_core's ``split``)
    # F_B as one GEMM for every token (F.linear, cuBLAS) before the core, which reads the raw gate: f_b_w read once,
    # not once a token by each (request, head) program
    "w4_fb_out": dict(num_warps=4, fb_outside=True),
    "split_fb_out": dict(split=True, fb_outside=True),
}


def make_copy(B: int, seed: int, dev: str, q_len: int = 1) -> dict:
    """One layer's worth of random inputs / weights / states for a step of B requests of ``q_len`` tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    T = B * q_len
    packed = rn(T, 4 * HD + FR + H).to(torch.bfloat16).to(dev)
    q, k, v, g_out, f_a, beta = packed.split([HD, HD, HD, HD, FR, H], -1)
    S = B + 2
    c_idx = torch.randperm(S, generator=g)[:B].to(torch.int32).to(dev)
    c = dict(
        packed=packed, q=q, k=k, v=v, g_out=g_out, f_a=f_a, beta=beta,
        f_b_w=(rn(HD, FR) * FR ** -0.5).to(torch.bfloat16).to(dev),
        conv_w=(rn(3 * HD, W) * 0.5).to(torch.bfloat16).to(dev),
        A_log=torch.log(torch.rand(H, generator=g) * 15 + 1).to(dev),
        dt_bias=rn(HD).to(dev),
        o_norm_w=(1 + 0.2 * rn(D)).to(torch.bfloat16).to(dev),
        conv_state=rn(S, W - 1, 3 * HD).to(torch.bfloat16).to(dev),
        rec_state=(rn(S, H, D, D) * 0.3).to(dev),
        state_indices=c_idx,
        accepted=torch.randint(1, q_len + 1, (B,), generator=g, dtype=torch.int32).to(dev),
        q_len=q_len,
    )
    c["out"] = torch.empty(T, HD, dtype=torch.bfloat16, device=dev)
    # fla's inputs: contiguous [1, T, H, D] q/k/v/g, [1, T, H] beta (values need not match ours).
    c["fla"] = dict(
        q=rn(1, T, H, D).to(torch.bfloat16).to(dev), k=rn(1, T, H, D).to(torch.bfloat16).to(dev),
        v=rn(1, T, H, D).to(torch.bfloat16).to(dev), g=rn(1, T, H, D).to(torch.bfloat16).to(dev),
        beta=rn(1, T, H).to(torch.bfloat16).to(dev), out=torch.empty(1, T, H, D, dtype=torch.bfloat16, device=dev),
        cu=torch.arange(0, T + 1, q_len, dtype=torch.int32, device=dev),
        # fla-core 0.6 stores the state after every token, at ssm_state_indices[request, token] (a contiguous
        # [B, q] table, vLLM's speculative layout; it ignores the token stride): each token its request's slot
        idx=c_idx.repeat_interleave(q_len).view(B, q_len).contiguous() if q_len > 1 else c_idx,
    )
    return c


def copy_bytes(B: int, q: int = 1) -> int:
    S = B + 2
    return (S * H * D * D * 4 + S * (W - 1) * 3 * HD * 2 + HD * FR * 2 + 3 * HD * W * 2
            + B * q * (4 * HD + FR + H) * 2)


def moved_bytes(B: int, q: int = 1) -> tuple[int, int]:
    """(state bytes read + written, all bytes that must move) for one step of ``q`` tokens a request."""
    state = 2 * B * H * D * D * 4
    conv = 2 * B * (W - 1) * 3 * HD * 2
    rest = HD * FR * 2 + 3 * HD * W * 2 + B * q * (4 * HD + FR + H) * 2 + B * q * HD * 2
    return state, state + conv + rest


def run_ours(kt, c, fb_outside: bool = False, **kw):
    f_a, f_b_w = (F.linear(c["f_a"], c["f_b_w"]), None) if fb_outside else (c["f_a"], c["f_b_w"])
    return kt.kda_decode_core(c["q"], c["k"], c["v"], f_a, f_b_w, c["beta"], c["g_out"], c["conv_w"],
                              c["A_log"], c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"],
                              c["state_indices"], c["accepted"], c["q_len"], LOWER_BOUND, NORM_EPS, out=c["out"], **kw)


def check(kt, c, kw) -> dict:
    from dep_compile.stock.reference.kda import kda_core_ref  # noqa: PLC0415

    conv0, rec0 = c["conv_state"].clone(), c["rec_state"].clone()
    c["out"].fill_(float("nan"))
    out = run_ours(kt, c, **kw).clone()
    conv_k, rec_k = c["conv_state"].clone(), c["rec_state"].clone()
    c["conv_state"].copy_(conv0)
    c["rec_state"].copy_(rec0)
    g_raw = F.linear(c["f_a"], c["f_b_w"])
    ref = kda_core_ref(c["q"], c["k"], c["v"], g_raw, c["beta"], c["g_out"], c["conv_w"], c["A_log"],
                       c["dt_bias"], c["o_norm_w"], c["conv_state"], c["rec_state"], c["state_indices"],
                       c["accepted"], c["q_len"], LOWER_BOUND, NORM_EPS)
    torch.cuda.synchronize()
    res = dict(
        finite=bool(torch.isfinite(out.float()).all()),
        out_rel=common.rel_err(out, ref),
        out_max=float((out.float() - ref.float()).abs().max()),
        state_rel=common.rel_err(rec_k, c["rec_state"]),
        conv_equal=bool(torch.equal(conv_k, c["conv_state"])),
    )
    res["ok"] = res["finite"] and res["out_rel"] < 1e-2 and res["state_rel"] < 1e-3 and res["conv_equal"]
    return res


def fla_step(fla_fwd, c):
    f = c["fla"]
    return fla_fwd(q=f["q"], k=f["k"], v=f["v"], g=f["g"], beta=f["beta"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                   initial_state=c["rec_state"], inplace_final_state=True, state_v_first=True,
                   cu_seqlens=f["cu"], ssm_state_indices=f["idx"], use_qk_l2norm_in_kernel=True,
                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND,
                   out=f["out"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--q", type=int, default=1, help="tokens a request (verify steps above 1)")
    args = ap.parse_args()
    from dep_compile.ops import kda_triton as kt  # noqa: PLC0415

    fla_fwd, fla_err = None, None
    if not args.no_fla:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd  # noqa: PLC0415
        except Exception as e:  # noqa: BLE001
            fla_err = repr(e)
    print("env", common.env_info(), "fla:", "yes" if fla_fwd else fla_err, flush=True)
    variants = {n: VARIANTS[n] for n in args.variants.split(",")}
    results = []
    for B in map(int, args.batches.split(",")):
        n = common.rotation_copies(copy_bytes(B, args.q))
        copies = [make_copy(B, 100 * B + i, "cuda", args.q) for i in range(n)]
        state_b, all_b = moved_bytes(B, args.q)
        row = dict(B=B, q=args.q, copies=n, state_bytes=state_b, all_bytes=all_b,
                   floor_state_us=common.floor_us(state_b), floor_all_us=common.floor_us(all_b))
        checks = {name: check(kt, copies[0], kw) for name, kw in variants.items()}
        row["check"] = dict(ok=all(c["ok"] for c in checks.values()), variants=checks)
        print(f"B={B} copies={n} check={checks}", flush=True)
        steps = common.steps_per_replay(max(3.0, B * 4.0 * args.q), n)
        for name, kw in variants.items():
            try:
                t = common.time_graph(lambda i, kw=kw: run_ours(kt, copies[i % n], **kw), steps)
                row[name] = t
                print(f"  {name:8s} {t['median_us']:8.2f} us  state {common.tbps(state_b, t['median_us']):.2f} TB/s"
                      f"  all {common.tbps(all_b, t['median_us']):.2f} TB/s", flush=True)
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=repr(e))
                print(f"  {name} failed: {e!r}", flush=True)
        if fla_fwd is not None:
            try:
                t = common.time_graph(lambda i: fla_step(fla_fwd, copies[i % n]), steps)
                row["fla"] = t
                fla_state = state_b * (1 + args.q) // 2  # its state read once, written after each of q tokens
                print(f"  fla      {t['median_us']:8.2f} us  state {common.tbps(fla_state, t['median_us']):.2f} TB/s",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                row["fla"] = dict(error=repr(e))
                print(f"  fla failed: {e!r}", flush=True)
        # second timing of the first variant: the run-to-run spread
        name0 = next(iter(variants))
        try:
            row[name0 + "_again"] = common.time_graph(lambda i: run_ours(kt, copies[i % n], **variants[name0]), steps)
        except Exception as e:  # noqa: BLE001
            row[name0 + "_again"] = dict(error=repr(e))
        results.append(row)
        copies.clear()  # free this batch's tensors before the next
        torch.cuda.empty_cache()

    names = list(variants) + ["fla"]
    headers = ["B", "copies"] + [f"{v} µs" for v in names] + ["best µs", "state TB/s", "all TB/s",
                                                              "state floor µs", "again µs", "check"]
    rows = []
    for r in results:
        times = {v: r[v]["median_us"] for v in variants if "median_us" in r.get(v, {})}
        best = min(times, key=times.get) if times else None
        bt = times.get(best, float("nan"))
        cells = [r["B"], r["copies"]]
        for v in names:
            t = r.get(v, {})
            cells.append(f"{t['median_us']:.2f}" if "median_us" in t else "-")
        again = r.get(name0 + "_again", {})
        cells += [f"{bt:.2f} ({best})", f"{common.tbps(r['state_bytes'], bt):.2f}",
                  f"{common.tbps(r['all_bytes'], bt):.2f}", f"{r['floor_state_us']:.2f}",
                  f"{again['median_us']:.2f}" if "median_us" in again else "-",
                  "ok" if r["check"]["ok"] else f"FAIL {r['check']}"]
        rows.append(cells)
    kernels = []
    try:  # registers / spills of every compiled specialization (best effort: Triton internals)
        for fn in (kt._kda_decode_kernel, kt._kda_prep_kernel, kt._kda_state_kernel, kt._kda_norm_kernel):
            for cache in fn.device_caches.values():
                for key, ck in cache[0].items():
                    kernels.append(dict(kernel=fn.__name__, key=str(key)[:200], n_regs=getattr(ck, "n_regs", None),
                                        n_spills=getattr(ck, "n_spills", None), num_warps=ck.metadata.num_warps))
                    print("kernel", fn.__name__, kernels[-1]["num_warps"], "warps: regs", kernels[-1]["n_regs"],
                          "spills", kernels[-1]["n_spills"])
    except Exception as e:  # noqa: BLE001
        print("kernel info unavailable:", repr(e))
    name = "kda_core" if args.q == 1 else f"kda_core_q{args.q}"
    path = common.write_json(os.path.join(args.out, f"{name}.json"), {"results": results, "kernels": kernels})
    plot(results, os.path.join(args.out, f"{name}.png"))
    print(common.format_table(headers, rows))
    print("wrote", path)


def plot(results: list[dict], path: str) -> None:
    """µs per launch vs requests: every variant, fla-core, and the state floor at 4.33 TB/s."""
    names = [n for n, v in results[0].items() if isinstance(v, dict) and "median_us" in v and not n.endswith("_again")]
    series = {("fla-core" if n == "fla" else f"kimi_dep {n}"): [r.get(n, {}).get("median_us") for r in results]
              for n in names}
    series["state floor @4.33 TB/s"] = [r["floor_state_us"] for r in results]
    common.plot_panels(path, [{"title": f"KDA decode core (full size, q={results[0]['q']})", "x": [r["B"] for r in results],
                               "series": series}], xlabel="requests", ylabel="µs per launch",
                       suptitle="kimi_dep Triton KDA core vs fla-core fused_recurrent_kda")


if __name__ == "__main__":
    main()
