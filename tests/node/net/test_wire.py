"""node.net.p2p.wire's Noise session against py-libp2p's stock classes, over in-memory sockets, and its
yamux over an in-memory connection.

A tuned node must put the same bytes on the wire and hand the same bytes up as a stock one, however
the socket splits them, and fail the same way when the socket ends early. Its yamux streams give their
window back once the peer has less than half of it left, not after every read.
"""

from __future__ import annotations

import random
import struct

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH, NoisePacketReadWriter, NoiseTransportReadWriter
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux.yamux import (
    DEFAULT_WINDOW_SIZE,
    HEADER_SIZE,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
)
from noise.connection import Keypair, NoiseConnection

from node.net.p2p.wire import NoisePackets, PacketReader, TunedSession, TunedYamux

SIZES = [0, 1, 12, MAX_PLAINTEXT_LENGTH - 1, MAX_PLAINTEXT_LENGTH, MAX_PLAINTEXT_LENGTH + 1, 300_000, (1 << 20) + 12]


class Socket:
    """One direction of a TCP connection: everything written, handed out in the given read sizes."""

    def __init__(self, data: bytes = b"", cuts: list[int] | None = None) -> None:
        self.data = bytearray(data)
        self.cuts = list(cuts or [])
        self.reads = 0

    async def write(self, data: bytes) -> None:
        self.data += data

    async def read(self, n: int | None = None) -> bytes:
        self.reads += 1
        size = min(n or len(self.data), self.cuts.pop(0) if self.cuts else len(self.data))
        piece = bytes(self.data[:size])
        del self.data[:size]
        return piece

    async def close(self) -> None:
        pass


def noise_pair() -> tuple[NoiseConnection, NoiseConnection]:
    """Two ends of a finished Noise XX handshake, as libp2p runs it."""
    ends = []
    for initiator in (True, False):
        end = NoiseConnection.from_name(b"Noise_XX_25519_ChaChaPoly_SHA256")
        if initiator:
            end.set_as_initiator()
        else:
            end.set_as_responder()
        end.set_keypair_from_private_bytes(Keypair.STATIC, random.Random(initiator).randbytes(32))
        end.start_handshake()
        ends.append(end)
    a, b = ends
    b.read_message(a.write_message())
    a.read_message(b.write_message())
    b.read_message(a.write_message())
    assert a.handshake_finished and b.handshake_finished
    return a, b


def random_cuts(rng: random.Random, total: int) -> list[int]:
    cuts = []
    while total > 0:
        cuts.append(rng.choice([1, 2, 3, rng.randrange(1, 70_000), rng.randrange(1, 600_000)]))
        total -= cuts[-1]
    return cuts


def session(conn: object, cls: type[SecureSession]) -> SecureSession:
    key = create_new_key_pair()
    peer = ID.from_pubkey(key.public_key)
    return cls(local_peer=peer, local_private_key=key.private_key, remote_peer=peer,
               remote_permanent_pubkey=key.public_key, is_initiator=True, conn=conn)  # type: ignore[arg-type]


def test_tuned_writes_are_the_stock_packets_on_the_wire() -> None:
    """Same packet lengths, and a stock reader opens them to the same plaintext pieces."""

    async def packets(cls: type[NoiseTransportReadWriter]) -> list[tuple[int, bytes]]:
        sender_end, receiver_end = noise_pair()
        wire = Socket()
        sender = cls(wire, sender_end)  # type: ignore[arg-type]
        for size in SIZES:
            await sender.write_msg(random.Random(size).randbytes(size))
        reader, out = NoisePacketReadWriter(wire), []  # type: ignore[arg-type]
        while wire.data:
            sealed = await reader.read_msg()
            out.append((len(sealed), receiver_end.decrypt(sealed)))
        return out

    async def main() -> None:
        assert await packets(NoisePackets) == await packets(NoiseTransportReadWriter)

    trio.run(main)


async def sealed_stream(messages: list[bytes]) -> tuple[bytes, NoiseConnection]:
    """What a stock sender puts on the wire for `messages`, and the receiving end's Noise state."""
    sender_end, receiver_end = noise_pair()
    wire = Socket()
    sender = NoiseTransportReadWriter(wire, sender_end)  # type: ignore[arg-type]
    for message in messages:
        await sender.write_msg(message)
    return bytes(wire.data), receiver_end


@pytest.mark.parametrize("seed", range(4))
def test_tuned_reads_give_what_stock_reads_give_however_the_socket_splits(seed: int) -> None:
    rng = random.Random(seed)
    messages = [rng.randbytes(size) for size in rng.sample(SIZES[1:], len(SIZES) - 1)]  # stock reads b"" as closed
    total = sum(map(len, messages))
    reads = [rng.choice([1, 12, 100, 65_536, 1 << 20, 2 << 20]) for _ in range(60)]

    async def read_all(reader: SecureSession) -> list[bytes]:
        out: list[bytes] = []
        for n in reads:
            left = total - sum(map(len, out))
            if not left:
                break
            out.append(await reader.read(min(n, left)))
        return out

    async def main() -> None:
        stock_wire, stock_end = await sealed_stream(messages)
        tuned_wire, tuned_end = await sealed_stream(messages)
        stock_conn = NoiseTransportReadWriter(Socket(stock_wire, random_cuts(rng, len(stock_wire))), stock_end)  # type: ignore[arg-type]
        tuned_conn = NoisePackets(Socket(tuned_wire, random_cuts(rng, len(tuned_wire))), tuned_end)  # type: ignore[arg-type]
        stock = await read_all(session(stock_conn, SecureSession))
        tuned = await read_all(session(tuned_conn, TunedSession))
        assert tuned == stock
        assert b"".join(tuned) == b"".join(messages)

    trio.run(main)


def test_packets_come_out_of_few_large_socket_reads() -> None:
    async def main() -> None:
        writer_end, reader_end = noise_pair()
        wire = Socket()
        for _ in range(32):
            await NoiseTransportReadWriter(wire, writer_end).write_msg(b"x" * MAX_PLAINTEXT_LENGTH)  # type: ignore[arg-type]
        stock_socket, tuned_socket = Socket(bytes(wire.data)), Socket(bytes(wire.data))
        stock, tuned = NoisePacketReadWriter(stock_socket), PacketReader(tuned_socket)  # type: ignore[arg-type]
        for _ in range(32):
            assert await tuned.read_msg() == await stock.read_msg()
        assert stock_socket.reads == 64  # a length, then a body, per packet
        assert tuned_socket.reads == 5  # 2 MiB in 512 KiB reads

    trio.run(main)


@pytest.mark.parametrize("keep", [0, 1, 2, 2 + 40])
def test_a_socket_that_ends_early_fails_as_the_stock_reader_fails(keep: int) -> None:
    async def main() -> None:
        packet = (100).to_bytes(2, "big") + b"y" * 100
        failures = []
        for reader_cls in (NoisePacketReadWriter, PacketReader):
            reader = reader_cls(Socket(packet[:keep]))  # type: ignore[arg-type]
            with pytest.raises(IncompleteReadError) as caught:
                await reader.read_msg()
            failures.append((type(caught.value), caught.value.is_clean_close, caught.value.expected_bytes))
        assert failures[0] == failures[1]
        assert failures[1][1] == (keep in (0, 2))  # nothing of the packet (or of its body) had arrived

    trio.run(main)


def test_a_session_read_after_the_peer_closed_raises_as_stock() -> None:
    class Closed:
        async def read_msg(self) -> bytes:
            return b""

    async def main() -> None:
        for cls in (SecureSession, TunedSession):
            with pytest.raises(ConnectionClosedError):
                await session(Closed(), cls).read(10)

    trio.run(main)


class Secured:
    """One end of an in-memory connection as yamux sees a secured one: reads return exactly what was asked (as
    `TunedSession`'s do); `window_updates` counts the WINDOW_UPDATE frames written that grant a stream more."""

    def __init__(self, stream: trio.StapledStream, initiator: bool) -> None:
        self.stream, self.is_initiator, self.window_updates = stream, initiator, 0
        self.pending = b""

    async def read(self, n: int | None = None) -> bytes:
        assert n is not None
        while len(self.pending) < n:
            self.pending += await self.stream.receive_some()
        data, self.pending = self.pending[:n], self.pending[n:]
        return data

    async def write(self, data: bytes) -> None:
        if len(data) == HEADER_SIZE:
            _, kind, _, stream_id, delta = struct.unpack(YAMUX_HEADER_FORMAT, data)
            self.window_updates += kind == TYPE_WINDOW_UPDATE and stream_id > 0 and delta > 0
        await self.stream.send_all(data)

    async def close(self) -> None:
        await self.stream.aclose()


def test_a_stream_gives_its_window_back_at_half_and_a_bulk_transfer_keeps_flowing() -> None:
    message = 1000
    small = DEFAULT_WINDOW_SIZE // 2 // message - 1  # just under half a window in small messages, each read
    bulk = 3 * DEFAULT_WINDOW_SIZE  # three windows at once: the writer needs the window back as it goes

    async def main() -> None:
        left, right = trio.testing.memory_stream_pair()
        writer_end, reader_end = Secured(left, True), Secured(right, False)
        writer_mux, reader_mux = TunedYamux(writer_end, ID(b"reader")), TunedYamux(reader_end, ID(b"writer"))
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer_mux.start)
                nursery.start_soon(reader_mux.start)
                await writer_mux.event_started.wait()
                await reader_mux.event_started.wait()
                sending = await writer_mux.open_stream()
                await sending.write(b"x" * message)
                receiving = await reader_mux.accept_stream()
                assert await receiving.read(message) == b"x" * message
                opened = reader_end.window_updates
                for i in range(small):
                    await sending.write(bytes([i % 256]) * message)
                    assert await receiving.read(message) == bytes([i % 256]) * message
                assert reader_end.window_updates == opened  # stock py-libp2p: one more for every read
                async with trio.open_nursery() as transfer:
                    transfer.start_soon(sending.write, b"y" * bulk)
                    got = b""
                    while len(got) < bulk:
                        got += await receiving.read(bulk - len(got))
                assert got == b"y" * bulk
                nursery.cancel_scope.cancel()

    trio.run(main)
