"""The `/tessera/hello/1` stream protocol: two connected peers say which protocol version they speak.

Soon after a connection is made (the host's supervisor, within a tick), each side opens a hello to the
other and answers the other's: one JSON frame each way, `{"protocol": N, "release": "X.Y.Z"}`
(protocol.version). A peer that speaks another protocol version is refused: one warning line in the log
the first time (per peer and version), counted and kept for the node's status (`GossipJudge.refuse_protocol`),
disconnected HANG_UP_AFTER_S later, and not dialled for REFUSED_BACKOFF_S. Gossip topics carry the protocol version too, so
the two never exchange a message meanwhile. A peer whose hello fails or does not parse is not refused:
a busy peer may time out, and its next connection asks again. Runs on the trio thread of
node.net.p2p.host; knows nothing about gossip or blobs.
"""

from __future__ import annotations

import logging

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from pydantic import BaseModel, ConfigDict, Field

from node.net.judge import GossipJudge
from node.net.p2p.peers import node_id_for
from node.net.p2p.streams import read_frame, reset, write_frame
from protocol.version import RELEASE

log = logging.getLogger(__name__)

HELLO_PROTOCOL = TProtocol("/tessera/hello/1")
MAX_HELLO_FRAME = 1024
REFUSED_BACKOFF_S = 60.0
"""How long a peer refused for its protocol version goes undialled: an operator who upgrades it is heard from
within a minute, and a peer that stays on another version costs a dial a minute."""

HANG_UP_AFTER_S = 1.0
"""How long a refused peer stays connected: long enough to read our hello and refuse us in turn (hung up on at
once, it lost our answer as often as not and never learned why). Gossip cannot cross meanwhile: the topics differ."""


class Hello(BaseModel):
    """What one peer says of itself when it connects."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)  # a later release may say more
    protocol: int = Field(ge=1)
    release: str = Field(min_length=1, max_length=64)


class Hellos:
    """Both ends of the hello protocol for one host, and the peers it refused."""

    def __init__(self, judge: GossipJudge, protocol: int, timeout_s: float) -> None:
        self.judge = judge
        self.ours = Hello(protocol=protocol, release=RELEASE)
        self.timeout_s = timeout_s
        self.greeted: set[ID] = set()
        """Connected peers a hello was sent to on their current connection."""
        self.barred: dict[ID, float] = {}
        """Refused peers -> trio time until which they are not dialled."""

    def is_barred(self, peer_id: ID) -> bool:
        return self.barred.get(peer_id, 0.0) > trio.current_time()

    def greet(self, host: IHost, connected: set[ID], nursery: trio.Nursery) -> None:
        """Say hello to every connected peer not yet greeted on its current connection."""
        self.greeted &= connected  # a peer that reconnects is greeted again
        now = trio.current_time()
        self.barred = {p: until for p, until in self.barred.items() if until > now}
        for peer_id in connected - self.greeted:
            self.greeted.add(peer_id)
            nursery.start_soon(self._ask, host, peer_id)

    async def _ask(self, host: IHost, peer_id: ID) -> None:
        try:
            with trio.fail_after(self.timeout_s):
                stream = await host.new_stream(peer_id, [HELLO_PROTOCOL])
                try:
                    await write_frame(stream, self.ours.model_dump_json().encode())
                    theirs = Hello.model_validate_json(await read_frame(stream, MAX_HELLO_FRAME))
                finally:
                    await stream.close()
        except Exception as exc:
            log.debug("p2p: hello to %s failed: %r", node_id_for(peer_id)[:12], exc)
            return
        await self._judge(host, peer_id, theirs)

    async def serve(self, host: IHost, stream: INetStream) -> None:
        """Answer a peer's hello with ours, then judge theirs (the stream handler of HELLO_PROTOCOL). What it said
        is judged even where our answer does not get through: a peer on another version may hang up first."""
        peer_id = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(self.timeout_s):
                theirs = Hello.model_validate_json(await read_frame(stream, MAX_HELLO_FRAME))
        except Exception as exc:
            log.debug("p2p: reading a hello from %s failed: %r", node_id_for(peer_id)[:12], exc)
            await reset(stream)
            return
        try:
            with trio.fail_after(self.timeout_s):
                await write_frame(stream, self.ours.model_dump_json().encode())
                await stream.close()
        except Exception as exc:
            log.debug("p2p: answering a hello from %s failed: %r", node_id_for(peer_id)[:12], exc)
            await reset(stream)
        await self._judge(host, peer_id, theirs)

    async def _judge(self, host: IHost, peer_id: ID, theirs: Hello) -> None:
        """Refuse a peer that speaks another protocol version: log it (once), note it, bar it, disconnect it."""
        if theirs.protocol == self.ours.protocol:
            return
        node_id = node_id_for(peer_id)
        if self.judge.refuse_protocol(node_id, theirs.protocol, theirs.release):
            fix = "upgrade this node" if theirs.protocol > self.ours.protocol else "that peer must upgrade"
            log.warning("p2p: refused peer %s (tessera %s): it speaks protocol %d and this node speaks %d: %s "
                        "(docs/operating.md, \"Upgrading\")", node_id[:12], _printable(theirs.release),
                        theirs.protocol, self.ours.protocol, fix)
        self.barred[peer_id] = trio.current_time() + REFUSED_BACKOFF_S
        await trio.sleep(HANG_UP_AFTER_S)
        try:
            await host.disconnect(peer_id)
        except Exception as exc:
            log.debug("p2p: disconnecting %s failed: %r", node_id[:12], exc)


def _printable(text: str) -> str:
    """A peer's release as it may go into one log line: no line breaks or other control characters."""
    return "".join(c if c.isprintable() else "?" for c in text)
