"""What a node checks before it takes its locks: what would run but never work is refused, each in one
ConfigError naming the field. A key the spec does not name as a validator's on a validator (or names on a
miner); a p2p or HTTP port another process listens on (libp2p listens with SO_REUSEPORT, so two nodes on
one port would share it silently and split their peers' connections); a bootstrap address that is not
one. Also what a node without peers should check (`alone_hint`), and where py-libp2p's own log lines go.
This module knows nothing of what a running node does.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

from node.net.config import P2PConfig
from node.net.network import Network
from node.runtime.config import ConfigError, NodeConfig
from protocol.identity import Identity
from protocol.spec import NetworkSpec


def check_role_key(config: NodeConfig, spec: NetworkSpec, identity: Identity) -> None:
    """ConfigError when the key does not fit the role: peers reject a validator's messages from a key the spec
    does not name, and a miner signing with a validator's key would be taken for that validator."""
    is_validator = identity.node_id in spec.validator_weights
    if config.node.role == "validator" and not is_validator:
        raise ConfigError(f"node.key: {config.node.key} ({identity.node_id[:12]}) is not one of the spec's validators "
                          f"([[validators]] in {config.node.spec}), so peers would reject everything this validator "
                          f"sends: use the validator key the spec names, or run this key as a miner")
    if config.node.role == "miner" and is_validator:
        raise ConfigError(f"node.key: {config.node.key} ({identity.node_id[:12]}) is a validator's key in the spec; "
                          f"a miner needs its own: create one with `tessera keygen` and set node.key")


def check_listen(config: NodeConfig) -> None:
    """ConfigError naming the field when a port to listen on is taken or a bootstrap address is not one."""
    check_p2p(config.p2p)
    if config.http.enabled:
        _check_port(config.http.host, config.http.port, "http.port")


def check_p2p(p2p: P2PConfig, port_field: str = "p2p.port", bootstrap_field: str = "p2p.bootstrap") -> None:
    """ConfigError naming the field (a config's, or a flag of `tessera bootstrap`) when the p2p port is taken
    or a bootstrap address is not one; routes py-libp2p's own log lines (`_route_libp2p_logs`)."""
    from node.net.network import NetworkError
    from node.net.p2p.peers import parse_bootstrap  # imports libp2p, which sets its logging up as it does

    _route_libp2p_logs()
    for addr in p2p.bootstrap:
        try:
            parse_bootstrap(addr)
        except NetworkError as exc:
            raise ConfigError(f"{bootstrap_field}: {addr!r} is not a multiaddr ending in /p2p/<peer id> (a peer id "
                              f"like 12D3KooW..., as `tessera bootstrap` prints it)") from exc
    _check_port(p2p.host, p2p.port, port_field)


def _check_port(host: str, port: int, field: str) -> None:
    """Bind and let go, as a listener would bind: another process's listener refuses us even where it set
    SO_REUSEPORT (our probe does not), while connections of a node just stopped (TIME_WAIT) do not."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{field}: cannot listen on {host}:{port}: {exc.strerror}") from exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"{field}: {host}:{port} is in use (by another node, or another program?); "
                                      f"stop it or pick another {field}") from exc
                raise ConfigError(f"{field}: cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def alone_hint(config: NodeConfig, network: Network) -> str:
    """What a node without peers should check, in one line."""
    listen = ", ".join(network.listen_addrs) or f"port {config.p2p.port}"
    if not config.p2p.bootstrap:
        return (f"p2p.bootstrap is empty, so this node only waits for others to dial it at {listen}; to join a "
                f"network, add a bootstrap peer's address to p2p.bootstrap")
    return (f"cannot reach any bootstrap peer ({', '.join(config.p2p.bootstrap)}); check that it runs and that host, "
            f"port and /p2p/<peer id> are the ones `tessera bootstrap` printed")


def _route_libp2p_logs() -> None:
    """py-libp2p's logger has no handler and does not propagate (it sets that up at import, unless LIBP2P_DEBUG is
    set), so its lines reached stderr bare through logging's last resort, one per failed redial. At --log-level
    DEBUG they go into the node's log; otherwise nowhere: the node says itself what an operator needs
    (`alone_hint`)."""
    if os.environ.get("LIBP2P_DEBUG"):
        return
    logger = logging.getLogger("libp2p")
    logger.propagate = logging.getLogger().isEnabledFor(logging.DEBUG)
    if not logger.handlers:  # logging's last resort serves only loggers without any handler on their way up
        logger.addHandler(logging.NullHandler())
