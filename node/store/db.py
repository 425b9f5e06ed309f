"""The node's durable state: one SQLite file (WAL) with one typed accessor per thing a node keeps.

Every public method is a coroutine that runs on the store's own single worker thread, so SQLite
never blocks the event loop and the connection is only ever touched by one thread. Every write is
one transaction (BEGIN IMMEDIATE ... COMMIT), so a killed node reopens to a consistent state; a
write of several rows (a round's rewards and its mark, a report and its entries, a state and its
vote) is one method, hence one transaction.

Durability: WAL with synchronous=FULL. NORMAL would survive a killed process but may lose the last
transactions on power loss; this file holds the rewards ledger and the commitments the node
accepted, writes are a few dozen per round, so the extra fsync per commit costs nothing that
matters. Schema and migrations: node.store.schema; records: node.store.records.
This module stores what it is given and judges nothing, with one exception the network's in-memory
check cannot make across a restart: it keeps only the first message per (kind, sender, round), heartbeats aside.
It computes no rewards or rankings. No other module names a storage key.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from node.store.chain import ChainStorage, chain_blobs, prune_offers
from node.store.records import (
    CommitRecord,
    GlobalStateRecord,
    MessageRecord,
    NodeRecord,
    PhaseRun,
    Proposal,
    RevealRecord,
    RewardRecord,
    RewardsLedger,
    RoundPlan,
    ScoreRecord,
    SeedRecord,
    SpecRecord,
    StorageError,
    Submission,
    SuccessorRecord,
)
from node.store.schema import SCHEMA_VERSION, get, insert_message, put, state_record, store_payload
from node.store.sqlite import read, write
from protocol.messages import Envelope, Message, ScoreReport

__all__ = ["SCHEMA_VERSION", "CommitRecord", "GlobalStateRecord", "MessageRecord", "NodeRecord", "Proposal",
           "RevealRecord", "RewardRecord", "RewardsLedger", "RoundPlan", "ScoreRecord", "SeedRecord", "SpecRecord",
           "Storage", "StorageError", "Submission", "SuccessorRecord"]

_HEAD = "head"
_MOMENTUM = "momentum"  # hash of the blob holding a validator's outer-optimizer momentum
_MOMENTUM_OF = "momentum_of:{}:{}"  # (state hash, voter) -> hash of the momentum blob it announced
_SUBMISSION = "submission:{}"  # round -> JSON {hash, size} of the blob this miner submits
_PGRAD_ERROR = "pgrad_error"  # hash of the blob holding the miner's error-feedback buffer after its last submission
_SEED = "seed:{}"  # round -> this validator's own seed
_REWARDED = "rewarded:{}"  # round -> "1" once the round's rewards are in the ledger
_REPORT = "round_report:{}"  # round -> this validator's JSON report of the round
_PROPOSAL = "proposal:{}"  # round -> JSON {state, momentum} this validator proposed
_MERGED_FROM = "merged_from:{}"  # round -> JSON list of the validators whose reports this validator's merge used
_EXPORTED = "rewards_exported_through"

class Storage(ChainStorage):
    """The node's SQLite state. Make it with `await Storage.open(path)`; `await close()` when done."""

    # -- messages ---------------------------------------------------------------------------

    @write
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
        stored = store_payload(conn, envelope.sender, message, received_at)
        verdict, reason = ("accept", "ok") if stored else ("reject", "equivocation")
        insert_message(conn, MessageRecord(message_id, envelope.kind, envelope.sender, envelope.round,
                                            verdict, reason, received_at))
        return stored

    @write
    def record_sent(self, conn: sqlite3.Connection, envelope: Envelope) -> None:
        """Note that we are about to hand `envelope` (signed with our key) to the network: written before it
        goes out, so that a node killed right after knows it as its own when peers hand it back."""
        conn.execute("INSERT OR IGNORE INTO sent VALUES (?, ?, ?)", (envelope.message_id, envelope.kind, envelope.round))

    @write
    def forget_sent(self, conn: sqlite3.Connection, message_id: str) -> None:
        """Drop the note of an envelope the network refused to send (it never left this node)."""
        conn.execute("DELETE FROM sent WHERE id = ?", (message_id,))

    @read
    def sent(self, conn: sqlite3.Connection, message_id: str) -> bool:
        """Whether this node handed the envelope `message_id` to the network (`record_sent`)."""
        return conn.execute("SELECT 1 FROM sent WHERE id = ?", (message_id,)).fetchone() is not None

    @read
    def accepted_since(self, conn: sqlite3.Connection, min_round: int) -> list[tuple[str, str, str, int]]:
        """(id, kind, sender, round) of every accepted message from `min_round` on, oldest first: the
        seen-set a restarted node's gossip check starts from."""
        rows = conn.execute("SELECT id, kind, sender, round FROM messages WHERE verdict = 'accept' AND round >= ? "
                            "ORDER BY received_at, id", (min_round,)).fetchall()
        return [(mid, kind, sender, r) for mid, kind, sender, r in rows]

    @write
    def prune(self, conn: sqlite3.Connection, before_round: int) -> int:
        """Forget the message log, the note of what we sent, and this node's per-round working state (own
        seeds, submissions, proposals, the reports merged from, announced momenta of states no longer
        current) of rounds before `before_round`; returns how many rows went. Payloads, plans, reports,
        leaderboards and the ledger stay.

        Safe once gossip for those rounds is IGNOREd as old: the payload tables keep the data and
        the first-message-per-sender rule, which do not depend on this log.
        """
        gone = conn.execute("DELETE FROM messages WHERE round < ?", (before_round,)).rowcount
        gone += conn.execute("DELETE FROM sent WHERE round < ?", (before_round,)).rowcount + prune_offers(conn, before_round)
        for prefix in (_SEED, _SUBMISSION, _PROPOSAL, _MERGED_FROM):
            head = prefix.format("")
            gone += conn.execute("DELETE FROM kv WHERE substr(key, 1, ?) = ? AND CAST(substr(key, ?) AS INTEGER) < ?",
                                 (len(head), head, len(head) + 1, before_round)).rowcount
        head = _MOMENTUM_OF.format("", "")[:-1]  # "momentum_of:"
        # Current: a state voted for since `before_round`, our head, or a head peers announce in heartbeats
        # since then (a node that missed the votes follows that head with the momentum named there).
        kept = ("SELECT hash FROM global_states WHERE round >= ? UNION SELECT value FROM kv WHERE key = ? "
                "UNION SELECT head FROM nodes WHERE round >= ?")
        gone += conn.execute(f"DELETE FROM kv WHERE substr(key, 1, ?) = ? AND substr(key, ?, 64) NOT IN ({kept})",
                             (len(head), head, len(head) + 1, before_round, _HEAD, before_round)).rowcount
        return gone

    @read
    def messages(self, conn: sqlite3.Connection, round: int) -> list[MessageRecord]:
        rows = conn.execute("SELECT id, kind, sender, round, verdict, reason, received_at FROM messages "
                            "WHERE round = ? ORDER BY received_at, id", (round,)).fetchall()
        return [MessageRecord(*row) for row in rows]

    # -- per-round payloads -----------------------------------------------------------------

    @read
    def commits_for(self, conn: sqlite3.Connection, round: int) -> list[CommitRecord]:
        rows = conn.execute("SELECT round, miner, commitment, received_at FROM commits WHERE round = ? "
                            "ORDER BY miner", (round,)).fetchall()
        return [CommitRecord(*row) for row in rows]

    @read
    def reveals_for(self, conn: sqlite3.Connection, round: int) -> list[RevealRecord]:
        rows = conn.execute("SELECT round, miner, commitment, size, received_at FROM reveals WHERE round = ? "
                            "ORDER BY miner", (round,)).fetchall()
        return [RevealRecord(*row) for row in rows]

    @read
    def seeds_for(self, conn: sqlite3.Connection, round: int) -> list[SeedRecord]:
        rows = conn.execute("SELECT round, validator, commitment, seed FROM seeds WHERE round = ? "
                            "ORDER BY validator", (round,)).fetchall()
        return [SeedRecord(*row) for row in rows]

    @read
    def scores_for(self, conn: sqlite3.Connection, round: int) -> list[ScoreRecord]:
        rows = conn.execute(
            "SELECT s.round, s.validator, s.miner, s.commitment, s.loss, s.verdict, s.reason, r.base, r.base_loss "
            "FROM scores s JOIN score_reports r ON r.round = s.round AND r.validator = s.validator "
            "WHERE s.round = ? ORDER BY s.validator, s.miner", (round,)).fetchall()
        return [ScoreRecord(*row) for row in rows]

    @read
    def global_states(self, conn: sqlite3.Connection, round: int | None = None,
                      since: int | None = None) -> list[GlobalStateRecord]:
        """Announced global states (all rounds, one `round`, or those from round `since` on), each with the
        validators that voted for it."""
        sql = "SELECT hash, parent, round, contributors, adopted FROM global_states"
        where, args = (" WHERE round = ?", (round,)) if round is not None else (
            (" WHERE round >= ?", (since,)) if since is not None else ("", ()))
        rows = conn.execute(sql + where + " ORDER BY round, hash", args).fetchall()
        return [state_record(conn, row) for row in rows]

    @write
    def mark_adopted(self, conn: sqlite3.Connection, state_hash: str, parent: str) -> None:
        """Flag a global state as adopted, with the `parent` its checked blob names, and make it the head.

        The row's parent came from the first vote for the hash, which any one validator can write.
        """
        if conn.execute("UPDATE global_states SET adopted = 1, parent = ? WHERE hash = ?",
                        (parent, state_hash)).rowcount != 1:
            raise ValueError(f"global state {state_hash} was never recorded; record it before adopting it")
        put(conn, _HEAD, state_hash)

    # -- rounds and phases ------------------------------------------------------------------

    @write
    def record_round(self, conn: sqlite3.Connection, round: int, started_at: float) -> None:
        conn.execute("INSERT OR IGNORE INTO rounds (round, started_at) VALUES (?, ?)", (round, started_at))

    @read
    def round_seed(self, conn: sqlite3.Connection, round: int) -> str | None:
        row = conn.execute("SELECT seed FROM rounds WHERE round = ?", (round,)).fetchone()
        return None if row is None else row[0]

    @read
    def latest_round(self, conn: sqlite3.Connection) -> int | None:
        latest: int | None = conn.execute("SELECT MAX(round) FROM rounds").fetchone()[0]
        return latest

    @write
    def record_phase_run(self, conn: sqlite3.Connection, run: PhaseRun) -> None:
        conn.execute("INSERT OR REPLACE INTO phase_runs VALUES (?, ?, ?, ?, ?, ?)",
                     (run.round, run.phase, run.started_at, run.finished_at, int(run.ok), run.error))

    @read
    def phase_runs(self, conn: sqlite3.Connection, round: int) -> list[PhaseRun]:
        rows = conn.execute("SELECT round, phase, started_at, finished_at, ok, error FROM phase_runs "
                            "WHERE round = ? ORDER BY started_at", (round,)).fetchall()
        return [PhaseRun(r, p, s, f, bool(ok), e) for r, p, s, f, ok, e in rows]

    @read
    def nodes(self, conn: sqlite3.Connection) -> list[NodeRecord]:
        """Peers' latest heartbeats."""
        rows = conn.execute("SELECT node_id, role, head, round, last_seen, spec FROM nodes ORDER BY node_id").fetchall()
        return [NodeRecord(*row) for row in rows]

    # -- rewards ----------------------------------------------------------------------------

    @write
    def add_rewards(self, conn: sqlite3.Connection, round: int, entries: Sequence[RewardRecord],
                    standings: Mapping[str, float]) -> bool:
        """Append one round to the ledger, make `standings` the standings (every miner's after this round:
        one no longer listed has decayed below the floor and goes) and mark the round rewarded, all in one
        transaction; False (writing nothing) when the round is already rewarded."""
        if get(conn, _REWARDED.format(round)) is not None:
            return False
        for e in entries:
            if e.round != round:
                raise ValueError(f"reward entry for round {e.round} passed with round {round}")
            conn.execute("INSERT INTO rewards VALUES (?, ?, ?, ?, ?, ?)",
                         (e.round, e.miner, e.rank, e.points, e.utility, e.standing))
        conn.execute("DELETE FROM standings")
        conn.executemany("INSERT INTO standings VALUES (?, ?, ?)",
                         [(miner, standing, round) for miner, standing in sorted(standings.items())])
        put(conn, _REWARDED.format(round), "1")
        return True

    @read
    def rewarded(self, conn: sqlite3.Connection, round: int) -> bool:
        """Whether round `round`'s rewards are in the ledger."""
        return get(conn, _REWARDED.format(round)) is not None

    @read
    def standings(self, conn: sqlite3.Connection) -> dict[str, float]:
        """Every rewarded miner's standing after the last rewarded round."""
        return dict(conn.execute("SELECT miner, standing FROM standings ORDER BY miner"))

    @read
    def rewards(self, conn: sqlite3.Connection, last_rounds: int | None = None,
                top: int | None = None) -> RewardsLedger:
        """The ledger's entries of its last `last_rounds` rounds, oldest first, and the `top` best standings,
        best first (None: all of either). Bounded, the read does not grow with the ledger's age."""
        since = -1 if last_rounds is None else conn.execute(
            "SELECT COALESCE(MAX(round), 0) - ? + 1 FROM rewards", (last_rounds,)).fetchone()[0]
        rows = conn.execute("SELECT round, miner, rank, points, utility, standing FROM rewards WHERE round >= ? "
                            "ORDER BY round, rank, miner", (since,)).fetchall()
        standings = dict(conn.execute("SELECT miner, standing FROM standings ORDER BY standing DESC, miner LIMIT ?",
                                      (-1 if top is None else top,)))
        return RewardsLedger([RewardRecord(*row) for row in rows], standings)

    @write
    def export_rewards_jsonl(self, conn: sqlite3.Connection, path: Path) -> int:
        """Append ledger rounds not yet exported to `path` (one JSON object a line, fsynced).

        The file is appended before the export mark moves, so a crash in between repeats lines
        (readers de-duplicate on round and miner) rather than losing them. A failed append (a full
        disk) is cut off again, and a torn last line that a crash left is dropped before appending:
        its round was not marked exported, so it is written again whole.
        """
        done = int(get(conn, _EXPORTED) or -1)
        rows = conn.execute("SELECT round, miner, rank, points, utility, standing FROM rewards WHERE round > ? "
                            "ORDER BY round, rank, miner", (done,)).fetchall()
        if not rows:
            return 0
        lines = "".join(json.dumps(RewardRecord(*row).as_dict(), sort_keys=True) + "\n" for row in rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        _append_whole_lines(path, lines.encode("utf-8"))
        put(conn, _EXPORTED, str(max(row[0] for row in rows)))
        return len(rows)

    # -- node state -------------------------------------------------------------------------

    @read
    def head(self, conn: sqlite3.Connection) -> str | None:
        """Hash of the global state this node currently builds on (None before the first)."""
        return get(conn, _HEAD)

    @write
    def set_head(self, conn: sqlite3.Connection, state_hash: str) -> None:
        put(conn, _HEAD, state_hash)

    @read
    def blobs_in_use(self, conn: sqlite3.Connection, since_round: int) -> set[str]:
        """The blobs this node keeps however old they are: the head, the outer momentum and every momentum
        announced for the head (what a re-syncing validator asks the head's voters for), the chain of specs'
        (`node.store.chain.chain_blobs`), and its own proposals and submissions from `since_round` on (what it
        serves). The error-feedback buffer ages out like any blob (node.duties.feedback)."""
        head = get(conn, _HEAD)
        kept = {value for value in (head, get(conn, _MOMENTUM)) if value is not None} | chain_blobs(conn)
        if head is not None:
            announced = _MOMENTUM_OF.format(head, "")  # "momentum_of:<head>:", then the voter
            kept.update(value for (value,) in conn.execute("SELECT value FROM kv WHERE substr(key, 1, ?) = ?",
                                                           (len(announced), announced)))
        for prefix in (_PROPOSAL, _SUBMISSION):
            head_text = prefix.format("")
            for (text,) in conn.execute("SELECT value FROM kv WHERE substr(key, 1, ?) = ? AND "
                                        "CAST(substr(key, ?) AS INTEGER) >= ?",
                                        (len(head_text), head_text, len(head_text) + 1, since_round)):
                record = json.loads(text)
                kept.update(record[field] for field in ("state", "momentum", "hash") if field in record)
        return kept

    # -- what a miner keeps ---------------------------------------------------------------------

    @read
    def submission(self, conn: sqlite3.Connection, round: int) -> Submission | None:
        """This miner's blob for `round`, once built."""
        text = get(conn, _SUBMISSION.format(round))
        return None if text is None else Submission(**json.loads(text))

    @write
    def set_submission(self, conn: sqlite3.Connection, round: int, submission: Submission,
                       pgrad_error: str | None = None) -> None:
        """Record this miner's blob for `round` and, when given, the hash of the error-feedback buffer
        its encoding left (one transaction, so a restart never sees one without the other)."""
        put(conn, _SUBMISSION.format(round), json.dumps({"hash": submission.hash, "size": submission.size}))
        if pgrad_error is not None:
            put(conn, _PGRAD_ERROR, pgrad_error)

    @read
    def pgrad_error(self, conn: sqlite3.Connection) -> str | None:
        """Hash of the blob holding this miner's error-feedback buffer (None before its first pgrad submission)."""
        return get(conn, _PGRAD_ERROR)

    # -- what a validator keeps -----------------------------------------------------------------

    @read
    def own_seed(self, conn: sqlite3.Connection, round: int) -> str | None:
        """The seed this validator committed to in `round` (kept before its commitment is published)."""
        return get(conn, _SEED.format(round))

    @write
    def set_own_seed(self, conn: sqlite3.Connection, round: int, seed: str) -> None:
        put(conn, _SEED.format(round), seed)

    @write
    def fix_round_plan(self, conn: sqlite3.Connection, plan: RoundPlan) -> RoundPlan:
        """Persist the plan of `plan.round` unless one is already fixed; returns the plan that holds.

        The round seed goes into `rounds.seed` in the same transaction.
        """
        row = conn.execute("SELECT plan FROM round_plans WHERE round = ?", (plan.round,)).fetchone()
        if row is not None:
            return RoundPlan.from_json(row[0])
        conn.execute("INSERT INTO round_plans VALUES (?, ?)", (plan.round, plan.to_json()))
        conn.execute("INSERT INTO rounds (round, started_at, seed) VALUES (?, 0, ?) "
                     "ON CONFLICT (round) DO UPDATE SET seed = excluded.seed", (plan.round, plan.seed))
        return plan

    @read
    def round_plan(self, conn: sqlite3.Connection, round: int) -> RoundPlan | None:
        row = conn.execute("SELECT plan FROM round_plans WHERE round = ?", (round,)).fetchone()
        return None if row is None else RoundPlan.from_json(row[0])

    @read
    def score_reports(self, conn: sqlite3.Connection, round: int) -> dict[str, ScoreReport]:
        """Every validator's score report of `round`, whole, by validator id."""
        rows = conn.execute("SELECT validator, body FROM score_reports WHERE round = ? ORDER BY validator",
                            (round,)).fetchall()
        return {validator: ScoreReport.model_validate_json(body) for validator, body in rows}

    @read
    def momentum(self, conn: sqlite3.Connection) -> str | None:
        """Hash of the blob holding this validator's outer momentum (None before its first merge)."""
        return get(conn, _MOMENTUM)

    @write
    def set_momentum(self, conn: sqlite3.Connection, momentum_hash: str) -> None:
        put(conn, _MOMENTUM, momentum_hash)

    @read
    def momentum_of(self, conn: sqlite3.Connection, state_hash: str, voter: str) -> str | None:
        """The momentum blob `voter` announced along with its vote for `state_hash`."""
        return get(conn, _MOMENTUM_OF.format(state_hash, voter))

    @write
    def set_momentum_of(self, conn: sqlite3.Connection, state_hash: str, voter: str, momentum_hash: str) -> None:
        put(conn, _MOMENTUM_OF.format(state_hash, voter), momentum_hash)

    @read
    def proposal(self, conn: sqlite3.Connection, round: int) -> Proposal | None:
        """The state and momentum this validator proposed in `round`."""
        text = get(conn, _PROPOSAL.format(round))
        return None if text is None else Proposal(**json.loads(text))

    @write
    def set_proposal(self, conn: sqlite3.Connection, round: int, proposal: Proposal, me: str) -> None:
        """Record our proposal of `round` and the momentum we announce with it, in one transaction."""
        put(conn, _PROPOSAL.format(round), json.dumps({"state": proposal.state, "momentum": proposal.momentum}))
        put(conn, _MOMENTUM_OF.format(proposal.state, me), proposal.momentum)

    @write
    def fix_merged_from(self, conn: sqlite3.Connection, round: int, validators: Iterable[str]) -> None:
        """Fix the validators whose score reports our merge of `round` uses (its rewards, leaderboard and
        vote follow from them); a set fixed before stays."""
        if get(conn, _MERGED_FROM.format(round)) is None:
            put(conn, _MERGED_FROM.format(round), json.dumps(sorted(validators)))

    @read
    def merged_from(self, conn: sqlite3.Connection, round: int) -> frozenset[str] | None:
        """The validators whose reports our merge of `round` used (`fix_merged_from`); None before it."""
        text = get(conn, _MERGED_FROM.format(round))
        return None if text is None else frozenset(json.loads(text))

    @read
    def round_report(self, conn: sqlite3.Connection, round: int) -> dict[str, Any] | None:
        """This validator's report of `round` (verdict, loss, rank, reward per miner), None if not written."""
        text = get(conn, _REPORT.format(round))
        return None if text is None else json.loads(text)

    @write
    def set_round_report(self, conn: sqlite3.Connection, round: int, report: Mapping[str, Any]) -> None:
        put(conn, _REPORT.format(round), json.dumps(report, sort_keys=True))

    # -- what every node learns about a round -----------------------------------------------------

    @write
    def set_round_results(self, conn: sqlite3.Connection, round: int, results: Mapping[str, Any]) -> None:
        """Store (or replace) the leaderboard of `round` (shape: node.duties.results)."""
        conn.execute("INSERT OR REPLACE INTO round_results VALUES (?, ?)", (round, json.dumps(results, sort_keys=True)))

    @read
    def round_results(self, conn: sqlite3.Connection, round: int) -> dict[str, Any] | None:
        """The leaderboard of `round`: every ranked miner's loss, rank, points and each validator's score."""
        row = conn.execute("SELECT results FROM round_results WHERE round = ?", (round,)).fetchone()
        return None if row is None else json.loads(row[0])

    @read
    def miner_history(self, conn: sqlite3.Connection, miner: str) -> list[dict[str, Any]]:
        """One miner's line of every stored leaderboard, oldest round first, each with its `round`."""
        history = []
        for r, text in conn.execute("SELECT round, results FROM round_results ORDER BY round"):
            line = next((m for m in json.loads(text)["miners"] if m["miner"] == miner), None)
            if line is not None:
                history.append({"round": r, **line})
        return history

    @read
    def adopted_losses(self, conn: sqlite3.Connection) -> dict[int, dict[str, Any]]:
        """Per round, the state it ended on and that state's held-out loss (a validator's reports only)."""
        losses = {}
        for _, text in conn.execute("SELECT key, value FROM kv WHERE key LIKE 'round_report:%'"):
            report = json.loads(text)
            if report.get("global_hash") is not None:
                losses[report["round"]] = {"hash": report["global_hash"], "loss": report["global_loss"]}
        return dict(sorted(losses.items()))


def _append_whole_lines(path: Path, data: bytes) -> None:
    """Append `data` (whole lines) to `path` and fsync; on failure the file ends at its last whole line."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        whole = _whole_lines_size(fd)
        os.ftruncate(fd, whole)
        try:
            rest = memoryview(data)
            while rest:
                rest = rest[os.write(fd, rest):]
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):  # if even this fails, the next export drops the torn line
                os.ftruncate(fd, whole)
            exc.filename = exc.filename or str(path)
            raise
    finally:
        os.close(fd)


def _whole_lines_size(fd: int) -> int:
    """Bytes of the open file `fd` up to and including its last newline."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - 4096)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0
