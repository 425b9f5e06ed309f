"""The `/tessera/blob/1` stream protocol: serve blobs by hash and pull them from providers.

A request is the 32-byte hash; the answer is a status byte, an 8-byte size and the bytes. The
fetching side checks the announced size against the cap and the blob store's budget (a fetch the
budget refuses ends there, with BlobStoreFull, whichever provider is asked, and so does one the full disk
refuses, with the OSError it raised, node.store.full), reads no more than the
announced size, hashes while it reads and lets the blob store verify and rename (nothing partial is
left behind: not when the provider stops mid-blob, nor when the disk fills). Either side gives up a transfer that is
idle for `blob_idle_timeout_s`, or not done by its deadline (that timeout plus the size at
`blob_min_rate_bytes_s`), so a peer that drips bytes holds a stream no longer than that. A provider
serves one peer at most `max_serves_per_peer` streams at once and answers more with BLOB_BUSY, so
one peer cannot make it upload the same blob many times over in parallel. Runs on the
trio thread of node.net.p2p.host; knows nothing about gossip, peers beyond their ids, or what a blob
contains.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import BinaryIO

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.network import BlobFetchError
from node.net.p2p.peers import node_id_for
from node.net.p2p.streams import read_exact, reset
from node.net.p2p.wire import FRAME_PAYLOAD_BYTES
from node.store.blobs import BlobStore, BlobWriter
from node.store.full import full_disk

log = logging.getLogger(__name__)

BLOB_PROTOCOL = TProtocol("/tessera/blob/1")
BLOB_OK, BLOB_NOT_SERVED, BLOB_BUSY = 0, 1, 2


class BlobStreams:
    """Both ends of the blob protocol for one host; `served` is the set of hashes we answer for."""

    def __init__(self, store: BlobStore, judge: GossipJudge, config: P2PConfig) -> None:
        self.store = store
        self.judge = judge
        self.config = config
        self.served: set[str] = set()
        self._serving: dict[ID, int] = {}  # streams being served, per peer

    async def handle(self, stream: INetStream) -> None:
        """The stream handler of BLOB_PROTOCOL: `serve` the request, or answer BLOB_BUSY when its peer
        already has `max_serves_per_peer` streams being served."""
        peer = stream.muxed_conn.peer_id
        if self._serving.get(peer, 0) >= self.config.max_serves_per_peer:
            try:
                with trio.fail_after(self.config.blob_idle_timeout_s):
                    await stream.write(bytes([BLOB_BUSY]) + (0).to_bytes(8, "big"))
                    await stream.close()
            except Exception as exc:
                log.debug("p2p: answering a blob request busy failed: %r", exc)
                await reset(stream)
            return
        self._serving[peer] = self._serving.get(peer, 0) + 1
        try:
            await self.serve(stream)
        finally:
            self._serving[peer] -= 1
            if not self._serving[peer]:
                del self._serving[peer]

    async def serve(self, stream: INetStream) -> None:
        """Answer one request."""
        try:
            with trio.fail_after(self.config.blob_idle_timeout_s):
                blob_hash = (await read_exact(stream, 32)).hex()
            if blob_hash not in self.served or not self.store.has(blob_hash):
                await stream.write(bytes([BLOB_NOT_SERVED]) + (0).to_bytes(8, "big"))
                await stream.close()
                return
            path = self.store.path(blob_hash)
            with open(path, "rb") as f:
                size = path.stat().st_size
                with trio.fail_after(self._deadline_s(size)):
                    await self._send(stream, f, size)
            await stream.close()
            self.judge.count_blob(served=1)
        except Exception as exc:
            log.info("p2p: serving a blob failed: %r", exc)
            await reset(stream)

    def _deadline_s(self, size: int) -> float:
        """How long a transfer of `size` bytes may take, either side."""
        return self.config.blob_idle_timeout_s + size / self.config.blob_min_rate_bytes_s

    async def _send(self, stream: INetStream, f: BinaryIO, size: int) -> None:
        await stream.write(bytes([BLOB_OK]) + size.to_bytes(8, "big"))
        rate = self.config.serve_rate_bytes_s
        chunk_bytes = min(self.config.blob_chunk_bytes, FRAME_PAYLOAD_BYTES)  # one frame each, unsliced
        chunk_bytes = max(1, min(chunk_bytes, int(rate / 10))) if rate > 0 else chunk_bytes
        while chunk := await trio.to_thread.run_sync(f.read, chunk_bytes):  # disk reads off the trio thread
            with trio.fail_after(self.config.blob_idle_timeout_s):
                await stream.write(chunk)
            self.judge.count_blob(bytes_out=len(chunk))
            if rate > 0:
                await trio.sleep(len(chunk) / rate)

    async def fetch(self, host: IHost, blob_hash: str, providers: list[ID], max_bytes: int) -> Path:
        """The blob from the first provider that delivers it; BlobFetchError when none did."""
        failures = []
        for peer_id in providers:
            try:
                path = await self._fetch_from(host, peer_id, blob_hash, max_bytes)
            except Exception as exc:
                if (full := full_disk(exc)) is not None:  # no other provider's bytes would fit either
                    self.judge.count_blob(failed=1)
                    raise full from None
                failures.append(f"{node_id_for(peer_id)[:12]}: {exc!r}")
                continue
            self.judge.count_blob(fetched=1)
            return path
        self.judge.count_blob(failed=1)
        raise BlobFetchError(f"blob {blob_hash[:12]}: no provider delivered it ({'; '.join(failures) or 'no providers'})")

    async def _fetch_from(self, host: IHost, peer_id: ID, blob_hash: str, max_bytes: int) -> Path:
        with trio.fail_after(self.config.dial_timeout_s):
            stream = await host.new_stream(peer_id, [BLOB_PROTOCOL])
        try:
            await stream.write(bytes.fromhex(blob_hash))
            with trio.fail_after(self.config.blob_idle_timeout_s):
                header = await read_exact(stream, 9)
            size = int.from_bytes(header[1:], "big")
            if header[0] != BLOB_OK:
                raise BlobFetchError("busy serving us other blobs" if header[0] == BLOB_BUSY else "not served")
            if size > max_bytes:
                raise BlobFetchError(f"announced {size} bytes, over the {max_bytes}-byte cap")
            self.store.check_room(blob_hash, size)
            with self.store.open_writer(blob_hash, max_bytes) as writer:  # aborts (deletes) on any error
                with trio.move_on_after(self._deadline_s(size)) as transfer:
                    await self._receive_into(stream, writer, size)
                if transfer.cancelled_caught:
                    raise BlobFetchError(f"{size} bytes not received within {self._deadline_s(size):.0f} s "
                                         f"(under {self.config.blob_min_rate_bytes_s:.0f} bytes/s)")
                path = await trio.to_thread.run_sync(writer.commit)
        except BaseException:
            await reset(stream)
            raise
        await stream.close()
        return path

    async def _receive_into(self, stream: INetStream, writer: BlobWriter, size: int) -> None:
        """Read `size` bytes into `writer`: each chunk is hashed here while it is hot in this CPU's cache
        (a third less hashing time than in another thread), then written to disk by a worker thread."""
        idle, chunk_bytes = self.config.blob_idle_timeout_s, self.config.blob_chunk_bytes
        send, receive = trio.open_memory_channel[list[bytes]](2)

        def store_all(chunks: list[bytes]) -> None:
            for chunk in chunks:
                writer.store(chunk)

        async def sink() -> None:
            async for chunks in receive:
                await trio.to_thread.run_sync(store_all, chunks)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sink)
            async with send:
                remaining, pending, pending_bytes = size, [], 0
                while remaining:
                    with trio.fail_after(idle):
                        data = await stream.read(remaining)
                    if not data:
                        raise EOFError(f"stream ended {remaining} bytes short")
                    writer.accept(data)
                    pending.append(data)
                    pending_bytes += len(data)
                    remaining -= len(data)
                    if pending_bytes >= chunk_bytes or not remaining:
                        self.judge.count_blob(bytes_in=pending_bytes)
                        await send.send(pending)
                        pending, pending_bytes = [], 0
