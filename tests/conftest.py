"""Shared test fixtures: deterministic identities, a valid network spec (dict, model, TOML file), and a
headless Chromium (Debian's package, driven by Playwright) for the status-page tests.

Identities come from fixed seeds: `make_identity(i)`; validators are identities 0..2, miners 100+.
`make_spec_dict()` returns data shaped like decoded TOML, with made-up hashes; `write_model_config` writes the
tiny model config it names, which a node reads its expert group's shapes from as it starts.

The order in which `make test`'s workers take the files is tests/scheduling.py's, a plugin loaded here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from protocol.identity import Identity
from protocol.spec import NetworkSpec, parse_spec

pytest_plugins = ["tests.scheduling"]

GENESIS = datetime(2026, 1, 1, tzinfo=UTC)
N_VALIDATORS = 3
MINER_OFFSET = 100


def make_identity(i: int) -> Identity:
    """A deterministic identity; the same `i` always gives the same key."""
    return Identity.from_seed(hashlib.sha256(f"tessera-test-identity-{i}".encode()).digest())


def make_spec_dict(n_validators: int = N_VALIDATORS) -> dict[str, Any]:
    """A valid spec as decoded TOML; validators are make_identity(0..n-1)."""
    return {
        "name": "testnet",
        "genesis": GENESIS,
        "timing": {
            "train_s": 30,
            "commit_s": 5,
            "reveal_s": 10,
            "evaluate_s": 10,
            "merge_s": 5,
            "clock_skew_s": 1.0,
        },
        "model": {"family": "qwen3_moe", "config": "tiny.json", "init_seed": 7, "base_hash": "ab" * 32},
        "group": {"0": [1, 3], "1": [0]},
        "data": {"train": ["train.txt"], "heldout_sha256": "cd" * 32, "seq_len": 32},
        "validators": [{"key": make_identity(i).node_id, "weight": 1.0} for i in range(n_validators)],
        "rewards": {"replication": 2, "top_k": 3},
    }


def write_model_config(directory: Path, name: str = "tiny.json") -> None:
    """The tiny model config `make_spec_dict()` names (`tiny.json`), in `directory` (as `name`)."""
    import json

    from training.tiny import tiny_config

    (directory / name).write_text(json.dumps(tiny_config("qwen3_moe")), encoding="utf-8")


def to_toml(data: dict[str, Any]) -> str:
    """Serialize a spec-shaped dict (tables, arrays of tables, scalars, lists) as TOML."""
    lines: list[str] = []
    _toml_table(data, [], lines)
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _toml_table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    tables = []
    for key, value in data.items():
        if isinstance(value, dict) or (isinstance(value, list) and value and isinstance(value[0], dict)):
            tables.append((key, value))
        else:
            lines.append(f'"{key}" = {_toml_value(value)}')
    for key, value in tables:
        if isinstance(value, dict):
            lines.append(f"\n[{'.'.join([*path, key])}]")
            _toml_table(value, [*path, key], lines)
        else:
            for item in value:
                lines.append(f"\n[[{'.'.join([*path, key])}]]")
                _toml_table(item, [*path, key], lines)


@pytest.fixture
def spec_dict() -> dict[str, Any]:
    return make_spec_dict()


@pytest.fixture
def spec(spec_dict: dict[str, Any]) -> NetworkSpec:
    return parse_spec(spec_dict)


@pytest.fixture
def validator_ids() -> list[Identity]:
    return [make_identity(i) for i in range(N_VALIDATORS)]


@pytest.fixture
def miner_ids() -> list[Identity]:
    return [make_identity(MINER_OFFSET + i) for i in range(4)]


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """write_spec(data=None, name="spec.toml") -> path of a TOML file holding `data` (default spec)."""

    def write(data: dict[str, Any] | None = None, name: str = "spec.toml") -> Path:
        path = tmp_path / name
        path.write_text(to_toml(make_spec_dict() if data is None else data), encoding="utf-8")
        return path

    return write


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Playwright's Chromium on Debian's binary (Playwright cannot download its own browsers here)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (make test installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()
