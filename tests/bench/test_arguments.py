"""Benchmarks refuse counts that would crash them after their set-up, and an `--out` that is a directory.

Each refusal is checked on the script's `main` in this process (the suite imported torch already); one
script is run as the program it is, to show a refusal is a usage error (exit 2) before any heavy import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import BENCH, load_bench

pytestmark = pytest.mark.slow

BAD = [
    ("validator", ["--repeats", "0"], "--repeats and --sequences must be at least 1"),
    ("transfer", ["--out", "x.json", "--repeats", "0"], "must be at least 1"),
    ("twins_load", ["--miners", "0"], "must be at least 1"),
    ("round", ["--rounds", "0"], "--rounds must be at least 1"),
    ("round", ["--miners", "0"], "--miners must be at least 1"),
    ("load", ["--hidden-size", "15"], "--hidden-size must be an even number of at least 2"),
    ("selection", ["--examples", "11", "--documents", "10"], "need 1 <= --examples <= --documents <= 200"),
    ("miner", ["--out", "."], "is a directory"),
    ("learning", ["--networks", "4,4/4"], "'4/4': need M >= 1 and 0 <= A < M"),
    ("learning", ["--seeds", "0,x"], "--seeds: expected comma-separated integers"),
    ("successor", ["--activation", "1"], "--activation must be at least 2"),
    ("successor", ["--rounds", "4", "--activation", "3"], "--rounds at least --activation + 2"),
]


@pytest.mark.parametrize(("script", "args", "message"), BAD)
def test_bad_arguments_are_refused_with_a_usage_error(script: str, args: list[str], message: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    main = load_bench(script).main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_script_run_as_a_program_refuses_before_it_imports_torch(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-X", "importtime", str(BENCH / "learning.py"), "--seeds", "0,x"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and "--seeds: expected comma-separated integers" in run.stderr, run.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert imported and "torch" not in imported, "bench/learning.py imported torch before it judged its arguments"
