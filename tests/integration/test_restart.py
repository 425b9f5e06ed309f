"""A real `tessera validator` process over loopback libp2p is sent gossip, SIGKILLed, restarted, and
still holds every commit, score and global state it had accepted (read from its SQLite file).

The validator runs its real duties on a simulation network whose TRAIN outlasts the test, so the
only score reports and global states it stores are the ones the test sends."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.p2p import P2PNetwork, peer_id_for
from node.store.blobs import BlobStore
from protocol.messages import Commit, Envelope, GlobalState, ScoreEntry, ScoreReport, seal
from protocol.spec import NetworkSpec
from tests.conftest import make_identity
from tests.integration.validator_process import (
    NODE,
    START_S,
    V0,
    V1,
    counts,
    healthy,
    start,
    status,
    wait_until,
    write_network,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SENDER = make_identity(50)  # the test's own libp2p host
MINERS = [make_identity(100 + i) for i in range(3)]


def messages(spec: NetworkSpec) -> list[Envelope]:
    net = spec.network_id
    commits = [seal(Commit(round=0, commitment=f"{i + 1:064x}"), net, m) for i, m in enumerate(MINERS[:2])]
    entries = tuple(ScoreEntry(miner=m.node_id, commitment=f"{i + 1:064x}", loss=1.5 + i, verdict="accept")
                    for i, m in enumerate(MINERS[:2]))
    report = seal(ScoreReport(round=0, base=spec.model.base_hash, base_loss=2.0, entries=entries), net, V0)
    state = GlobalState(round=0, hash="ee" * 32, parent=spec.model.base_hash, contributors=(MINERS[0].node_id,))
    return [*commits, report, seal(state, net, V0), seal(state, net, V1)]


async def deliver(net: P2PNetwork, envelopes: list[Envelope], db: Path, expected: dict[str, int]) -> None:
    """Gossip until the node's file shows `expected` rows (gossip drops messages before the mesh forms)."""
    deadline = time.monotonic() + START_S
    while counts(db) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"node stored {counts(db)}, expected {expected}")
        for envelope in envelopes:
            await net.publish_raw(envelope.to_bytes())
        await asyncio.sleep(1.0)


async def test_validator_keeps_accepted_state_across_sigkill(tmp_path: Path) -> None:
    config, spec, p2p_port, http_port = write_network(tmp_path)
    db, log = tmp_path / "data" / "node.db", tmp_path / "node.log"
    address = f"/ip4/127.0.0.1/tcp/{p2p_port}/p2p/{peer_id_for(NODE.node_id).to_base58()}"
    proc = start(config, log)
    net = None
    try:
        await wait_until(lambda: healthy(http_port), "the validator's HTTP API")
        net = await P2PNetwork.create(SENDER, GossipJudge(spec, time.time), BlobStore(tmp_path / "sender"),
                                      P2PConfig(port=0, bootstrap=(address,)))
        expected = {"commits": 2, "scores": 2, "score_reports": 1, "global_states": 1, "state_votes": 2}
        await deliver(net, messages(spec), db, expected)

        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert counts(db) == expected  # the file alone holds everything accepted

        proc = start(config, log)
        await wait_until(lambda: healthy(http_port), "the restarted validator")
        await wait_until(lambda: status(http_port)["last_run"] is not None, "the first phase after restart")
        after = status(http_port)
        assert after["node_id"] == NODE.node_id and after["round"] == 0
        assert (after["last_run"]["round"], after["last_run"]["phase"]) == (0, after["phase"])  # resumed in place
        # Replays of old messages are not stored twice; one new commit shows the node is listening.
        late = seal(Commit(round=0, commitment="0f" * 32), spec.network_id, MINERS[2])
        await deliver(net, [*messages(spec), late], db, {**expected, "commits": 3})
        conn = sqlite3.connect(db)
        try:
            stored = conn.execute("SELECT miner, commitment FROM commits ORDER BY commitment").fetchall()
            votes = conn.execute("SELECT validator FROM state_votes WHERE hash = ?", ("ee" * 32,)).fetchall()
            losses = conn.execute("SELECT loss FROM scores ORDER BY loss").fetchall()
        finally:
            conn.close()
        assert stored == [(MINERS[0].node_id, f"{1:064x}"), (MINERS[1].node_id, f"{2:064x}"),
                          (MINERS[2].node_id, "0f" * 32)]
        assert sorted(v for (v,) in votes) == sorted([V0.node_id, V1.node_id])
        assert losses == [(1.5,), (2.5,)]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # a clean stop exits 0
    finally:
        if net is not None:
            await net.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        print(log.read_text(errors="replace")[-4000:])
