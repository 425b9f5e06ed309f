"""SQLite state: every kind of accepted message round-trips, writes are atomic, a reopened file has it all."""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.store.db import SCHEMA_VERSION, Proposal, RewardRecord, RoundPlan, Storage, StorageError, Submission
from node.store.records import PhaseRun
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
PLAN = RoundPlan(round=3, seed=f"{6:064x}", revealed={M0.node_id: f"{1:064x}"},
                 commits={M0.node_id: f"{1:064x}", M1.node_id: f"{2:064x}"},
                 assignment={M0.node_id: (V0.node_id, V1.node_id)}, unrevealed_seeds=(V1.node_id,))


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
    await store.mark_adopted(h(9), h(0))
    await store.set_momentum(h(5))
    await store.set_momentum_of(h(9), V1.node_id, h(4))
    await store.set_submission(3, Submission(h(1), 1234))
    await store.set_own_seed(3, h(8))
    await store.set_proposal(3, Proposal(h(9), h(5)), V0.node_id)
    await store.set_round_report(3, {"round": 3, "miners": []})
    await store.record_round(3, 100.0)
    await store.fix_round_plan(PLAN)
    await store.record_phase_run(PhaseRun(3, "train", 100.0, 101.5, False, "boom", 100.0))
    await store.close()

    again = await Storage.open(tmp_path / "node.db")
    try:
        await check_filled(again)
        assert await again.head() == h(9)
        assert (await again.global_states(3))[0].adopted
        assert await again.momentum() == h(5)
        assert await again.momentum_of(h(9), V1.node_id) == h(4)
        assert await again.momentum_of(h(9), V0.node_id) == h(5)  # written with the proposal
        assert await again.submission(3) == Submission(h(1), 1234) and await again.submission(4) is None
        assert await again.own_seed(3) == h(8)
        assert await again.proposal(3) == Proposal(h(9), h(5))
        assert await again.round_report(3) == {"round": 3, "miners": []}
        assert await again.round_plan(3) == PLAN
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
        envelope = seal(first, SPEC.network_id, M0)
        assert await store.accepted_since(min_round=2) == [(envelope.message_id, "commit", M0.node_id, 3)]
        assert [m.verdict for m in await store.messages(3)] == ["accept"]
        assert await store.prune(before_round=3) == 1  # round 1's log entry
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
        seen = {mid for mid, *_ in await store.accepted_since(min_round=3)}
        assert seen and not seen & {m.id for m in refused}
    finally:
        await store.close()


async def test_a_heartbeat_of_an_earlier_round_does_not_replace_a_later_one(tmp_path: Path) -> None:
    """A catch-up hands on a round's heartbeats after gossip brought the next round's."""
    store = await Storage.open(tmp_path / "node.db")
    try:
        assert await accept(store, Heartbeat(round=4, role="validator", head=h(40)), V0, at=9.0)
        assert await accept(store, Heartbeat(round=3, role="validator", head=h(30)), V0, at=10.0)
        assert [(n.head, n.round) for n in await store.nodes()] == [(h(40), 4)]
        assert await accept(store, Heartbeat(round=5, role="validator", head=h(50)), V0, at=11.0)
        assert [(n.head, n.round, n.last_seen) for n in await store.nodes()] == [(h(50), 5, 11.0)]
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
            await store.mark_adopted(h(1), h(0))
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
        last = await store.rewards(last_rounds=1, top=1)  # the latest round of the ledger, the best standing
        assert [(e.round, e.miner) for e in last.entries] == [(2, M1.node_id)] and list(last.standings) == [M1.node_id]
    finally:
        await store.close()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail (EFBIG) as on a full disk: a write that crosses it lands in part."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


async def test_a_failed_rewards_export_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "rewards.jsonl"
    out.write_text(json.dumps({"round": -1, "note": "x" * (1 << 20)}) + "\n")  # larger than node.db and its WAL
    before = out.read_bytes()
    store = await Storage.open(tmp_path / "node.db")
    try:
        entries = [RewardRecord(0, h(i), i + 1, 1.0 / (i + 1), 0.5, 0.25) for i in range(200)]
        await store.add_rewards(0, entries, {e.miner: e.standing for e in entries})
        with file_size_limit(len(before) + 5000), pytest.raises(OSError) as caught:  # ~40 kB to append
            await store.export_rewards_jsonl(out)
        assert out.read_bytes() == before and caught.value.filename == str(out)
        assert await store.export_rewards_jsonl(out) == 200  # space freed: the round is exported whole
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["round"] for line in lines] == [-1] + [0] * 200
    finally:
        await store.close()


async def test_a_torn_last_rewards_line_is_dropped_before_appending(tmp_path: Path) -> None:
    """What a crash in the middle of an append leaves: its round was not marked exported, so it comes again."""
    out = tmp_path / "rewards.jsonl"
    kept = json.dumps({"round": 0, "miner": h(1)}) + "\n"
    out.write_text(kept + '{"round": 1, "miner": "' + "0" * 30)
    store = await Storage.open(tmp_path / "node.db")
    try:
        await store.add_rewards(1, [RewardRecord(1, h(1), 1, 1.0, 0.5, 0.25)], {h(1): 0.25})
        assert await store.export_rewards_jsonl(out) == 1
        text = out.read_text()
        assert text.startswith(kept) and [json.loads(line)["round"] for line in text.splitlines()] == [0, 1]
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
    with pytest.raises(StorageError, match="node.db: not a tessera state file"):
        await Storage.open(path)
    assert path.read_bytes() == b"this is not a database" * 100


async def test_a_damaged_file_is_refused_at_open(tmp_path: Path) -> None:
    """Valid header, corrupted pages: refused at open with SQLite's finding, not at the first query."""
    path = tmp_path / "node.db"
    store = await Storage.open(path)
    for i in range(200):
        await accept(store, Heartbeat(round=i, role="miner", head=h(i)), make_identity(1000 + i), at=float(i))
    await store.close()
    data = bytearray(path.read_bytes())
    data[-4000:-100] = b"\xff" * 3900  # the last page: a table or index page, not the header or the schema
    path.write_bytes(data)
    with pytest.raises(StorageError, match=r"node.db: damaged: .*; restore it from a backup or move it away") as caught:
        await Storage.open(path)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)  # one `tessera: error:` line
    assert path.read_bytes() == data


async def test_a_foreign_sqlite_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "node.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE rounds (name TEXT)")  # user_version 0, with a table tessera would also create
    conn.execute("INSERT INTO rounds VALUES ('theirs')")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StorageError, match="node.db: not a tessera state file"):
        await Storage.open(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["node.db"]
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("rounds",)]
    assert conn.execute("SELECT * FROM rounds").fetchall() == [("theirs",)]
    conn.close()


async def test_score_reports_come_back_whole(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        await fill(store)
        empty = ScoreReport(round=3, base=h(0), base_loss=2.75, entries=())
        assert await accept(store, empty, V1)
        reports = await store.score_reports(3)
        assert set(reports) == {V0.node_id, V1.node_id}
        assert reports[V1.node_id] == empty  # a report without entries is still a report
        assert len(reports[V0.node_id].entries) == 2 and reports[V0.node_id].entries[1].reason == "bad dtype"
    finally:
        await store.close()


async def test_a_round_plan_is_fixed_once(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        assert await store.round_plan(3) is None
        assert await store.fix_round_plan(PLAN) == PLAN
        later = RoundPlan(round=3, seed=h(7), revealed={}, commits={}, assignment={})
        assert await store.fix_round_plan(later) == PLAN  # a later plan cannot replace it
        assert await store.round_plan(3) == PLAN and await store.round_seed(3) == PLAN.seed
    finally:
        await store.close()


async def test_rewards_and_their_mark_are_one_write(tmp_path: Path) -> None:
    """A second MERGE of a rewarded round (a restart before its report) writes nothing and does not fail."""
    store = await Storage.open(tmp_path / "node.db")
    try:
        entries = [RewardRecord(1, M0.node_id, 1, 1.0, 0.2, 0.3)]
        assert not await store.rewarded(1)
        assert await store.add_rewards(1, entries, {M0.node_id: 0.3})
        assert await store.rewarded(1)
        assert not await store.add_rewards(1, entries, {M0.node_id: 0.51})
        ledger = await store.rewards()
        assert len(ledger.entries) == 1 and ledger.standings == {M0.node_id: 0.3}
        assert await store.add_rewards(2, [], {M0.node_id: 0.21})  # a round without winners is marked too
        assert not await store.add_rewards(2, [], {M0.node_id: 0.147})
        assert (await store.rewards()).standings == {M0.node_id: 0.21}
    finally:
        await store.close()


async def test_a_version_1_file_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "node.db"
    store = await Storage.open(path)
    await fill(store)
    await store.close()
    conn = sqlite3.connect(path)  # turn it back into what version 1 wrote
    conn.execute("DROP TABLE round_plans")
    conn.execute("DROP TABLE round_results")
    conn.execute("ALTER TABLE score_reports DROP COLUMN body")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    again = await Storage.open(path)
    try:
        await check_filled(again)
        [(validator, report)] = (await again.score_reports(3)).items()
        assert validator == V0.node_id and report.base_loss == 3.0 and len(report.entries) == 2
        assert await again.fix_round_plan(PLAN) == PLAN
    finally:
        await again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


async def test_pruning_forgets_old_working_state_and_keeps_the_record(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        await fill(store)  # round 3: a state h(9) voted by V0 and V1
        for r in (1, 2, 3, 12):
            await store.set_own_seed(r, h(20 + r))
            await store.set_submission(r, Submission(h(40 + r), 10))
            await store.set_proposal(r, Proposal(h(60 + r), h(80 + r)), V0.node_id)
        await store.set_momentum_of(h(9), V1.node_id, h(5))
        # heads known only from validators' heartbeats (their votes were missed): round 3's is current
        assert await accept(store, Heartbeat(round=3, role="validator", head=h(70), momentum=h(71)), V1)
        assert await accept(store, Heartbeat(round=1, role="validator", head=h(72), momentum=h(73)), V0)
        await store.set_momentum_of(h(70), V1.node_id, h(71))
        await store.set_momentum_of(h(72), V0.node_id, h(73))
        await store.set_round_report(1, {"round": 1})
        await store.add_rewards(1, [RewardRecord(1, M0.node_id, 1, 1.0, 0.2, 0.3)], {M0.node_id: 0.3})
        await store.prune(before_round=3)
        assert [await store.own_seed(r) for r in (1, 2, 3, 12)] == [None, None, h(23), h(32)]
        assert [await store.submission(r) for r in (2, 3)] == [None, Submission(h(43), 10)]
        assert await store.proposal(2) is None and await store.proposal(12) is not None
        assert await store.momentum_of(h(61), V0.node_id) is None  # round 1's proposal: no longer current
        assert await store.momentum_of(h(9), V1.node_id) == h(5)  # a state of round 3 stays
        assert await store.momentum_of(h(70), V1.node_id) == h(71)  # announced in a round-3 heartbeat
        assert await store.momentum_of(h(72), V0.node_id) is None  # announced only in round 1
        assert await store.round_report(1) == {"round": 1} and await store.rewarded(1)
        assert len(await store.commits_for(3)) == 2
    finally:
        await store.close()


async def test_a_miner_whose_standing_decayed_away_leaves_the_standings(tmp_path: Path) -> None:
    """`add_rewards` is given every miner's standing after the round; one that fell below the floor
    (protocol.ranking.update_standing drops it) must not keep its last value, nor a row, for good."""
    store = await Storage.open(tmp_path / "node.db")
    try:
        await store.add_rewards(1, [RewardRecord(1, M0.node_id, 1, 1.0, 0.2, 0.3)], {M0.node_id: 0.3, M1.node_id: 0.15})
        await store.add_rewards(2, [], {M1.node_id: 0.1})
        ledger = await store.rewards(last_rounds=0)
        assert ledger.standings == {M1.node_id: 0.1} == await store.standings()
        assert ledger.entries == []  # last_rounds=0: the standings alone
    finally:
        await store.close()
