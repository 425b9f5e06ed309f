"""A restarted node knows its own messages when peers hand them back, even one it gossiped and was killed
(or failed) before recording: each is noted as sent before it goes out (`Storage.record_sent`, table
`sent`, schema version 3). A message signed with its key that it never sent is still reported as another
node's. Version-2 state files gain the table on open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from node.net.network import PublishRefused
from node.sim.twins import Twins, identity
from node.store.db import SCHEMA_VERSION, Storage
from protocol.messages import Commit, Envelope, Heartbeat, Message, seal
from protocol.rounds import Phase
from protocol.spec import parse_spec
from tests.conftest import make_identity, make_spec_dict

pytestmark = pytest.mark.timeout(180)


async def test_a_message_gossiped_and_never_recorded_is_known_as_its_own_after_a_restart(
        tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        v0 = await net.start("validator-0")
        await net.start("validator-1")
        await net.start("miner-0")
        record = v0.ctx.storage.record_accepted

        async def killed_before_recording(envelope: Envelope, message: Message, at: float) -> bool:
            if envelope.sender == net.id("validator-0") and envelope.kind == "seed_commit":
                raise sqlite3.OperationalError("disk I/O error")  # gossiped, never recorded
            return await record(envelope, message, at)

        v0.ctx.storage.record_accepted = killed_before_recording  # type: ignore[method-assign]
        await net.phase(0, Phase.TRAIN)
        mine = [m for m in await v0.ctx.storage.messages(0) if m.sender == net.id("validator-0")]
        assert "seed_commit" not in {m.kind for m in mine}  # the peers have it, this node's log does not
        v0 = await net.restart("validator-0")  # catches up on round 0: its seed commit comes back
        await net.ran(0, Phase.TRAIN)
        assert any(m.kind == "seed_commit" and m.sender == net.id("validator-0")
                   for m in await v0.ctx.storage.messages(0))
        assert (await v0.status())["key_used_elsewhere"] is None

        await net.phase(0, Phase.COMMIT)
        stolen = seal(Commit(round=0, commitment="88" * 32), net.spec.network_id, identity("validator-0"))
        net.hub.inject(stolen.to_bytes(), net.id("validator-1"), to=[net.id("validator-0")])  # from another node
        await net.hub.settle()
        reported = {"messages": 1, "last_kind": "commit", "last_round": 0}
        assert (await v0.status())["key_used_elsewhere"] == reported
    finally:
        await net.close()


async def test_a_message_the_network_refuses_is_not_noted_as_sent(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        v0 = await net.start("validator-0")
        await net.phase(0, Phase.TRAIN)  # its heartbeat of round 0 went out
        again = Heartbeat(round=0, role="validator", head="77" * 32)
        with pytest.raises(PublishRefused, match="already sent one this round"):
            await v0.ctx.publish(again)
        refused = seal(again, net.spec.network_id, identity("validator-0"))
        assert not await v0.ctx.storage.sent(refused.message_id)
        beats = [m for m in await v0.ctx.storage.messages(0) if m.kind == "heartbeat"]
        assert len(beats) == 1 and await v0.ctx.storage.sent(beats[0].id)
    finally:
        await net.close()


async def test_the_note_of_what_was_sent_is_kept_and_pruned_with_the_log(tmp_path: Path) -> None:
    spec, me = parse_spec(make_spec_dict()), make_identity(0)
    envelopes = [seal(Commit(round=r, commitment=f"{r:064x}"), spec.network_id, me) for r in (1, 5)]
    store = await Storage.open(tmp_path / "node.db")
    try:
        for envelope in envelopes:
            await store.record_sent(envelope)
        await store.record_sent(envelopes[0])  # the same envelope again: one note
        assert [await store.sent(e.message_id) for e in envelopes] == [True, True]
        assert await store.prune(before_round=3) == 1
        assert [await store.sent(e.message_id) for e in envelopes] == [False, True]
        await store.forget_sent(envelopes[1].message_id)
        assert not await store.sent(envelopes[1].message_id)
    finally:
        await store.close()


async def test_a_version_2_file_gains_the_note_of_what_was_sent(tmp_path: Path) -> None:
    spec, me = parse_spec(make_spec_dict()), make_identity(0)
    path = tmp_path / "node.db"
    store = await Storage.open(path)
    commit = Commit(round=2, commitment=f"{1:064x}")
    assert await store.record_accepted(seal(commit, spec.network_id, me), commit, 1.0)
    await store.set_round_report(2, {"round": 2})
    await store.close()
    conn = sqlite3.connect(path)  # turn it back into what version 2 wrote
    conn.execute("DROP TABLE sent")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    again = await Storage.open(path)
    try:
        assert [m.kind for m in await again.messages(2)] == ["commit"]  # what it held is kept
        assert await again.round_report(2) == {"round": 2}
        envelope = seal(Commit(round=3, commitment=f"{2:064x}"), spec.network_id, me)
        assert not await again.sent(envelope.message_id)
        await again.record_sent(envelope)
        assert await again.sent(envelope.message_id)
    finally:
        await again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    conn.close()
