"""The release and the protocol version: where the release comes from, and what a node says of peers on another
protocol version."""

from __future__ import annotations

import tomllib
from pathlib import Path

from protocol.version import PROTOCOL_VERSION, RELEASE, describe, other_protocol_line

ROOT = Path(__file__).resolve().parents[2]


def test_the_release_is_the_packages_version_and_names_its_protocol() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert RELEASE == project["version"]  # the installed metadata, which `make` refreshes when pyproject changes
    assert describe() == f"tessera {RELEASE} (protocol {PROTOCOL_VERSION})"


def test_a_node_behind_is_told_to_upgrade_and_one_ahead_names_who_must() -> None:
    assert other_protocol_line(2, 3, ours=2) == "2 peers speak protocol 3; this node speaks 2: upgrade"
    assert other_protocol_line(1, 3, ours=2) == "1 peer speaks protocol 3; this node speaks 2: upgrade"
    assert other_protocol_line(1, 1, ours=2) == "1 peer speaks protocol 1; this node speaks 2: that peer must upgrade"
    assert other_protocol_line(3, 1, ours=2) == (
        "3 peers speak protocol 1; this node speaks 2: those peers must upgrade")
    assert other_protocol_line(1, PROTOCOL_VERSION + 1).endswith(f"this node speaks {PROTOCOL_VERSION}: upgrade")
