"""Bulk bytes through py-libp2p's Noise sessions and yamux with fewer copies and system calls.

Stock py-libp2p 0.8.1 reads a Noise packet with two socket reads (length, then body), copies each
packet about twice on its way up, re-copies a yamux frame body after the session already gathered
it, and writes a large message as one send per 64 KiB packet; with yamux frames capped at 64 KiB a
blob stream ran near 270 MB/s on loopback; and it answers almost every read of a yamux stream with a
WINDOW_UPDATE frame. Each class here subclasses the stock one and changes how bytes move through the
process, and on the wire no more than a go-yamux peer would, so a tuned node speaks to any libp2p peer:

- yamux DATA frames may carry up to 1 MiB. A frame is still capped by the receive window the peer
  granted (256 KiB at first, growing to 16 MiB under go-yamux semantics), as every yamux expects.
- A Noise session reads its socket in 512 KiB pieces and cuts packets out of them, writes all the
  packets of one message with one send, and joins the packets of a read once.
- yamux takes a frame body straight from the session instead of copying it again.
- A yamux stream at its initial window gives back what its reads free once the peer has less than
  half of it left, as go-yamux does, instead of one WINDOW_UPDATE per gossip message read (each sealed
  and sent, then opened and handled by the peer: a quarter of a sixteen-node network's CPU). This one
  shows on the wire, as fewer and larger updates.

One change is not about speed: yamux closes the connection of a peer that sends a DATA frame past
what is left of a stream's receive window, before reading its body, as go-yamux does; stock
py-libp2p buffers it, so a peer that ignored windows made a stream nobody reads hold any amount.

Three module-level names of py-libp2p are set on import: yamux's frame-size constant, and the classes
its upgrader and yamux build for a connection's yamux and its streams, which they take by name rather
than from the host's muxer options. These and the window check rely on private details of
libp2p==0.8.1 (pinned in pyproject.toml); tests/node/net/test_wire.py and two integration tests
(test_p2p.py, test_p2p_limits.py) hold them to it. The allocator policy that keeps these buffers'
pages between frames is the process's (training.allocator). This module knows nothing about Tessera.
"""

from __future__ import annotations

import logging
import sys

import libp2p.stream_muxer.yamux.yamux as yamux_module
import trio
from libp2p.abc import IRawConnection, ISecureConn
from libp2p.io.abc import ReadWriteCloser
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError
from libp2p.io.utils import read_exactly
from libp2p.peer.id import ID
from libp2p.security.noise.io import (
    MAX_PLAINTEXT_LENGTH,
    SIZE_NOISE_MESSAGE_LEN,
    NoisePacketReadWriter,
    NoiseTransportReadWriter,
)
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer import muxer_multistream
from libp2p.stream_muxer.yamux.yamux import Yamux
from noise.connection import NoiseConnection

log = logging.getLogger(__name__)

FRAME_BYTES = 1 << 20
"""Largest yamux frame this node sends, header included."""
FRAME_PAYLOAD_BYTES = FRAME_BYTES - yamux_module.HEADER_SIZE
"""Writes of exactly this many bytes go out as one frame without being sliced."""
SOCKET_READ_BYTES = 512 * 1024

# The stock module reads this constant at every write to size DATA frames (64 KiB there).
yamux_module.MAX_MESSAGE_SIZE = max(yamux_module.MAX_MESSAGE_SIZE, FRAME_BYTES)


class TunedNoise(NoiseTransport):
    """The stock Noise XX handshake, then a session that moves bytes with fewer copies."""

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        return _tuned(await super().secure_inbound(conn))

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        return _tuned(await super().secure_outbound(conn, peer_id))


def _tuned(session: ISecureConn) -> TunedSession:
    """The same session over the same socket and cipher states. The stock handshake reads exact lengths,
    so no byte past it is buffered anywhere yet."""
    assert isinstance(session, SecureSession) and isinstance(session.conn, NoiseTransportReadWriter)
    stock = session.conn
    return TunedSession(
        local_peer=session.local_peer,
        local_private_key=session.local_private_key,
        remote_peer=session.remote_peer,
        remote_permanent_pubkey=session.remote_permanent_pubkey,
        is_initiator=session.is_initiator,
        # The stock session's own socket: typed as a ReadWriteCloser there, an IRawConnection here.
        conn=NoisePackets(stock.read_writer.read_write_closer, stock.noise_state),  # type: ignore[arg-type]
    )


class PacketReader(NoisePacketReadWriter):
    """Noise packets (2-byte big-endian length, then the body) cut out of large socket reads."""

    def __init__(self, conn: ReadWriteCloser) -> None:
        super().__init__(conn)
        self._chunk = b""
        self._pos = 0

    async def read_msg(self) -> bytes:
        length = int.from_bytes(await self._take(SIZE_NOISE_MESSAGE_LEN), "big")
        return await self._take(length)

    async def _take(self, n: int) -> bytes:
        """Exactly `n` bytes; IncompleteReadError, as the stock reader raises, if the socket ends first."""
        parts, got = [], 0
        while True:
            piece = self._chunk[self._pos : self._pos + n - got]  # the whole chunk is not copied
            self._pos += len(piece)
            parts.append(piece)
            got += len(piece)
            if got == n:
                return b"".join(parts)  # one part is returned as it is
            self._chunk, self._pos = await self.read_write_closer.read(SOCKET_READ_BYTES), 0
            if not self._chunk:
                raise IncompleteReadError(
                    f"Connection closed during read operation: expected {n} bytes but received {got} bytes",
                    expected_bytes=n,
                    received_bytes=got,
                )


class NoisePackets(NoiseTransportReadWriter):
    """Noise transport messages over one socket: buffered reads, one send per message."""

    def __init__(self, conn: IRawConnection, noise_state: NoiseConnection) -> None:
        super().__init__(conn, noise_state)
        self._socket = conn
        self.read_writer = PacketReader(conn)

    async def write_msg(self, msg: bytes, prefix_encoded: bool = False) -> None:
        assert not prefix_encoded, "the handshake prefix belongs to the handshake, not to a session"
        pieces = [msg[i : i + MAX_PLAINTEXT_LENGTH] for i in range(0, len(msg), MAX_PLAINTEXT_LENGTH)] or [msg]
        packets: list[bytes] = []
        for piece in pieces:
            sealed = self.encrypt(piece)
            packets += (len(sealed).to_bytes(SIZE_NOISE_MESSAGE_LEN, "big"), sealed)
        await self._socket.write(b"".join(packets))


class TunedSession(SecureSession):
    """A read of n bytes gathers whole packets and joins them once."""

    async def read(self, n: int | None = None) -> bytes:
        if n is None or n <= 0:
            return await super().read(n)
        parts = [self._drain(n)]
        got = len(parts[0])
        while got < n:
            msg = await self.conn.read_msg()
            if not msg:  # as stock: the bytes so far, or an error when there are none
                if got:
                    break
                raise ConnectionClosedError("Connection closed")
            if len(msg) > n - got:
                self._fill(msg[n - got :])
                msg = msg[: n - got]
            parts.append(msg)
            got += len(msg)
        return b"".join(parts)


class WindowExceeded(trio.TooSlowError):
    """A peer sent a DATA frame larger than what is left of the stream's receive window.

    A TooSlowError because that is the one error that every caller of `Yamux._read_data_body` answers by
    closing the connection (as it does for a frame body that takes too long)."""


class TunedStream(yamux_module.YamuxStream):
    """A yamux stream that, while its window is still the initial 256 KiB, gives back what its reads free
    only once the peer has less than half of it left (go-yamux's rule); stock, it sends a WINDOW_UPDATE
    after almost every read, one for each small gossip message. A bulk transfer uses the window up at
    once, and from its first update on (which grows the window) the stream gives it back as stock, whose
    quick updates keep growing it to 16 MiB."""

    _held = 0

    async def _auto_tune_and_send_window_update(self, *, bytes_read: int = 0) -> None:
        self._held += bytes_read
        if self.target_recv_window <= yamux_module.DEFAULT_WINDOW_SIZE \
                and self.recv_window >= self.target_recv_window // 2:
            return
        held, self._held = self._held, 0
        await super()._auto_tune_and_send_window_update(bytes_read=held)


# yamux builds every stream of a connection by this module-level name.
yamux_module.YamuxStream = TunedStream  # type: ignore[misc]  # replaces a class by its subclass


class TunedYamux(Yamux):
    """yamux whose DATA frame bodies come straight from the session, which returns exactly what was asked,
    and which closes a connection whose peer sends past a stream's receive window."""

    async def _read_data_body(self, length: int) -> bytes:
        # Stock 0.8.1 buffers every DATA frame up to MAX_WINDOW_SIZE (16 MiB) whatever is left of the
        # stream's receive window: it only logs "peer exceeded receive window" and sets that window to 0,
        # so a peer that ignores it grows the buffer of a stream nobody reads without bound. go-yamux ends
        # the session on such a frame (ErrRecvWindowExceeded); so does this, before reading its body.
        # handle_incoming calls this with the length alone: the frame's stream id and flags are its locals.
        frame = sys._getframe(1).f_locals
        stream = self.streams.get(frame["stream_id"])
        if stream is not None:
            window = stream.recv_window
        elif frame["flags"] & yamux_module.FLAG_SYN:
            window = yamux_module.DEFAULT_WINDOW_SIZE  # the frame opens the stream
        else:
            window = yamux_module.MAX_WINDOW_SIZE  # a stream already gone: the stock reader drops the bytes
        if length > window:
            log.warning("yamux: peer %s sent %d bytes on stream %d with %d left of its window; closing the "
                        "connection", self.peer_id, length, frame["stream_id"], window)
            raise WindowExceeded(f"{length}-byte DATA frame, {window} bytes of window left")
        with trio.fail_after(yamux_module._yamux_data_read_timeout()):
            body = await self.secured_conn.read(length)
            if len(body) < length:  # the session ended early: let the stock reader raise as it would
                body += await read_exactly(self.secured_conn, length - len(body))
            return body


# The stock upgrader builds `Yamux` by name for /yamux/1.0.0, whatever class the muxer options give.
muxer_multistream.Yamux = TunedYamux  # type: ignore[attr-defined]  # replaces an imported name
