"""bench/ scripts as modules for tests, and as the programs they are: bench/ is a directory of scripts, not a package."""

from __future__ import annotations

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

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/`name`.py as the module `bench_<name>`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def run_bench(name: str, out: Path, *args: str, timeout: float = 600.0,
              env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run bench/`name`.py end to end with the project's python and `--out out`; the report it wrote there.

    Torch gets one thread (`env` adds or overrides variables): the tests share the machine's cores, and an
    OpenMP pool with more threads than free cores spins instead of working (a run 15 times slower).
    """
    variables = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_THREADS": "1", **(env or {})}
    run = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out)], capture_output=True,
                         text=True, timeout=timeout, cwd=BENCH.parent, env=variables)
    assert run.returncode == 0, f"bench/{name}.py exited with {run.returncode}:\n{run.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


def assert_positive(report: Mapping[str, Any], *keys: str) -> None:
    """Each of `keys` is in `report` and a finite number above zero."""
    for key in keys:
        value = report[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
