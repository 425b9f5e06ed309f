"""Benchmarks refuse counts that would crash them after their set-up, and an `--out` that is a directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import BENCH

BAD = [
    ("validator.py", ["--repeats", "0"], "--repeats and --sequences must be at least 1"),
    ("transfer.py", ["--out", "x.json", "--repeats", "0"], "must be at least 1"),
    ("twins_load.py", ["--miners", "0"], "must be at least 1"),
    ("round.py", ["--rounds", "0"], "--rounds must be at least 1"),
    ("round.py", ["--miners", "0"], "--miners must be at least 1"),
    ("load.py", ["--hidden-size", "15"], "--hidden-size must be an even number of at least 2"),
    ("selection.py", ["--examples", "11", "--documents", "10"], "need 1 <= --examples <= --documents <= 200"),
    ("miner.py", ["--out", "."], "is a directory"),
    ("learning.py", ["--set", "training.inner_steps=5"], "give H as --inner-steps"),
    ("learning.py", ["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
]


@pytest.mark.parametrize(("script", "args", "message"), BAD)
def test_bad_arguments_are_refused_with_a_usage_error(script: str, args: list[str], message: str,
                                                      tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
