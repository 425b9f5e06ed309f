"""The network interface every duty codes against, the gossip judge, and the in-memory twin.

`Network` = `Gossip` (publish signed envelopes, subscribe to accepted ones) + `BlobTransfer`
(serve blobs by hash, pull them from providers) + peers, listen addresses and counters. Every
received envelope goes through `GossipJudge` (protocol.check with this node's clock and an
in-memory seen-set); only ACCEPTed envelopes reach subscribers or are relayed, and every REJECT
is counted against the peer that sent it. A node's own published envelopes are not delivered
back to its own subscribers. `MemoryHub` joins several `MemoryNetwork` twins that deliver to each
other directly, applying the same judge; tests use it instead of libp2p (node.net.p2p). `P2PConfig`,
the libp2p implementation's settings, lives here so a daemon can build it without importing
libp2p. This module knows nothing about libp2p, storage beyond the blob store, or what the
messages mean.

Errors: `NetworkError(ValueError)` is the root; `PublishRefused` (our own envelope would be
rejected), `BlobFetchError` (no provider delivered a blob with the right hash within the cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from node.store.blobs import BlobStore, BlobTooLarge, HashMismatch
from protocol.check import CheckContext, CheckResult, SeenKey, Verdict, check, check_bytes
from protocol.messages import MESSAGE_TYPES, Envelope
from protocol.rounds import Schedule
from protocol.spec import NetworkSpec

SUBSCRIPTION_QUEUE = 4096
SEEN_ROUNDS_KEPT = 3


class NetworkError(ValueError):
    """Root of the network layer's errors."""


class PublishRefused(NetworkError):
    """Our own envelope fails the gossip check (wrong window, not a validator...); peers would reject it."""


class BlobFetchError(NetworkError):
    """No provider delivered the blob: all refused, died, sent too much or sent the wrong bytes."""


@dataclass
class NetworkStats:
    """Counters since start: messages by (kind, verdict), REJECTs by peer, bytes and blobs."""

    messages: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejects_by_peer: Counter[str] = field(default_factory=Counter)
    gossip_bytes_in: int = 0
    gossip_bytes_out: int = 0
    blob_bytes_in: int = 0
    blob_bytes_out: int = 0
    blobs_fetched: int = 0
    blob_fetch_failures: int = 0
    dropped_deliveries: int = 0


@dataclass(frozen=True)
class P2PConfig:
    """Settings of the libp2p implementation (node.net.p2p): listening, finding peers, pacing gossip, moving blobs."""

    host: str = "127.0.0.1"
    """Listen IP; 0.0.0.0 accepts peers from other hosts."""
    port: int = 0
    """Listen TCP port; 0 picks a free one (see `listen_addrs`)."""
    bootstrap: tuple[str, ...] = ()
    """Bootstrap multiaddrs with /p2p/<peer id>; redialled for as long as the node runs."""
    max_peers: int = 32
    """Stop dialling discovered peers once this many are connected."""
    publish_interval_s: float = 0.005
    """Gap between two of our publishes; bursts wait in a queue instead of being dropped."""
    supervise_interval_s: float = 1.0
    """How often lost peers are redialled and the peer list refreshed."""
    exchange_interval_s: float = 10.0
    """How often each connected peer is asked for the peers it knows."""
    max_redial_backoff_s: float = 5.0
    """Longest wait between two dials of a lost peer (bootstrap peers are redialled forever)."""
    dial_timeout_s: float = 5.0
    """Give up one dial after this long."""
    blob_idle_timeout_s: float = 30.0
    """Abort a blob transfer when no byte arrives for this long."""
    blob_chunk_bytes: int = 1 << 20
    """Bytes per write when serving a blob (at most one yamux frame) and per disk write when fetching."""
    start_timeout_s: float = 30.0
    """Give up starting the host after this long."""
    forget_after_failures: int = 5
    """Stop redialling a discovered (non-bootstrap) peer after this many failed dials in a row."""
    serve_rate_bytes_s: float = 0.0
    """Upload cap per blob stream in bytes/s; 0 serves as fast as the link allows."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"p2p port must be 0..65535, got {self.port}")
        if self.max_peers < 1 or self.blob_chunk_bytes < 1 or self.forget_after_failures < 1:
            raise ValueError("p2p max_peers, blob_chunk_bytes and forget_after_failures must be >= 1")
        timings = (self.supervise_interval_s, self.exchange_interval_s, self.max_redial_backoff_s,
                   self.dial_timeout_s, self.blob_idle_timeout_s, self.start_timeout_s)
        if min(timings) <= 0 or self.publish_interval_s < 0 or self.serve_rate_bytes_s < 0:
            raise ValueError("p2p intervals and timeouts must be positive (publish gap and serve rate >= 0)")


class GossipJudge:
    """Applies protocol.check to incoming gossip with an in-memory seen-set; thread-safe.

    `seen` holds ids of accepted envelopes and `first_seen` the first accepted id per
    (kind, sender, round); both are pruned to the last few rounds.
    """

    def __init__(self, spec: NetworkSpec, now: Callable[[], float]) -> None:
        self.network_id = spec.network_id
        self.max_bytes = spec.limits.max_message_bytes
        self._validators = spec.validator_weights
        self._schedule = Schedule.from_spec(spec)
        self._now = now
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._first_seen: dict[SeenKey, str] = {}
        self._pruned_below = 0
        self.stats = NetworkStats()

    def _context(self) -> CheckContext:
        return CheckContext(
            network_id=self.network_id,
            validators=self._validators,
            schedule=self._schedule,
            now=self._now(),
            seen=self._seen,
            first_seen=self._first_seen,
        )

    def judge(self, data: bytes, peer: str) -> tuple[CheckResult, Envelope | None]:
        """Judge bytes received from `peer`; records accepted envelopes and counts the verdict."""
        with self._lock:
            self.stats.gossip_bytes_in += len(data)
            result, envelope = check_bytes(data, self._context(), self.max_bytes)
            kind = envelope.kind if envelope is not None else "unknown"
            self.stats.messages[(kind, result.verdict.value)] += 1
            if result.verdict is Verdict.REJECT:
                self.stats.rejects_by_peer[peer] += 1
            elif result.verdict is Verdict.ACCEPT:
                assert envelope is not None
                self._record(envelope)
            return result, envelope

    def admit_own(self, envelope: Envelope) -> bytes:
        """Check and record an envelope we are about to publish; raises PublishRefused if peers would reject it."""
        with self._lock:
            result = check(envelope, self._context())
            if result.verdict is not Verdict.ACCEPT:
                raise PublishRefused(f"{envelope.kind} for round {envelope.round}: {result.reason} {result.detail}")
            data = envelope.to_bytes()
            if len(data) > self.max_bytes:
                raise PublishRefused(f"{envelope.kind} envelope is {len(data)} bytes, over {self.max_bytes}")
            self._record(envelope)
            self.stats.gossip_bytes_out += len(data)
            self.stats.messages[(envelope.kind, "published")] += 1
            return data

    def _record(self, envelope: Envelope) -> None:
        message_id = envelope.message_id
        self._seen[message_id] = envelope.round
        self._first_seen.setdefault((envelope.kind, envelope.sender, envelope.round), message_id)
        oldest = envelope.round - SEEN_ROUNDS_KEPT
        if oldest > self._pruned_below:
            # protocol.check ignores rounds this old anyway, so their ids need not be remembered.
            self._pruned_below = oldest
            self._seen = {m: r for m, r in self._seen.items() if r >= oldest}
            self._first_seen = {k: m for k, m in self._first_seen.items() if k[2] >= oldest}

    @property
    def remembered(self) -> int:
        """How many accepted message ids are remembered for de-duplication."""
        return len(self._seen)

    def reject_counts(self) -> Mapping[str, int]:
        with self._lock:
            return dict(self.stats.rejects_by_peer)

    def count_blob(self, bytes_in: int = 0, bytes_out: int = 0, fetched: int = 0, failed: int = 0) -> None:
        """Add blob-transfer counts (called from whichever thread moves the bytes)."""
        with self._lock:
            self.stats.blob_bytes_in += bytes_in
            self.stats.blob_bytes_out += bytes_out
            self.stats.blobs_fetched += fetched
            self.stats.blob_fetch_failures += failed

    def snapshot(self) -> NetworkStats:
        """A copy of the counters that another thread may read while this one keeps counting."""
        with self._lock:
            s = self.stats
            return replace(s, messages=Counter(s.messages), rejects_by_peer=Counter(s.rejects_by_peer))


@dataclass(frozen=True)
class Delivery:
    """An accepted envelope, the peer it arrived from, and the check's result."""

    envelope: Envelope
    result: CheckResult
    peer: str


class Subscription:
    """Accepted envelopes of some kinds, in arrival order; iterate with `async for`, stop with `close()`."""

    def __init__(self, kinds: frozenset[str] | None, on_close: Callable[[Subscription], None]) -> None:
        self.kinds = kinds
        self._queue: asyncio.Queue[Delivery | None] = asyncio.Queue(SUBSCRIPTION_QUEUE)
        self._on_close = on_close
        self._closed = False

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds

    def offer(self, delivery: Delivery) -> bool:
        """Queue a delivery (call on the subscription's loop); False when the queue is full and it was dropped."""
        try:
            self._queue.put_nowait(delivery)
        except asyncio.QueueFull:
            return False
        return True

    def close(self) -> None:
        """Stop receiving; a pending `async for` ends once the queued deliveries are consumed."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self

    async def __anext__(self) -> Delivery:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def get(self, timeout: float | None = None) -> Delivery:
        """The next delivery; asyncio.TimeoutError after `timeout` seconds."""
        item = await asyncio.wait_for(self._queue.get(), timeout)
        if item is None:
            raise NetworkError("subscription closed")
        return item


class Gossip(Protocol):
    async def publish(self, envelope: Envelope) -> None:
        """Check our own envelope (PublishRefused if peers would reject it), then gossip it."""
        ...

    def subscribe(self, kinds: Iterable[str] | None = None) -> Subscription:
        """Start receiving accepted envelopes of `kinds` (all kinds when None) from now on."""
        ...

    def reject_counts(self) -> Mapping[str, int]:
        """REJECT verdicts per peer node id since start."""
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


class Subscribers:
    """The subscriptions of one node and fan-out to them (shared by the twin and the libp2p host)."""

    def __init__(self, stats: NetworkStats) -> None:
        self._subs: list[Subscription] = []
        self._stats = stats

    def add(self, kinds: Iterable[str] | None) -> Subscription:
        if kinds is not None and (unknown := set(kinds) - set(MESSAGE_TYPES)):
            raise NetworkError(f"cannot subscribe to unknown message kinds {sorted(unknown)}; known: {sorted(MESSAGE_TYPES)}")
        sub = Subscription(None if kinds is None else frozenset(kinds), self._subs.remove)
        self._subs.append(sub)
        return sub

    def deliver(self, delivery: Delivery) -> None:
        for sub in list(self._subs):
            if sub.wants(delivery.envelope.kind) and not sub.offer(delivery):
                self._stats.dropped_deliveries += 1

    def close_all(self) -> None:
        for sub in list(self._subs):
            sub.close()


class MemoryHub:
    """Joins in-memory networks; `publish` on one delivers to every other joined twin."""

    def __init__(self) -> None:
        self.nodes: dict[str, MemoryNetwork] = {}

    def join(self, node_id: str, judge: GossipJudge, store: BlobStore) -> MemoryNetwork:
        if node_id in self.nodes:
            raise NetworkError(f"node {node_id[:12]} already joined this hub")
        net = MemoryNetwork(self, node_id, judge, store)
        self.nodes[node_id] = net
        return net

    def inject(self, data: bytes, sender: str, to: Iterable[str] | None = None) -> None:
        """Deliver raw bytes as if peer `sender` gossiped them (tests send forged or malformed data)."""
        targets = self.nodes if to is None else {n: self.nodes[n] for n in to}
        for node_id, net in targets.items():
            if node_id != sender:
                net.receive(data, sender)


class MemoryNetwork:
    """The in-memory twin of the libp2p network: same interface, same judge, no sockets."""

    def __init__(self, hub: MemoryHub, node_id: str, judge: GossipJudge, store: BlobStore) -> None:
        self._hub = hub
        self._node_id = node_id
        self._judge = judge
        self._store = store
        self._subscribers = Subscribers(judge.stats)
        self._served: set[str] = set()
        self.closed = False

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self._node_id}"]

    @property
    def stats(self) -> NetworkStats:
        return self._judge.snapshot()

    def peers(self) -> list[str]:
        return sorted(n for n, net in self._hub.nodes.items() if n != self._node_id and not net.closed)

    async def publish(self, envelope: Envelope) -> None:
        assert not self.closed, "publish on a closed network"
        data = self._judge.admit_own(envelope)
        self._hub.inject(data, self._node_id)

    def subscribe(self, kinds: Iterable[str] | None = None) -> Subscription:
        return self._subscribers.add(kinds)

    def reject_counts(self) -> Mapping[str, int]:
        return self._judge.reject_counts()

    def receive(self, data: bytes, peer: str) -> None:
        if self.closed:
            return
        result, envelope = self._judge.judge(data, peer)
        if result.verdict is Verdict.ACCEPT:
            assert envelope is not None
            self._subscribers.deliver(Delivery(envelope, result, peer))

    def serve(self, blob_hash: str) -> None:
        if not self._store.has(blob_hash):
            raise NetworkError(f"cannot serve blob {blob_hash[:12]}: not in the blob store")
        self._served.add(blob_hash)

    def unserve(self, blob_hash: str) -> None:
        self._served.discard(blob_hash)

    def read_served(self, blob_hash: str) -> bytes | None:
        """The blob's bytes if this node serves it, else None (what a provider answers)."""
        if self.closed or blob_hash not in self._served:
            return None
        return self._store.path(blob_hash).read_bytes()

    async def fetch(self, blob_hash: str, providers: Sequence[str], max_bytes: int) -> Path:
        if self._store.has(blob_hash):
            return self._store.path(blob_hash)
        failures: list[str] = []
        for provider in providers:
            net = self._hub.nodes.get(provider)
            data = net.read_served(blob_hash) if net is not None else None
            if data is None:
                failures.append(f"{provider[:12]}: not served")
                continue
            try:
                with self._store.open_writer(blob_hash, max_bytes) as writer:
                    writer.write(data)
            except (HashMismatch, BlobTooLarge) as exc:
                failures.append(f"{provider[:12]}: {exc}")
                continue
            self._judge.count_blob(bytes_in=len(data), fetched=1)
            return self._store.path(blob_hash)
        self._judge.count_blob(failed=1)
        raise BlobFetchError(f"blob {blob_hash[:12]}: no provider delivered it ({'; '.join(failures) or 'no providers'})")

    async def close(self) -> None:
        self.closed = True
        self._subscribers.close_all()
