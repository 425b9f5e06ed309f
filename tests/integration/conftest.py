"""Fixtures for loopback integration tests: a test network spec and `node.sim.peer` processes to drive.

`Cluster` starts `node.sim.peer.PeerProcess`es that share one spec and stops them all at the end.
Tests poll with generous timeouts instead of sleeping for fixed times.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from node.sim.peer import PeerProcess
from protocol.identity import Identity
from tests.conftest import write_model_config


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder runs real processes: mark it so `make check` (-m "not integration") skips it."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.integration)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_test_spec(directory: Path, validator: Identity) -> Path:
    """A spec whose current phase accepts Heartbeats: genesis a minute ago, hour-long rounds."""
    genesis = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = f"""
name = "p2p-test"
genesis = {genesis}
group = {{ 0 = [0, 1] }}
validators = [{{ key = "{validator.node_id}" }}]

[timing]
train_s = 3000.0
commit_s = 200.0
reveal_s = 200.0
evaluate_s = 100.0
merge_s = 100.0

[model]
family = "qwen3_moe"
config = "model.json"
base_hash = "{"ab" * 32}"

[data]
train = ["train.jsonl"]
heldout_sha256 = "{"cd" * 32}"
"""
    path = directory / "spec.toml"
    path.write_text(text)
    write_model_config(directory, "model.json")  # a node reads the group's shapes from it when it starts
    return path


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll until `predicate()` is truthy; returns its value or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Cluster:
    """Starts peers that share one spec and stops them all at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.validator = Identity.from_seed(b"\x07" * 32)
        self.spec = write_test_spec(root, self.validator)
        self.peers: list[PeerProcess] = []

    def start(self, name: str, seed: int, bootstrap: Sequence[str] = (), port: int = 0, *extra: str) -> PeerProcess:
        directory = self.root / name
        directory.mkdir(exist_ok=True)
        args = [*extra, *(arg for addr in bootstrap for arg in ("--bootstrap", addr))]
        peer = PeerProcess(directory, self.spec, Identity.from_seed(seed.to_bytes(32, "big")), port or free_port(), *args)
        self.peers.append(peer)
        return peer

    free_port = staticmethod(free_port)
    wait_for = staticmethod(wait_for)

    def stop_all(self) -> None:
        for peer in self.peers:  # all at once: each may take a moment to close its host
            if peer.alive:
                peer.proc.terminate()
        for peer in self.peers:
            peer.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()
