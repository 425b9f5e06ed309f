"""The fetching end of the blob protocol at its faults: a blob larger than the cap is cut off at the cap, a
disk that fills (or a blob budget that would be passed) leaves nothing half-written and ends the fetch with its
error, whichever provider is asked, and a provider killed
mid-blob fails the fetch cleanly, after which the same blob from the restarted provider is stored whole.

`BlobStreams.fetch` runs under trio against an in-memory host whose streams play the provider's side.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from pathlib import Path

import pytest
import trio

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.network import BlobFetchError
from node.net.p2p.blobs import BLOB_OK, BlobStreams
from node.net.p2p.peers import peer_id_for
from node.store.blobs import BlobStore, BlobStoreFull, BlobWriter
from protocol.spec import NetworkSpec
from tests.conftest import make_identity

CHUNK = 1_000
PROVIDER = peer_id_for(make_identity(100).node_id)


class ProviderStream:
    """The provider's side of one blob stream, as the fetcher sees it: a header announcing `announced` bytes,
    then `body` in chunks, then the end of the stream (a provider killed mid-blob) unless `endless`."""

    def __init__(self, announced: int, body: bytes, endless: bool = False) -> None:
        self.pending = bytes([BLOB_OK]) + announced.to_bytes(8, "big")
        self.body = body
        self.endless = endless
        self.requested = b""
        self.read_bytes = 0  # body bytes handed to the fetcher
        self.ending = ""

    async def write(self, data: bytes) -> None:
        self.requested += data

    async def read(self, n: int) -> bytes:
        await trio.sleep(0)
        if self.pending:
            chunk, self.pending = self.pending[:n], self.pending[n:]
            return chunk
        if self.endless:
            chunk = bytes(min(n, CHUNK))
        else:
            chunk, self.body = self.body[:min(n, CHUNK)], self.body[min(n, CHUNK):]
        self.read_bytes += len(chunk)
        return chunk

    async def close(self) -> None:
        self.ending = "closed"

    async def reset(self) -> None:
        self.ending = "reset"


class Host:
    """Opens the next prepared stream for each request."""

    def __init__(self, *streams: ProviderStream) -> None:
        self.streams = list(streams)

    async def new_stream(self, peer_id: object, protocols: object) -> ProviderStream:
        return self.streams.pop(0)


def blobs_for(spec: NetworkSpec, store: BlobStore) -> BlobStreams:
    return BlobStreams(store, GossipJudge(spec, time.time), P2PConfig(port=0, blob_chunk_bytes=CHUNK))


def nothing_left(store: BlobStore, blob_hash: str) -> bool:
    return not store.has(blob_hash) and list((store.root / "tmp").iterdir()) == []


def fetch(blobs: BlobStreams, host: Host, blob_hash: str, max_bytes: int) -> Path:
    async def run() -> Path:
        return await blobs.fetch(host, blob_hash, [PROVIDER], max_bytes)  # type: ignore[arg-type]

    return trio.run(run)


def test_a_blob_announced_over_the_cap_is_refused_before_its_bytes(spec: NetworkSpec, tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    body = os.urandom(50_000)
    blob_hash = hashlib.sha256(body).hexdigest()
    stream = ProviderStream(len(body), body)
    with pytest.raises(BlobFetchError, match="over the 10000-byte cap"):
        fetch(blobs_for(spec, store), Host(stream), blob_hash, 10_000)
    assert stream.read_bytes == 0 and stream.ending == "reset"
    assert nothing_left(store, blob_hash)


def test_a_provider_that_sends_past_its_announced_size_is_cut_off_there(spec: NetworkSpec, tmp_path: Path) -> None:
    """A provider announces the cap and streams on without end: the fetcher reads the cap and no more."""
    store = BlobStore(tmp_path)
    blob_hash = hashlib.sha256(bytes(10_000)).hexdigest()
    stream = ProviderStream(10_000, b"", endless=True)
    assert fetch(blobs_for(spec, store), Host(stream), blob_hash, 10_000).read_bytes() == bytes(10_000)
    assert stream.read_bytes == 10_000
    liar = ProviderStream(10_000, b"", endless=True)  # the same, for a blob whose bytes are not zeros
    other = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(BlobFetchError, match="hash to"):
        fetch(blobs_for(spec, store), Host(liar), other, 10_000)
    assert liar.read_bytes == 10_000 and nothing_left(store, other)


def test_a_disk_that_fills_mid_fetch_leaves_nothing_half_written(spec: NetworkSpec, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = BlobStore(tmp_path)
    body = os.urandom(40_000)
    blob_hash = hashlib.sha256(body).hexdigest()
    store_chunk = BlobWriter.store

    def fills_up(writer: BlobWriter, data: bytes | memoryview) -> None:
        if writer._stored + len(data) > 20_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        store_chunk(writer, data)

    monkeypatch.setattr(BlobWriter, "store", fills_up)
    with pytest.raises(OSError, match="No space left on device") as raised:  # no other provider's bytes would fit
        fetch(blobs_for(spec, store), Host(ProviderStream(len(body), body)), blob_hash, 100_000)
    assert raised.value.errno == errno.ENOSPC and not isinstance(raised.value, BlobFetchError)
    assert nothing_left(store, blob_hash)


def test_a_fetch_past_the_blob_budget_is_refused_before_its_bytes(spec: NetworkSpec, tmp_path: Path) -> None:
    store = BlobStore(tmp_path, budget_bytes=30_000)
    body = os.urandom(40_000)
    blob_hash = hashlib.sha256(body).hexdigest()
    stream = ProviderStream(len(body), body)
    with pytest.raises(BlobStoreFull, match="past its budget of 30000 bytes"):
        fetch(blobs_for(spec, store), Host(stream), blob_hash, 100_000)
    assert stream.read_bytes == 0 and nothing_left(store, blob_hash)


def test_a_provider_killed_mid_blob_fails_the_fetch_and_is_fetched_whole_after_its_restart(
        spec: NetworkSpec, tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    body = os.urandom(40_000)
    blob_hash = hashlib.sha256(body).hexdigest()
    blobs = blobs_for(spec, store)
    killed = ProviderStream(len(body), body[:15_000])  # the stream ends 25,000 bytes short
    with pytest.raises(BlobFetchError, match="25000 bytes short"):
        fetch(blobs, Host(killed), blob_hash, 100_000)
    assert killed.ending == "reset" and nothing_left(store, blob_hash)
    restarted = ProviderStream(len(body), body)  # EVALUATE fetches again, from the miner now back
    assert fetch(blobs, Host(restarted), blob_hash, 100_000).read_bytes() == body
    assert list((store.root / "tmp").iterdir()) == []
