"""bench/round.py's reading of the miners' logs: a miner-round with no training run counts as 0 s of
training, so a miner that missed a round lowers the train share instead of dropping out of it; and the
benchmark end to end on its smallest network (one validator, one miner, one round)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.rounds import PHASES
from tests.bench.scripts import assert_positive, load_bench, run_bench

pytestmark = pytest.mark.slow


def trained(round: int, steps: int, seconds: float) -> str:
    """A miner's log line of one training run, as node.duties.miner writes it."""
    return f"round {round}: trained {steps} steps at lr 0.001 in {seconds:.1f} s (500 tokens/s), loss 3.0000 -> 2.9000\n"


def test_a_miner_round_without_a_training_run_counts_as_no_training() -> None:
    bench_round = load_bench("round")
    logs = [trained(0, 30, 60.0) + trained(1, 12, 20.0)  # restarted in TRAIN:
            + trained(1, 30, 64.0),  # the run it finished last counts
            trained(0, 28, 58.0),  # this miner did not train in round 1
            trained(2, 30, 99.0)]  # beyond the rounds measured, and none in 0 and 1
    seconds, steps = bench_round.training_runs(logs, miners=3, rounds=2)
    assert sorted(seconds) == [0.0, 0.0, 0.0, 58.0, 60.0, 64.0]
    assert sorted(steps) == [28, 30, 30]
    with pytest.raises(SystemExit, match="no miner logged a training run"):
        bench_round.training_runs(["nothing here\n"], miners=1, rounds=1)


@pytest.mark.integration
def test_one_round_of_the_smallest_network_reports_where_its_time_went(tmp_path: Path) -> None:
    report = run_bench("round", tmp_path / "round.json", "--rounds", "1", "--validators", "1", "--miners", "1",
                       "--round-seconds", "30", "--train-share", "0.5")
    assert (report["rounds_measured"], report["validators"], report["miners"]) == (1, 1, 1)
    assert report["round_seconds"] == 30.0 and report["timing"]["train_s"] == 15.0
    train = report["miner_train_seconds"]
    assert (train["runs"], train["runs_expected"]) == (1, 1)
    assert_positive(train, "mean", "min", "max")
    assert_positive(report["miner_inner_steps"], "mean", "min", "max")
    assert report["train_share"] > 0 and report["train_window_share"] == pytest.approx(2 * report["train_share"],
                                                                                      abs=0.002)
    assert set(report["phase_seconds"]) == {str(p) for p in PHASES}
    assert all(seconds >= 0 for seconds in report["phase_seconds"].values())
    assert [entry["round"] for entry in report["rounds"]] == [0]
