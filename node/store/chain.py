"""What a node keeps of the chain of specs: the successor documents offered and judged, the successor specs it
knows, and the one in force.

`ChainStorage` is the part of `node.store.db.Storage` that holds them (a mixin on the same SQLite worker: one
typed accessor per thing kept, each write one transaction). The documents and specs themselves are blobs too,
which the node serves; `chain_blobs` names every blob the chain needs kept for good (documents, specs and the
states successor specs inherit). This module judges nothing; node.duties.succession does.
"""

from __future__ import annotations

import sqlite3

from node.store.records import SpecRecord, SuccessorRecord
from node.store.schema import get, put
from node.store.sqlite import SqliteWorker, read, write

_SPEC = "spec"  # network id of the successor spec in force (absent: the genesis spec)


class ChainStorage(SqliteWorker):
    """Successor offers, judged documents, known successor specs and the spec in force."""

    @read
    def successor_offers(self, conn: sqlite3.Connection, since_round: int) -> list[tuple[str, int, str]]:
        """(document, size, sender) of the documents offered since `since_round` that this node has not judged."""
        rows = conn.execute("SELECT document, size, sender FROM successor_offers o WHERE round >= ? AND NOT EXISTS "
                            "(SELECT 1 FROM successors s WHERE s.document = o.document) ORDER BY round, sender",
                            (since_round,)).fetchall()
        return [(document, size, sender) for document, size, sender in rows]

    @write
    def judge_successor(self, conn: sqlite3.Connection, record: SuccessorRecord, at: float) -> None:
        """Keep this node's verdict on a document (a later verdict on it replaces the earlier one)."""
        conn.execute("INSERT OR REPLACE INTO successors VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (record.document, record.body_hash, record.predecessor, record.activation, record.verdict,
                      record.reason, record.signed, at))

    @read
    def successors(self, conn: sqlite3.Connection) -> list[SuccessorRecord]:
        """Every document judged, by activation round then address."""
        rows = conn.execute("SELECT document, body_hash, predecessor, activation, verdict, reason, signed "
                            "FROM successors ORDER BY activation, document").fetchall()
        return [SuccessorRecord(*row) for row in rows]

    @write
    def add_spec(self, conn: sqlite3.Connection, record: SpecRecord) -> None:
        conn.execute("INSERT OR IGNORE INTO specs VALUES (?, ?, ?, ?)",
                     (record.id, record.predecessor, record.first_round, record.body.decode()))

    @read
    def specs(self, conn: sqlite3.Connection) -> dict[str, SpecRecord]:
        """The successor specs this node knows, by network id."""
        rows = conn.execute("SELECT id, predecessor, first_round, body FROM specs").fetchall()
        return {row[0]: SpecRecord(row[0], row[1], row[2], row[3].encode()) for row in rows}

    @read
    def spec_in_force(self, conn: sqlite3.Connection) -> str | None:
        """Network id of the successor spec this node runs; None: the genesis spec."""
        return get(conn, _SPEC)

    @write
    def set_spec_in_force(self, conn: sqlite3.Connection, spec_id: str | None) -> None:
        if spec_id is None:
            conn.execute("DELETE FROM kv WHERE key = ?", (_SPEC,))
        else:
            put(conn, _SPEC, spec_id)


def chain_blobs(conn: sqlite3.Connection) -> set[str]:
    """The blobs the chain needs for good: accepted documents, known successor specs and the states they inherit
    (what a node that missed an activation fetches, and what builds a successor's model)."""
    kept = {document for (document,) in conn.execute("SELECT document FROM successors WHERE verdict != 'refuse'")}
    for row in conn.execute("SELECT id, predecessor, first_round, body FROM specs"):
        record = SpecRecord(row[0], row[1], row[2], row[3].encode())
        kept.update((record.id, *record.inherits))
    return kept


def prune_offers(conn: sqlite3.Connection, before_round: int) -> int:
    """Forget offers made before `before_round`; how many went."""
    return conn.execute("DELETE FROM successor_offers WHERE round < ?", (before_round,)).rowcount
