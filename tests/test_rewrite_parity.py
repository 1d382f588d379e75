"""Parity: the rewritten graph matches stock eager on logits and on every cache after 8+ steps."""

from __future__ import annotations

import pytest

from dep_compile.stock import preset
from dep_compile.tactics import DEP_OPROJ, DEP_PROJECTION, SplitK

from helpers import LOGIT_ATOL, STATE_ATOL, run_pair

# Split-K at small batches, cuBLAS above 2 rows: one run crosses a table boundary.
SPLITK_TABLES = {
    "projection_tables": {
        "dsa_qkv_a_g_index": {2: SplitK(4)},
        "kda_in_proj": {2: SplitK(2), 4: SplitK(8)},
        "moe_front": {2: SplitK(4)},
    },
    "oproj_table": {2: SplitK(3)},
}


def _assert_close(r, exact=False):
    assert r.report.num_rewritten > 0
    if exact:
        assert r.logits_err == 0.0 and r.cache_err == 0.0, r.cache_errs
    assert r.logits_err < LOGIT_ATOL, r.logits_err
    assert r.cache_err < STATE_ATOL, {k: v for k, v in r.cache_errs.items() if v >= STATE_ATOL}


@pytest.mark.parametrize("q", [1, 2, 4])
def test_decode_and_verify_exact_with_cublas_tactics(q):
    cfg = preset("mixed-small")
    accepted = None if q == 1 else (lambda i, b: [1 + (i + r) % q for r in range(b)])
    r = run_pair(cfg, steps=8, batch=3, q=q, accepted=accepted)
    assert len(r.report.rewritten()) == 1 + 6 + 7  # layer 3 DSA, layer 7 MLA (stock)
    _assert_close(r, exact=True)


@pytest.mark.parametrize("q", [1, 2])
def test_batches_inside_and_outside_the_split_k_tables(q):
    cfg = preset("k31-small")
    r = run_pair(cfg, q=q, options=SPLITK_TABLES, batches=[1, 2, 3, 5, 1, 2, 5, 3])
    _assert_close(r)
    tactics = r.report.rewritten("kda")[0].tactics["kda_in_proj"]
    assert tactics[1].startswith("splitk2") and tactics[4].startswith("splitk8") and tactics[8] == "cublas"


def test_default_measured_tables():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, steps=8, batch=3, q=2, options={"projection_tables": DEP_PROJECTION, "oproj_table": DEP_OPROJ})
    _assert_close(r)


def test_pooled_cache_views():
    cfg = preset("mixed-small")
    r = run_pair(cfg, steps=8, batch=3, q=2, pooled=True, accepted=lambda i, b: [2, 1, 2][:b])
    _assert_close(r, exact=True)


def test_dynamic_batch_one_graph():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, dynamic=True, batches=[2, 3, 5, 2, 4, 3, 2, 5], options=SPLITK_TABLES)
    _assert_close(r)


def test_padding_requests_leave_states_untouched():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, batch=4, padding=1)
    _assert_close(r, exact=True)


def test_through_inductor():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, steps=8, batch=2, q=2, options={"inductor": True, **SPLITK_TABLES})
    _assert_close(r)


def test_moe_above_front_max_runs_stock_path():
    cfg = preset("k31-small", num_layers=4)
    r = run_pair(cfg, steps=8, batch=3, q=2, options={"front_max": 4})  # 6 rows > 4
    _assert_close(r, exact=True)
