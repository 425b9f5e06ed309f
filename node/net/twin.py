"""The in-memory twin of the libp2p network: `MemoryHub` joins `MemoryNetwork`s that deliver to
each other directly, through the same `GossipJudge` as libp2p. Unit and whole-round tests use it.

A peer the judge penalises is treated as disconnected: it is left out of `peers()` and its
envelopes are dropped unread, as the libp2p host would. `MemoryHub.idle()` says whether every
delivery has been consumed, so tests can advance a manual clock once the network has gone quiet
instead of polling wall time. This module knows nothing about sockets, rounds or duties.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from node.net.judge import GossipJudge
from node.net.network import BlobFetchError, Delivery, NetworkError, NetworkStats, Subscribers, Subscription
from node.store.blobs import BlobStore, BlobTooLarge, HashMismatch
from protocol.check import Verdict
from protocol.messages import Envelope


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

    def idle(self) -> bool:
        """True when no joined node has a delivery waiting in any subscription."""
        return all(net.pending == 0 for net in self.nodes.values())

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Let the event loop run until every delivery has been consumed; AssertionError if it is not within
        `timeout_s`. A handler can wait on a thread (a node's SQLite writes run in one), which a busy machine can
        hold up for longer than any number of loop turns takes: 10,000 turns did not cover 12 commits' writes
        in a whole suite on 2 cores."""
        deadline = time.monotonic() + timeout_s
        turns = 0
        while True:
            await asyncio.sleep(0 if turns < 1000 else 0.001)  # the loop's own turns first, then the threads'
            if self.idle():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the network is still busy after {timeout_s:g} s")
            turns += 1


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

    @property
    def pending(self) -> int:
        """Deliveries queued in this node's subscriptions and not yet consumed."""
        return self._subscribers.pending

    def peers(self) -> list[str]:
        return sorted(n for n, net in self._hub.nodes.items()
                      if n != self._node_id and not net.closed and not self._judge.is_penalised(n))

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

    async def catch_up(self, round: int, providers: Sequence[str]) -> int:
        for provider in providers:
            net = self._hub.nodes.get(provider)
            if net is None or net.closed or net is self:
                continue
            frames, delivered = net._judge.recent(round), 0
            for data in frames:
                result, envelope = self._judge.judge_replayed(data, provider, round)
                if result.verdict is Verdict.ACCEPT:
                    assert envelope is not None
                    self._subscribers.deliver(Delivery(envelope, result, provider))
                    delivered += 1
            if frames:  # a provider with no history (restarted, just joined) is not an answer
                return delivered
        return 0

    def forget(self, envelope: Envelope) -> None:
        self._judge.forget(envelope)

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
        data = self._store.path(blob_hash).read_bytes()
        self._judge.count_blob(bytes_out=len(data), served=1)
        return data

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
