"""What a node's data directory needs for the rounds ahead and what it has, and the one line a full disk gets.

`RoundNeed` is the estimate, from the spec's blob sizes (each at its cap: the group's tensors, and the
header up to `limits.max_header_bytes`) and the node's config: the most one round stores in the blob store,
by what stores it. A miner: the adopted global state, its submission and, in a pgrad network, its
error-feedback buffer. A validator: its proposed state and momentum, the adopted ones when another proposal
won, and the miners' blobs it fetches: `validator.prefetch_bytes` of them, at least the
`aggregation.top_g` its merge reads, at most as many as one score report names. The store keeps
`storage.blob_retention_rounds` rounds beside the one in progress (no more than
`storage.blob_budget_bytes` where that is set). What the rounds ahead need is what the store still grows
by to hold them, at least one round, plus `DATABASE_HEADROOM` for SQLite. Miners' blobs a validator is
assigned beyond its prefetch budget are not counted: how many there are depends on how many miners come.

`DiskWatch` compares it with the free bytes of the data directory's filesystem (at start, at each TRAIN,
and whenever /status or /metrics asks) and says so when they fall short; a write refused because the disk
(or the blob store's budget) is full is said in one line naming the path, the free bytes and what to do
(`quiet`, after which the caller logs nothing of it, and no traceback). One disk line a round at most: the
warning or the error, whichever comes first. This module knows nothing about what the node writes or why.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.runtime.config import NodeConfig
from node.runtime.metrics import NodeMetrics
from node.store.blobs import BlobStore, BlobStoreFull
from node.store.full import full_disk
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)

MIB = 1 << 20
DATABASE_HEADROOM = 4 * MIB
"""SQLite's write-ahead log grows to about 1000 pages of 4 KiB between checkpoints; a round's rows are far
less (0.014 MiB a round on a validator in bench/soak.py)."""


@dataclass(frozen=True)
class RoundNeed:
    """The most bytes one round stores in the blob store, by what stores them, and how much the store keeps."""

    role: str
    blobs: Mapping[str, int]
    """What a round stores -> the most bytes it takes."""
    kept_rounds: int
    """Rounds of blobs the store holds at its fullest: `storage.blob_retention_rounds` and the round in progress."""
    budget_bytes: int | None
    """`storage.blob_budget_bytes`: fetches stop there (the node's own blobs are written all the same)."""

    @property
    def round_bytes(self) -> int:
        return sum(self.blobs.values())

    @property
    def fullest_bytes(self) -> int:
        """The most the blob store holds: `kept_rounds` rounds, or its budget and a round of the node's own."""
        fullest = self.kept_rounds * self.round_bytes
        return fullest if self.budget_bytes is None else min(fullest, max(self.budget_bytes, self.round_bytes))

    def needed(self, stored: int) -> int:
        """Free bytes the rounds ahead need with `stored` bytes in the blob store: what it still grows by, at
        least a round, and the database's headroom."""
        return max(self.round_bytes, self.fullest_bytes - stored) + DATABASE_HEADROOM

    def parts(self) -> str:
        """What a round stores, as one phrase: "the adopted global state 1.1 MiB, its submission 1.1 MiB"."""
        return ", ".join(f"{what} {size_text(n)}" for what, n in self.blobs.items())

    def advice(self) -> str:
        """What an operator can do about too little room, in one phrase."""
        fewer = "fewer rounds kept need less (storage.blob_retention_rounds)"
        if self.role == "validator":
            fewer += ", and so do fewer miners' blobs fetched ahead (validator.prefetch_bytes)"
        return f"free space there or move node.data_dir to a larger disk; {fewer}"


def round_need(config: NodeConfig, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> RoundNeed:
    """The estimate for this node, given the group's tensor shapes (`group_shapes`)."""
    from protocol.messages import report_capacity
    from training.blob import max_blob_bytes
    from validator.checks import submission_cap

    state = max_blob_bytes(shapes, "float32", spec.limits.max_header_bytes)  # states and momenta are fp32
    submission = submission_cap(spec, shapes)
    blobs: dict[str, int]
    if config.node.role == "miner":
        blobs = {"the adopted global state": state, "its submission": submission}
        if spec.submission.format == "pgrad":
            blobs["its error-feedback buffer"] = state
    else:
        most = report_capacity(spec.limits.max_message_bytes) * submission
        fetched = min(most, max(config.validator.prefetch_bytes, spec.aggregation.top_g * submission))
        blobs = {"its proposed state and momentum": 2 * state, "the adopted state and momentum": 2 * state,
                 "miners' blobs": fetched}
    return RoundNeed(config.node.role, blobs, config.storage.blob_retention_rounds + 1,
                     config.storage.blob_budget_bytes)


def group_shapes(spec: NetworkSpec, spec_path: Path) -> dict[str, tuple[int, ...]]:
    """The expert group's tensor shapes, from the spec's model built on the meta device (no weights read)."""
    from training.adapters import adapter_for
    from training.experts import expected_shapes
    from training.model import meta_base

    return expected_shapes(meta_base(spec, spec_path), adapter_for(spec.model.family), spec.group)


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem `path` is on (or would be, for a path not made yet)."""
    return shutil.disk_usage(_existing(path)).free


def total_bytes(path: Path) -> int:
    """The size of the filesystem `path` is on (or would be)."""
    return shutil.disk_usage(_existing(path)).total


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def size_text(n: int) -> str:
    """Bytes for a person: "0 B", "812 KiB", "13.4 MiB", "8.0 GiB"."""
    if n < 1024:
        return f"{n} B"
    if n < MIB:
        return f"{n // 1024} KiB"
    return f"{n / MIB:.1f} MiB" if n < 1024 * MIB else f"{n / (1024 * MIB):.1f} GiB"


@dataclass(frozen=True)
class DiskLook:
    """The data directory's free bytes and what the rounds ahead need, as read at one moment."""

    free_bytes: int
    needed_bytes: int

    @property
    def low(self) -> bool:
        return self.free_bytes < self.needed_bytes


class DiskWatch:
    """One node's data directory against its `RoundNeed`; `round_now` is the round in progress (-1 before
    genesis), for saying a full disk once a round."""

    def __init__(self, config: NodeConfig, blobs: BlobStore, need: RoundNeed, metrics: NodeMetrics,
                 round_now: Callable[[], int]) -> None:
        self.data_dir = config.node.data_dir
        self._database = config.db_path
        self._blobs = blobs
        self.need = need
        self._metrics = metrics
        self._round_now = round_now
        self._said: int | None = None
        """The round whose disk line was said (the low-space warning or a full disk's error)."""
        self.refused: dict[str, Any] | None = None
        """The last write refused for a full disk: {"round", "error"}; /status shows it for that round and the next."""

    def look(self) -> DiskLook:
        """Free and needed bytes now (exported as metrics too); reads the filesystem, so off the event loop."""
        look = DiskLook(free_bytes(self.data_dir), self.need.needed(self._blobs.stored_bytes()))
        self._metrics.disk(look.free_bytes, look.needed_bytes)
        return look

    def warn_if_low(self, look: DiskLook) -> None:
        """Say so when the free bytes of `look` fall short of what the rounds ahead need (once a round)."""
        if look.low and self._first_this_round():
            log.warning("%sthe disk of %s has %s free, and the rounds ahead need about %s (a round stores up to %s: "
                        "%s; %d rounds kept, and %s for the database): %s", self._round_prefix(), self.data_dir,
                        size_text(look.free_bytes), size_text(look.needed_bytes), size_text(self.need.round_bytes),
                        self.need.parts(), self.need.kept_rounds, size_text(DATABASE_HEADROOM), self.need.advice())

    def quiet(self, exc: BaseException) -> bool:
        """True when `exc` is a write refused for a full disk (or the blob store's budget): then it is said here,
        in one line a round, and the caller logs nothing more of it; False for any other error."""
        full = full_disk(exc)
        if full is None:
            return False
        self.refused = {"round": self._round_now(), "error": str(full)}
        if not self._first_this_round():
            log.debug("a write refused for a full disk, said already this round: %s", full)
        elif isinstance(full, BlobStoreFull):
            log.error("%sthe blob store %s is at its budget: %s; the node goes on, and fetches again once there is "
                      "room", self._round_prefix(), self._blobs.root, full)
        else:
            log.error("%sthe disk is full: %s; %s has %s free, and the rounds ahead need about %s: %s; the node "
                      "goes on, and catches up once there is room", self._round_prefix(), self._failed(full),
                      self.data_dir, size_text(free_bytes(self.data_dir)),
                      size_text(self.need.needed(self._blobs.stored_bytes())), self.need.advice())
        return True

    def status(self, look: DiskLook) -> dict[str, Any]:
        """The data directory's space as /status shows it."""
        refused = self.refused if self.refused is not None and self.refused["round"] >= self._round_now() - 1 else None
        return {"path": str(self.data_dir), "free_bytes": look.free_bytes, "needed_bytes": look.needed_bytes,
                "low": look.low, "refused": refused}

    def _first_this_round(self) -> bool:
        round = self._round_now()
        first = self._said != round
        self._said = round
        return first

    def _round_prefix(self) -> str:
        round = self._round_now()
        return f"round {round}: " if round >= 0 else ""

    def _failed(self, full: OSError | sqlite3.Error) -> str:
        """What a full disk refused: a write of the file the OS names, else of the data directory or (SQLite) the
        database."""
        if isinstance(full, OSError):
            return f"writing {full.filename or self.data_dir} failed ({full.strerror or full})"
        return f"writing {self._database} failed ({full})"
