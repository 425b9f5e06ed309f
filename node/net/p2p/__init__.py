"""The libp2p layer: the only package that imports libp2p or trio.

`host` is the libp2p implementation of `node.net.network.Network` (gossip, blob streams, peer
exchange, reconnects); `wire` moves bulk bytes through py-libp2p's Noise and yamux with fewer
copies. Nothing outside this package sees a libp2p or trio type.
"""

from node.net.p2p.host import P2PConfig, P2PNetwork, peer_id_for

__all__ = ["P2PConfig", "P2PNetwork", "peer_id_for"]
