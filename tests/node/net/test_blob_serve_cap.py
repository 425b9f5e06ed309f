"""A provider serves one peer at most `max_serves_per_peer` blob streams at once; the rest are told busy.

`BlobStreams.handle` (the stream handler) runs against in-memory streams under trio: one peer opens many streams for the
same blob and never reads past the first write, as a peer that wants to make us upload the blob
again and again would. Another peer is still served, and a stream that ends frees its slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import trio

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.p2p.blobs import BLOB_OK, BlobStreams
from node.store.blobs import BlobStore
from protocol.spec import NetworkSpec


@dataclass
class Conn:
    peer_id: str


class StuckFetcher:
    """The fetching end of one blob stream, as the provider sees it: it asks for a hash, then takes the
    status and size and nothing more until `release` is set."""

    def __init__(self, peer: str, blob_hash: str, release: trio.Event) -> None:
        self.muxed_conn = Conn(peer)
        self.request = bytes.fromhex(blob_hash)
        self.release = release
        self.received = b""

    async def read(self, n: int) -> bytes:
        chunk, self.request = self.request[:n], self.request[n:]
        return chunk

    async def write(self, data: bytes) -> None:
        if self.received:
            await self.release.wait()
        self.received += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass


def test_one_peer_is_served_a_few_streams_at_a_time(spec: NetworkSpec, tmp_path: Path) -> None:
    config = P2PConfig(port=0, blob_chunk_bytes=1_000)
    store = BlobStore(tmp_path)
    blobs = BlobStreams(store, GossipJudge(spec, time.time), config)
    blob_hash = store.put_bytes(bytes(10_000))
    blobs.served.add(blob_hash)

    async def main() -> tuple[list[StuckFetcher], StuckFetcher, StuckFetcher]:
        release = trio.Event()
        greedy = [StuckFetcher("greedy", blob_hash, release) for _ in range(8)]
        other = StuckFetcher("other", blob_hash, release)
        async with trio.open_nursery() as nursery:
            for fetcher in [*greedy, other]:
                nursery.start_soon(blobs.handle, fetcher)
            await trio.sleep(0.5)
            release.set()
        later = StuckFetcher("greedy", blob_hash, release)
        await blobs.handle(later)  # type: ignore[arg-type]  # the slots of the streams that ended are free again
        return greedy, other, later

    greedy, other, later = trio.run(main)

    served = [f for f in greedy if f.received[:1] == bytes([BLOB_OK])]
    assert len(served) == config.max_serves_per_peer, f"{len(served)} streams of one peer served at once"
    assert all(len(f.received) == 9 + 10_000 for f in served)
    assert all(len(f.received) == 9 and f.received[0] != BLOB_OK for f in greedy if f not in served)
    assert len(other.received) == 9 + 10_000 and len(later.received) == 9 + 10_000
