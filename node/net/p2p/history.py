"""The `/tessera/history/1` stream protocol: a restarted node asks a peer for the envelopes of a round.

A request is the round as 4 big-endian bytes; the answer is the envelopes the peer's judge accepted
in that round (`GossipJudge.recent`: the current and the previous round only), each as a
length-prefixed frame of at most the spec's message size, then an empty frame. The asking side
judges each again (`GossipJudge.judge_replayed`) and hands the accepted ones to `deliver`, as gossip
would. Runs on the trio thread of node.net.p2p.host; knows nothing about what the envelopes mean.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from node.net.config import P2PConfig
from node.net.judge import RECENT_BYTES_PER_ROUND, GossipJudge
from node.net.network import Delivery
from node.net.p2p.peers import node_id_for
from node.net.p2p.streams import read_exact, read_frame, reset, write_frame
from protocol.check import Verdict

log = logging.getLogger(__name__)

HISTORY_PROTOCOL = TProtocol("/tessera/history/1")


class HistoryStreams:
    """Both ends of the history protocol for one host."""

    def __init__(self, judge: GossipJudge, config: P2PConfig) -> None:
        self.judge = judge
        self.config = config

    async def serve(self, stream: INetStream) -> None:
        """Answer one request (the stream handler of HISTORY_PROTOCOL)."""
        try:
            with trio.fail_after(self.config.blob_idle_timeout_s):
                round = int.from_bytes(await read_exact(stream, 4), "big")
                for data in self.judge.recent(round):
                    await write_frame(stream, data)
                await write_frame(stream, b"")
            await stream.close()
        except Exception as exc:
            log.info("p2p: answering a history request failed: %r", exc)
            await reset(stream)

    async def catch_up(self, host: IHost, round: int, providers: list[ID],
                       deliver: Callable[[Delivery], None]) -> int:
        """Envelopes of `round` from the first provider that answers with any, judged and delivered; how
        many. A provider with none (it restarted or joined since) holds no history: the next is asked."""
        for peer_id in providers:
            try:
                frames = await self._ask(host, peer_id, round)
            except Exception as exc:
                log.info("p2p: history of round %d from %s: %r", round, node_id_for(peer_id)[:12], exc)
                continue
            peer, delivered = node_id_for(peer_id), 0
            for data in frames:
                result, envelope = self.judge.judge_replayed(data, peer, round)
                if result.verdict is Verdict.ACCEPT and envelope is not None:
                    deliver(Delivery(envelope, result, peer))
                    delivered += 1
            log.info("p2p: history of round %d from %s: %d envelope(s), %d new", round, peer[:12], len(frames),
                     delivered)
            if frames:
                return delivered
        return 0

    async def _ask(self, host: IHost, peer_id: ID, round: int) -> list[bytes]:
        with trio.fail_after(self.config.dial_timeout_s):
            stream = await host.new_stream(peer_id, [HISTORY_PROTOCOL])
        frames, total = [], 0
        try:
            await stream.write(round.to_bytes(4, "big"))
            with trio.fail_after(self.config.blob_idle_timeout_s):
                while frame := await read_frame(stream, self.judge.max_bytes):
                    total += len(frame)
                    if total > RECENT_BYTES_PER_ROUND:
                        raise ValueError(f"history of round {round} exceeds {RECENT_BYTES_PER_ROUND} bytes")
                    frames.append(frame)
        except BaseException:
            await reset(stream)
            raise
        await stream.close()
        return frames
