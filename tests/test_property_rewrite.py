"""A seeded property test: random small configs x random re-spellings x random near misses on random layers.

For each seed (plain ``random.Random``, no hypothesis): a ``k31-small`` or ``mixed-small`` decoder at 4
layers with some fields changed (``rms_eps``, ``routed_scaling_factor``, ``kda_heads`` / ``kda_head_dim``,
``index_topk``, ``n_routed_experts``, ``situ_beta``), with one DSA variant, two other "either" variants
(near misses, legal or not) and two other "rewrite" variants (re-spellings) of tests/near_miss_variants.py,
each on a random layer it fits, on distinct module slots. Then, through ``kimi_dep`` in pattern-only mode
with cuBLAS tactics against eager stock:

* never an exception;
* exact (logits and every cache): every rewritten layer computes what stock does;
* every row a near miss touched: stock with a failed check as its reason, or rewritten;
* every row only re-spellings touched, and every untouched DSA / KDA / MoE row: rewritten.

The draws cycle through the whole catalogue: each variant appears in some case (33 cases, ~50 s). Every
assertion message starts with the case: seed, preset, config changes, steps, variants with their layers.
"""

from __future__ import annotations

import random

import pytest

from dep_compile.stock import build_model, preset

from near_miss_variants import BASE_RUN, EITHER, REWRITE, check_report, compile_and_compare

DSA_VARIANTS = [v for v in EITHER + REWRITE if v.kind == "dsa"]
# a 4-layer decoder has one DSA layer: one DSA variant per case, so enough cases that each comes up once; then
# FP8_CASES on models with FP8 block-scaled projections, where the FP8 variants (and only they) apply
BF16_CASES = max(30, len(DSA_VARIANTS))
FP8_CASES = 3
NUM_CASES = BF16_CASES + FP8_CASES
N_EITHER, N_REWRITE = 2, 2  # besides the DSA variant: near misses and re-spellings of KDA, MoE and router


class Cycle:
    """Draws from a seeded shuffle of ``pool`` in order, wrapping around, so that every entry comes up."""

    def __init__(self, pool, seed):
        self.order = list(pool)
        random.Random(seed).shuffle(self.order)
        self.next = 0

    def draw(self, fits):
        """The next entry that ``fits`` (entries passed over stay first in line), or None."""
        for i in range(len(self.order)):
            v = self.order[(self.next + i) % len(self.order)]
            if fits(v):
                j = (self.next + i) % len(self.order)
                self.order.insert(self.next % len(self.order), self.order.pop(j))
                self.next += 1
                return v
        return None


def random_config(rng: random.Random, dense_format: str = "bf16"):
    name = rng.choice(["k31-small", "mixed-small"])
    changes = {}
    if rng.random() < 0.6:
        changes["rms_eps"] = rng.choice([1e-6, 1e-5, 1e-4, 3e-3])
    if rng.random() < 0.6:
        changes["routed_scaling_factor"] = rng.choice([1.0, 2.5, 1.75, 3.0])
    if rng.random() < 0.6:
        changes["kda_heads"], changes["kda_head_dim"] = rng.choice([(4, 32), (2, 32), (4, 16), (8, 16), (2, 64)])
    if rng.random() < 0.6:
        changes["index_topk"] = rng.choice([8, 16, 32])
    if rng.random() < 0.6:
        changes["n_routed_experts"] = rng.choice([16, 32, 48, 64])
    if rng.random() < 0.6:
        changes["situ_beta"] = rng.choice([4.0, 3.0, 6.0])
    if rng.random() < 0.5:
        changes["experts_format"] = "mxfp4"  # K3's shipped experts (the MXFP4 variants apply only there)
    if dense_format != "bf16":
        changes["dense_format"] = dense_format
    return name, changes, preset(name, num_layers=4, **changes)


def _slot_key(v, layer):
    return (layer, v.slot)


def plan_cases():
    """Per seed: (preset name, config changes, cfg, weights seed, [(variant, layer)]), without building a model.

    One DSA variant (near miss or re-spelling), ``N_EITHER`` other near misses and ``N_REWRITE`` other
    re-spellings per case, each from a cycle over its part of the catalogue, so that every variant comes up
    in some case; each on a random layer it fits whose module slot is still free.
    """
    cycles = ((Cycle(DSA_VARIANTS, 91), 1),
              (Cycle([v for v in EITHER if v.kind != "dsa"], 1234), N_EITHER),
              (Cycle([v for v in REWRITE if v.kind != "dsa"], 5678), N_REWRITE))
    plans = []
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        name, changes, cfg = random_config(rng, "bf16" if seed < BF16_CASES else "fp8_block")
        used, applied = set(), []
        for cycle, count in cycles:
            for _ in range(count):
                v = cycle.draw(lambda v: any(_slot_key(v, l) not in used for l in v.layers(cfg)))
                if v is None:
                    continue
                layer = rng.choice([l for l in v.layers(cfg) if _slot_key(v, l) not in used])
                used.add(_slot_key(v, layer))
                applied.append((v, layer))
        plans.append((name, changes, cfg, rng.randrange(1 << 16), applied))
    return plans


PLANS = plan_cases()


def build_case(seed: int):
    """(cfg, model, expects, run, description) for one seed."""
    name, changes, cfg, weights_seed, applied = PLANS[seed]
    model = build_model(cfg, seed=weights_seed)
    expects = {}
    for v, layer in applied:
        v.apply(model, cfg, layer)
        row = (layer, v.row_kind)
        # a row touched by a near miss may stay stock; a row only re-spellings touched must be rewritten
        expects[row] = "either" if v.expect == "either" or expects.get(row) == "either" else v.expect
    run = dict(BASE_RUN)
    for v, _ in applied:
        run.update(v.run)
    desc = (f"case seed={seed} preset={name} changes={changes} run={run} variants="
            + ", ".join(f"{v.name}@layer{layer}({v.expect})" for v, layer in applied))
    return cfg, model, expects, run, desc


def test_cases_cover_the_catalogue():
    drawn = {v.name for *_, applied in PLANS for v, _ in applied}
    missing = {v.name for v in EITHER + REWRITE} - drawn
    assert not missing, f"variants in no case: {sorted(missing)}"


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_random_configs_spellings_and_near_misses(seed):
    try:
        cfg, model, expects, run, desc = build_case(seed)
    except Exception as e:  # noqa: BLE001 - a case the catalogue cannot build is a bug in the catalogue
        raise AssertionError(f"case seed={seed}: building it raised {type(e).__name__}: {e}") from e
    r = compile_and_compare(desc, cfg, model, run)
    check_report(desc, expects, r)
