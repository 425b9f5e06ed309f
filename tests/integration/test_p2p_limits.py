"""Two real libp2p hosts in this process, one of them hostile: what a peer can make the other hold.

A peer that ignores the yamux receive window it was granted loses its connection before the node
buffers past that window (which yamux's autotuning may grow to MAX_WINDOW_SIZE, 16 MiB, while the
node reads the request, so the flood is twice that); a provider that drips a blob one byte at a time, each inside the idle
timeout, loses the fetch once the transfer's deadline (idle timeout + size / minimum rate) passes.
The serving side's deadline is tested in tests/node/net/test_blob_deadline.py: over loopback yamux grows
a stream's window to 16 MiB at once, so a slow reader would need a blob larger than that to hold it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.network import BlobFetchError
from node.net.p2p import P2PNetwork, peer_id_for
from node.net.p2p.blobs import BLOB_OK, BLOB_PROTOCOL
from node.net.p2p.streams import read_exact
from node.store.blobs import BlobStore
from protocol.identity import Identity
from protocol.spec import NetworkSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FLOOD = 2 * MAX_WINDOW_SIZE  # more than any window a stream is granted


async def connected_pair(spec: NetworkSpec, tmp_path: Path, second: P2PConfig) -> tuple[P2PNetwork, P2PNetwork]:
    """Two networks on free ports, the second (with `second` as its config) connected to the first."""
    nets = [await P2PNetwork.create(Identity.from_seed(bytes([seed]) * 32), GossipJudge(spec, time.time),
                                    BlobStore(tmp_path / str(seed)), config)
            for seed, config in ((71, P2PConfig(port=0)), (72, second))]
    await nets[1].connect(nets[0].listen_addrs[0])
    return nets[0], nets[1]


def yamux_buffered(net: P2PNetwork) -> int:
    """Bytes held in the yamux receive buffers of all of `net`'s connections (read from another thread)."""
    conns = [c for cs in net._host.get_network().connections.values() for c in cs]  # the host is private
    return sum(len(b) for c in conns for b in c.muxed_conn.stream_buffers.values())


def connections(net: P2PNetwork, other: P2PNetwork) -> int:
    """How many connections `net` holds to `other`."""
    return len(net._host.get_network().connections.get(peer_id_for(other.node_id), []))


async def test_a_peer_that_ignores_the_receive_window_is_cut_off_before_it_is_buffered(
        spec: NetworkSpec, tmp_path: Path) -> None:
    victim, attacker = await connected_pair(spec, tmp_path, P2PConfig(port=0))
    sent = 0
    try:
        async def flood() -> None:
            nonlocal sent
            stream = await attacker._host.new_stream(peer_id_for(victim.node_id), [BLOB_PROTOCOL])
            await stream.write(bytes(32))  # a hash the victim does not serve: it answers and reads no more
            stream.muxed_stream.send_window = 1 << 40  # the hostile part: ignore the window granted
            piece = bytes(64 * 1024)  # small frames: the overrun is caught however it is spread
            try:
                for _ in range(FLOOD // len(piece)):
                    await stream.write(piece)
                    sent += len(piece)
            except Exception:  # the victim closed the connection
                pass
            await trio.sleep(0.5)

        await attacker._call_trio(flood)
        held = await asyncio.get_running_loop().run_in_executor(None, yamux_buffered, victim)
        assert held <= MAX_WINDOW_SIZE, f"the victim buffered {held} bytes, more than a stream is ever granted"
        assert sent < FLOOD, "the attacker could keep writing: its connection was not closed"
        assert not await asyncio.get_running_loop().run_in_executor(None, connections, victim, attacker)
    finally:
        await victim.close()
        await attacker.close()


async def test_a_provider_that_drips_a_blob_loses_the_fetch_at_its_deadline(spec: NetworkSpec, tmp_path: Path) -> None:
    size, idle, min_rate = 1000, 1.0, 1000.0  # deadline: 1 s + 1000 B / 1000 B/s = 2 s
    provider, fetcher = await connected_pair(
        spec, tmp_path, P2PConfig(port=0, blob_idle_timeout_s=idle, blob_min_rate_bytes_s=min_rate))
    try:
        async def drip(stream: INetStream) -> None:
            await read_exact(stream, 32)
            await stream.write(bytes([BLOB_OK]) + size.to_bytes(8, "big"))
            for _ in range(size):
                await stream.write(b"x")
                await trio.sleep(0.3)  # always inside the idle timeout: 300 s for the whole blob
        provider._to_trio(provider._host.set_stream_handler, BLOB_PROTOCOL, drip)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(BlobFetchError, match="not received within"):
            await asyncio.wait_for(fetcher.fetch("ab" * 32, [provider.node_id], size), timeout=8.0)
        assert time.monotonic() - started < 4.0
        assert list((fetcher._store.root / "tmp").iterdir()) == []
    finally:
        await provider.close()
        await fetcher.close()

