"""The libp2p layer: the only package that imports libp2p or trio.

`host` is the libp2p implementation of `node.net.network.Network` (gossip, penalties, reconnects);
`blobs` the blob stream protocol; `peers` peer ids, the peer book and peer exchange; `streams`
small stream helpers; `wire` moves bulk bytes through py-libp2p's Noise and yamux with fewer
copies. Its settings are `node.net.config.P2PConfig`. Nothing outside this package sees a libp2p
or trio type.
"""

from node.net.p2p.host import P2PNetwork
from node.net.p2p.peers import peer_id_for

__all__ = ["P2PNetwork", "peer_id_for"]
