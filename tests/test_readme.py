"""The README's file map is current: one line per product module, the first sentence of its docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("bench", "miner", "node", "protocol", "training", "validator")
WIDTH = 28  # the map's path column


def map_block() -> list[str]:
    """The lines of the README's "File map" code block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## File map", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def expected_line(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    summary = " ".join(docstring.strip().split("\n\n")[0].split())  # the summary paragraph, unwrapped
    first = re.split(r"(?<=[.?!])\s+(?=[A-Z`(])", summary)[0]  # its first sentence
    return f"{str(path.relative_to(ROOT)):<{WIDTH}}{first}".rstrip()


def product_modules() -> list[Path]:
    return sorted(p for package in PRODUCT if (ROOT / package).is_dir() for p in (ROOT / package).rglob("*.py"))


def test_every_module_has_its_line() -> None:
    lines = set(map_block())
    missing = [expected_line(p) for p in product_modules() if expected_line(p) not in lines]
    assert not missing, "README file map lacks (or has another wording of) these lines:\n" + "\n".join(missing)


def test_no_line_names_a_module_that_is_gone() -> None:
    named = [m.group(0) for line in map_block() if (m := re.match(r"\S+\.py\b", line))]
    gone = [name for name in named if not (ROOT / name).is_file()]
    assert not gone, f"README file map names modules that do not exist: {gone}"


def test_every_module_opens_with_a_docstring() -> None:
    bare = [str(p.relative_to(ROOT)) for p in product_modules() if not ast.get_docstring(ast.parse(p.read_text("utf-8")))]
    assert not bare, f"modules without a docstring saying what they are for: {bare}"
