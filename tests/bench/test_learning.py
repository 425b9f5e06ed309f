"""bench/learning.py at its small size: a network of 2 miners runs 2 rounds through the product's round and ESFT runs beside it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.bench.scripts import BENCH


def test_the_small_learning_benchmark_records_every_rounds_adopted_loss(tmp_path: Path) -> None:
    out = tmp_path / "learning.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "learning.py"), "--small", "--set", "aggregation.top_g=1",
         "--cache", str(tmp_path / "cache"), "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["spec_overrides"] == {"aggregation.top_g": 1}
    assert math.isfinite(report["seconds"]) and report["rounds"] == 2
    key = {"domain": "arithmetic", "seed": 0, "miners": 2, "inner_steps": 2}
    [network] = report["runs"]
    [esft] = report["baselines"]
    assert {k: network[k] for k in key} == key and {k: esft[k] for k in key} == key
    base, adopted, best = network["base_loss"], network["adopted_losses"], network["best_single_losses"]
    assert len(adopted) == len(best) == len(network["merged"]) == len(esft["esft_losses"]) == 2
    assert all(math.isfinite(loss) for loss in [base, *adopted, *best, *esft["esft_losses"]])
    assert all(merged in (0, 1) for merged in network["merged"])  # --set reached the spec: top-G 1
    # the adopted state moves exactly in the rounds that merged an update (the spec keeps no average)
    for before, after, merged in zip([base, *adopted], adopted, network["merged"], strict=False):
        assert (after != before) == bool(merged)
    assert adopted[-1] < base and esft["esft_losses"][-1] < base  # the domain is new to the base: both learn
