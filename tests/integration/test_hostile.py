"""A hostile peer floods a real `tessera validator` process over loopback libp2p.

First with 3,000 validly signed heartbeats (10 senders, many heads each): the node stores at most one
heartbeat per sender per round. Then with junk, forged and oversized messages: past the penalty
threshold the node disconnects the peer and drops what it relays, even valid messages, while it
keeps serving honest peers. Its resident memory grows by less than RSS_BOUND over the attack.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.p2p import P2PNetwork, peer_id_for
from node.store.blobs import BlobStore
from protocol.identity import Identity
from protocol.messages import Commit, Envelope, Heartbeat, seal
from protocol.spec import NetworkSpec
from tests.conftest import make_identity
from tests.integration.validator_process import (
    NODE,
    counts,
    healthy,
    rss_bytes,
    start,
    stored_heartbeats,
    wait_until,
    write_network,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ATTACKER = make_identity(60)
HONEST = make_identity(61)
SENDERS = [ATTACKER, *(make_identity(200 + i) for i in range(9))]  # keys the attacker signs with
HEADS_PER_BATCH = 40
FLOOD = 3000  # validly signed heartbeats at least, as in the attack issue 11 reports
RSS_BOUND = 48 * 1024 * 1024
PENALTY_THRESHOLD = 20  # the node's default (P2PConfig)


def beat(spec: NetworkSpec, who: Identity, head: int) -> Envelope:
    return seal(Heartbeat(round=0, role="miner", head=f"{head:064x}"), spec.network_id, who)


def spoiled(spec: NetworkSpec, i: int) -> list[bytes]:
    """One of each kind the node must REJECT: junk, a bad signature, an envelope over the size limit."""
    forged = beat(spec, SENDERS[1], 10_000 + i)
    forged = forged.model_copy(update={"signature": format(int(forged.signature[0], 16) ^ 1, "x") + forged.signature[1:]})
    return [b"\x00junk" * 10, forged.to_bytes(), b"x" * (spec.limits.max_message_bytes + 1)]


async def host(identity: Identity, spec: NetworkSpec, tmp: Path, address: str) -> P2PNetwork:
    return await P2PNetwork.create(identity, GossipJudge(spec, time.time), BlobStore(tmp / identity.node_id[:8]),
                                   P2PConfig(port=0, bootstrap=(address,)))


async def gone_out(net: P2PNetwork) -> None:
    """Wait until what `net` published has left its paced outbox: a message still queued there has not
    been sent, and under load the outbox drains slower than a test fills it."""
    await wait_until(lambda: net.publish_backlog == 0, "the attacker's queued messages to go out")


async def test_a_flooding_peer_is_bounded_then_disconnected(tmp_path: Path, record_property) -> None:
    config, spec, p2p_port, http_port = write_network(tmp_path)
    assert P2PConfig().penalty_threshold == PENALTY_THRESHOLD
    db, log = tmp_path / "data" / "node.db", tmp_path / "node.log"
    address = f"/ip4/127.0.0.1/tcp/{p2p_port}/p2p/{peer_id_for(NODE.node_id).to_base58()}"
    proc = start(config, log)
    nets: list[P2PNetwork] = []
    try:
        await wait_until(lambda: healthy(http_port), "the validator's HTTP API")
        attacker = await host(ATTACKER, spec, tmp_path, address)
        nets.append(attacker)
        await wait_until(lambda: NODE.node_id in attacker.peers(), "the attacker to connect")
        rss_before = rss_bytes(proc.pid)

        # Validly signed spam: every sender signs many heartbeats with different heads, batch after
        # batch, FLOOD in all and until each sender has one stored (gossip drops some while the mesh forms).
        heads = iter(range(1_000_000))
        sent = 0
        while sent < FLOOD or not all((s.node_id, 0) in stored_heartbeats(db) for s in SENDERS):
            assert sent < 4 * FLOOD, f"stored only {stored_heartbeats(db)}"
            for _ in range(HEADS_PER_BATCH):
                for sender in SENDERS:
                    await attacker.publish_raw(beat(spec, sender, next(heads)).to_bytes())
                    sent += 1
            await gone_out(attacker)
            await asyncio.sleep(1.0)
        await asyncio.sleep(2.0)  # the tail of the flood lands
        beats = stored_heartbeats(db)
        assert all(beats[(s.node_id, 0)] == 1 for s in SENDERS), beats
        assert sent >= FLOOD
        assert NODE.node_id in attacker.peers(), "repeated heartbeats are ignored, not penalised"

        # Junk, forged and oversized messages: the node disconnects the peer past the threshold.
        i = 0
        while NODE.node_id in attacker.peers():
            assert i < 20 * PENALTY_THRESHOLD, "the node never disconnected the attacker"
            for data in spoiled(spec, i):
                await attacker.publish_raw(data)
            await gone_out(attacker)
            i += 1
            await asyncio.sleep(0.05)
        assert 3 * i > PENALTY_THRESHOLD
        # Barred: whatever it relays now is dropped unread, even a valid heartbeat of a new sender.
        newcomer = make_identity(300)
        for _ in range(10):
            await attacker.publish_raw(beat(spec, newcomer, 1).to_bytes())
            await asyncio.sleep(0.3)
        assert (newcomer.node_id, 0) not in stored_heartbeats(db)

        # The node still serves honest peers.
        honest = await host(HONEST, spec, tmp_path, address)
        nets.append(honest)
        await wait_until(lambda: NODE.node_id in honest.peers(), "an honest peer to connect")
        commit = seal(Commit(round=0, commitment="0f" * 32), spec.network_id, make_identity(301)).to_bytes()
        deadline = time.monotonic() + 30
        while counts(db).get("commits", 0) < 1:  # resent: gossip drops messages while the mesh forms
            assert time.monotonic() < deadline, "the honest peer's commit was never stored"
            await honest.publish_raw(commit)
            await asyncio.sleep(1.0)
        assert healthy(http_port)
        growth = rss_bytes(proc.pid) - rss_before
        record_property("rss_growth_mib", round(growth / 2**20, 1))
        record_property("messages_sent", sent + 3 * i + 10)
        assert growth < RSS_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB over the attack"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        for net in nets:
            await net.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
