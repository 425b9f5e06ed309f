"""The serving end of the blob protocol gives up a transfer at its deadline, however slowly each write goes.

`BlobStreams.serve` runs against an in-memory stream that takes each write slowly (inside the idle
timeout, as a fetcher that grants its yamux window a little at a time would make it), under trio.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.p2p.blobs import BLOB_OK, BlobStreams
from node.store.blobs import BlobStore
from protocol.spec import NetworkSpec

WRITE_S = 0.2


class SlowFetcher:
    """The fetching end of one blob stream, as the provider sees it: it asks for a hash, then takes
    each write WRITE_S."""

    def __init__(self, blob_hash: str) -> None:
        self.request = bytes.fromhex(blob_hash)
        self.received = b""
        self.ending = ""

    async def read(self, n: int) -> bytes:
        chunk, self.request = self.request[:n], self.request[n:]
        return chunk

    async def write(self, data: bytes) -> None:
        await trio.sleep(WRITE_S)
        self.received += data

    async def close(self) -> None:
        self.ending = "closed"

    async def reset(self) -> None:
        self.ending = "reset"


def test_a_slow_fetcher_is_reset_when_the_transfer_deadline_passes(spec: NetworkSpec, tmp_path: Path) -> None:
    size = 20_000  # 20 writes of 1,000 bytes take 4 s, each inside the 1 s idle timeout
    config = P2PConfig(port=0, blob_idle_timeout_s=1.0, blob_min_rate_bytes_s=20_000, blob_chunk_bytes=1_000)
    store = BlobStore(tmp_path)
    blobs = BlobStreams(store, GossipJudge(spec, time.time), config)
    blob_hash = store.put_bytes(bytes(size))
    blobs.served.add(blob_hash)
    fetcher = SlowFetcher(blob_hash)

    started = time.monotonic()
    trio.run(blobs.serve, fetcher)  # a stand-in for the libp2p stream

    assert fetcher.ending == "reset", "served to the end: no deadline on the serving side"
    assert time.monotonic() - started < 3.0  # the deadline: 1 s + 20,000 B / 20,000 B/s
    assert fetcher.received[0] == BLOB_OK and len(fetcher.received) < 9 + size
