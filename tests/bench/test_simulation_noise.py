"""bench/simulation.py's statistics and per-sequence losses, on hand-made numbers and a tiny model.

The benchmark's noise figures rest on three claims checked here: its subsets are the rows the
validators' `heldout_subset` picks; a subset's loss built from per-sequence sums is the loss
`training.evaluate.heldout_loss` gives on those rows; and the noise and verdict arithmetic.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tests.bench.scripts import load_bench
from training.data import heldout_subset
from training.evaluate import heldout_loss
from training.tiny import build_tiny_model, tiny_config

PAD = 256


@pytest.fixture(scope="module")
def sim() -> ModuleType:
    """bench/simulation.py as a module (bench/ is a directory of scripts, not a package)."""
    return load_bench("simulation")


def test_subsets_are_the_rows_validators_score(sim: ModuleType) -> None:
    sequences = torch.arange(50 * 3).reshape(50, 3)
    seeds = sim.noise_seeds(5)
    assert len(set(seeds)) == 5 and all(len(s) == 64 for s in seeds)
    rows = sim.subset_rows(50, 8, seeds)
    assert rows.shape == (5, 8)
    for seed, picked in zip(seeds, rows, strict=True):
        assert torch.equal(sequences[picked], heldout_subset(sequences, seed, 8))
    assert len({tuple(r.tolist()) for r in rows}) == 5


def test_subset_loss_weighs_sequences_by_tokens(sim: ModuleType) -> None:
    sums = torch.tensor([1.0, 2.0, 3.0, 5.0])
    tokens = torch.tensor([1, 1, 2, 2])
    losses = sim.subset_losses(sums, tokens, torch.tensor([[0, 1], [2, 3], [0, 3]]))
    assert losses.tolist() == pytest.approx([1.5, 2.0, 2.0])


def test_noise_is_the_spread_across_and_between_subsets(sim: ModuleType) -> None:
    noise = sim.state_noise(torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64))
    assert noise["subset_mean"] == pytest.approx(2.0)
    assert noise["subset_std"] == pytest.approx(math.sqrt(2 / 3))
    assert noise["round_to_round_std"] == pytest.approx(math.sqrt(2))  # differences -1 and 1
    with pytest.raises(ValueError, match="at least 4 subsets"):
        sim.state_noise(torch.tensor([1.0, 2.0, 3.0]))


def test_a_round_beats_noise_only_above_twice_the_larger_round_to_round_std(sim: ModuleType) -> None:
    quiet = {"subset_std": 0.02, "round_to_round_std": 0.03}
    loud = {"subset_std": 0.04, "round_to_round_std": 0.06}
    paired = torch.tensor([0.1, 0.2, 0.3])
    ok = sim.round_verdict(2.0, 1.9, quiet, quiet, paired)
    assert ok["drop"] == pytest.approx(0.1) and ok["noise_2sigma"] == pytest.approx(0.06)
    assert ok["beats_noise"] and ok["beats_2_subset_std"]
    assert ok["paired_drop_mean"] == pytest.approx(0.2) and ok["paired_drop_std"] == pytest.approx(0.1)
    noisy = sim.round_verdict(2.0, 1.9, quiet, loud, paired)
    assert not noisy["beats_noise"] and noisy["beats_2_subset_std"]  # 0.1 < 0.12, 0.1 > 0.08
    assert not sim.round_verdict(2.0, 2.05, quiet, quiet, -paired)["beats_noise"]


def test_per_sequence_losses_add_up_to_evaluate_loss(sim: ModuleType) -> None:
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0)
    ids = torch.randint(0, 256, (7, 16), generator=torch.Generator().manual_seed(0))
    ids[2, 10:] = PAD
    ids[5, 4:] = PAD
    sums, tokens = sim.sequence_losses(model, ids, PAD)
    assert tokens.tolist() == [15, 15, 9, 15, 15, 3, 15]
    assert float(sums.sum() / tokens.sum()) == pytest.approx(heldout_loss(model, ids, pad_id=PAD).loss, abs=1e-5)
    rows = torch.tensor([[1, 2, 5]])
    subset = float(sim.subset_losses(sums, tokens, rows)[0])
    assert subset == pytest.approx(heldout_loss(model, ids[rows[0]], pad_id=PAD).loss, abs=1e-5)


def test_larger_subsets_let_a_small_drop_beat_the_noise(sim: ModuleType) -> None:
    tokens = torch.full((300,), 10)
    sums_a = tokens * (2.0 + torch.randn(300, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    sums_b = sums_a - 0.1 * tokens  # every sequence 0.1 nats better: a real drop of exactly 0.1
    per_state = {"a": (sums_a, tokens), "b": (sums_b, tokens)}
    whole = {h: sim.whole_loss(*losses) for h, losses in per_state.items()}
    assert whole["a"] - whole["b"] == pytest.approx(0.1)
    sweep = sim.size_sweep(per_state, whole, ["a", "b"], 300, sim.noise_seeds(200))
    assert list(sweep) == ["16", "32", "64", "128", "256"]
    assert sweep["16"]["rounds_beating_noise"] == [] and sweep["256"]["rounds_beating_noise"] == [0]
    stds = [entry["adopted_max_round_to_round_std"] for entry in sweep.values()]
    assert stds == sorted(stds, reverse=True)
