"""bench/miner.py compares the same work: both modes' loss before any update, and bad arguments refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.bench.scripts import BENCH, load_bench


@pytest.fixture(scope="module")
def miner() -> ModuleType:
    return load_bench("miner")


def test_both_modes_report_the_same_loss_before_any_update(miner: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_THREADS", str(torch.get_num_threads()))  # the worker sets torch's threads from it
    sparse, full = miner._worker("sparse", 1), miner._worker("full", 1)
    assert sparse["loss_before_update"] == pytest.approx(full["loss_before_update"], rel=1e-4)
    # one update later the two have learned different amounts; that is not the loss before an update
    assert sparse["first_loss"] != pytest.approx(full["first_loss"], rel=1e-4)


def test_steps_below_one_are_refused_before_any_worker_runs() -> None:
    run = subprocess.run([sys.executable, str(BENCH / "miner.py"), "--steps", "0"], capture_output=True, text=True,
                         cwd=Path(BENCH).parent, timeout=120)
    assert run.returncode == 2 and "--steps must be at least 1" in run.stderr
