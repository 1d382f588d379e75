"""Greedy generation with the stock decoder in eager mode: what the vLLM model must reproduce token for token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dep_compile.stock.cache import KimiCache, RequestBatch, check_step


def fp32_logits(lm_head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """lm_head in FP32: [T, hidden] BF16 -> [T, vocab] FP32. The stock decoder's BF16 logits tie
    often (8-bit mantissa), and a tie makes a greedy choice depend on tie-breaking, not the model."""
    return F.linear(hidden.float(), lm_head.weight.float())


@torch.no_grad()
def stock_generate(model, prompts: list[list[int]], max_tokens: int | list[int],
                   block_size: int = 16) -> list[list[int]]:
    """Each prompt on its own, one token a step (q = 1) from zero caches; the argmax of each step's
    FP32 logits (``fp32_logits`` of the stock decoder's final hidden state).

    ``model`` is a ``dep_compile.stock`` decoder (e.g. ``checkpoint.load_stock_model(dir)``);
    ``max_tokens`` one count or one per prompt.
    """
    cfg = model.config
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outputs = []
    for prompt, max_tokens in zip(prompts, counts):
        blocks = -(-(len(prompt) + max_tokens) // block_size)
        cache = KimiCache.allocate(cfg, num_slots=1, num_blocks=blocks, block_size=block_size, seed=None)
        for lc in cache.layers:
            for t in lc.tensors().values():
                t.zero_()
        batch = RequestBatch(cache, 1)
        tokens, out = list(prompt), []
        for i in range(len(prompt) + max_tokens - 1):
            ids, meta = torch.tensor([tokens[i]]), batch.step(1)
            check_step(cfg, ids, meta, cache)
            logits = fp32_logits(model.lm_head, model.model(ids, meta, cache))
            if i >= len(prompt) - 1:
                tokens.append(int(logits[0].argmax()))
                out.append(tokens[-1])
        outputs.append(out)
    return outputs


@torch.no_grad()
def stock_replay(model, prompt: list[int], generated: list[int], block_size: int = 16) -> list[tuple[float, float]]:
    """Teacher-forced stock decoder over ``prompt + generated`` (one token a step, q = 1): per
    generated token, (its FP32 logit's gap below the best logit, its log-probability)."""
    cfg = model.config
    seq = list(prompt) + list(generated)
    cache = KimiCache.allocate(cfg, num_slots=1, num_blocks=-(-len(seq) // block_size), block_size=block_size,
                               seed=None)
    for lc in cache.layers:
        for t in lc.tensors().values():
            t.zero_()
    batch = RequestBatch(cache, 1)
    out = []
    for i in range(len(seq) - 1):
        ids, meta = torch.tensor([seq[i]]), batch.step(1)
        check_step(cfg, ids, meta, cache)
        logits = fp32_logits(model.lm_head, model.model(ids, meta, cache))[0]
        if i >= len(prompt) - 1:
            tok = seq[i + 1]
            out.append((float(logits.max() - logits[tok]), float(torch.log_softmax(logits, -1)[tok])))
    return out


__all__ = ["stock_generate", "stock_replay", "fp32_logits"]
