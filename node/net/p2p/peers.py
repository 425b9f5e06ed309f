"""Who our peers are: node id <-> libp2p peer id, bootstrap addresses, the peer book, peer exchange.

A node id is the hex Ed25519 public key that also signs the node's messages. The peer book keeps
bootstrap peers forever and discovered ones until they fail too often; each discovered peer is
charged to the peer that named it (itself when it dialled us), and one peer's names fill at most
MAX_PEERS_PER_SOURCE places, so a peer that makes up ids by the hundred cannot crowd out honest
peers; a bootstrap peer, which the operator chose, names as many as the book holds. Peer exchange
(`/tessera/peers/1`) sends our listen addresses and gets back those of the peers the other side is
connected to. Runs on the trio thread of node.net.p2p.host; knows nothing about gossip or blobs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from node.net.network import NetworkError
from node.net.p2p.streams import read_frame, reset, write_frame
from protocol.identity import Identity

log = logging.getLogger(__name__)

PEX_PROTOCOL = TProtocol("/tessera/peers/1")
MAX_PEX_FRAME = 64 * 1024
MAX_PEX_PEERS = 64
MAX_KNOWN_PEERS = 256
MAX_PEERS_PER_SOURCE = MAX_KNOWN_PEERS // 8  # places in the book the peers named by one peer may take


def keypair_for(identity: Identity) -> KeyPair:
    """The libp2p key pair of a node: the same Ed25519 key that signs its messages."""
    private = Ed25519PrivateKey.new(identity.seed)
    return KeyPair(private, private.get_public_key())


def peer_id_for(node_id: str) -> ID:
    """The libp2p peer id of a node id (hex Ed25519 public key); NetworkError if it is not one."""
    try:
        return ID.from_pubkey(Ed25519PublicKey.from_bytes(bytes.fromhex(node_id)))
    except Exception as exc:
        raise NetworkError(f"not a node id (64 hex characters of an Ed25519 key): {node_id!r}") from exc


def node_id_for(peer_id: ID) -> str:
    """The node id behind a libp2p peer id; the base58 peer id for non-Ed25519 peers."""
    key = peer_id.extract_public_key()
    if isinstance(key, Ed25519PublicKey):
        return key.to_bytes().hex()
    return peer_id.to_base58()


def parse_bootstrap(addr: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:
        raise NetworkError(f"bootstrap address {addr!r} is not a multiaddr ending in /p2p/<peer id>") from exc


@dataclass
class PeerBook:
    """Peers we know how to reach: bootstrap ones forever, discovered ones until they keep failing."""

    bootstrap: dict[ID, PeerInfo]
    discovered: dict[ID, list[multiaddr.Multiaddr]] = field(default_factory=dict)
    failures: dict[ID, int] = field(default_factory=dict)
    dialing: set[ID] = field(default_factory=set)
    last_exchange: dict[ID, float] = field(default_factory=dict)
    next_dial: dict[ID, float] = field(default_factory=dict)
    sources: dict[ID, ID] = field(default_factory=dict)  # discovered peer -> the peer that named it

    def info(self, peer_id: ID) -> PeerInfo:
        return self.bootstrap.get(peer_id) or PeerInfo(peer_id, self.discovered[peer_id])

    def known(self) -> list[ID]:
        return list(self.bootstrap) + list(self.discovered)

    def forget(self, peer_id: ID) -> None:
        """Drop a discovered peer (it failed too often), freeing its place and its source's share."""
        self.discovered.pop(peer_id, None)
        self.sources.pop(peer_id, None)

    def _add(self, peer_id: ID, addrs: list[multiaddr.Multiaddr], source: ID) -> None:
        """Remember a discovered peer named by `source`, unless the book or `source`'s share is full."""
        if peer_id in self.discovered or len(self.discovered) >= MAX_KNOWN_PEERS:
            return
        shared = sum(1 for s in self.sources.values() if s == source)
        if source not in self.bootstrap and shared >= MAX_PEERS_PER_SOURCE:  # bootstraps are the operator's
            return
        self.discovered[peer_id] = addrs
        self.sources[peer_id] = source

    @staticmethod
    async def disconnect(host: IHost, peer_id: ID, disconnecting: set[ID]) -> None:
        """Close our connection to `peer_id` (a penalised peer) and take it out of `disconnecting`; a
        failure is only logged (the connection may already be gone)."""
        try:
            await host.disconnect(peer_id)
        except Exception as exc:
            log.debug("p2p: disconnecting %s failed: %r", peer_id, exc)
        finally:
            disconnecting.discard(peer_id)

    async def exchange(self, host: IHost, peer_id: ID, listen_addrs: list[str], timeout_s: float) -> None:
        """Ask `peer_id` for the peers it is connected to and remember the new ones."""
        try:
            with trio.fail_after(timeout_s):
                stream = await host.new_stream(peer_id, [PEX_PROTOCOL])
                try:
                    await write_frame(stream, json.dumps({"addrs": listen_addrs}).encode())
                    reply = json.loads(await read_frame(stream, MAX_PEX_FRAME))
                finally:
                    await stream.close()
            for entry in reply["peers"][:MAX_PEX_PEERS]:
                other = ID.from_base58(entry["id"])
                if other != host.get_id() and other not in self.bootstrap:
                    self._add(other, [multiaddr.Multiaddr(a) for a in entry["addrs"][:8]], peer_id)
        except Exception as exc:
            log.debug("p2p: peer exchange with %s failed: %r", peer_id, exc)

    async def serve_exchange(self, host: IHost, stream: INetStream, timeout_s: float) -> None:
        """Answer a peer exchange: remember the asker's addresses, send those of our other peers."""
        try:
            with trio.fail_after(timeout_s):
                request = json.loads(await read_frame(stream, MAX_PEX_FRAME))
                remote = stream.muxed_conn.peer_id
                observed = stream.get_remote_address()
                addrs = [_reachable(multiaddr.Multiaddr(a), observed) for a in request["addrs"][:8]]
                if remote in self.discovered:
                    self.discovered[remote] = addrs
                else:
                    self._add(remote, addrs, remote)
                connected = set(host.get_connected_peers())
                peers = [
                    {"id": p.to_base58(), "addrs": [str(a) for a in addrs]}
                    for p, addrs in list(self.discovered.items())
                    if p in connected and p != remote
                ]
                await write_frame(stream, json.dumps({"peers": peers[:MAX_PEX_PEERS]}).encode())
                await stream.close()
        except Exception as exc:
            log.debug("p2p: serving peer exchange failed: %r", exc)
            await reset(stream)


def _reachable(addr: multiaddr.Multiaddr, observed: tuple[str, int] | None) -> multiaddr.Multiaddr:
    """A peer listening on 0.0.0.0 announces that; dial it at the IP its connection came from instead."""
    text = str(addr)
    if observed is None or not text.startswith("/ip4/0.0.0.0/"):
        return addr
    return multiaddr.Multiaddr(text.replace("/ip4/0.0.0.0/", f"/ip4/{observed[0]}/", 1))

