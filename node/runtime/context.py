"""The node's contract with its duties: what a duty may use (`NodeContext`) and must provide (`Duties`).

A duty sees the node only through its `NodeContext`: the config, spec and schedule; the identity it
signs with; the clock; typed storage and the blob store; the network (peers, blob transfer, catch-up);
the metrics; the data directory's disk (`disk`: a write refused for a full disk is said there, once a
round); and `publish`, which signs, gossips, records and hands one of our own messages back to our
duties (`announce` logs a refusal instead of raising it). It never reaches into the Node, the scheduler or the HTTP API. In return it provides
`Duties` (`on_phase`, `on_message`), built by a `DutiesFactory` from the context once, at start;
`BuiltOnce` loads what a role needs (model, data) in a worker thread at its first phase.
`HeartbeatDuties`, the minimal duty, announces liveness and head once a round: a node started without
a role's duties runs it, and the miner and validator duties run it beside their own work.
This module knows nothing about training, scoring or merging, nor about how the node wires or runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Container, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from node.net.network import Network, NetworkError, PublishRefused
from node.runtime.clock import Clock
from node.runtime.config import NodeConfig
from node.runtime.disk import DiskWatch
from node.runtime.metrics import NodeMetrics
from node.store.blobs import BlobStore
from node.store.db import Storage
from node.store.records import SuccessorRecord
from protocol.identity import Identity
from protocol.messages import Envelope, Heartbeat, Message, seal
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

TAKE_IN_S = 2.0  # how long a duty may spend asking a peer for what gossip missed and recording it


def history_providers(own: str, peers: Iterable[str], validators: Container[str]) -> list[str]:
    """`peers` in the order a node asks them for a round's history: validators first, each node in an
    order of its own (a hash of its id and theirs), so that nodes restarting together do not all ask
    the same validator."""
    return sorted(peers, key=lambda p: (p not in validators, hashlib.sha256(f"{own}:{p}".encode()).digest()))


class LocalDelivery:
    """Where our own published envelopes go: set by the Node to its gossip handler."""

    def __init__(self) -> None:
        self.handler: Callable[[Envelope, Message], Awaitable[None]] | None = None


@dataclass(frozen=True)
class NodeContext:
    """Everything a duty may use; handed to the duties factory once, at start."""

    config: NodeConfig
    spec: NetworkSpec
    schedule: Schedule
    identity: Identity
    clock: Clock
    storage: Storage
    blobs: BlobStore
    network: Network
    metrics: NodeMetrics
    local: LocalDelivery
    disk: DiskWatch

    async def publish(self, message: Message) -> Envelope:
        """Sign, gossip, record and hand to our duties one of our own messages; PublishRefused if peers
        would reject it.

        Noted as sent (`Storage.record_sent`) before it goes out, so that after a crash at any point the
        node knows it as its own when peers hand it back; recorded as accepted after gossiping, so a
        refused message leaves no trace; a duty that must not repeat an action after a crash in between
        records its intent first (a typed storage write).
        """
        envelope = seal(message, self.spec.gossip_id, self.identity)
        try:
            await self.storage.record_sent(envelope)
        except (sqlite3.Error, OSError) as exc:
            raise PublishRefused(f"{message.kind} for round {message.round}: cannot note it as sent: {exc} "
                                 f"(is the disk of {self.config.db_path} full?)") from exc
        try:
            await self.network.publish(envelope)
        except PublishRefused:
            await self.storage.forget_sent(envelope.message_id)
            raise
        assert self.local.handler is not None, "publish before the node was built"
        await self.local.handler(envelope, message)
        return envelope

    async def announce(self, message: Message) -> Envelope | None:
        """`publish`, with a refusal logged rather than raised (a full disk's once a round, by `disk`); None then."""
        try:
            return await self.publish(message)
        except PublishRefused as exc:
            if not self.disk.quiet(exc):
                log.warning("round %d: %s refused: %s", message.round, message.kind, exc)
            return None

    async def head(self) -> str:
        """The global state this node builds on: the adopted head, else the base model."""
        return await self.storage.head() or self.spec.root

    async def catch_up(self, round: int) -> int:
        """Ask a peer, validators first (`history_providers`), for the envelopes of `round` it accepted,
        and hand those we lacked to the gossip consumer (which records them); how many. 0 when there is
        no peer or none answers (a network error is logged)."""
        providers = history_providers(self.identity.node_id, self.network.peers(), self.spec.validator_weights)
        if not providers:
            return 0
        try:
            return await self.network.catch_up(round, providers)
        except NetworkError as exc:
            log.warning("round %d: could not catch up on missed messages: %s", round, exc)
            return 0

    async def take_in_from_peer(self, round: int, missing: Callable[[], Awaitable[bool]]) -> bool:
        """While `missing()` holds, gossip may have missed us: catch up on `round` from a peer and let the
        consumer record what it handed on, TAKE_IN_S at most for both. Whether something is still missing."""
        if not await missing():
            return False
        try:
            async with asyncio.timeout(TAKE_IN_S):
                if got := await self.catch_up(round):
                    log.info("round %d: a peer handed on %d message(s) gossip missed", round, got)
                    while await missing():
                        await asyncio.sleep(0.05)
        except TimeoutError:
            log.info("round %d: no peer handed on what is missing within %.0f s", round, TAKE_IN_S)
        return await missing()


class Duties(Protocol):
    """A role's work. Both hooks run on the event loop; torch work belongs in a thread.

    `on_phase` calls never overlap each other; `on_message` runs concurrently with them. A node
    restarted mid-phase calls `on_phase` for that phase again, so duties check storage for what
    they already did (a miner must not commit twice in a round).
    """

    async def on_phase(self, round: int, phase: Phase) -> None:
        """Called once at the start of each phase (at once for the phase in progress at start)."""
        ...

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        """Called for each accepted envelope (ours too) and its decoded message, after storage recorded it."""
        ...

    async def close(self, round: int) -> None:
        """The last work on a spec whose successor is in force from `round`: settle round - 1 as TRAIN of `round`
        would (node.duties.succession then derives the successor on the head this ends on)."""
        ...


DutiesFactory = Callable[[NodeContext], Duties]


@runtime_checkable
class TakesSuccessors(Protocol):
    """Duties that keep the chain of specs (node.duties.succession): an operator's offer goes to them."""

    async def offer(self, data: bytes) -> SuccessorRecord:
        """Judge a signed successor document; kept and offered to peers when accepted."""
        ...


class BuiltOnce(Generic[T]):
    """What a role's duties load at their first phase (model, data), built once in a worker thread."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._value: T | None = None

    async def get(self) -> T:
        if self._value is None:
            self._value = await asyncio.to_thread(self._build)
        return self._value


class HeartbeatDuties:
    """The minimal duty: at each phase start, announce our role and head (a validator: and the outer
    momentum it holds) unless already announced.

    Peers accept one heartbeat per sender per round (node.net.judge), so one goes out per round;
    after a restart in the same round the network refuses a second one, which is fine.
    """

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self._announced: int | None = None

    async def on_phase(self, round: int, phase: Phase) -> None:
        if self._announced == round:
            return
        head = await self.ctx.head()
        role = self.ctx.config.node.role
        momentum = await self.ctx.storage.momentum() if role == "validator" else None
        try:
            spec = None if self.ctx.spec.lineage is None else self.ctx.spec.network_id
            await self.ctx.publish(Heartbeat(round=round, role=role, head=head, momentum=momentum, spec=spec))
        except PublishRefused as exc:
            if not self.ctx.disk.quiet(exc):
                log.info("round %d: no heartbeat: %s", round, exc)
        self._announced = round

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        return None

    async def close(self, round: int) -> None:
        return None
