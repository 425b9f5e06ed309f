"""Benchmark output: each benchmark prints its JSON report and, given a path, writes it there too.

The file is written whole or not at all: into a temporary file beside it, then renamed over it, so
a run that fails while writing leaves an earlier report at that path as it was.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def out_file(text: str) -> Path:
    """argparse type of `--out`: a file path; a directory is refused before the benchmark runs, not after."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the JSON file to write, such as {path / 'report.json'}")
    return path


def emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        try:
            partial.write_text(text + "\n", encoding="utf-8")
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
