"""Run a whole Tessera network on 127.0.0.1 as separate processes: a bootstrap, validators, miners.

`Simulation(directory, SimSettings(...))` writes a simulation network (node.sim.layout) under
DIR/network with genesis a little in the future, one config TOML per node under
DIR/nodes/<name>/config.toml, and starts each node as its own `tessera` process logging to
DIR/nodes/<name>/log.txt. It watches the nodes only through their HTTP APIs (/status,
/rounds/{r}) and state files, can kill, restart and add nodes (fault tests), and assembles the
per-round report written to DIR/report.json. `close()` (also on errors and Ctrl-C, as a context
manager) stops every child: SIGTERM, then SIGKILL after a timeout. This module knows nothing about
training, scoring or merging; it starts processes and reads what they report.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from node.sim.layout import SimNetwork, make_sim_network, prepare_base, remove_written, sim_identity, to_toml
from node.sim.process import (
    ADVERSARY_KINDS,
    ADVERSARY_PROGRAM,
    SimNode,
    SimSettings,
    SimulationError,
    first_listen_port,
    interrupts_noted,
    next_free_port,
)
from node.sim.warm import warm_up
from node.store.db import Storage
from node.store.records import PhaseRun
from protocol.files import write_file
from protocol.identity import save_identity
from protocol.rounds import PHASES, Phase, Schedule
from protocol.spec import load_spec

POLL_S = 1.0
STOP_POLL_S = 0.05

T = TypeVar("T")


class Simulation:
    """A local network of node processes. Use as a context manager, or call close() in a finally."""

    def __init__(self, directory: str | Path, settings: SimSettings | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.settings = settings or SimSettings()
        self.nodes: dict[str, SimNode] = {}
        self.network: SimNetwork | None = None
        self.schedule: Schedule | None = None
        self._next_port = self.settings.base_port or first_listen_port()
        self._bootstrap: list[str] = []

    # -- set-up ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Write the network and every node's config (starts nothing); a failure removes what was written."""
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"{self.directory}: directory is not empty; remove it or choose another --dir")
        s = self.settings
        prepare_base(s.family)  # a cold cache pretrains first, so genesis is not already past
        warm_up()  # and the nodes' fork server imports torch and the node before the clock starts
        genesis = (datetime.now(UTC) + timedelta(seconds=s.delay_s())).replace(microsecond=0)
        created = not self.directory.exists()
        try:
            self._write(genesis)
        except BaseException:
            remove_written(self.directory, created)
            self.nodes.clear()
            self.network = self.schedule = None
            raise

    def _write(self, genesis: datetime) -> None:
        s = self.settings
        self.network = make_sim_network(self.directory / "network", validators=s.validators, family=s.family,
                                        genesis=genesis, timing=s.timing(), seed=s.seed,
                                        submission_format=s.submission_format,
                                        settings=[("training.inner_steps", s.inner_steps), *s.spec_settings])
        self.use_network(self.network)

    def use_network(self, network: SimNetwork) -> None:
        """Run `network` (a spec, its data and validator keys written by `make_sim_network` or by hand): the
        bootstrap, validators and miners the settings ask for are added, not started (`start`)."""
        self.network = network
        self.schedule = Schedule.from_spec(load_spec(network.spec_path))
        self._add_bootstrap()
        for i in range(self.settings.validators):
            self._add_daemon("validator", i, "honest")
        for j, kind in enumerate(self.settings.miner_kinds()):
            self._add_daemon("miner", j, kind)

    def start(self) -> None:
        """Prepare (if not done) and start every node."""
        if self.network is None:
            self.prepare()
        for node in self.nodes.values():
            if node.proc is None:
                node.start()

    def add_node(self, kind: str = "honest", start: bool = True) -> SimNode:
        """Add a miner of `kind` to the simulation, started at once unless told not to.

        Only miners can join late: the spec fixes the validator set.
        """
        if kind != "honest" and kind not in ADVERSARY_KINDS:
            raise ValueError(f"unknown miner kind {kind!r}")
        index = sum(1 for n in self.nodes.values() if n.role == "miner")
        node = self._add_daemon("miner", index, kind)
        if start:
            node.start()
        return node

    def _add_bootstrap(self) -> None:
        from node.net.p2p import peer_id_for  # imports libp2p; only needed to name the bootstrap peer

        assert self.network is not None
        identity = sim_identity(self.settings.seed, "bootstrap", 0)
        directory = self._node_dir("bootstrap")
        p2p_port, _ = self._ports()
        args = ["bootstrap", "--spec", str(self.network.spec_path), "--sim-key", str(self.settings.seed),
                "--data-dir", str(directory / "data"), "--port", str(p2p_port)]
        self.nodes["bootstrap"] = SimNode("bootstrap", "bootstrap", "-", identity.node_id, directory, args, None)
        self._bootstrap = [f"/ip4/127.0.0.1/tcp/{p2p_port}/p2p/{peer_id_for(identity.node_id)}"]

    def _add_daemon(self, role: str, index: int, kind: str) -> SimNode:
        from node.net.p2p import peer_id_for

        assert self.network is not None
        name = f"{role}-{index}"
        directory = self._node_dir(name)
        p2p_port, http_port = self._ports()
        network = self.network.directory
        if role == "validator":
            identity = sim_identity(self.settings.seed, "validator", index)
            key = network / "keys" / f"validator-{index}.key"
        else:
            identity = sim_identity(self.settings.seed, "miner", index)
            key = directory / "node.key"
            save_identity(identity, key)
        config: dict[str, Any] = {
            "node": {"role": role, "spec": _rel(self.network.spec_path, directory), "key": _rel(key, directory),
                     "data_dir": "data"},
            "p2p": {"host": "127.0.0.1", "port": p2p_port, "bootstrap": list(self._bootstrap)},
            "http": {"host": "127.0.0.1", "port": http_port},
        }
        if role == "validator":
            config["validator"] = {"heldout": _rel(network / "data" / "heldout.jsonl", directory)}
        (directory / "config.toml").write_text(to_toml(config), encoding="utf-8")
        if role == "validator" and index == 0:
            # A second way into the network, for nodes that start while the bootstrap is down.
            self._bootstrap.append(f"/ip4/127.0.0.1/tcp/{p2p_port}/p2p/{peer_id_for(identity.node_id)}")
        args = [role, "--config", str(directory / "config.toml")]
        if kind != "honest":  # an adversary: `tessera miner` playing it
            args, program = [kind, *args], ADVERSARY_PROGRAM
        else:
            program = SimNode.program
        node = SimNode(name, role, kind, identity.node_id, directory, args, http_port, program)
        self.nodes[name] = node
        return node

    def _node_dir(self, name: str) -> Path:
        directory = self.directory / "nodes" / name
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _ports(self) -> tuple[int, int]:
        if self.settings.base_port == 0:  # free now, and outside the range outgoing connections use
            first = next_free_port(self._next_port)
            second = next_free_port(first + 1)
            self._next_port = second + 1
            return first, second
        self._next_port += 2
        return self._next_port - 2, self._next_port - 1

    # -- control --------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one node (a crash)."""
        self.nodes[name].kill()

    def restart(self, name: str) -> None:
        """Start a stopped or killed node again with the same key, config and state."""
        node = self.nodes[name]
        if node.alive:
            node.stop(self.settings.stop_timeout_s)
        node.start()

    def close(self) -> None:
        """Stop every node: SIGTERM to all at once, then SIGKILL to any still running after the timeout.

        An interrupt (Ctrl-C or SIGTERM, however many) cannot cut this short and leave nodes running: it
        ends the wait at once, every node still running gets SIGKILL, and then KeyboardInterrupt is raised.
        """
        with interrupts_noted() as interrupts:
            running = [n for n in self.nodes.values() if n.alive]
            for node in running:
                node.stopped_on_purpose = True
                assert node.proc is not None
                node.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.settings.stop_timeout_s
            while any(n.alive for n in running) and not interrupts and time.monotonic() < deadline:
                time.sleep(STOP_POLL_S)
            for node in running:
                node.kill()
        if interrupts:
            raise KeyboardInterrupt

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation ----------------------------------------------------------------------------

    def get(self, name: str, path: str) -> Any:
        """GET a JSON document from a node's HTTP API; None if it does not answer (yet)."""
        node = self.nodes[name]
        if node.http_port is None or not node.alive:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}{path}", timeout=2) as response:
                return json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def validators(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.role == "validator"]

    def check_alive(self) -> None:
        """Raise SimulationError naming any node that exited without being told to."""
        dead = [n for n in self.nodes.values() if n.died]
        if dead:
            names = ", ".join(f"{n.name} (exit {n.proc.returncode if n.proc else '?'}, log {n.log_path})"
                              for n in dead)
            raise SimulationError(f"node(s) died: {names}")

    def now_round_phase(self) -> tuple[int, Phase] | None:
        """The round and phase by the spec's clock; None before genesis."""
        assert self.schedule is not None, "call prepare() or start() first"
        now = time.time()
        return None if now < self.schedule.genesis_ts else self.schedule.phase_at(now)

    def wait_until(self, predicate: Callable[[], T | None], timeout: float, what: str,
                   on_poll: Callable[[], None] | None = None) -> T:
        """Poll `predicate` (checking that no node died) until truthy; SimulationError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if on_poll is not None:
                on_poll()
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise SimulationError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL_S)

    def wait_phase(self, round: int, phase: Phase, on_poll: Callable[[], None] | None = None) -> None:
        """Return once `phase` of `round` has begun by the clock."""
        assert self.schedule is not None, "call prepare() or start() first"
        start = self.schedule.phase_window(round, phase)[0]
        self.wait_until(lambda: time.time() >= start, start - time.time() + 30, f"round {round} {phase}", on_poll)

    def wait_round(self, round: int, on_poll: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
        """Wait until every running validator's report of `round` is final; returns the reports by name.

        Final means a global hash and the loss of the adopted state (known once the next round begins).
        From the round's end plus half a round on, whatever running validators have reported will do.
        """
        assert self.schedule is not None, "call prepare() or start() first"
        end = self.schedule.round_start(round + 1)
        grace = self.schedule.round_seconds / 2

        def done() -> dict[str, dict[str, Any]] | None:
            running = [v for v in self.validators() if v.alive]
            reports = {v.name: r for v in running
                       if isinstance(r := self.get(v.name, f"/rounds/{round}"), dict) and r.get("global_hash")}
            final = all(r.get("global_loss") is not None for r in reports.values())
            if running and len(reports) == len(running) and final:
                return reports
            return reports if reports and time.time() > end + grace else None

        timeout = end + grace + self.schedule.round_seconds - time.time()
        return self.wait_until(done, timeout, f"validators to finish round {round}", on_poll)

    def phase_seconds(self, r: int) -> dict[str, float]:
        """Per phase, the longest time any node's handler ran in round `r` (from the nodes' state files)."""
        longest: dict[str, float] = {}
        for name in self.nodes:
            for run in self.phase_runs(name, r):
                longest[run.phase] = max(longest.get(run.phase, 0.0), run.duration_s)
        return {str(p): round(longest[str(p)], 3) for p in PHASES if str(p) in longest}

    def phase_runs(self, name: str, r: int) -> list[PhaseRun]:
        """The phase handler runs node `name` recorded for round `r` (none for the bootstrap)."""
        db = self.nodes[name].directory / "data" / "node.db"
        if not db.exists():
            return []

        async def read() -> list[PhaseRun]:
            storage = await Storage.open(db)
            try:
                return await storage.phase_runs(r)
            finally:
                await storage.close()

        return asyncio.run(read())

    def round_entry(self, round: int, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """One element of report.json's "rounds", from the validators' reports of `round`."""
        kinds = {n.node_id: n.kind for n in self.nodes.values() if n.role == "miner"}
        first = reports[min(reports)]
        miners = [{"id": m["id"], "kind": kinds.get(m["id"], "unknown"), "verdict": m.get("verdict"),
                   "loss": m.get("loss"), "rank": m.get("rank"), "reward": m.get("reward", 0.0),
                   "reason": m.get("reason")} for m in first.get("miners", [])]
        return {
            "round": round,
            "base_loss": first.get("base_loss"),
            "global_loss": first.get("global_loss"),
            "miners": miners,
            "validators": [{"id": v.node_id, "global_hash": reports.get(v.name, {}).get("global_hash")}
                           for v in self.validators()],
            "phase_seconds": self.phase_seconds(round),
        }

    def write_report(self, rounds: list[dict[str, Any]]) -> Path:
        path = self.directory / "report.json"
        write_file(path, (json.dumps({"rounds": rounds}, indent=2) + "\n").encode("utf-8"))
        return path


def _rel(path: Path, directory: Path) -> str:
    return os.path.relpath(path, directory)
