"""The network interface every duty codes against: errors, counters, deliveries and subscriptions.

`Network` = `Gossip` (publish signed envelopes, subscribe to accepted ones) + `BlobTransfer`
(serve blobs by hash, pull them from providers) + peers, listen addresses and counters. Two
implementations share the gossip judge (node.net.judge): the in-memory twin (node.net.twin) and
libp2p (node.net.p2p). Only ACCEPTed envelopes reach subscribers; a node's own envelopes are not
delivered back to it. This module knows nothing about libp2p, storage, or what messages mean.

Errors: `NetworkError(ValueError)` is the root; `PublishRefused` (our own envelope would be
rejected or ignored by peers), `BlobFetchError` (no provider delivered a blob with the right hash
within the cap).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from protocol.check import CheckResult
from protocol.messages import MESSAGE_TYPES, VALIDATOR_KINDS, Envelope, Message

SUBSCRIPTION_QUEUE = 4096
VALIDATOR_RESERVE = 512
"""Room at the end of a subscription's queue that only validators' messages may take. Any key may mine
and send heartbeats, so a flood of those from throwaway keys must not crowd out the seeds, reports
and votes consensus needs (a dropped delivery is lost: the judge has marked it seen)."""


class NetworkError(ValueError):
    """Root of the network layer's errors."""


class PublishRefused(NetworkError):
    """Our own envelope fails the gossip check (wrong window, not a validator...); peers would drop it."""


class BlobFetchError(NetworkError):
    """No provider delivered the blob: all refused, died, sent too much or sent the wrong bytes."""


@dataclass
class NetworkStats:
    """Counters since start: messages by (kind, verdict), REJECTs by peer, bytes, blobs and penalties."""

    messages: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejects_by_peer: Counter[str] = field(default_factory=Counter)
    """REJECTs by peer; past node.net.judge.REJECT_PEERS_KEPT peers, those with the fewest count as "other"."""
    gossip_bytes_in: int = 0
    gossip_bytes_out: int = 0
    blob_bytes_in: int = 0
    blob_bytes_out: int = 0
    blobs_fetched: int = 0
    blobs_served: int = 0
    blob_fetch_failures: int = 0
    dropped_deliveries: int = 0
    peer_scores: dict[str, int] = field(default_factory=dict)
    """Penalty score per peer: REJECTs it sent in the current round, late messages aside (reset when the
    round changes)."""
    penalised: dict[str, float] = field(default_factory=dict)
    """Peers past the penalty threshold -> clock time until which they stay disconnected."""
    penalties: int = 0
    """How many times a peer was penalised (disconnected and barred) since start."""
    early: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Validators whose authentic messages arrived before their window opened, beyond the clock-skew tolerance,
    in about the last two rounds -> (the most seconds one arrived before its window, when the last arrived)."""
    other_protocols: dict[str, tuple[int, str, float]] = field(default_factory=dict)
    """Peers refused because they speak another protocol version -> (their protocol, their release, when last
    refused)."""
    protocol_refusals: int = 0
    """How many times a peer was refused for speaking another protocol version since start."""


@dataclass(frozen=True)
class Delivery:
    """An accepted envelope, the peer it arrived from, and the check's result (with the decoded message)."""

    envelope: Envelope
    result: CheckResult
    peer: str

    @property
    def message(self) -> Message:
        """The body as the judge decoded it; an accepted envelope is never decoded twice."""
        assert self.result.message is not None, "a delivery is made only from an ACCEPT"
        return self.result.message


def room_for(kind: str) -> int:
    """How many deliveries a queue may hold before one of `kind` is dropped."""
    return SUBSCRIPTION_QUEUE if kind in VALIDATOR_KINDS else SUBSCRIPTION_QUEUE - VALIDATOR_RESERVE


class Subscription:
    """Accepted envelopes of some kinds, in arrival order; iterate with `async for`, stop with `close()`."""

    def __init__(self, kinds: frozenset[str] | None, on_close: Callable[[Subscription], None]) -> None:
        self.kinds = kinds
        self._queue: asyncio.Queue[Delivery | None] = asyncio.Queue(SUBSCRIPTION_QUEUE + 1)  # + the end marker
        self._on_close = on_close
        self._closed = False
        self._waiting = 0

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def offer(self, delivery: Delivery) -> bool:
        """Queue a delivery (call on the subscription's loop); False when there is no room for its kind and it
        was dropped."""
        if self._closed or self._queue.qsize() >= room_for(delivery.envelope.kind):
            return False
        self._queue.put_nowait(delivery)
        return True

    @property
    def pending(self) -> int:
        """Deliveries queued and not yet consumed."""
        return self._queue.qsize()

    @property
    def waiting(self) -> int:
        """Consumers blocked waiting for the next delivery."""
        return self._waiting

    def close(self) -> None:
        """Stop receiving; a pending `async for` ends once the queued deliveries are consumed."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        self._queue.put_nowait(None)  # offers stop one short of the queue's size, so this always fits

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self

    async def __anext__(self) -> Delivery:
        item = await self._next(None)
        if item is None:
            raise StopAsyncIteration
        return item

    async def get(self, timeout: float | None = None) -> Delivery:
        """The next delivery; asyncio.TimeoutError after `timeout` seconds."""
        item = await self._next(timeout)
        if item is None:
            raise NetworkError("subscription closed")
        return item

    async def _next(self, timeout: float | None) -> Delivery | None:
        self._waiting += 1
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        finally:
            self._waiting -= 1


class Subscribers:
    """The subscriptions of one node and fan-out to them (shared by the twin and the libp2p host).

    What is accepted before the first subscription (the host joins gossip while the node is still
    being built) waits for it, up to SUBSCRIPTION_QUEUE deliveries: the judge has already marked it
    seen, so a peer's history could not hand it on again.
    """

    def __init__(self, stats: NetworkStats) -> None:
        self._subs: list[Subscription] = []
        self._stats = stats
        self._early: list[Delivery] | None = []  # None once the first subscription has taken them

    def add(self, kinds: Iterable[str] | None) -> Subscription:
        if kinds is not None and (unknown := set(kinds) - set(MESSAGE_TYPES)):
            raise NetworkError(f"cannot subscribe to unknown message kinds {sorted(unknown)}; known: {sorted(MESSAGE_TYPES)}")
        sub = Subscription(None if kinds is None else frozenset(kinds), self._subs.remove)
        self._subs.append(sub)
        early, self._early = self._early or [], None
        for delivery in early:
            self._offer(sub, delivery)
        return sub

    def deliver(self, delivery: Delivery) -> None:
        if self._early is not None:  # no subscription yet
            if len(self._early) < room_for(delivery.envelope.kind):
                self._early.append(delivery)
            else:
                self._stats.dropped_deliveries += 1
            return
        for sub in list(self._subs):
            self._offer(sub, delivery)

    def _offer(self, sub: Subscription, delivery: Delivery) -> None:
        if sub.wants(delivery.envelope.kind) and not sub.offer(delivery):
            self._stats.dropped_deliveries += 1

    @property
    def pending(self) -> int:
        """Deliveries queued in the open subscriptions and not yet consumed."""
        return sum(sub.pending for sub in self._subs)

    def close_all(self) -> None:
        for sub in list(self._subs):
            sub.close()


class Gossip(Protocol):
    async def publish(self, envelope: Envelope) -> None:
        """Check our own envelope (PublishRefused if peers would reject it), then gossip it."""
        ...

    def subscribe(self, kinds: Iterable[str] | None = None) -> Subscription:
        """Start receiving accepted envelopes of `kinds` (all kinds when None) from now on; the first
        subscription also gets what was accepted before it."""
        ...

    def reject_counts(self) -> Mapping[str, int]:
        """REJECT verdicts per peer node id since start."""
        ...

    async def catch_up(self, round: int, providers: Sequence[str]) -> int:
        """Ask `providers` in turn for the envelopes of `round` they accepted (the current or the previous
        round), judge each again (`GossipJudge.judge_replayed`) and deliver the accepted ones like gossip.

        For a node that was down while they went out. Returns how many were delivered; the first provider
        that answers with any envelopes is the last one asked (one with none restarted or joined since,
        and holds no history). Never raises for what a provider sends.
        """
        ...

    def forget(self, envelope: Envelope) -> None:
        """Judge a delivered envelope afresh when it comes again: this node could not keep it (a full disk),
        so a peer's history (`catch_up`) may hand it on once more."""
        ...


class BlobTransfer(Protocol):
    async def fetch(self, blob_hash: str, providers: Sequence[str], max_bytes: int) -> Path:
        """Pull a blob by sha256 hex from the first provider that delivers it; verified, stored, its path.

        Tries providers in order; raises BlobFetchError when none delivered. Leaves no partial file.
        """
        ...

    def serve(self, blob_hash: str) -> None:
        """Answer requests for this blob (it must be in the blob store)."""
        ...

    def unserve(self, blob_hash: str) -> None: ...


class Network(Gossip, BlobTransfer, Protocol):
    @property
    def node_id(self) -> str: ...

    @property
    def listen_addrs(self) -> list[str]: ...

    @property
    def stats(self) -> NetworkStats:
        """A snapshot of the counters, safe to read from any thread."""
        ...

    def peers(self) -> list[str]:
        """Node ids of the peers connected right now."""
        ...

    async def close(self) -> None: ...
