"""bench/simulation.py end to end on its smallest network: one validator and one miner for one round, the
adopted state scored on the whole held-out file against the noise of four subsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import assert_positive, run_bench

pytestmark = pytest.mark.integration


def test_one_round_of_the_smallest_network_is_scored_against_the_subset_noise(tmp_path: Path) -> None:
    report = run_bench("simulation", tmp_path / "simulation.json", "--rounds", "1", "--validators", "1",
                       "--miners", "1", "--round-seconds", "30", "--train-share", "0.5", "--inner-steps", "5",
                       "--subsets", "4")
    assert report["failure"] == ""
    assert report["settings"]["rounds"] == 1 and report["settings"]["inner_steps"] == 5
    assert_positive(report, "base_whole_heldout_loss")
    assert_positive(report["base_noise"], "subset_mean", "subset_std", "round_to_round_std")
    heldout = report["heldout"]
    assert heldout["subsets_drawn"] == 4 and 0 < heldout["subset_rows"] <= heldout["rows"]
    assert heldout["per_sequence_vs_evaluate_abs_diff"] < 1e-4
    assert_positive(report["seconds"], "simulation", "evaluation")
    [entry] = report["rounds"]
    assert entry["round"] == 0 and entry["validators_agree"] is True and entry["miners_accepted"] == 1
    assert_positive(entry, "whole_heldout_loss", "noise_2sigma", "round_to_round_std", "subset_std")
    assert entry["drop"] == pytest.approx(report["base_whole_heldout_loss"] - entry["whole_heldout_loss"], abs=1e-4)
    assert isinstance(entry["beats_noise"], bool) and isinstance(report["lowered_every_round_above_noise"], bool)
    # the benchmark's per-sequence losses are the validators' numbers on the round's own subset
    recomputed, validators = entry["recomputed_on_round_subset"], entry["validators_report"]
    assert recomputed["base_loss"] == pytest.approx(validators["base_loss"], abs=1e-3)
    assert recomputed["global_loss"] == pytest.approx(validators["global_loss"], abs=1e-3)
    assert report["noise_by_subset_size"]
