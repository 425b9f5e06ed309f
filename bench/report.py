"""Benchmark output: each benchmark prints its JSON report and, given a path, writes it there too.

The file is written whole or not at all (`protocol.files.write_file`), so a run that fails while
writing leaves an earlier report at that path as it was.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from protocol.files import write_file


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
        write_file(out, (text + "\n").encode("utf-8"))
