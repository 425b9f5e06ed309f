"""One peer cannot fill the peer book with node ids it makes up (sybils) and crowd out honest peers.

`PeerBook.exchange` runs under trio against an in-memory host: a connected attacker answers every peer
exchange with MAX_PEX_PEERS fresh ids (cheap keys, addresses that lead nowhere); an honest peer then
names one honest peer, and an honest peer that dials us announces itself.
"""

from __future__ import annotations

import json

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.net.p2p.peers import MAX_KNOWN_PEERS, MAX_PEERS_PER_SOURCE, MAX_PEX_PEERS, PeerBook

ADDR = "/ip4/10.0.0.1/tcp/4001"


def new_id() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class Stream:
    """One peer-exchange stream: takes the request frame, answers with `reply`."""

    def __init__(self, reply: bytes, remote: ID | None = None) -> None:
        self.unread = len(reply).to_bytes(4, "big") + reply
        self.written = b""
        self.muxed_conn = type("Conn", (), {"peer_id": remote})()

    async def read(self, n: int) -> bytes:
        chunk, self.unread = self.unread[:n], self.unread[n:]
        return chunk

    async def write(self, data: bytes) -> None:
        self.written += data

    async def close(self) -> None:
        pass

    async def reset(self) -> None:
        pass

    def get_remote_address(self) -> tuple[str, int]:
        return ("10.0.0.9", 4001)


class Host:
    """Our host: every peer we ask answers with the list `answers` makes for it."""

    def __init__(self, answers: dict[ID, list[ID]]) -> None:
        self.me = new_id()
        self.answers = answers

    def get_id(self) -> ID:
        return self.me

    def get_connected_peers(self) -> list[ID]:
        return list(self.answers)

    async def new_stream(self, peer_id: ID, protocols: list[str]) -> Stream:
        peers = [{"id": p.to_base58(), "addrs": [ADDR]} for p in self.answers[peer_id]]
        return Stream(json.dumps({"peers": peers}).encode())


def test_sybils_named_by_one_peer_do_not_crowd_out_honest_peers() -> None:
    attacker, honest, newcomer, friend = new_id(), new_id(), new_id(), new_id()
    host = Host({attacker: [], honest: [friend]})
    book = PeerBook({})

    async def main() -> None:
        for _ in range(2 * MAX_KNOWN_PEERS // MAX_PEX_PEERS):
            host.answers[attacker] = [new_id() for _ in range(MAX_PEX_PEERS)]
            await book.exchange(host, attacker, [], 5.0)  # type: ignore[arg-type]
        await book.exchange(host, honest, [], 5.0)  # type: ignore[arg-type]
        request = json.dumps({"addrs": [ADDR]}).encode()
        await book.serve_exchange(host, Stream(request, newcomer), 5.0)  # type: ignore[arg-type]

    trio.run(main)

    sybils = set(book.discovered) - {friend, newcomer}
    assert len(sybils) <= MAX_PEERS_PER_SOURCE, f"one peer put {len(sybils)} made-up peers in the book"
    assert friend in book.discovered, "an honest peer named by an honest peer was crowded out"
    assert book.discovered[newcomer] == [multiaddr.Multiaddr(ADDR)], "a peer that dialled us was crowded out"


def test_forgetting_a_peer_frees_its_source_s_share() -> None:
    attacker = new_id()
    host = Host({attacker: [new_id() for _ in range(MAX_PEX_PEERS)]})
    book = PeerBook({})
    trio.run(book.exchange, host, attacker, [], 5.0)
    named = list(book.discovered)
    for peer_id in named:
        book.forget(peer_id)
    host.answers[attacker] = [new_id() for _ in range(MAX_PEX_PEERS)]
    trio.run(book.exchange, host, attacker, [], 5.0)
    assert len(book.discovered) == len(named) == MAX_PEERS_PER_SOURCE


def test_a_bootstrap_peer_may_name_more_peers_than_one_share() -> None:
    """The operator chose its bootstrap peers, and in a large network most peers are first heard of
    from one: what a bootstrap names is not held to one peer's share."""
    bootstrap = new_id()
    host = Host({bootstrap: []})
    book = PeerBook({bootstrap: PeerInfo(bootstrap, [multiaddr.Multiaddr(ADDR)])})

    async def main() -> None:
        for _ in range(2):
            host.answers[bootstrap] = [new_id() for _ in range(MAX_PEX_PEERS)]
            await book.exchange(host, bootstrap, [], 5.0)  # type: ignore[arg-type]

    trio.run(main)
    assert len(book.discovered) == 2 * MAX_PEX_PEERS > MAX_PEERS_PER_SOURCE
