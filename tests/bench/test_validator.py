"""bench/validator.py end to end at its smallest size: one repeat over one held-out sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import assert_positive, run_bench

pytestmark = pytest.mark.slow


def test_a_one_sequence_run_reports_the_cost_of_scoring_a_submission(tmp_path: Path) -> None:
    report = run_bench("validator", tmp_path / "validator.json", "--repeats", "1", "--sequences", "1")
    assert (report["repeats"], report["heldout_sequences"]) == (1, 1)
    assert_positive(report, "overhead_ratio", "bare_forward_s", "submission_s", "verify_s", "blob_bytes", "threads",
                    "base_loss", "submission_loss")
    assert report["verify_s"] < report["submission_s"]  # checking the blob is one part of scoring it
    assert report["model"]["selected_per_layer"] == 4
