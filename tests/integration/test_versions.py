"""A node meets a peer of the next release, one that speaks protocol version PROTOCOL_VERSION + 1, over loopback
libp2p: the node refuses it in one log line, counts it, says it on /status, /metrics and its status page (headless
Chromium), and hears nothing the other gossips, while a peer on its own version stays connected. The node runs in
this process (a real libp2p host, HTTP API and status views, with the heartbeat duties); its peers are
`node.sim.peer` processes, the newer one started with `--protocol`. `tessera --version`, /status and
`tessera_build_info` name the same release."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.runtime.config import load_config
from node.runtime.daemon import Node
from protocol.identity import Identity, save_identity
from protocol.version import PROTOCOL_VERSION, RELEASE, describe

if TYPE_CHECKING:
    from conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
NEWER = PROTOCOL_VERSION + 1
ALERT = f"1 peer speaks protocol {NEWER}; this node speaks {PROTOCOL_VERSION}: upgrade"


class RunningNode:
    """A node on an event loop of its own thread (Playwright's sync API runs its own loop in this one)."""

    def __init__(self, config: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node: Node = asyncio.run_coroutine_threadsafe(Node.create(load_config(config)), self.loop).result(60)
        self.running = asyncio.run_coroutine_threadsafe(self.node.run(), self.loop)

    def get(self, path: str) -> bytes:
        port = self.node.ctx.config.http.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            body: bytes = response.read()
            return body

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self.get("/status"))
        return status

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        parsed = text_string_to_metric_families(self.get("/metrics").decode())
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in parsed for s in family.samples}

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.node.stop)
        self.running.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def node(cluster: Cluster) -> Iterator[RunningNode]:
    directory = cluster.root / "node"
    directory.mkdir()
    save_identity(Identity.from_seed(b"\x05" * 32), directory / "node.key")
    (directory / "node.toml").write_text(
        f'[node]\nrole = "miner"\nspec = "{cluster.spec}"\n\n'
        f'[p2p]\nport = {cluster.free_port()}\n\n[http]\nport = {cluster.free_port()}\n', encoding="utf-8")
    running = RunningNode(directory / "node.toml")
    try:
        yield running
    finally:
        running.close()


def test_a_peer_of_the_next_protocol_version_is_refused_counted_and_shown(
        cluster: Cluster, node: RunningNode, browser: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="node.net.p2p.hello")
    addr = node.node.ctx.network.listen_addrs[0]
    same = cluster.start("same", 1, [addr])
    newer = cluster.start("newer", 2, [addr], 0, "--protocol", str(NEWER))
    cluster.wait_for(lambda: node.status()["protocol_alert"] == ALERT, 30, "the node to refuse the newer peer")
    peers = node.node.ctx.network.peers
    cluster.wait_for(lambda: newer.node_id not in peers() and same.node_id in peers(), 30,
                     "the node to hold the same-version peer and not the newer one")

    refusals = [r.getMessage() for r in caplog.records if newer.node_id[:12] in r.getMessage()]
    assert refusals == [f"p2p: refused peer {newer.node_id[:12]} (tessera {RELEASE}): it speaks protocol {NEWER} and "
                        f"this node speaks {PROTOCOL_VERSION}: upgrade this node (docs/operating.md, \"Upgrading\")"]
    status = node.status()
    assert status["version"] == RELEASE and status["protocol"] == PROTOCOL_VERSION
    assert status["other_protocols"] == [{"protocol": NEWER, "peers": 1, "releases": [RELEASE]}]
    metrics = node.metrics()
    assert metrics[("tessera_build_info", (("protocol", str(PROTOCOL_VERSION)), ("version", RELEASE)))] == 1
    assert metrics[("tessera_protocol_refusals_total", ())] >= 1
    assert metrics[("tessera_other_protocol_peers", ())] == 1
    # The newer peer refused the node in turn: it is the older one there. The same-version peer counts there too
    # where it has dialed the newer peer by then (it can learn the address from the node), so one or two peers.
    (older,) = newer.call("stats")["other_protocols"]
    assert older["protocol"] == PROTOCOL_VERSION and older["releases"] == [RELEASE] and older["peers"] in (1, 2), older

    # Gossip does not cross versions: what the same-version peer publishes reaches the node, never the newer peer.
    heard = ("tessera_messages_total", (("kind", "heartbeat"), ("verdict", "accept")))
    same.call("publish")
    cluster.wait_for(lambda: node.metrics().get(heard, 0) >= 1, 20, "the same-version peer's heartbeat")
    newer.call("publish")
    assert newer.call("received")["received"] == []

    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{node.node.ctx.config.http.port}/")
    page.wait_for_selector("#protocol-alert:not([hidden])", timeout=15_000)
    assert page.locator("#protocol-alert").inner_text() == f"{ALERT} (peers on another protocol version are refused)."
    assert page.locator("#version").inner_text() == f"tessera {RELEASE} · protocol {PROTOCOL_VERSION}"
    page.close()

    printed = subprocess.run([sys.executable, "-m", "node.cli", "--version"], capture_output=True, text=True,
                             timeout=60, check=True)
    assert printed.stdout == f"{describe()}\n" == f"tessera {status['version']} (protocol {status['protocol']})\n"
