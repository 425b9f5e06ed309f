"""The typed records storage hands out: one frozen dataclass per thing a node persists or reads back.

`RoundPlan` is the one a validator fixes when EVALUATE starts (seed, revealed miners, assignment)
and MERGE reuses; `Submission` a miner's own blob of a round; `PhaseRun` one run of the scheduler's
phase handler (node.runtime.scheduler makes them); the rest mirror gossip payload rows.
This module knows nothing about SQLite; node.store.db reads and writes these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


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
    """An announced global state and the validators that announced it.

    `parent`, `round` and `contributors` are what the first vote for the hash said; only the hash is bound to
    the blob. Adopting a state rewrites its parent with the one the checked blob names.
    """

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
    spec: str | None = None
    """The successor spec its heartbeat names (None: the genesis spec)."""


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


@dataclass(frozen=True, slots=True)
class PhaseRun:
    """One run of the phase handler: when its phase began, when it ran, and how it ended."""

    round: int
    phase: str
    started_at: float
    finished_at: float
    ok: bool
    error: str = ""
    phase_start: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at

    @property
    def late_s(self) -> float:
        """How long after its phase began the handler started (resumes and overruns show here)."""
        return max(0.0, self.started_at - self.phase_start)


class StorageError(ValueError):
    """The state file cannot be used: unreadable, damaged, not a tessera state file, or written by a newer schema."""


@dataclass(frozen=True, slots=True)
class Submission:
    """A miner's own blob of a round: its hash (the commitment) and size."""

    hash: str
    size: int


@dataclass(frozen=True, slots=True)
class Proposal:
    """The state and momentum blobs a validator proposed in a round."""

    state: str
    momentum: str


@dataclass(frozen=True)
class RoundPlan:
    """What a round is scored and merged by, fixed once when EVALUATE starts.

    `revealed`: miner -> commitment of every miner with a Commit and a matching Reveal; `commits`:
    every miner's commitment; `assignment`: miner -> the validators that evaluate it;
    `unrevealed_seeds`: validators that committed a seed and did not reveal it in time; `excluded`:
    validators left out of `assignment` for withholding a seed in a recent round (node.duties.plan).
    """

    round: int
    seed: str
    revealed: dict[str, str]
    commits: dict[str, str]
    assignment: dict[str, tuple[str, ...]]
    unrevealed_seeds: tuple[str, ...] = field(default=())
    excluded: tuple[str, ...] = field(default=())

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "assignment": {m: list(v) for m, v in self.assignment.items()},
                           "unrevealed_seeds": list(self.unrevealed_seeds), "excluded": list(self.excluded)},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RoundPlan:
        data: dict[str, Any] = json.loads(text)
        return cls(round=data["round"], seed=data["seed"], revealed=data["revealed"], commits=data["commits"],
                    assignment={m: tuple(v) for m, v in data["assignment"].items()},
                    unrevealed_seeds=tuple(data["unrevealed_seeds"]),
                    excluded=tuple(data.get("excluded", ())))  # plans stored before exclusions existed


@dataclass(frozen=True, slots=True)
class SuccessorRecord:
    """A successor document this node judged: its address, body hash, what it succeeds and when, the verdict
    (`accept`, `refuse`, or `void`: accepted, then left behind by validators that stayed on its predecessor),
    the reason, and the validator weight that signed it."""

    document: str
    body_hash: str
    predecessor: str
    activation: int
    verdict: str
    reason: str
    signed: float


@dataclass(frozen=True, slots=True)
class SpecRecord:
    """A successor spec this node knows: its network id, predecessor, first round and canonical bytes."""

    id: str
    predecessor: str
    first_round: int
    body: bytes

    @property
    def inherits(self) -> list[str]:
        """The states the spec inherits (its lineage's), read from its body."""
        return list(json.loads(self.body)["lineage"]["inherits"])
