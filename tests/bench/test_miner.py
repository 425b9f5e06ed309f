"""bench/miner.py end to end at one timed step: its ratios, both modes' loss before any update (the same
work), and bad arguments refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import BENCH, assert_positive, run_bench

pytestmark = pytest.mark.slow


def test_a_one_step_run_reports_its_ratios_and_both_modes_start_from_the_same_loss(tmp_path: Path) -> None:
    report = run_bench("miner", tmp_path / "miner.json", "--steps", "1")
    assert report["steps"] == 1
    assert_positive(report, "throughput_ratio", "wall_throughput_ratio", "memory_ratio", "process_memory_ratio",
                    "payload_ratio", "payload_bytes", "selected_expert_bytes", "blob_header_bytes", "full_model_bytes")
    assert report["payload_ratio"] < 1 and report["payload_is_experts_plus_header"] is True
    sparse, full = report["sparse"], report["full"]
    for mode in (sparse, full):
        assert mode["steps"] == 1
        assert_positive(mode, "seconds", "median_step_wall_s", "median_step_cpu_s", "tokens_per_s", "tokens_per_cpu_s",
                        "peak_rss_bytes", "rss_runtime_bytes", "loss_before_update", "first_loss", "last_loss")
    assert sparse["loss_before_update"] == pytest.approx(full["loss_before_update"], rel=1e-4)
    # one update later the two have learned different amounts; that is not the loss before an update
    assert sparse["first_loss"] != pytest.approx(full["first_loss"], rel=1e-4)
    assert report["loss_before_update"] == {"sparse": sparse["loss_before_update"], "full": full["loss_before_update"]}


def test_steps_below_one_are_refused_before_any_worker_runs() -> None:
    run = subprocess.run([sys.executable, str(BENCH / "miner.py"), "--steps", "0"], capture_output=True, text=True,
                         cwd=Path(BENCH).parent, timeout=120)
    assert run.returncode == 2 and "--steps must be at least 1" in run.stderr
