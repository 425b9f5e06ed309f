"""Which Tessera this is: the release (the package's version) and the protocol version peers compare.

`PROTOCOL_VERSION` names what every node must compute identically and what it may expect of its peers: the
message and blob formats, the checks, the round, the merge. It goes up with any change that makes nodes of
two releases decide differently on the same inputs (docs/operating.md, "Upgrading"), and nodes on different
protocol versions do not talk: each says its version when they connect and refuses a peer on another
(node.net.p2p.hello), and their gossip topics differ. The release is the `tessera-node` package's version
(CHANGELOG.md); releases that keep the protocol version are interchangeable on one network. This module
knows nothing about how the versions travel.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PROTOCOL_VERSION = 2
"""This release's protocol (0.2.0's); 1 was the protocol of the releases before it, which did not say theirs."""

try:
    RELEASE = version("tessera-node")
except PackageNotFoundError:  # a checkout run from its directory without `pip install`
    RELEASE = "unknown"


def describe() -> str:
    """`tessera X.Y.Z (protocol N)`: what `tessera --version` prints and a node logs as it starts."""
    return f"tessera {RELEASE} (protocol {PROTOCOL_VERSION})"


def other_protocol_line(peers: int, theirs: int, ours: int = PROTOCOL_VERSION) -> str:
    """What a node says of `peers` peers it refused for speaking protocol `theirs`: "2 peers speak protocol 3;
    this node speaks 2: upgrade" (theirs is newer: this node should upgrade), or, where theirs is older, that
    they should."""
    who = "1 peer speaks" if peers == 1 else f"{peers} peers speak"
    fix = "upgrade" if theirs > ours else ("that peer must upgrade" if peers == 1 else "those peers must upgrade")
    return f"{who} protocol {theirs}; this node speaks {ours}: {fix}"
