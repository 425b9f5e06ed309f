"""bench/report.py: the `--out` file written whole or not at all, a directory refused before a run, and the learning
benchmark's report rendered as docs/learning.md holds it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench

# Writes to any file are capped at 4 KiB (EFBIG past that), so a 64 KiB report fails part-way through.
FAILING_WRITE = """
import resource, signal, sys
from pathlib import Path
from bench.report import emit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
emit({"runs": ["x" * 64] * 1000}, Path(sys.argv[1]))
"""


@pytest.mark.slow  # an interpreter that imports torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses RLIMIT_FSIZE")
def test_a_report_that_fails_while_written_leaves_the_earlier_file_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "miner.json"
    out.write_text('{"earlier": true}\n')
    run = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(out)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode != 0 and "File too large" in run.stderr
    assert out.read_text() == '{"earlier": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["miner.json"]


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return load_bench("report")


def test_out_must_name_a_file_not_a_directory(report: ModuleType, tmp_path: Path) -> None:
    assert report.out_file(str(tmp_path / "a.json")) == tmp_path / "a.json"
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        report.out_file(str(tmp_path))


def test_docs_learning_holds_the_committed_runs_tables_and_the_benchmarks_sizes(report: ModuleType) -> None:
    """docs/learning.md's numbers are the committed run's, rendered by bench/report.py, and the benchmark's own."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "learning.md").read_text(encoding="utf-8")
    results = json.loads((root / "bench" / "results" / "learning.json").read_text(encoding="utf-8"))
    assert report.learning_markdown(results) in doc
    prose = " ".join(doc.split())  # the prose's numbers, wherever its lines break
    data, stats = load_bench("learning_data"), load_bench("learning_stats")
    full = data.FULL
    from training.corpus import _REGISTRY, _WORDS, generate

    for text in (f"the town, trade and age of {_REGISTRY} people", f"the meaning of {_WORDS:,} invented words",
                 f"own file of {full.miner_docs} documents", f"a report set of {full.report_docs} held-out",
                 f"{full.rounds} rounds.", f"{stats.DRAWS:,} times",
                 "at 1, 2 and 4 times the miners' lr", f"each of {data.VALIDATORS} validators",
                 generate("registry", 1, 0)[0].splitlines()[0][:40], generate("lexicon", 1, 0)[0].splitlines()[0]):
        assert text in prose, text
    from protocol.spec import AggregationSpec, DataSpec, TrainingSpec

    defaults = {"top_g": AggregationSpec.model_fields["top_g"].default,
                "scored": DataSpec.model_fields["heldout_sequences"].default,
                "gate": DataSpec.model_fields["gate_sequences"].default,
                "h": TrainingSpec.model_fields["inner_steps"].default,
                "batch": TrainingSpec.model_fields["batch_size"].default}
    for text in (f"`aggregation.top_g` updates are merged ({defaults['top_g']} by default)",
                 f"(`data.gate_sequences`, {defaults['gate']} by default)",
                 f"H = {defaults['h']} steps of {defaults['batch']} sequences a round",
                 f"The report set ({full.report_docs} documents)",
                 f"choose on {defaults['scored']} scored and {defaults['gate']} gate rows"):
        assert text in prose, text
    assert full.dp_lr_scales == (1.0, 2.0, 4.0) and full.seeds == (0, 1, 2)
    assert {r["miners"] for r in results["runs"]} == {m for m, _ in full.networks}


def test_the_learning_findings_read_each_gain_against_the_ceilings(report: ModuleType) -> None:
    def compared(what: str, mean: float, low: float, high: float) -> dict[str, object]:
        return {"domain": "registry", "seed": "pooled", "what": what, "round": 0, "miners": None, "esft_at": None,
                "mean": mean, "ci_low": low, "ci_high": high}

    run = {"domain": "registry", "seed": 0, "miners": 1, "inner_steps": 20, "adversaries": 0, "base_loss": 1.0,
           "adopted_losses": [0.9], "best_single_losses": [0.9], "gates": [{"adopted": "merged", "gains": {},
                                                                             "merged": 1}]}
    results = {"seconds": 1.0, "spec_overrides": {}, "runs": [run], "baselines": [], "comparisons": [
        compared("ceiling 1->4", 0.010, 0.008, 0.012), compared("network 1->4", 0.006, 0.004, 0.008),
        compared("ceiling 4->8", 0.004, 0.001, 0.007), compared("network 4->8", -0.001, -0.003, 0.001)]}
    text = report.learning_markdown(results)
    assert "the ceiling's 1 -> 4 gain is 0.0100 (interval above zero); the network's is 0.0060 (interval above " \
           "zero), 0.60 of the ceiling's, at least half." in text
    assert "the ceiling's gain is 0.0040 (interval above zero), the network's -0.0010 (interval spanning zero)" in text
