"""bench/load.py checks what its loads hold, not only how many bytes: a load of other weights of the same
size fails the benchmark. `main` runs on the children's reports, and the whole benchmark on a small checkpoint
of the benchmark's shape (`--hidden-size 16`): a 1 GB checkpoint is not written."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.scripts import assert_positive, load_bench, run_bench
from training.model import state_hash
from training.tiny import build_tiny_model, tiny_config

pytestmark = pytest.mark.slow

WRITTEN = "a" * 64
COMPRESSED = "c" * 64


def reports(**hashes: str) -> dict[str, dict[str, Any]]:
    """What each child reports when every load holds what it should, with `hashes` put in by mode."""
    runs: dict[str, dict[str, Any]] = {
        "write": {"bytes": 1 << 30, "state_sha256": WRITTEN},
        "tessera": {"state_sha256": WRITTEN}, "hash": {}, "plain": {"state_sha256": WRITTEN}, "old": {},
        "compressed_full_load": {"held_bytes": 1 << 27, "state_sha256": COMPRESSED},
        "compressed_skip": {"held_bytes": 1 << 27, "state_sha256": COMPRESSED},
    }
    for mode, digest in hashes.items():
        runs[mode]["state_sha256"] = digest
    for run in runs.values():
        run.update(seconds=1.0, peak_above_runtime_bytes=1 << 29)
    return runs


def run_main(runs: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    load = load_bench("load")
    emitted: list[dict[str, Any]] = []
    monkeypatch.setattr(load, "measure", lambda mode, directory, extra_path=None: runs[mode])
    monkeypatch.setattr(load, "old_package", lambda root: tmp_path)
    monkeypatch.setattr(load, "emit", lambda report, out: emitted.append(report))
    monkeypatch.setattr(sys, "argv", ["load.py"])
    load.main()
    return emitted[0]


def test_loads_that_hold_the_written_weights_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = run_main(reports(), monkeypatch, tmp_path)
    assert report["checkpoint_bytes"] == 1 << 30


@pytest.mark.parametrize(("mode", "message"), [
    ("compressed_skip", "the two ways built different compressed models"),
    ("tessera", "tessera loaded other weights than were written"),
    ("plain", "plain loaded other weights than were written"),
])
def test_a_load_of_other_weights_of_the_same_size_fails_the_benchmark(
        mode: str, message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=message):
        run_main(reports(**{mode: "d" * 64}), monkeypatch, tmp_path)


def test_every_checked_child_reports_the_hash_of_what_it_loaded(tmp_path: Path) -> None:
    """The whole benchmark, children included, on a small checkpoint of the benchmark's shape (12 layers of 32
    experts)."""
    report = run_bench("load", tmp_path / "load.json", "--hidden-size", "16")
    load = load_bench("load")
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe", **load.config(16)), seed=0)
    assert model.config.num_hidden_layers == 12 and model.config.num_experts == 32
    runs = {mode: {"state_sha256": digest} for mode, digest in report["state_sha256"].items() if mode != "written"}
    assert set(runs) == {"tessera", "plain", "compressed_full_load", "compressed_skip"}
    assert report["state_sha256"]["written"] == state_hash(model)
    load.check_loads(state_hash(model), runs)
    assert runs["tessera"]["state_sha256"] != runs["compressed_skip"]["state_sha256"]
    assert report["hidden_size"] == 16
    assert_positive(report, "checkpoint_bytes", "write_seconds", "peak_rss_ratio", "load_seconds", "base_hash_seconds",
                    "base_hash_peak_rss_ratio", "compressed_miner_peak_rss_gib_full_load",
                    "compressed_miner_peak_rss_gib_skip_unselected", "compressed_miner_skip_vs_full_load_peak_ratio",
                    "compressed_miner_seconds_full_load", "compressed_miner_seconds_skip_unselected",
                    "compressed_miner_held_gib")
    for reference in ("plain_from_pretrained", "old_loader_7069fea"):
        assert_positive(report[reference], "peak_rss_ratio", "load_seconds")
