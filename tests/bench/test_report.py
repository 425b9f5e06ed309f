"""bench/report.py's `--out` file: written whole or not at all, and a directory refused before a run."""

from __future__ import annotations

import argparse
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
