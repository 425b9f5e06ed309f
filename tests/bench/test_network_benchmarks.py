"""The three benchmarks that run a network (bench/simulation.py, bench/soak.py, bench/round.py) end to end on one
smallest network: one validator and one miner for the two rounds a slope needs, run once by the simulation
benchmark and read again by the other two (`--reuse`, bench/network.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from protocol.rounds import PHASES
from tests.bench.scripts import assert_positive, run_bench

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the network run reads /proc")]


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The run's directory and the simulation benchmark's report of it."""
    tmp = tmp_path_factory.mktemp("network")
    report = run_bench("simulation", tmp / "simulation.json", "--dir", str(tmp / "run"), "--rounds", "2",
                       "--validators", "1", "--miners", "1", "--round-seconds", "30", "--train-share", "0.5",
                       "--inner-steps", "5", "--subsets", "4")
    return tmp / "run", report


def test_the_simulation_scores_each_adopted_state_against_the_subset_noise(network: tuple[Path, dict[str, Any]]) -> None:
    _, report = network
    assert report["failure"] == ""
    assert report["settings"]["rounds"] == 2 and report["settings"]["inner_steps"] == 5
    assert_positive(report, "base_whole_heldout_loss")
    assert_positive(report["base_noise"], "subset_mean", "subset_std", "round_to_round_std")
    heldout = report["heldout"]
    assert heldout["subsets_drawn"] == 4 and 0 < heldout["subset_rows"] <= heldout["rows"]
    assert heldout["per_sequence_vs_evaluate_abs_diff"] < 1e-4
    assert_positive(report["seconds"], "simulation", "evaluation")
    assert [entry["round"] for entry in report["rounds"]] == [0, 1]
    previous = report["base_whole_heldout_loss"]
    for entry in report["rounds"]:
        assert entry["validators_agree"] is True and entry["miners_accepted"] == 1
        assert_positive(entry, "whole_heldout_loss", "noise_2sigma", "round_to_round_std", "subset_std")
        assert entry["drop"] == pytest.approx(previous - entry["whole_heldout_loss"], abs=1e-4)
        assert isinstance(entry["beats_noise"], bool)
        # the benchmark's per-sequence losses are the validators' numbers on the round's own subset
        recomputed, validators = entry["recomputed_on_round_subset"], entry["validators_report"]
        assert recomputed["base_loss"] == pytest.approx(validators["base_loss"], abs=1e-3)
        assert recomputed["global_loss"] == pytest.approx(validators["global_loss"], abs=1e-3)
        previous = entry["whole_heldout_loss"]
    assert isinstance(report["lowered_every_round_above_noise"], bool) and report["noise_by_subset_size"]


def test_the_soak_reports_every_node_s_growth(network: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    run, _ = network
    report = run_bench("soak", tmp_path / "soak.json", "--reuse", str(run), "--warmup", "0")
    assert report["failure"] == "" and report["rounds_completed"] == 2
    assert report["settings"]["rounds"] == 2 and report["settings"]["train_share"] == 0.5
    assert report["seconds"] > 0 and report["one_global_state_every_round"] is True
    assert len(report["global_loss"]) == 2
    for key in ("max_rss_growth_mib_per_round", "max_fd_growth_per_round", "max_thread_growth_per_round",
                "max_data_growth_mib_per_round"):
        assert math.isfinite(report[key]), key
    assert set(report["nodes"]) == set(report["series"]) == {"bootstrap", "validator-0", "miner-0"}
    for name, node in report["nodes"].items():
        assert [r["round"] for r in report["series"][name]] == [0, 1], name
        assert node["rss_mib"]["at_end"] > 0 and node["fds"]["at_end"] > 0 and node["threads"]["at_end"] > 0, name
        assert node["peak_rss_mib"] >= node["rss_mib"]["max"] - 0.05, name  # one decimal against two


def test_the_round_benchmark_reports_where_the_time_went(network: tuple[Path, dict[str, Any]],
                                                         tmp_path: Path) -> None:
    run, _ = network
    report = run_bench("round", tmp_path / "round.json", "--reuse", str(run))
    assert (report["rounds_measured"], report["validators"], report["miners"]) == (2, 1, 1)
    assert report["round_seconds"] == 30.0 and report["timing"]["train_s"] == 15.0
    train = report["miner_train_seconds"]
    assert (train["runs"], train["runs_expected"]) == (2, 2)
    assert_positive(train, "mean", "min", "max")
    assert report["miner_inner_steps"]["max"] == 5  # the run's H
    assert report["train_share"] > 0 and report["train_window_share"] == pytest.approx(2 * report["train_share"],
                                                                                      abs=0.002)
    assert set(report["phase_seconds"]) == {str(p) for p in PHASES}
    assert all(seconds >= 0 for seconds in report["phase_seconds"].values())
    assert [entry["round"] for entry in report["rounds"]] == [0, 1]


def test_a_directory_no_network_ran_in_is_refused(tmp_path: Path) -> None:
    for name in ("simulation", "soak", "round"):
        with pytest.raises(SystemExit):
            run_bench(name, tmp_path / f"{name}.json", "--reuse", str(tmp_path))
