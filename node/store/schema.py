"""The SQLite schema of a node's state file, its migrations, and the rows each gossip payload writes.

Version 2 adds `round_plans` (the plan a validator fixes when EVALUATE starts), `round_results`
(each round's leaderboard, which every node computes) and keeps every score report whole
(`score_reports.body`, the report's canonical JSON); version 3 adds `sent` (the id of every envelope this
node signed and handed to the network, written before it goes out, so that a restarted node knows its own
messages when peers hand them back). Older files are migrated in place on open, one version after the
other; version 4 adds the chain of specs: `successor_offers` (the documents peers offered), `successors` (each
document this node judged, and its verdict), `specs` (the successor specs it knows) and the spec each peer's
heartbeat names (`nodes.spec`). Functions here take an open connection inside the caller's transaction. This
module knows nothing about asyncio or about what the rows mean to a duty.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from node.store.records import GlobalStateRecord, MessageRecord, StorageError
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
    Successor,
)

SCHEMA_VERSION = 4

_V2 = ("CREATE TABLE round_plans (round INTEGER PRIMARY KEY, plan TEXT NOT NULL)",
       "CREATE TABLE round_results (round INTEGER PRIMARY KEY, results TEXT NOT NULL)")
# IF NOT EXISTS: a version-1 or -2 file may be one that tests turned back from a current one
_V3 = ("CREATE TABLE IF NOT EXISTS sent (id TEXT PRIMARY KEY, kind TEXT NOT NULL, round INTEGER NOT NULL)",)
_V4 = ("ALTER TABLE nodes ADD COLUMN spec TEXT",
       "CREATE TABLE successor_offers (round INTEGER, sender TEXT, document TEXT NOT NULL, size INTEGER NOT NULL, "
       "PRIMARY KEY (round, sender))",
       "CREATE TABLE successors (document TEXT PRIMARY KEY, body_hash TEXT NOT NULL, predecessor TEXT NOT NULL, "
       "activation INTEGER NOT NULL, verdict TEXT NOT NULL, reason TEXT NOT NULL, signed REAL NOT NULL, "
       "judged_at REAL NOT NULL)",
       "CREATE TABLE specs (id TEXT PRIMARY KEY, predecessor TEXT NOT NULL, first_round INTEGER NOT NULL, "
       "body TEXT NOT NULL)")

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
    received_at REAL NOT NULL, body TEXT, PRIMARY KEY (round, validator));
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
""" + "".join(f"{statement};\n" for statement in (*_V2, *_V3, *_V4))



def connect(path: Path) -> sqlite3.Connection:
    """Open (creating or migrating) the state file at `path`; StorageError if it cannot be used as one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(path, isolation_level=None)
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"{path}: cannot open the state file: {exc}") from exc
    try:
        _prepare(conn, path)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise _refusal(path, exc) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: Path) -> None:
    """Check the file is an undamaged tessera state file, then create or migrate its schema.

    The checks only read: a file refused here is left byte for byte as it was (WAL mode is set after them).
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    problem = conn.execute("PRAGMA quick_check(1)").fetchone()[0]  # reads every page once
    if problem != "ok":
        found = "; ".join(line for line in problem.splitlines() if not line.startswith("*** in database"))
        raise StorageError(f"{path}: damaged: {found}; restore it from a backup or move it away")
    if version > SCHEMA_VERSION:
        raise StorageError(f"{path}: schema version {version} is newer than this tessera ({SCHEMA_VERSION})")
    if version == 0 and conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None:
        raise StorageError(f"{path}: not a tessera state file (an SQLite file with tables of its own); move it away")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    if version == 0:
        conn.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}PRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;")
    elif version < SCHEMA_VERSION:
        conn.execute("BEGIN IMMEDIATE")
        if version == 1:
            _migrate_v1(conn)
        for statement in _V3:
            conn.execute(statement)
        if version < 4:
            _migrate_v3(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")


def _migrate_v3(conn: sqlite3.Connection) -> None:
    """Add the chain of specs (what a file that tests turned back from a current one still has stays)."""
    if "spec" not in {row[1] for row in conn.execute("PRAGMA table_info(nodes)")}:
        conn.execute(_V4[0])
    for statement in _V4[1:]:
        conn.execute(statement.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1))


def _refusal(path: Path, exc: sqlite3.DatabaseError) -> StorageError:
    """SQLite's own complaint about `path`, said as what it means for the operator."""
    code = exc.sqlite_errorcode & 0xFF  # the primary code of an extended one (SQLITE_CORRUPT_INDEX, ...)
    if code == sqlite3.SQLITE_NOTADB:
        return StorageError(f"{path}: not a tessera state file ({exc}); move it away")
    if code == sqlite3.SQLITE_CORRUPT:
        return StorageError(f"{path}: damaged: {exc}; restore it from a backup or move it away")
    return StorageError(f"{path}: cannot use the state file: {exc}")


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Add the plan table and keep each stored report whole, rebuilt once from its rows."""
    for statement in _V2:
        conn.execute(statement)
    conn.execute("ALTER TABLE score_reports ADD COLUMN body TEXT")
    for r, validator, base, base_loss in conn.execute(
            "SELECT round, validator, base, base_loss FROM score_reports").fetchall():
        entries = tuple(ScoreEntry(miner=m, commitment=c, loss=loss, verdict=v, reason=why)
                        for m, c, loss, v, why in conn.execute(
                            "SELECT miner, commitment, loss, verdict, reason FROM scores WHERE round = ? AND "
                            "validator = ? ORDER BY miner", (r, validator)))
        report = ScoreReport(round=r, base=base, base_loss=base_loss, entries=entries)
        conn.execute("UPDATE score_reports SET body = ? WHERE round = ? AND validator = ?",
                     (report.model_dump_json(), r, validator))


def insert_message(conn: sqlite3.Connection, r: MessageRecord) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO messages VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (r.id, r.kind, r.sender, r.round, r.verdict, r.reason, r.received_at))
    return cur.rowcount == 1


def store_payload(conn: sqlite3.Connection, sender: str, m: Message, at: float) -> bool:
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
        cur = conn.execute("INSERT OR IGNORE INTO score_reports VALUES (?, ?, ?, ?, ?, ?)",
                           (m.round, sender, m.base, m.base_loss, at, m.model_dump_json()))
        if cur.rowcount == 1:
            conn.executemany("INSERT OR IGNORE INTO scores VALUES (?, ?, ?, ?, ?, ?, ?)",
                             [(m.round, sender, e.miner, e.commitment, e.loss, e.verdict, e.reason) for e in m.entries])
    elif isinstance(m, GlobalState):
        cur = conn.execute("INSERT OR IGNORE INTO state_votes VALUES (?, ?, ?)", (m.round, sender, m.hash))
        if cur.rowcount == 1:
            conn.execute("INSERT OR IGNORE INTO global_states (hash, parent, round, contributors) VALUES (?, ?, ?, ?)",
                         (m.hash, m.parent, m.round, json.dumps(list(m.contributors))))
    elif isinstance(m, Successor):
        cur = conn.execute("INSERT OR IGNORE INTO successor_offers VALUES (?, ?, ?, ?)",
                           (m.round, sender, m.document, m.size))
    elif isinstance(m, Heartbeat):  # one of an earlier round (a catch-up hands them on late) changes nothing
        conn.execute("INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET "
                     "role = excluded.role, head = excluded.head, round = excluded.round, "
                     "last_seen = excluded.last_seen, spec = excluded.spec WHERE excluded.round >= nodes.round",
                     (sender, m.role, m.head, m.round, at, m.spec))
        return True
    else:
        raise AssertionError(f"no table for message kind {m.kind!r}")
    return cur.rowcount == 1


def state_record(conn: sqlite3.Connection, row: tuple[Any, ...]) -> GlobalStateRecord:
    state_hash, parent, r, contributors, adopted = row
    voters = [v for (v,) in conn.execute("SELECT validator FROM state_votes WHERE round = ? AND hash = ? "
                                         "ORDER BY validator", (r, state_hash))]
    return GlobalStateRecord(state_hash, parent, r, tuple(json.loads(contributors)), bool(adopted), tuple(voters))


def get(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def put(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, value))
