"""bench/ scripts as modules for tests, and as the programs they are: bench/ is a directory of scripts, not a package."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/`name`.py as the module `bench_<name>`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def run_bench(name: str, out: Path, *args: str) -> dict[str, Any]:
    """Run bench/`name`.py's `main` on `args` and `--out out` in this process; the report it wrote there.

    In this process, not as a program: the suite has imported torch and transformers already, which cost a
    fresh interpreter about 8 s of CPU, and the suite is short of CPU (test_arguments.py runs a script as the
    program it is). The working directory is the repository, as for `make bench`; the script sees one torch
    thread (`BENCH_THREADS`), as the suite's tests do, and the suite's thread count is restored afterwards.
    """
    threads = torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ, {"BENCH_THREADS": "1"}), contextlib.chdir(BENCH.parent):
            code = load_bench(name).main([*args, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code in (0, None), f"bench/{name}.py's main returned {code}"
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


def run_bench_program(name: str, out: Path, *args: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Run bench/`name`.py as a program, with `env` added to the environment (where a variable must be set before
    torch reads it) and torch at one thread; the report it wrote to `out`."""
    variables = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_THREADS": "1", **env}
    run = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out)], capture_output=True,
                         text=True, timeout=600, cwd=BENCH.parent, env=variables)
    assert run.returncode == 0, f"bench/{name}.py exited with {run.returncode}:\n{run.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


def assert_positive(report: Mapping[str, Any], *keys: str) -> None:
    """Each of `keys` is in `report` and a finite number above zero."""
    for key in keys:
        value = report[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
