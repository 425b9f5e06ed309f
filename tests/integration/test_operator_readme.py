"""The README's operator commands ("Running a node") run exactly as written, on a tiny network: keys, a bootstrap
peer, `spec check`, `tessera init` with the options a host that others reach needs, a miner and a validator that
start and answer `tessera status`, and a clean stop of each on SIGINT.

The test gives the commands what the README says they start from: a spec (`spec.toml`, a simulation network's
tiny model and data, its genesis an hour away so the nodes wait for it), its held-out file (`heldout.jsonl`) and
the validator key the spec names (`val1.key`, from `tessera keygen` as in "Start a network from a real
checkpoint"). The README's fixed ports are the defaults an operator sees, so where root allows the commands run
in a network namespace of their own, where no other test's port can be in the way; elsewhere on this host."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from node.sim.layout import make_sim_network, prepare_base, to_toml
from node.sim.process import die_with_parent
from protocol.identity import load_identity
from tests.integration import netns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
DAEMONS = {"bootstrap": "other nodes join with", "miner": "http api on", "validator": "http api on"}


def readme_commands() -> list[list[str]]:
    """The commands of the README's "Running a node" block: continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("## Running a node", 1)[1]
    block = text.split("```", 2)[1].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("tessera ")]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """What the README's commands start from: spec.toml, heldout.jsonl and the validator's key val1.key."""
    prepare_base("qwen3_moe")
    genesis = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    make_sim_network(tmp_path, validators=1, genesis=genesis)
    run(tmp_path, [], ["tessera", "keygen", "--out", "val1.key"])
    spec = tomllib.loads((tmp_path / "spec.toml").read_text(encoding="utf-8"))
    spec["validators"] = [{"key": load_identity(tmp_path / "val1.key").node_id, "weight": 1.0}]
    (tmp_path / "spec.toml").write_text(to_toml(spec), encoding="utf-8")
    shutil.copy(tmp_path / "data" / "heldout.jsonl", tmp_path / "heldout.jsonl")
    return tmp_path


@pytest.fixture
def prefix() -> Iterator[list[str]]:
    """What each command runs under: `ip netns exec` of a namespace of its own, where root allows."""
    if netns.unavailable() is not None:
        yield []
        return
    with netns.Hosts() as hosts:
        hosts.add("operator")
        yield ["ip", "netns", "exec", hosts.namespace("operator")]


def argv(prefix: list[str], command: list[str]) -> tuple[list[str], dict[str, str]]:
    """`tessera ARGS` as this checkout's `python -m node.cli ARGS` under `prefix`, and its environment."""
    assert command[0] == "tessera"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TESSERA_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return [*prefix, sys.executable, "-m", "node.cli", *command[1:]], env


def run(cwd: Path, prefix: list[str], command: list[str]) -> str:
    """Run a command to its end in `cwd`; its stdout. It must succeed."""
    args, env = argv(prefix, command)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{shlex.join(command)} failed: {done.stderr}"
    return done.stdout


def start(cwd: Path, prefix: list[str], command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a command that runs until SIGINT in `cwd`, its output to `log`."""
    args, env = argv(prefix, command)
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def test_the_readme_operator_commands_run_as_written_and_start_the_nodes(workdir: Path, prefix: list[str]) -> None:
    commands = readme_commands()
    assert [c[1] for c in commands] == ["keygen", "bootstrap", "keygen", "spec", "init", "miner", "init",
                                        "validator", "status"]  # what this test was written against
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    out = ""
    try:
        for command in commands:
            if command[1] not in DAEMONS:
                out = run(workdir, prefix, command)
                continue
            log = workdir / f"{command[1]}.log"
            daemons[command[1]] = start(workdir, prefix, command, log)
            deadline = time.monotonic() + 120
            while DAEMONS[command[1]] not in log.read_text(encoding="utf-8", errors="replace"):
                assert daemons[command[1]].poll() is None, f"{shlex.join(command)} exited: {log.read_text()}"
                assert time.monotonic() < deadline, f"{shlex.join(command)} did not start: {log.read_text()}"
                time.sleep(0.5)
        status = json.loads(out)  # the README's last command: tessera status
        assert status["role"] == "validator" and status["round"] is None  # waiting for genesis
        assert status["node_id"] == load_identity(workdir / "val1.key").node_id
        assert status["announce"] == ["/ip4/198.51.100.7/tcp/4003"]
        assert [a.split("/p2p/")[0] for a in status["listen"]] == ["/ip4/0.0.0.0/tcp/4003"]
        miner = tomllib.loads((workdir / "miner1" / "node.toml").read_text(encoding="utf-8"))
        assert miner["node"]["key"] == "../miner1.key" and miner["miner"]["forward"] == "compressed"
    finally:
        for proc in daemons.values():
            proc.send_signal(signal.SIGINT)
        codes = {name: proc.wait(30) for name, proc in daemons.items()}
    assert codes == {"bootstrap": 0, "miner": 0, "validator": 0}
    for name in ("miner", "validator"):
        assert "stopped cleanly" in (workdir / f"{name}.log").read_text(encoding="utf-8")
