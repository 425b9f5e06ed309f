"""A network across hosts: a bootstrap, a validator and two miners, each on a host of its own (a Linux network
namespace, tests/integration/netns.py), over non-loopback addresses on one bridge, set up as an operator would
with `tessera init --host/--announce` and `tessera bootstrap`, complete two rounds on one state.

miner-1's host sits behind a router, as at home: it listens on its private address, 192.168.58.2:4001, and
announces the router's, 10.58.0.4:4001, which the router forwards to it. The bootstrap's and miner-0's hosts
have a route to the private network; the validator's has none, so the only way the validator reaches miner-1
is the announced address: miner-1 is scored in both rounds only if peers are told, and dial, what it announces.
Skipped, in one line, where network namespaces cannot be made (no root, no `ip`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from node.cli.main import main
from node.sim.layout import make_sim_network, prepare_base, sim_identity
from node.sim.process import SimSettings
from protocol.identity import save_identity
from protocol.rounds import Schedule
from protocol.spec import load_spec
from tests.integration import netns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2
# 4 nodes: 40 s rounds, half of them TRAIN, and 5 inner steps leave each phase room on a busy 2-core machine;
# the nodes start as fresh interpreters (a fork server cannot enter a namespace), about 10 s each to import.
SETTINGS = SimSettings(validators=1, miners=2, round_seconds=40, train_share=0.5, inner_steps=5)
START_S = 35.0
PORT = 4001
ANNOUNCED = f"/ip4/{netns.SUBNET}.4/tcp/{PORT}"  # the router's address, forwarded to miner-1


@dataclass
class MultiHost:
    hosts: netns.Hosts
    schedule: Schedule
    node_ids: dict[str, str]
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def status(self, host: str) -> dict[str, Any]:
        status: dict[str, Any] | None = self.hosts.get(host, "http://127.0.0.1:8080/status")
        return status or {}

    def wait(self, predicate: Any, until: float, what: str) -> Any:
        while True:
            dead = [f"{name} (exit {p.returncode}, log {self.logs / name}.log)" for name, p in self.procs.items()
                    if p.poll() is not None]
            assert not dead, f"node(s) died: {', '.join(dead)}"
            value = predicate()
            if value:
                return value
            assert time.time() < until, f"timed out waiting for {what}; logs in {self.logs}"
            time.sleep(2)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    if (reason := netns.unavailable()) is not None:
        pytest.skip(reason)
    from node.net.p2p import peer_id_for

    root = tmp_path_factory.mktemp("multihost")
    prepare_base(SETTINGS.family)  # before genesis is fixed: a cold cache pretrains first
    genesis = (datetime.now(UTC) + timedelta(seconds=START_S)).replace(microsecond=0)
    network = make_sim_network(root / "network", validators=1, genesis=genesis, timing=SETTINGS.timing(),
                               settings=[("training.inner_steps", SETTINGS.inner_steps)])
    spec = str(network.spec_path)
    boot = sim_identity(0, "bootstrap", 0)
    save_identity(boot, root / "boot.key")
    with netns.Hosts() as hosts:
        for host in ("boot", "val", "miner-0", "router"):
            hosts.add(host)
        hosts.behind("miner-1", "router", routed_from=["boot", "miner-0"])
        bootstrap = f"/ip4/{hosts.addresses['boot']}/tcp/{PORT}/p2p/{peer_id_for(boot.node_id)}"
        inits = {
            "val": ["--role", "validator", "--key", str(network.validator_keys[0]),
                    "--heldout", str(network.directory / "data" / "heldout.jsonl")],
            "miner-0": ["--role", "miner"],
            "miner-1": ["--role", "miner", "--announce", ANNOUNCED],
        }
        for host, flags in inits.items():
            assert main(["init", "--spec", spec, "--dir", str(root / host), "--host", hosts.addresses[host],
                         "--bootstrap", bootstrap, *flags]) == 0
        ids = {host: load_node_id(root / host) for host in inits}
        run = MultiHost(hosts, Schedule.from_spec(load_spec(spec)), ids, root)
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TESSERA_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        commands = {
            "router": [sys.executable, "-m", "tests.integration.netns", "forward",
                       f"{hosts.addresses['router']}:{PORT}", f"{hosts.addresses['miner-1']}:{PORT}"],
            "boot": [sys.executable, "-m", "node.cli", "bootstrap", "--spec", spec, "--key", str(root / "boot.key"),
                     "--host", hosts.addresses["boot"], "--port", str(PORT)],
            **{host: [sys.executable, "-m", "node.cli", "validator" if host == "val" else "miner", "--config",
                      str(root / host / "node.toml")] for host in inits},
        }
        try:
            for host, argv in commands.items():
                with (root / f"{host}.log").open("ab") as log:
                    run.procs[host] = hosts.run(host, argv, log, ROOT, env)
            yield run
        finally:
            for proc in run.procs.values():
                proc.terminate()
            for proc in run.procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def load_node_id(directory: Path) -> str:
    from node.runtime.config import load_config
    from protocol.identity import load_identity

    return load_identity(load_config(directory / "node.toml").node.key).node_id


def test_four_hosts_complete_two_rounds_on_one_state_with_a_miner_reached_at_its_announced_address(
        net: MultiHost) -> None:
    hosts = net.hosts
    # The premise: the validator's host cannot reach miner-1's private address, only the router's forward.
    assert not hosts.connects("val", hosts.addresses["miner-1"], PORT)
    last = ROUNDS - 1
    until = net.schedule.round_start(ROUNDS) + SETTINGS.round_seconds
    reports = {}
    for r in range(ROUNDS):
        reports[r] = net.wait(lambda r=r: final(hosts.get("val", f"http://127.0.0.1:8080/rounds/{r}")), until,
                              f"the validator's report of round {r}")
    for r, report in reports.items():
        verdicts = {m["id"]: (m["verdict"], m["loss"] is not None) for m in report["miners"]}
        assert verdicts == {net.node_ids["miner-0"]: ("accept", True), net.node_ids["miner-1"]: ("accept", True)}, (
            r, report["miners"])
    assert any(report["global_hash"] != report["base"] for report in reports.values()), "the state never moved"
    head = reports[last]["global_hash"]
    for host in ("val", "miner-0", "miner-1"):
        net.wait(lambda h=host: net.status(h).get("head") == head, until, f"{host} to hold round {last}'s state")

    behind_nat = net.status("miner-1")
    assert behind_nat["announce"] == [ANNOUNCED]
    assert [a.split("/p2p/")[0] for a in behind_nat["listen"]] == [f"/ip4/{hosts.addresses['miner-1']}/tcp/{PORT}"]
    for host in ("val", "miner-0", "miner-1"):
        status = net.status(host)
        assert not any("/ip4/127." in addr for addr in status["listen"]), status["listen"]
        assert status["protocol_alert"] is None


def final(report: Any) -> dict[str, Any] | None:
    """A validator's report of a round once it is final: the adopted state and its loss."""
    if isinstance(report, dict) and report.get("global_hash") and report.get("global_loss") is not None:
        return report
    return None
