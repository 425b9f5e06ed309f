"""What a node checks before it takes its locks: what would run but never work is refused, each in one
ConfigError naming the field. A key the spec does not name as a validator's on a validator (or names on a
miner); a p2p or HTTP port another process listens on (libp2p listens with SO_REUSEPORT, so two nodes on
one port would share it silently and split their peers' connections); a bootstrap address that is not
one; a CUDA device that does not exist, or that cannot hold the role's step as `training.plan` traces it
before any weight loads (`check_memory`); a validator whose blob budget, or whole disk, cannot hold one
round of the network (`check_disk`, on node.runtime.disk's estimate). Also what a node without peers should
check (`alone_hint`), and where py-libp2p's own log lines go. This module knows nothing of what a running node does.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.net.config import P2PConfig
from node.net.network import Network
from node.runtime.config import ConfigError, NodeConfig
from node.runtime.disk import DATABASE_HEADROOM, RoundNeed, size_text, total_bytes
from protocol.identity import Identity
from protocol.spec import NetworkSpec, spec_dir_path

if TYPE_CHECKING:
    import torch

    from training.plan import MemoryPlan, Setting


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


@dataclass(frozen=True)
class PlannedModel:
    """A spec's model as `training.plan.plan` builds it: its config dict, family, weights' dtype and attention."""

    config: dict[str, Any]
    family: str
    dtype: torch.dtype | None
    """None: the checkpoint config's own dtype."""
    attn: str


def planned_model(spec: NetworkSpec, spec_path: Path) -> PlannedModel:
    """The spec's model as a node builds it: a tiny config in fp32 with eager attention (training.tiny), or a
    checkpoint's config.json in its dtype with sdpa. Reads no weights."""
    import torch

    from training.checkpoint import read_config
    from training.model import spec_model_config

    if spec.model.config is not None:
        return PlannedModel(spec_model_config(spec, spec_path), spec.model.family, torch.float32, "eager")
    assert spec.model.checkpoint is not None, "the spec validator requires config or checkpoint"
    return PlannedModel(read_config(spec_dir_path(spec_path, spec.model.checkpoint)), spec.model.family, None, "sdpa")


def check_memory(config: NodeConfig, spec: NetworkSpec) -> None:
    """ConfigError when the role's device is CUDA and the role's own step, traced on fake tensors, needs more
    than its `device_memory_gib` (unset: the device's free memory) or the device does not exist. The one line
    names the memory needed and the first of this node's settings, taken in turn, that would make it fit."""
    role = config.node.role
    section = config.miner if role == "miner" else config.validator
    field = f"{role}.device"
    if not section.device.startswith("cuda"):  # cpu, or a validator's 'auto' (training.device sizes that)
        return
    from training.device import GIB, check_device

    if section.device_memory_gib is None:
        try:
            check_device(section.device, None, 1, spec.data.seq_len, setting=field)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        import torch

        free = torch.cuda.mem_get_info(torch.device(section.device).index or 0)[0]
        where = "has"
    else:
        free = int(section.device_memory_gib * GIB)
        where = f"may use ({role}.device_memory_gib)"
    try:
        model = planned_model(spec, config.node.spec)
    except ValueError as exc:
        raise ConfigError(f"node.spec: {exc}") from exc
    setting = _setting(config, spec)
    result = _plan(model, spec, setting)
    need = result.peak_bytes + result.margin_bytes
    if need <= free:
        return
    fix = "no setting of this node makes it fit: use a GPU with more memory"
    for changes, tried in _fixes(role, setting):
        fitted = _plan(model, spec, tried)
        if fitted.peak_bytes + fitted.margin_bytes <= free:
            fix = f"it fits with {', '.join(changes)} (tessera plan traces any setting)"
            break
    raise ConfigError(f"{field}: this {role} needs about {need / GIB:.1f} GiB of {section.device} (a traced peak of "
                      f"{result.peak_bytes / GIB:.1f} GiB plus {result.margin_bytes / GIB:.1f} GiB margin) but "
                      f"{where} {free / GIB:.1f} GiB; {fix}")


def _setting(config: NodeConfig, spec: NetworkSpec) -> Setting:
    """What this node runs on one micro-batch, as `training.plan` traces it."""
    from training.plan import Setting

    if config.node.role == "validator":
        return Setting(role="validator", seq_len=spec.data.seq_len, micro_batch=config.validator.batch_size,
                       device=config.validator.device, weights=config.validator.weights)
    miner = config.miner
    return Setting(role="miner", seq_len=spec.data.seq_len,
                   micro_batch=miner.micro_batch_size or spec.training.batch_size, device=miner.device,
                   forward=miner.forward, checkpointing=miner.checkpointing, autocast=miner.autocast,
                   optimizer=miner.optimizer)


def _fixes(role: str, setting: Setting) -> Iterator[tuple[list[str], Setting]]:
    """This node's settings that save memory, each added to those before it: (what changed, the setting then)."""
    steps: list[tuple[str, dict[str, Any]]] = [("validator.weights = 'int8'", {"weights": "int8"}),
                                                ("validator.batch_size = 1", {"micro_batch": 1})]
    if role == "miner":
        steps = [("miner.forward = 'compressed'", {"forward": "compressed"}),
                 ("miner.checkpointing = true", {"checkpointing": True}),
                 ("miner.autocast = true", {"autocast": True}),
                 ("miner.optimizer = 'adamw8bit'", {"optimizer": "adamw8bit"}),
                 ("miner.micro_batch_size = 1", {"micro_batch": 1})]
    changes: list[str] = []
    for name, change in steps:
        if all(getattr(setting, key) == value for key, value in change.items()):
            continue
        setting = replace(setting, **change)
        changes.append(name)
        yield list(changes), setting


def _plan(model: PlannedModel, spec: NetworkSpec, setting: Setting) -> MemoryPlan:
    from training.plan import plan

    group = {layer: list(ids) for layer, ids in spec.group.items()}
    return plan(model.config, setting, group, family=model.family, dtype=model.dtype, attn_implementation=model.attn)


def check_disk(config: NodeConfig, need: RoundNeed) -> None:
    """ConfigError when this node is a validator and `storage.blob_budget_bytes`, or the whole disk its data
    directory is on, cannot hold one round of what it stores (`need`): it could not keep what it scores and
    merges. A miner, and a disk with too little free now, are told of in the log once running (DiskWatch)."""
    if config.node.role != "validator":
        return
    one, parts = need.round_bytes, need.parts()
    budget = config.storage.blob_budget_bytes
    if budget is not None and budget < one:
        raise ConfigError(f"storage.blob_budget_bytes: {budget} bytes cannot hold a round of this network, in which "
                          f"a validator stores up to {one} bytes ({parts}); raise it to at least {one}, or lower "
                          "validator.prefetch_bytes")
    data_dir, total = config.node.data_dir, total_bytes(config.node.data_dir)
    if total < one + DATABASE_HEADROOM:
        raise ConfigError(f"node.data_dir: {data_dir} is on a disk of {size_text(total)} in all, and a validator "
                          f"of this network stores up to {size_text(one)} a round ({parts}) and "
                          f"{size_text(DATABASE_HEADROOM)} for its database; put node.data_dir on a larger disk, or "
                          "lower validator.prefetch_bytes")


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
