"""bench/round.py's reading of the miners' logs: a miner-round with no training run counts as 0 s of
training, so a miner that missed a round lowers the train share instead of dropping out of it. The benchmark
end to end is in test_network_benchmarks.py."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_bench

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
