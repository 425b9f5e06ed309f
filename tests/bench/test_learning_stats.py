"""bench/learning_stats.py: the paired bootstrap's intervals (their mean, their coverage, seeds pooled) and which states
every comparison pairs."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench


@pytest.fixture(scope="module")
def stats() -> ModuleType:
    return load_bench("learning_stats")


def normal(n: int, mean: float, sd: float, seed: int) -> tuple[float, ...]:
    rng = random.Random(seed)
    return tuple(rng.gauss(mean, sd) for _ in range(n))


def test_shares_average_to_the_token_weighted_loss(stats: ModuleType) -> None:
    row_sums, tokens = (12.0, 30.0, 3.0), 90  # rows of 40, 40 and 10 tokens
    shares = stats.shares(row_sums, tokens)
    assert sum(shares) / len(shares) == pytest.approx(45.0 / 90)


def test_an_interval_holds_its_mean_and_is_the_same_each_time(stats: ModuleType) -> None:
    diffs = normal(300, 0.01, 0.05, seed=1)
    interval = stats.paired(diffs)
    assert interval.mean == pytest.approx(sum(diffs) / len(diffs))
    assert interval.low < interval.mean < interval.high
    assert stats.paired(diffs) == interval
    assert interval.high - interval.low == pytest.approx(2 * 1.96 * 0.05 / 300**0.5, rel=0.15)  # the normal's width
    constant = stats.paired((0.25,) * 40)
    assert (constant.mean, constant.low, constant.high) == pytest.approx((0.25, 0.25, 0.25))
    with pytest.raises(ValueError, match="paired"):
        stats.difference((1.0, 2.0), (1.0,))


def test_about_95_of_100_intervals_hold_the_true_mean(stats: ModuleType) -> None:
    held = sum(stats.paired(normal(60, 0.1, 1.0, seed)).low < 0.1 < stats.paired(normal(60, 0.1, 1.0, seed)).high
               for seed in range(100))
    assert 88 <= held <= 99


def test_pooled_seeds_hold_the_spread_between_seeds(stats: ModuleType) -> None:
    same = normal(200, 0.0, 0.01, seed=2)
    apart = [tuple(x + shift for x in same) for shift in (0.0, 0.02, 0.04)]
    pooled = stats.pooled(apart)
    assert pooled.mean == pytest.approx(0.02 + sum(same) / len(same))
    assert pooled.low < 0.01 and pooled.high > 0.03  # the seeds' means 0, 0.02 and 0.04 are part of the spread
    alone = stats.paired(apart[1])
    assert alone.high - alone.low < 0.01  # one seed's interval holds only its sequences' spread
    assert stats.pooled([apart[1]]) == alone
    with pytest.raises(ValueError, match="same non-empty set"):
        stats.pooled([same, same[:-1]])


def test_each_comparison_pairs_the_states_it_names(stats: ModuleType) -> None:
    rows = stats.TaskRows()
    for r in (0, 1):
        for m, level in ((1, 3.0), (4, 2.0), (8, 1.5)):
            rows.put("adopted", m, r, (level - r, level - r))
            rows.put("ceiling", m, r, (level - 0.5 - r, level - 0.5 - r))
            rows.put("best single", m, r, (level - 0.1, level + 0.1))
            rows.put("adopted general", m, r, (5.0, 5.0))
            rows.put("esft general", m, r, (6.0, 6.0))
            rows.put("esft matched general", m, r, (5.4, 5.4))
    assert rows.diffs("network 1->4", None, 0) == (1.0, 1.0)  # a gain: fewer miners' loss minus more miners'
    assert rows.diffs("ceiling 4->8", None, 1) == (0.5, 0.5)
    assert rows.diffs("adopted - ceiling", 4, 1) == (0.5, 0.5)
    assert rows.diffs("adopted - best_single", 8, 0) == pytest.approx((0.1, -0.1))
    assert rows.forgetting(1, 0, "equal tokens") == (-1.0, -1.0)
    assert rows.forgetting(1, 0, "matched loss") == pytest.approx((-0.4, -0.4))
    assert rows.forgetting(2, 0, "equal tokens") is None  # no network of 2 miners
    assert rows.diffs("network 1->4", None, 2) is None  # no third round


def test_comparisons_give_every_seed_and_the_pooled_one(stats: ModuleType) -> None:
    tasks = {}
    for seed in (0, 1, 2):
        rows = stats.TaskRows()
        for m in (1, 4):
            rows.put("adopted", m, 0, normal(50, 1.0 - 0.1 * (m > 1), 0.01, seed * 10 + m))
            rows.put("best single", m, 0, normal(50, 1.0, 0.01, seed * 10 + m + 5))
        tasks["lexicon", seed] = rows
    out = stats.comparisons(tasks)
    gains = [c for c in out if c["what"] == "network 1->4"]
    assert [c["seed"] for c in gains] == [0, 1, 2, "pooled"]
    assert all(set(c) == {"domain", "seed", "what", "round", "miners", "esft_at", "mean", "ci_low", "ci_high"}
               for c in out)
    assert {c["what"] for c in out} == {"network 1->4", "adopted - best_single"}  # no ceiling, ESFT or 8 miners here
    pooled = gains[-1]
    assert pooled["ci_low"] > 0.09 and pooled["ci_high"] < 0.11
    assert pooled["mean"] == pytest.approx(sum(c["mean"] for c in gains[:3]) / 3, abs=1e-5)
