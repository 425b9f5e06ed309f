"""The node's durable state: one SQLite file (WAL) holding rounds, messages, commits, scores, rewards.

Every public method is a coroutine that runs on the store's own single worker thread, so SQLite
never blocks the event loop and the connection is only ever touched by one thread. Every write is
one transaction (BEGIN IMMEDIATE ... COMMIT), so a killed node reopens to a consistent state.

Durability: WAL with synchronous=FULL. NORMAL would survive a killed process but may lose the last
transactions on power loss; this file holds the rewards ledger and the commitments the node
accepted, writes are a few dozen per round, so the extra fsync per commit costs nothing that
matters. The schema version lives in `PRAGMA user_version`; a file from a newer version is refused.
This module stores what it is given and judges nothing, with one exception the network's in-memory
check cannot make across a restart: it keeps only the first message per (kind, sender, round), heartbeats aside.
It computes no rewards or rankings.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sqlite3
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from node.runtime.scheduler import PhaseRun
from protocol.messages import (
    Commit,
    Envelope,
    GlobalState,
    Heartbeat,
    Message,
    Reveal,
    ScoreReport,
    SeedCommit,
    SeedReveal,
)

SCHEMA_VERSION = 1
HEAD_KEY = "head"
MOMENTUM_KEY = "momentum"  # hash of the blob holding a validator's outer-optimizer momentum
_EXPORTED_KEY = "rewards_exported_through"

_SCHEMA = """
CREATE TABLE rounds (round INTEGER PRIMARY KEY, started_at REAL NOT NULL, seed TEXT);
CREATE TABLE phase_runs (round INTEGER, phase TEXT, started_at REAL NOT NULL, finished_at REAL NOT NULL,
    ok INTEGER NOT NULL, error TEXT NOT NULL, PRIMARY KEY (round, phase));
CREATE TABLE messages (id TEXT PRIMARY KEY, kind TEXT NOT NULL, sender TEXT NOT NULL, round INTEGER NOT NULL,
    verdict TEXT NOT NULL, reason TEXT NOT NULL, received_at REAL NOT NULL);
CREATE INDEX messages_round ON messages (round, verdict);
CREATE TABLE commits (round INTEGER, miner TEXT, commitment TEXT NOT NULL, received_at REAL NOT NULL,
    PRIMARY KEY (round, miner));
CREATE TABLE reveals (round INTEGER, miner TEXT, commitment TEXT NOT NULL, size INTEGER NOT NULL,
    received_at REAL NOT NULL, PRIMARY KEY (round, miner));
CREATE TABLE seeds (round INTEGER, validator TEXT, commitment TEXT, seed TEXT, PRIMARY KEY (round, validator));
CREATE TABLE score_reports (round INTEGER, validator TEXT, base TEXT NOT NULL, base_loss REAL NOT NULL,
    received_at REAL NOT NULL, PRIMARY KEY (round, validator));
CREATE TABLE scores (round INTEGER, validator TEXT, miner TEXT, commitment TEXT NOT NULL, loss REAL,
    verdict TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (round, validator, miner));
CREATE TABLE global_states (hash TEXT PRIMARY KEY, parent TEXT NOT NULL, round INTEGER NOT NULL,
    contributors TEXT NOT NULL, adopted INTEGER NOT NULL DEFAULT 0);
CREATE TABLE state_votes (round INTEGER, validator TEXT, hash TEXT NOT NULL, PRIMARY KEY (round, validator));
CREATE TABLE rewards (round INTEGER, miner TEXT, rank INTEGER NOT NULL, points REAL NOT NULL,
    utility REAL NOT NULL, standing REAL NOT NULL, PRIMARY KEY (round, miner));
CREATE TABLE standings (miner TEXT PRIMARY KEY, standing REAL NOT NULL, round INTEGER NOT NULL);
CREATE TABLE nodes (node_id TEXT PRIMARY KEY, role TEXT NOT NULL, head TEXT NOT NULL, round INTEGER NOT NULL,
    last_seen REAL NOT NULL);
CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

P = ParamSpec("P")
T = TypeVar("T")
_Fn = Callable[Concatenate["Storage", sqlite3.Connection, P], T]
_Async = Callable[Concatenate["Storage", P], Coroutine[Any, Any, T]]


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """A gossip message the node has judged."""

    id: str
    kind: str
    sender: str
    round: int
    verdict: str
    reason: str
    received_at: float


@dataclass(frozen=True, slots=True)
class CommitRecord:
    round: int
    miner: str
    commitment: str
    received_at: float


@dataclass(frozen=True, slots=True)
class RevealRecord:
    round: int
    miner: str
    commitment: str
    size: int
    received_at: float


@dataclass(frozen=True, slots=True)
class SeedRecord:
    """A validator's seed commitment and, once revealed, its seed."""

    round: int
    validator: str
    commitment: str | None
    seed: str | None


@dataclass(frozen=True, slots=True)
class ScoreRecord:
    """One entry of one validator's report, with the report's base and base loss."""

    round: int
    validator: str
    miner: str
    commitment: str
    loss: float | None
    verdict: str
    reason: str
    base: str
    base_loss: float


@dataclass(frozen=True, slots=True)
class GlobalStateRecord:
    """An announced global state and the validators that announced it."""

    hash: str
    parent: str
    round: int
    contributors: tuple[str, ...]
    adopted: bool
    voters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A peer's latest heartbeat."""

    node_id: str
    role: str
    head: str
    round: int
    last_seen: float


@dataclass(frozen=True, slots=True)
class RewardRecord:
    """One ledger line: a miner's rank and points in a round, and its standing after it."""

    round: int
    miner: str
    rank: int
    points: float
    utility: float
    standing: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RewardsLedger:
    entries: list[RewardRecord]
    standings: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return {"entries": [e.as_dict() for e in self.entries], "standings": self.standings}


class StorageError(ValueError):
    """The state file cannot be used: unreadable, corrupt, or written by a newer schema."""


def _read(fn: _Fn[P, T]) -> _Async[P, T]:
    async def run(self: Storage, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._submit(lambda conn: fn(self, conn, *args, **kwargs))

    functools.update_wrapper(run, fn)
    return run


def _write(fn: _Fn[P, T]) -> _Async[P, T]:
    async def run(self: Storage, /, *args: P.args, **kwargs: P.kwargs) -> T:
        def transaction(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self, conn, *args, **kwargs)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

        return await self._submit(transaction)

    functools.update_wrapper(run, fn)
    return run


class Storage:
    """The node's SQLite state. Make it with `await Storage.open(path)`; `await close()` when done."""

    def __init__(self, path: Path, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self.path = path
        self._executor = executor
        self._conn: sqlite3.Connection | None = conn

    @classmethod
    async def open(cls, path: str | Path) -> Storage:
        path = Path(path)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-storage")
        loop = asyncio.get_running_loop()
        try:
            conn = await loop.run_in_executor(executor, _connect, path)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(path, executor, conn)

    async def close(self) -> None:
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        await asyncio.get_running_loop().run_in_executor(self._executor, conn.close)
        self._executor.shutdown(wait=True)

    async def _submit(self, job: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._conn
        assert conn is not None, "storage used after close()"
        return await asyncio.get_running_loop().run_in_executor(self._executor, job, conn)

    # -- messages ---------------------------------------------------------------------------

    @_write
    def record_accepted(self, conn: sqlite3.Connection, envelope: Envelope, message: Message,
                        received_at: float) -> bool:
        """Store an accepted message and its payload in one transaction; True if it is new.

        False when this message is already stored, or when its sender already has a different one
        of this kind for this round: an equivocation that the network's in-memory check cannot see
        across a restart. That one is kept as a REJECT and its payload is not stored.
        """
        message_id = envelope.message_id
        if conn.execute("SELECT 1 FROM messages WHERE id = ?", (message_id,)).fetchone() is not None:
            return False
        stored = _store_payload(conn, envelope.sender, message, received_at)
        verdict, reason = ("accept", "ok") if stored else ("reject", "equivocation")
        _insert_message(conn, MessageRecord(message_id, envelope.kind, envelope.sender, envelope.round,
                                            verdict, reason, received_at))
        return stored

    @_read
    def accepted_index(self, conn: sqlite3.Connection, min_round: int) -> tuple[set[str], dict[tuple[str, str, int], str]]:
        """Ids of accepted messages from `min_round` on, and the first id per (kind, sender, round)."""
        rows = conn.execute(
            "SELECT id, kind, sender, round FROM messages WHERE verdict = 'accept' AND round >= ? "
            "ORDER BY received_at, id", (min_round,)).fetchall()
        first: dict[tuple[str, str, int], str] = {}
        for mid, kind, sender, r in rows:
            first.setdefault((kind, sender, r), mid)
        return {row[0] for row in rows}, first

    @_write
    def prune_messages(self, conn: sqlite3.Connection, before_round: int) -> int:
        """Forget the message log of rounds before `before_round`; returns how many rows went.

        Safe once gossip for those rounds is IGNOREd as old: the payload tables keep the data and
        the first-message-per-sender rule, which do not depend on this log.
        """
        return conn.execute("DELETE FROM messages WHERE round < ?", (before_round,)).rowcount

    @_read
    def messages(self, conn: sqlite3.Connection, round: int) -> list[MessageRecord]:
        rows = conn.execute("SELECT id, kind, sender, round, verdict, reason, received_at FROM messages "
                            "WHERE round = ? ORDER BY received_at, id", (round,)).fetchall()
        return [MessageRecord(*row) for row in rows]

    # -- per-round payloads -----------------------------------------------------------------

    @_read
    def commits_for(self, conn: sqlite3.Connection, round: int) -> list[CommitRecord]:
        rows = conn.execute("SELECT round, miner, commitment, received_at FROM commits WHERE round = ? "
                            "ORDER BY miner", (round,)).fetchall()
        return [CommitRecord(*row) for row in rows]

    @_read
    def reveals_for(self, conn: sqlite3.Connection, round: int) -> list[RevealRecord]:
        rows = conn.execute("SELECT round, miner, commitment, size, received_at FROM reveals WHERE round = ? "
                            "ORDER BY miner", (round,)).fetchall()
        return [RevealRecord(*row) for row in rows]

    @_read
    def seeds_for(self, conn: sqlite3.Connection, round: int) -> list[SeedRecord]:
        rows = conn.execute("SELECT round, validator, commitment, seed FROM seeds WHERE round = ? "
                            "ORDER BY validator", (round,)).fetchall()
        return [SeedRecord(*row) for row in rows]

    @_read
    def scores_for(self, conn: sqlite3.Connection, round: int) -> list[ScoreRecord]:
        rows = conn.execute(
            "SELECT s.round, s.validator, s.miner, s.commitment, s.loss, s.verdict, s.reason, r.base, r.base_loss "
            "FROM scores s JOIN score_reports r ON r.round = s.round AND r.validator = s.validator "
            "WHERE s.round = ? ORDER BY s.validator, s.miner", (round,)).fetchall()
        return [ScoreRecord(*row) for row in rows]

    @_read
    def global_states(self, conn: sqlite3.Connection, round: int | None = None) -> list[GlobalStateRecord]:
        """Announced global states (all rounds, or one), each with the validators that voted for it."""
        sql = "SELECT hash, parent, round, contributors, adopted FROM global_states"
        rows = conn.execute(sql + (" WHERE round = ?" if round is not None else "") + " ORDER BY round, hash",
                            () if round is None else (round,)).fetchall()
        return [_state_record(conn, row) for row in rows]

    @_write
    def mark_adopted(self, conn: sqlite3.Connection, state_hash: str) -> None:
        """Flag a global state as adopted and make it the head."""
        if conn.execute("UPDATE global_states SET adopted = 1 WHERE hash = ?", (state_hash,)).rowcount != 1:
            raise ValueError(f"global state {state_hash} was never recorded; record it before adopting it")
        _set(conn, HEAD_KEY, state_hash)

    # -- rounds and phases ------------------------------------------------------------------

    @_write
    def record_round(self, conn: sqlite3.Connection, round: int, started_at: float) -> None:
        conn.execute("INSERT OR IGNORE INTO rounds (round, started_at) VALUES (?, ?)", (round, started_at))

    @_write
    def set_round_seed(self, conn: sqlite3.Connection, round: int, seed: str) -> None:
        conn.execute("INSERT INTO rounds (round, started_at, seed) VALUES (?, 0, ?) "
                     "ON CONFLICT (round) DO UPDATE SET seed = excluded.seed", (round, seed))

    @_read
    def round_seed(self, conn: sqlite3.Connection, round: int) -> str | None:
        row = conn.execute("SELECT seed FROM rounds WHERE round = ?", (round,)).fetchone()
        return None if row is None else row[0]

    @_read
    def latest_round(self, conn: sqlite3.Connection) -> int | None:
        latest: int | None = conn.execute("SELECT MAX(round) FROM rounds").fetchone()[0]
        return latest

    @_write
    def record_phase_run(self, conn: sqlite3.Connection, run: PhaseRun) -> None:
        conn.execute("INSERT OR REPLACE INTO phase_runs VALUES (?, ?, ?, ?, ?, ?)",
                     (run.round, run.phase, run.started_at, run.finished_at, int(run.ok), run.error))

    @_read
    def phase_runs(self, conn: sqlite3.Connection, round: int) -> list[PhaseRun]:
        rows = conn.execute("SELECT round, phase, started_at, finished_at, ok, error FROM phase_runs "
                            "WHERE round = ? ORDER BY started_at", (round,)).fetchall()
        return [PhaseRun(r, p, s, f, bool(ok), e) for r, p, s, f, ok, e in rows]

    @_read
    def nodes(self, conn: sqlite3.Connection) -> list[NodeRecord]:
        """Peers' latest heartbeats."""
        rows = conn.execute("SELECT node_id, role, head, round, last_seen FROM nodes ORDER BY node_id").fetchall()
        return [NodeRecord(*row) for row in rows]

    # -- rewards ----------------------------------------------------------------------------

    @_write
    def add_rewards(self, conn: sqlite3.Connection, round: int, entries: Sequence[RewardRecord],
                    standings: Mapping[str, float]) -> None:
        """Append one round to the ledger and replace every listed miner's standing."""
        for e in entries:
            if e.round != round:
                raise ValueError(f"reward entry for round {e.round} passed with round {round}")
            conn.execute("INSERT INTO rewards VALUES (?, ?, ?, ?, ?, ?)",
                         (e.round, e.miner, e.rank, e.points, e.utility, e.standing))
        conn.executemany("INSERT OR REPLACE INTO standings VALUES (?, ?, ?)",
                         [(miner, standing, round) for miner, standing in sorted(standings.items())])

    @_read
    def rewards(self, conn: sqlite3.Connection) -> RewardsLedger:
        rows = conn.execute("SELECT round, miner, rank, points, utility, standing FROM rewards "
                            "ORDER BY round, rank, miner").fetchall()
        standings = dict(conn.execute("SELECT miner, standing FROM standings ORDER BY standing DESC, miner"))
        return RewardsLedger([RewardRecord(*row) for row in rows], standings)

    @_write
    def export_rewards_jsonl(self, conn: sqlite3.Connection, path: Path) -> int:
        """Append ledger rounds not yet exported to `path` (one JSON object a line, fsynced).

        The file is appended before the export mark moves, so a crash in between repeats lines
        (readers de-duplicate on round and miner) rather than losing them.
        """
        done = int(_get(conn, _EXPORTED_KEY) or -1)
        rows = conn.execute("SELECT round, miner, rank, points, utility, standing FROM rewards WHERE round > ? "
                            "ORDER BY round, rank, miner", (done,)).fetchall()
        if not rows:
            return 0
        lines = "".join(json.dumps(RewardRecord(*row).as_dict(), sort_keys=True) + "\n" for row in rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        _set(conn, _EXPORTED_KEY, str(max(row[0] for row in rows)))
        return len(rows)

    # -- node state -------------------------------------------------------------------------

    @_read
    def head(self, conn: sqlite3.Connection) -> str | None:
        """Hash of the global state this node currently builds on (None before the first)."""
        return _get(conn, HEAD_KEY)

    @_write
    def set_head(self, conn: sqlite3.Connection, state_hash: str) -> None:
        _set(conn, HEAD_KEY, state_hash)

    @_read
    def get_state(self, conn: sqlite3.Connection, key: str) -> str | None:
        return _get(conn, key)

    @_write
    def set_state(self, conn: sqlite3.Connection, key: str, value: str) -> None:
        _set(conn, key, value)


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"{path}: not a usable SQLite state file: {exc}") from exc
    if version > SCHEMA_VERSION:
        conn.close()
        raise StorageError(f"{path}: schema version {version} is newer than this tessera ({SCHEMA_VERSION})")
    if version == 0:
        conn.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}PRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
    return conn


def _insert_message(conn: sqlite3.Connection, r: MessageRecord) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO messages VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (r.id, r.kind, r.sender, r.round, r.verdict, r.reason, r.received_at))
    return cur.rowcount == 1


def _store_payload(conn: sqlite3.Connection, sender: str, m: Message, at: float) -> bool:
    """Write a message's rows; False (writing nothing) when the sender already has one for the round."""
    if isinstance(m, Commit):
        cur = conn.execute("INSERT OR IGNORE INTO commits VALUES (?, ?, ?, ?)", (m.round, sender, m.commitment, at))
    elif isinstance(m, Reveal):
        cur = conn.execute("INSERT OR IGNORE INTO reveals VALUES (?, ?, ?, ?, ?)",
                           (m.round, sender, m.commitment, m.size, at))
    elif isinstance(m, SeedCommit):
        cur = conn.execute("INSERT INTO seeds (round, validator, commitment) VALUES (?, ?, ?) ON CONFLICT "
                           "(round, validator) DO UPDATE SET commitment = excluded.commitment "
                           "WHERE seeds.commitment IS NULL", (m.round, sender, m.commitment))
    elif isinstance(m, SeedReveal):
        cur = conn.execute("INSERT INTO seeds (round, validator, seed) VALUES (?, ?, ?) ON CONFLICT "
                           "(round, validator) DO UPDATE SET seed = excluded.seed WHERE seeds.seed IS NULL",
                           (m.round, sender, m.seed))
    elif isinstance(m, ScoreReport):
        cur = conn.execute("INSERT OR IGNORE INTO score_reports VALUES (?, ?, ?, ?, ?)",
                           (m.round, sender, m.base, m.base_loss, at))
        if cur.rowcount == 1:
            conn.executemany("INSERT OR IGNORE INTO scores VALUES (?, ?, ?, ?, ?, ?, ?)",
                             [(m.round, sender, e.miner, e.commitment, e.loss, e.verdict, e.reason) for e in m.entries])
    elif isinstance(m, GlobalState):
        cur = conn.execute("INSERT OR IGNORE INTO state_votes VALUES (?, ?, ?)", (m.round, sender, m.hash))
        if cur.rowcount == 1:
            conn.execute("INSERT OR IGNORE INTO global_states (hash, parent, round, contributors) VALUES (?, ?, ?, ?)",
                         (m.hash, m.parent, m.round, json.dumps(list(m.contributors))))
    elif isinstance(m, Heartbeat):
        cur = conn.execute("INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?)", (sender, m.role, m.head, m.round, at))
    else:
        raise AssertionError(f"no table for message kind {m.kind!r}")
    return cur.rowcount == 1


def _state_record(conn: sqlite3.Connection, row: tuple[Any, ...]) -> GlobalStateRecord:
    state_hash, parent, r, contributors, adopted = row
    voters = [v for (v,) in conn.execute("SELECT validator FROM state_votes WHERE round = ? AND hash = ? "
                                         "ORDER BY validator", (r, state_hash))]
    return GlobalStateRecord(state_hash, parent, r, tuple(json.loads(contributors)), bool(adopted), tuple(voters))


def _get(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def _set(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, value))
