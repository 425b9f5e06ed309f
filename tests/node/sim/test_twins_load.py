"""A small run of bench/twins_load.py: 3 validators and 12 miners for one round on the in-memory twins.

`run_load` raises unless every miner has a loss in every validator's round report and every
validator voted for the one state of the round; this test runs it and checks the figures it returns.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # the benchmark at 12 miners: seconds of CPU

BENCH = Path(__file__).resolve().parents[3] / "bench" / "twins_load.py"


def _run_load() -> Callable[..., Any]:
    """bench/twins_load.py's `run_load` (bench/ is a directory of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("twins_load", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_load


async def test_every_miner_is_scored_and_the_validators_agree(tmp_path: Path) -> None:
    report = await _run_load()(tmp_path, validators=3, miners=12, rounds=1)
    assert report["every_miner_scored"] and report["validators_agree"]
    (summary,) = report["per_round"]
    assert summary["miners_scored"] == 12
    assert summary["global_loss"] < summary["base_loss"]
    assert report["evaluations"] == 12 * report["replication"]
    assert report["evaluate_s_per_miner"] > 0
