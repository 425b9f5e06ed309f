"""An operator's mistakes as a node starts, and what the running node tells the operator: each mistake is
refused in one `tessera: error:` line naming the config file and field before the node takes its locks or
joins the network; a node alone says so in its log, with what to check; a stop signal is acknowledged."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from node.cli.main import main
from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime import daemon
from node.runtime.clock import ManualClock
from node.runtime.config import ConfigError, load_config
from node.runtime.context import HeartbeatDuties
from node.runtime.daemon import Node
from node.store.blobs import BlobStore
from node.store.lock import NodeLock, Owner
from protocol.identity import save_identity
from protocol.spec import load_spec
from tests.conftest import make_identity, make_spec_dict, to_toml, write_model_config

ROOT = Path(__file__).resolve().parents[3]
VALIDATOR = make_identity(0)
MINER = make_identity(100)
BOOT = "/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWGXZ2GHu78yvJNtGaaYae2C8avDKw8TDByJ3j5S2ewXRv"


def write_node(tmp_path: Path, role: str = "miner", extra: str = "", key_seed: int | None = None) -> Path:
    (tmp_path / "spec.toml").write_text(to_toml(make_spec_dict()), encoding="utf-8")
    write_model_config(tmp_path)
    if not (tmp_path / "node.key").exists():
        save_identity(make_identity(key_seed if key_seed is not None else (0 if role == "validator" else 100)),
                      tmp_path / "node.key")
    heldout = '[validator]\nheldout = "h.jsonl"\n' if role == "validator" else ""
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nrole = "{role}"\nspec = "spec.toml"\n{extra}{heldout}', encoding="utf-8")
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reuseport_listener() -> socket.socket:
    """A listener as libp2p opens one: SO_REUSEADDR and SO_REUSEPORT, which let a second such socket share it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.fixture(autouse=True)
def heartbeats_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon commands run the built-in heartbeat duty: no model to load, no data files to check."""
    import node.duties.miner
    import node.duties.validator

    monkeypatch.setattr(node.duties.miner.MinerDuties, "factory", staticmethod(lambda *args: HeartbeatDuties))
    monkeypatch.setattr(node.duties.validator, "ValidatorDuties", HeartbeatDuties)


def refused(config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what the test printed before is not the command's
    assert main(["miner" if "miner" in config.read_text() else "validator", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_port_another_process_listens_on_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with reuseport_listener() as other:  # another node's libp2p listener: a second one would share the port
        port = other.getsockname()[1]
        config = write_node(tmp_path, extra=f"[p2p]\nport = {port}\n[http]\nport = 0\n")
        err = refused(config, capsys)
        assert err.startswith(f"tessera: error: {config}: p2p.port: 127.0.0.1:{port} is in use"), err
        config = write_node(tmp_path, extra=f"[p2p]\nport = {free_port()}\n[http]\nport = {port}\n")
        err = refused(config, capsys)
        assert err.startswith(f"tessera: error: {config}: http.port: 127.0.0.1:{port} is in use"), err
    assert not (tmp_path / "data").exists()  # refused before it locked or opened anything


def test_a_bootstrap_address_with_a_bad_peer_id_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = "/ip4/127.0.0.1/tcp/4001/p2p/abc"
    config = write_node(tmp_path, extra=f'[p2p]\nport = 0\nbootstrap = ["{bad}"]\n[http]\nport = 0\n')
    err = refused(config, capsys)
    assert err.startswith(f"tessera: error: {config}: p2p.bootstrap: '{bad}' is not a multiaddr"), err
    assert not (tmp_path / "data").exists()


def test_a_missing_spec_names_the_config_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_node(tmp_path, extra="[p2p]\nport = 0\n[http]\nport = 0\n")
    (tmp_path / "spec.toml").unlink()
    err = refused(config, capsys)
    assert err.startswith(f"tessera: error: {config}: node.spec: ") and "no such spec file" in err, err


@pytest.mark.parametrize(("role", "seed", "reason"), [
    ("validator", 100, "is not one of the spec's validators"),
    ("miner", 0, "is a validator's key in the spec"),
])
def test_a_key_that_does_not_fit_the_role_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str, seed: int, reason: str
) -> None:
    config = write_node(tmp_path, role, "[p2p]\nport = 0\n[http]\nport = 0\n", key_seed=seed)
    err = refused(config, capsys)
    assert err.startswith(f"tessera: error: {config}: node.key: ") and reason in err, err
    assert not (tmp_path / "data").exists()


def test_a_validator_whose_blob_budget_cannot_hold_a_round_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A round of the test spec's tiny group stores a few MiB on a validator (blob caps include the spec's
    1 MiB header limit); a budget of 1 MiB cannot hold it."""
    config = write_node(tmp_path, "validator", f"[p2p]\nport = 0\n[http]\nport = 0\n[storage]\nblob_budget_bytes = {1 << 20}\n")
    err = refused(config, capsys)
    assert err.startswith(f"tessera: error: {config}: storage.blob_budget_bytes: 1048576 bytes cannot hold a round "
                          "of this network, in which a validator stores up to "), err
    assert "its proposed state and momentum " in err and "raise it to at least" in err, err
    assert not (tmp_path / "data").exists()  # refused before it locked or opened anything


def test_a_data_directory_is_refused_to_a_node_of_another_role_network_or_key(tmp_path: Path) -> None:
    data, key = tmp_path / "data", tmp_path / "node.key"
    save_identity(MINER, key)
    mine = Owner(network="aa" * 32, role="validator", node=VALIDATOR.node_id)
    NodeLock.acquire(data, key, mine).release()
    NodeLock.acquire(data, key, mine).release()  # the same node again
    for other in (Owner("aa" * 32, "miner", VALIDATOR.node_id), Owner("bb" * 32, "validator", VALIDATOR.node_id),
                  Owner("aa" * 32, "validator", MINER.node_id)):
        with pytest.raises(ValueError, match=r"this data directory belongs to a validator of network aaaaaaaaaaaa "
                                             r"with key .*; give it its own node\.data_dir"):
            NodeLock.acquire(data, key, other)
    NodeLock.acquire(data, key, mine).release()  # a refusal takes no locks with it, nor changes the claim


async def test_a_node_on_a_data_directory_of_another_role_refuses_to_start(tmp_path: Path) -> None:
    config_path = write_node(tmp_path, "validator", "[http]\nport = 0\n")
    config = load_config(config_path)
    spec = load_spec(config.node.spec)
    clock = ManualClock(spec.genesis_ts - 100)
    hub = MemoryHub()
    node = await Node.create(config, hub.join(VALIDATOR.node_id, GossipJudge(spec, clock.now),
                                              BlobStore(tmp_path / "b1")), clock)
    await node._close()
    (tmp_path / "node.key").unlink()
    miner = load_config(write_node(tmp_path, "miner", "[http]\nport = 0\n"))
    with pytest.raises(ValueError, match=r"belongs to a validator of network .* and this node is a miner"):
        await Node.create(miner, hub.join(MINER.node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / "b2")),
                          clock)


async def test_a_node_without_peers_says_so_and_what_to_check_without_libp2ps_bare_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Real libp2p, a bootstrap address where nothing listens: py-libp2p's own lines went to stderr bare, one per
    failed redial, and nothing said that the node had no peer."""
    monkeypatch.setattr(daemon, "ALONE_WARN_S", 1.0, raising=False)
    caplog.set_level(logging.INFO)
    nothing = BOOT.format(port=free_port())
    config = load_config(write_node(tmp_path, extra=f'[p2p]\nport = 0\nbootstrap = ["{nothing}"]\n'
                                                   f'supervise_interval_s = 0.2\n[http]\nenabled = false\n'))
    rooted: list[logging.LogRecord] = []  # what reaches the root logger's handlers, as the node's log
    collect = logging.Handler(logging.INFO)
    collect.emit = rooted.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(collect)
    node = await Node.create(config, clock=ManualClock(load_spec(config.node.spec).genesis_ts - 1000))
    task = asyncio.create_task(node.run())
    try:
        for _ in range(100):
            if any("no peers" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.1)
    finally:
        node.stop()
        await asyncio.wait_for(task, 20)
        logging.getLogger().removeHandler(collect)
    warnings = [r.getMessage() for r in caplog.records if "no peers" in r.getMessage()]
    assert len(warnings) == 1 and f"cannot reach any bootstrap peer ({nothing})" in warnings[0], warnings
    assert "Failed to open TCP stream" not in capfd.readouterr().err
    assert not [r for r in rooted if r.name.startswith("libp2p")]  # nor in the node's own log (at INFO)


@pytest.mark.slow
def test_the_daemon_acknowledges_a_stop_signal_and_the_same_one_again_exits_at_once(tmp_path: Path) -> None:
    """SIGTERM stops the node; SIGINT after it (a supervisor's Ctrl-C reaching the whole group, say) lets the
    stop go on; SIGTERM again exits at once."""
    config = write_node(tmp_path, extra="[p2p]\nport = 0\n[http]\nport = 0\n")
    code = ("import asyncio, sys; from node.cli.main import main; from node.runtime import daemon\n"
            "from node.duties.miner import MinerDuties\n"
            "from node.runtime.context import HeartbeatDuties\n"
            "async def hang(self): await asyncio.Event().wait()\n"  # a close that never ends
            "daemon.Node._close = hang\n"
            "MinerDuties.factory = staticmethod(lambda *args: HeartbeatDuties)\n"  # no model to load
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "miner", "--config", str(config)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:  # wait until it runs
            lines.append(line)
            if "http api on" in line:
                break
        for sig, said in ((signal.SIGTERM, "SIGTERM: stopping"), (signal.SIGINT, "SIGINT: already stopping")):
            proc.send_signal(sig)
            for line in proc.stderr:
                lines.append(line)
                if said in line:
                    break
        assert proc.poll() is None, "".join(lines)  # the other signal is not a repeat: the stop goes on
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "SIGTERM again: exiting now" in rest and "Traceback" not in rest, rest


def test_status_says_when_nothing_listens_and_when_the_port_is_picked_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "--url", url, "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: error: {url}/status: no answer from the node: nothing listens there; "
                          "is it running?") and err.count("\n") == 1, err
    config = write_node(tmp_path, extra="[http]\nport = 0\n")
    assert main(["status", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"tessera: error: {config}: http.port is 0 ")


def test_a_misspelt_field_is_named_with_the_one_meant(tmp_path: Path) -> None:
    config = write_node(tmp_path, extra="[http]\nprot = 8080\n")
    with pytest.raises(ConfigError, match=r"http\.prot: Extra inputs are not permitted \(did you mean http\.port\?\)"):
        load_config(config)
    config = write_node(tmp_path, extra="[htp]\nport = 8080\n")
    with pytest.raises(ConfigError, match=r"htp: Extra inputs are not permitted \(did you mean http\?\)"):
        load_config(config)
