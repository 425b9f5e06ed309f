"""SQLite state: every kind of accepted message round-trips, writes are atomic, a reopened file has it all."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from node.runtime.scheduler import PhaseRun
from node.store.db import SCHEMA_VERSION, RewardRecord, Storage, StorageError
from protocol.messages import (
    Commit,
    GlobalState,
    Heartbeat,
    Message,
    Reveal,
    ScoreEntry,
    ScoreReport,
    SeedCommit,
    SeedReveal,
    seal,
)
from protocol.spec import parse_spec
from tests.conftest import make_identity, make_spec_dict

SPEC = parse_spec(make_spec_dict())
V0, V1 = make_identity(0), make_identity(1)
M0, M1 = make_identity(100), make_identity(101)


def h(i: int) -> str:
    return f"{i:064x}"


async def accept(store: Storage, message: Message, who=M0, at: float = 1.0) -> bool:
    envelope = seal(message, SPEC.network_id, who)
    return await store.record_accepted(envelope, message, at)


async def fill(store: Storage) -> None:
    assert await accept(store, Commit(round=3, commitment=h(1)), M0)
    assert await accept(store, Commit(round=3, commitment=h(2)), M1)
    assert await accept(store, Reveal(round=3, commitment=h(1), size=1234), M0)
    assert await accept(store, SeedCommit(round=3, commitment=h(7)), V0)
    assert await accept(store, SeedReveal(round=3, seed=h(8)), V0)
    entries = (ScoreEntry(miner=M0.node_id, commitment=h(1), loss=2.5, verdict="accept"),
               ScoreEntry(miner=M1.node_id, commitment=h(2), verdict="reject", reason="bad dtype"))
    assert await accept(store, ScoreReport(round=3, base=h(0), base_loss=3.0, entries=entries), V0)
    state = GlobalState(round=3, hash=h(9), parent=h(0), contributors=(M0.node_id,))
    assert await accept(store, state, V0)
    assert await accept(store, state, V1)
    assert await accept(store, Heartbeat(round=3, role="miner", head=h(0)), M1, at=5.0)


async def check_filled(store: Storage) -> None:
    commits = await store.commits_for(3)
    assert {(c.miner, c.commitment) for c in commits} == {(M0.node_id, h(1)), (M1.node_id, h(2))}
    assert await store.commits_for(4) == []
    [reveal] = await store.reveals_for(3)
    assert (reveal.miner, reveal.commitment, reveal.size) == (M0.node_id, h(1), 1234)
    [seed] = await store.seeds_for(3)
    assert (seed.validator, seed.commitment, seed.seed) == (V0.node_id, h(7), h(8))
    scores = {s.miner: s for s in await store.scores_for(3)}
    assert scores[M0.node_id].loss == 2.5 and scores[M0.node_id].base_loss == 3.0
    assert scores[M1.node_id].loss is None and scores[M1.node_id].reason == "bad dtype"
    [state] = await store.global_states(3)
    assert (state.hash, state.parent, state.contributors) == (h(9), h(0), (M0.node_id,))
    assert set(state.voters) == {V0.node_id, V1.node_id}
    [peer] = await store.nodes()
    assert (peer.node_id, peer.role, peer.last_seen) == (M1.node_id, "miner", 5.0)


async def test_every_kind_round_trips(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        await fill(store)
        await check_filled(store)
        assert not (await store.global_states(3))[0].adopted
    finally:
        await store.close()


async def test_reopened_store_sees_everything(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    await fill(store)
    await store.mark_adopted(h(9))
    await store.set_state("momentum", h(5))
    await store.record_round(3, 100.0)
    await store.set_round_seed(3, h(6))
    await store.record_phase_run(PhaseRun(3, "train", 100.0, 101.5, False, "boom", 100.0))
    await store.close()

    again = await Storage.open(tmp_path / "node.db")
    try:
        await check_filled(again)
        assert await again.head() == h(9)
        assert (await again.global_states(3))[0].adopted
        assert await again.get_state("momentum") == h(5)
        assert await again.round_seed(3) == h(6) and await again.latest_round() == 3
        [run] = await again.phase_runs(3)
        assert (run.phase, run.ok, run.error, run.duration_s) == ("train", False, "boom", 1.5)
    finally:
        await again.close()


async def test_duplicates_are_stored_once_and_indexed(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        first = Commit(round=3, commitment=h(1))
        assert await accept(store, first)
        assert not await accept(store, first)
        assert await accept(store, Commit(round=1, commitment=h(3)))
        ids, first_seen = await store.accepted_index(min_round=2)
        envelope = seal(first, SPEC.network_id, M0)
        assert ids == {envelope.message_id}
        assert first_seen == {("commit", M0.node_id, 3): envelope.message_id}
        assert [m.verdict for m in await store.messages(3)] == ["accept"]
        assert await store.prune_messages(before_round=3) == 1  # round 1's log entry
        assert await store.messages(1) == [] and len(await store.commits_for(1)) == 1
    finally:
        await store.close()


async def test_a_second_message_per_sender_kind_and_round_is_refused(tmp_path: Path) -> None:
    """What the network's in-memory check catches until a restart, storage catches after it."""
    store = await Storage.open(tmp_path / "node.db")
    try:
        await fill(store)
        assert not await accept(store, Commit(round=3, commitment=h(11)), M0)
        assert not await accept(store, Reveal(round=3, commitment=h(11), size=9), M0)
        assert not await accept(store, SeedCommit(round=3, commitment=h(12)), V0)
        assert not await accept(store, SeedReveal(round=3, seed=h(13)), V0)
        assert not await accept(store, ScoreReport(round=3, base=h(0), base_loss=1.0, entries=()), V0)
        assert not await accept(store, GlobalState(round=3, hash=h(14), parent=h(0), contributors=()), V1)
        assert await accept(store, Heartbeat(round=3, role="miner", head=h(15)), M1, at=6.0)
        assert [c.commitment for c in await store.commits_for(3) if c.miner == M0.node_id] == [h(1)]
        [seed] = await store.seeds_for(3)
        assert (seed.commitment, seed.seed) == (h(7), h(8))
        assert [s.base_loss for s in await store.scores_for(3)] == [3.0, 3.0]
        assert [s.hash for s in await store.global_states()] == [h(9)]
        refused = [m for m in await store.messages(3) if m.verdict == "reject"]
        assert len(refused) == 6 and {m.reason for m in refused} == {"equivocation"}
        ids, _ = await store.accepted_index(min_round=3)
        assert not ids & {m.id for m in refused}
    finally:
        await store.close()


async def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        good = RewardRecord(round=2, miner=M0.node_id, rank=1, points=1.0, utility=0.2, standing=0.3)
        wrong = RewardRecord(round=5, miner=M1.node_id, rank=2, points=0.5, utility=0.1, standing=0.15)
        with pytest.raises(ValueError, match="round 5 passed with round 2"):
            await store.add_rewards(2, [good, wrong], {M0.node_id: 0.3})
        ledger = await store.rewards()
        assert ledger.entries == [] and ledger.standings == {}
        with pytest.raises(ValueError, match="never recorded"):
            await store.mark_adopted(h(1))
        assert await store.head() is None
    finally:
        await store.close()


async def test_rewards_ledger_and_jsonl_export(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    out = tmp_path / "ledger" / "rewards.jsonl"
    try:
        r1 = [RewardRecord(1, M0.node_id, 1, 1.0, 0.2, 0.3), RewardRecord(1, M1.node_id, 2, 0.5, 0.1, 0.15)]
        await store.add_rewards(1, r1, {M0.node_id: 0.3, M1.node_id: 0.15})
        assert await store.export_rewards_jsonl(out) == 2
        assert await store.export_rewards_jsonl(out) == 0  # nothing new: no duplicate lines
        await store.add_rewards(2, [RewardRecord(2, M1.node_id, 1, 1.0, 0.4, 0.405)],
                                {M0.node_id: 0.21, M1.node_id: 0.405})
        assert await store.export_rewards_jsonl(out) == 1
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [(x["round"], x["miner"], x["rank"]) for x in lines] == [
            (1, M0.node_id, 1), (1, M1.node_id, 2), (2, M1.node_id, 1)]
        ledger = await store.rewards()
        assert len(ledger.entries) == 3
        assert list(ledger.standings) == [M1.node_id, M0.node_id]  # best standing first
        assert ledger.standings[M0.node_id] == pytest.approx(0.21)
        assert ledger.as_dict()["entries"][0]["points"] == 1.0
    finally:
        await store.close()


async def test_wal_full_sync_and_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "node.db"
    store = await Storage.open(path)
    await store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(StorageError, match="newer than this tessera"):
        await Storage.open(path)


async def test_garbage_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StorageError, match="not a usable SQLite state file"):
        await Storage.open(path)
