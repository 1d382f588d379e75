"""DEP2: two ranks (gloo on CPU, NCCL on 2 GPUs), each with its own requests and half the experts,
equal to one device; bad EP setups fail on every rank with a clear error, not a hang."""

from __future__ import annotations

import json

import pytest

import dep_workers
from dep_workers import run_ranks


def test_dep2_gloo_equals_single_device(tmp_path):
    run_ranks(dep_workers.dep_check_worker, 2, str(tmp_path))
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(res["ops"]) == {"kimi_dep.moe[ep2]"}
        # against the same backend on one device: only the cross-rank FP32 sum order differs
        # (0 and 0 measured on gloo and NCCL); the bounds leave room for it to flip a BF16 rounding
        assert res["logits_err"] < 0.1 and res["cache_err"] < 0.05, res


@pytest.mark.cuda
@pytest.mark.multigpu
def test_dep2_nccl_equals_single_device(tmp_path):
    run_ranks(dep_workers.dep_check_worker, 2, str(tmp_path), "nccl")
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(res["ops"]) == {"kimi_dep.moe[ep2]"}
        assert res["logits_err"] < 0.1 and res["cache_err"] < 0.05, res


def test_ranks_not_dividing_experts_fail_everywhere(tmp_path):
    run_ranks(dep_workers.bad_setup_worker, 3, str(tmp_path), False)
    msgs = [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)]
    assert all("3 ranks do not divide 64 experts" in m for m in msgs), msgs


def test_mismatched_configs_fail_everywhere(tmp_path):
    run_ranks(dep_workers.bad_setup_worker, 2, str(tmp_path), True)
    msgs = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert all("config differs" in m for m in msgs), msgs


def test_ranks_with_different_batches_meet_in_padded_rows(tmp_path):
    """DP ranks whose batches differ in size (vLLM without CUDA graphs): each rank's experts call pads to the
    rows the ranks agreed on, and returns its own rows equal to all experts on one rank (only the cross-rank
    FP32 sum order differs: one BF16 rounding); a call with more rows than agreed fails before any collective."""
    run_ranks(dep_workers.padded_rows_worker, 2, str(tmp_path))
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["rows"] == 1 + 5 * r and res["err"] < 2 ** -7, res
        assert "more than the" in res["too_many"], res


def test_vllm_model_aligns_its_decoder_calls_across_ep_ranks(tmp_path):
    """The vLLM model's DP alignment (``vllm_k3.dp.align_calls``, no vLLM needed): a rank with fewer step groups
    runs a padding call (no output rows), every call's experts rows are the largest rank's, and each call's
    experts then meet across the ranks and equal all experts on one rank."""
    run_ranks(dep_workers.aligned_calls_worker, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["calls"] == [["decode", 2, 1, 2, 2], ["padding", 2, 2, 12, 0]], res
    assert res[1]["calls"] == [["decode", 1, 1, 2, 1], ["prefill", 1, 12, 12, 12]], res
    assert all(r["err"] < 2 ** -7 for r in res), res
