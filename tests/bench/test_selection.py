"""bench/selection.py end to end at a small size: the simulation's model, one domain, ten documents."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.bench.scripts import assert_positive, run_bench

pytestmark = pytest.mark.slow


def test_a_small_run_reports_both_modes_curves_and_the_stability_it_could_measure(tmp_path: Path) -> None:
    report = run_bench("selection", tmp_path / "selection.json", "--sim", "--domains", "arithmetic", "--examples", "1",
                       "--documents", "10", "--heldout", "4", "--seeds", "1")
    assert (report["examples"], report["documents"], report["heldout_sequences"], report["random_seeds"]) == (1, 10, 4, 1)
    assert report["base"].startswith("simulation") and report["model"]["experts"] == 8
    [domain] = report["domains"].values()
    for mode in ("global", "layerwise"):
        result = domain[mode]
        assert all(len(experts) == report["top_d"] for experts in result["group"].values()), mode
        assert_positive(result, "full", "group_loss", "without_group")
        fractions = [point["fraction"] for point in result["curve"]]
        assert fractions == sorted(fractions) and fractions[-1] == 1.0, mode
        for point in result["curve"]:
            assert len(point["random"]) == 1 and all(math.isfinite(v) and v > 0 for v in point["random"]), point
            assert_positive(point, "rule", "random_mean", "kept")
        assert result["curve"][-1]["rule"] == result["full"]  # keeping every expert is the full model
    assert set(domain["stability"]) == {"1", "5", "10"}  # 100 examples do not fit in ten documents
    for overlap in domain["stability"].values():
        assert 0 <= overlap["pairwise_jaccard"] <= 1 and 0 <= overlap["reference_jaccard"] <= 1
    assert report["seconds"] >= 0
