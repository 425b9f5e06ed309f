"""`tessera init | miner | validator | status`: write a node config, run the daemon, ask a node its status.

Heavy imports (the daemon, aiohttp, libp2p) happen inside the run functions so `tessera --help`
stays fast. This module only turns arguments into calls on node.runtime.config and node.runtime.daemon.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from node.net.config import P2PConfig
from node.runtime.config import MinerSection

if TYPE_CHECKING:
    from node.runtime.config import NodeConfig
    from node.runtime.context import DutiesFactory

CONFIG_NAME = "node.toml"
P2P_DEFAULTS = P2PConfig()
MINER_DEFAULTS = MinerSection()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    init = subparsers.add_parser("init", help="write a node config TOML (and a key, unless --key names one) into a "
                                 "directory")
    init.add_argument("--role", required=True, choices=("miner", "validator"))
    init.add_argument("--spec", required=True, metavar="SPEC", help="the network spec TOML")
    init.add_argument("--dir", required=True, metavar="DIR", help="the node's directory (created)")
    init.add_argument("--key", metavar="FILE", help="an existing key (`tessera keygen`; a validator's must be one the "
                      "spec names), which the config points at; default: a new key DIR/node.key (miners only)")
    init.add_argument("--host", default=P2P_DEFAULTS.host, metavar="IP",
                      help=f"the IPv4 address libp2p listens on (default {P2P_DEFAULTS.host}: this host only; "
                           "0.0.0.0: every interface, for peers on other hosts)")
    init.add_argument("--p2p-port", type=int, default=P2P_DEFAULTS.port, metavar="PORT")
    init.add_argument("--announce", action="append", default=[], metavar="MULTIADDR",
                      help="the address peers should dial, e.g. /ip4/203.0.113.7/tcp/4001, for a host behind NAT or a "
                           "port forward (repeat for several; default: the listen address)")
    init.add_argument("--http-port", type=int, default=8080, metavar="PORT")
    init.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                      help="a bootstrap peer (repeat for several)")
    init.add_argument("--device", metavar="DEVICE", help="the torch device it trains (miner) or scores (validator) on: "
                      f"cpu, cuda, cuda:N (a validator also auto); default {MINER_DEFAULTS.device}")
    init.add_argument("--device-memory", type=float, metavar="GIB",
                      help="GiB of the device the role may use (host memory on a cpu); a miner's memory settings "
                           "are then chosen, the fastest whose traced plan fits, and written into the config")
    init.add_argument("--forward", choices=("full", "compressed"), help="miners: hold every expert (full) or only the "
                      "group's (compressed); default: chosen to fit the device's memory on CUDA, else "
                      f"{MINER_DEFAULTS.forward}")
    init.add_argument("--heldout", metavar="FILE", help="validators: the held-out file the spec pins")
    init.add_argument("--general", metavar="FILE",
                      help="validators: the general-domain held-out file the spec pins (data.general_sha256), if any")
    init.set_defaults(run=run_init)

    for role in ("miner", "validator"):
        parser = subparsers.add_parser(role, help=f"run a {role} node until SIGINT/SIGTERM")
        parser.add_argument("--config", required=True, metavar="FILE", help="the node config TOML")
        parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
        parser.set_defaults(run=run_daemon, role=role)

    status = subparsers.add_parser("status", help="print a running node's /status")
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the node's config TOML (finds its HTTP port)")
    where.add_argument("--url", metavar="URL", help="the node's HTTP API, e.g. http://127.0.0.1:8080")
    status.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS")
    status.set_defaults(run=run_status)


def run_init(args: argparse.Namespace) -> int:
    """Judge everything first (spec, role options, held-out files, the config as written, the key), then write."""
    from node.cli.common import write_new_file
    from node.runtime.config import parse_config, render_config
    from node.runtime.preflight import check_role_key
    from protocol.identity import load_identity, load_or_create_identity
    from protocol.spec import load_spec
    from training.data import check_general_file, check_heldout_file

    directory = Path(args.dir)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    config_path = directory / CONFIG_NAME
    if config_path.exists():
        raise ValueError(f"{config_path}: a node config already exists; refusing to overwrite it")
    spec = load_spec(args.spec)  # refuse to write a config that points at a broken spec
    _check_role_options(args)
    if args.role == "validator":
        try:
            check_heldout_file(Path(args.heldout), spec.data.heldout_sha256)
        except ValueError as exc:
            raise ValueError(f"--heldout: {exc}") from None
        check_general_file(None if args.general is None else Path(args.general), spec.data.general_sha256,
                           "--general")
    given_key = args.key is not None
    if given_key and not Path(args.key).is_file():
        raise ValueError(f"--key {args.key}: no such key file (create one with `tessera keygen --out {args.key}`)")
    settings = _device_settings(args)

    def render() -> str:
        return render_config(
            role=args.role, spec=_relative(Path(args.spec), directory),
            key=_relative(Path(args.key), directory) if given_key else Path("node.key"), data_dir=Path("data"),
            host=args.host, p2p_port=args.p2p_port, announce=tuple(args.announce), http_port=args.http_port,
            bootstrap=tuple(args.bootstrap), settings=settings,
            heldout=None if args.heldout is None else _relative(Path(args.heldout), directory),
            general=None if args.general is None else _relative(Path(args.general), directory),
        )

    text = render()
    config = parse_config(text, config_path)  # ports, addresses, devices, environment overrides
    chosen = None
    if args.role == "miner" and args.device_memory is not None:
        from node.runtime.preflight import fit_memory

        fitted, chosen = fit_memory(config, spec)  # the daemon's own choice, made now, before a weight loads
        settings.update({name: value for name, value in fitted.miner.model_dump().items()
                         if name in _MEMORY_SETTINGS and value is not None})
        text = render()
        config = parse_config(text, config_path)
    if config.node.key.exists():  # a key already there must be usable, and fit the role, before the config names it
        check_role_key(config, spec, load_identity(config.node.key))
    elif args.role == "validator":  # a new key is in no spec's validator set
        raise ValueError("init --role validator needs --key FILE: the key whose node id the spec names in "
                         "[[validators]] (a new key would be in no spec)")
    directory.mkdir(parents=True, exist_ok=True)
    identity = load_or_create_identity(config.node.key)
    write_new_file(config_path, text.encode("utf-8"), "node config")  # another `tessera init` may have run
    print(f"{config_path}\t{identity.node_id}")
    if chosen is not None:
        print(chosen)
    return 0


def _check_role_options(args: argparse.Namespace) -> None:
    """Refuse an option the role does not take, and a validator without its held-out file."""
    if args.role == "validator" and args.heldout is None:
        raise ValueError("init --role validator needs --heldout FILE (the held-out file the spec pins)")
    given = {"--heldout": args.heldout, "--general": args.general} if args.role == "miner" else {"--forward": args.forward}
    for flag, value in given.items():
        if value is not None:
            raise ValueError(f"{flag} is for {'validators' if args.role == 'miner' else 'miners'}; "
                             f"init --role {args.role} does not take it")


def _device_settings(args: argparse.Namespace) -> dict[str, str | int | float | bool]:
    """The role section's fields the flags set: the device (checked a torch device), its memory, a miner's forward."""
    settings: dict[str, str | int | float | bool] = {}
    if args.device is not None:
        if args.device != "auto" or args.role != "validator":
            from torch import device as torch_device

            try:
                torch_device(args.device)
            except RuntimeError:
                raise ValueError(f"--device {args.device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        settings["device"] = args.device
    if args.device_memory is not None:
        if not (math.isfinite(args.device_memory) and args.device_memory > 0):
            raise ValueError(f"--device-memory must be a positive number of GiB, got {args.device_memory}")
        if args.device is None:
            raise ValueError("--device-memory: name the --device it is of (cuda, cuda:N or cpu)")
        settings["device_memory_gib"] = args.device_memory
    if args.forward is not None:
        settings["forward"] = args.forward
    return settings


_MEMORY_SETTINGS = ("forward", "micro_batch_size", "checkpointing", "autocast", "optimizer", "step_in_backward")
"""The `[miner]` fields `tessera init --device-memory` chooses (node.runtime.preflight.fit_memory)."""


def run_daemon(args: argparse.Namespace, miner: DutiesFactory | None = None) -> int:
    """`tessera miner | validator --config FILE`. `miner`: a miner's duties (None: the honest miner's); a
    simulation's adversarial miner hands its own (node.sim.adversaries)."""
    from node.runtime.config import ConfigError, load_config

    config = load_config(args.config)
    if config.node.role != args.role:
        raise ValueError(f"{args.config}: node.role is {config.node.role!r}; run `tessera {config.node.role}` "
                         f"or change the role")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _serve(config, miner)
    except ConfigError as exc:  # a setting the node found wrong as it started (a port in use): name the file
        raise ConfigError(f"{args.config}: {exc}") from exc


def _serve(config: NodeConfig, miner: DutiesFactory | None) -> int:
    from node.duties.succession import Succession
    from node.runtime.daemon import serve

    if config.node.role == "miner":
        from node.duties.miner import MinerDuties

        return serve(config, Succession.around(miner or MinerDuties.factory()))
    from node.duties.validator import ValidatorDuties

    return serve(config, Succession.around(ValidatorDuties))


def run_status(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    url = node_url(args.config, args.url)
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=args.timeout) as response:
            body = response.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ConnectionRefusedError):
            raise ValueError(f"{url}/status: no answer from the node: nothing listens there; is it running? (its "
                             f"log names its address: \"http api on ...\")") from exc
        raise ValueError(f"{url}/status: no answer from the node ({reason})") from exc
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict):
        raise ValueError(f"{url}/status: the answer is not a node's status (a JSON object); is a Tessera node there?")
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


def node_url(config: str | None, url: str | None) -> str:
    """A running node's HTTP API: `url` as given, else the address its config file (`--config`) sets."""
    if url is not None:
        return url.rstrip("/")
    from node.runtime.config import load_config

    assert config is not None, "argparse requires --config or --url"
    api = load_config(config).http
    if not api.enabled:
        raise ValueError(f"{config}: http.enabled is false; the node serves no HTTP API")
    if api.port == 0:
        raise ValueError(f"{config}: http.port is 0 (a free port the node picks as it starts); give "
                         f"--url with the address its log names (\"http api on ...\")")
    host = "127.0.0.1" if api.host in ("0.0.0.0", "") else api.host
    return f"http://{host}:{api.port}"


def _relative(path: Path, directory: Path) -> Path:
    """`path` as written relative to `directory`, so the node directory can move with its spec."""
    return Path(os.path.relpath(path.resolve(), directory.resolve()))
