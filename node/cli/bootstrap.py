"""`tessera bootstrap`: a relay-only peer other nodes dial first to find each other.

It joins the network's gossip topic through the same judge as every node (so it relays only what
it ACCEPTs and penalises peers that send junk), answers peer exchange, prints its listen
addresses and the one other nodes give as `--bootstrap` (its announced address, `--announce`, with its peer
id), and runs until SIGINT/SIGTERM. It keeps no state but its key: no storage, no duties,
no HTTP. This module only parses arguments and wires node.net.p2p together.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.net.config import P2PConfig
    from protocol.identity import Identity
    from protocol.spec import NetworkSpec


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    boot = subparsers.add_parser("bootstrap", help="run a relay-only bootstrap peer until SIGINT/SIGTERM")
    boot.add_argument("--spec", required=True, type=Path, metavar="SPEC", help="the network spec TOML")
    key = boot.add_mutually_exclusive_group(required=True)
    key.add_argument("--key", type=Path, metavar="FILE", help="Ed25519 key file (created on first start)")
    key.add_argument("--sim-key", type=int, metavar="SEED",
                     help="use the simulation network's well-known bootstrap key for SEED (local networks only)")
    boot.add_argument("--data-dir", type=Path, metavar="DIR",
                      help="where the key is written with --sim-key (needed with it, unused with --key)")
    boot.add_argument("--host", default="127.0.0.1", help="listen IP (0.0.0.0 for other hosts)")
    boot.add_argument("--port", type=int, default=4001, help="listen TCP port (default 4001)")
    boot.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                      help="the address other nodes dial, e.g. /ip4/203.0.113.7/tcp/4001, for a host behind NAT or "
                           "a port forward (default: the listen address)")
    boot.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="another bootstrap peer")
    boot.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    boot.set_defaults(run=run_bootstrap)


def run_bootstrap(args: argparse.Namespace) -> int:
    from protocol.identity import load_or_create_identity, save_identity
    from protocol.spec import load_spec

    if args.sim_key is not None and args.data_dir is None:
        raise ValueError("--sim-key needs --data-dir DIR: the directory its key is written to")
    spec = load_spec(args.spec)
    config = _p2p_config(args)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    from node.runtime.preflight import check_p2p

    check_p2p(config, port_field="--port", bootstrap_field="--bootstrap")  # a port in use, a bad peer address
    key = args.key
    if args.sim_key is not None:
        from node.sim.layout import sim_identity

        key = args.data_dir / "node.key"
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            save_identity(sim_identity(args.sim_key, "bootstrap", 0), key)
    identity = load_or_create_identity(key)
    asyncio.run(_relay(spec, identity, config))
    return 0


def _p2p_config(args: argparse.Namespace) -> P2PConfig:
    """The listening and peer settings from the flags; ValueError naming the flag."""
    from pydantic import ValidationError

    from node.net.config import P2PConfig

    try:
        return P2PConfig(host=args.host, port=args.port, announce=tuple(args.announce), bootstrap=tuple(args.bootstrap))
    except ValidationError as exc:
        error = exc.errors()[0]
        flag = "--" + str(error["loc"][0]) if error["loc"] else "bootstrap"
        raise ValueError(f"{flag}: {error['msg'].removeprefix('Value error, ')}") from exc


async def _relay(spec: NetworkSpec, identity: Identity, config: P2PConfig) -> None:
    from node.net.judge import GossipJudge
    from node.net.p2p import P2PNetwork
    from node.runtime.clock import SystemClock
    from node.store.blobs import BlobStore

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with tempfile.TemporaryDirectory(prefix="tessera-bootstrap-") as blobs:  # serves no blobs; the host needs a store
        net = await P2PNetwork.create(identity, GossipJudge(spec, SystemClock().now, config), BlobStore(Path(blobs)),
                                      config)
        try:
            print(f"bootstrap {net.node_id} listening on {' '.join(net.listen_addrs)}; other nodes join with "
                  f"{' '.join(f'--bootstrap {addr}' for addr in net.announced_addrs)}", flush=True)
            await stop.wait()
        finally:
            await net.close()
