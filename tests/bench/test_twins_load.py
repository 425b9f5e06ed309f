"""bench/twins_load.py end to end at a small size: one validator and two miners on the twins for one round."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.rounds import PHASES
from tests.bench.scripts import assert_positive, run_bench

pytestmark = pytest.mark.slow


def test_a_small_load_scores_every_miner_and_reports_its_costs(tmp_path: Path) -> None:
    report = run_bench("twins_load", tmp_path / "twins_load.json", "--validators", "1", "--miners", "2",
                       "--rounds", "1")
    assert (report["validators"], report["miners"], report["rounds"]) == (1, 2, 1)
    assert report["every_miner_scored"] is True and report["validators_agree"] is True
    assert report["evaluations"] >= 2
    assert_positive(report, "total_wall_s", "evaluate_s_per_miner", "rss_before_mib", "peak_rss_mib", "inner_steps")
    assert report["peak_rss_mib"] >= report["rss_before_mib"] and report["peak_rss_growth_per_node_mib"] >= 0
    [walls] = report["phase_wall_s"]
    assert set(walls) == {str(p) for p in PHASES} and report["evaluate_phase_wall_s"] == [walls["evaluate"]]
    [summary] = report["per_round"]
    assert summary["round"] == 0 and summary["miners_scored"] == 2 and len(summary["state"]) == 64
    assert_positive(summary, "base_loss", "global_loss")
