"""bench/round.py's reading of the miners' logs: a miner-round with no training run counts as 0 s of
training, so a miner that missed a round lowers the train share instead of dropping out of it."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_bench


def test_a_miner_round_without_a_training_run_counts_as_no_training() -> None:
    bench_round = load_bench("round")
    logs = ["round 0: trained 30 steps in 60.0 s\nround 1: trained 12 steps in 20.0 s\n"  # restarted in TRAIN:
            "round 1: trained 30 steps in 64.0 s\n",  # the run it finished last counts
            "round 0: trained 28 steps in 58.0 s\n",  # this miner did not train in round 1
            "round 2: trained 30 steps in 99.0 s\n"]  # beyond the rounds measured, and none in 0 and 1
    seconds, steps = bench_round.training_runs(logs, miners=3, rounds=2)
    assert sorted(seconds) == [0.0, 0.0, 0.0, 58.0, 60.0, 64.0]
    assert sorted(steps) == [28, 30, 30]
    with pytest.raises(SystemExit, match="no miner logged a training run"):
        bench_round.training_runs(["nothing here\n"], miners=1, rounds=1)
