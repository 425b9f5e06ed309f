"""One simulated network run that the network benchmarks read: `tessera simulate`'s network for R rounds, recorded.

`run(directory, settings, rounds)` starts `node.sim.run.Simulation` (a bootstrap, V validators and M miners as
separate processes over loopback libp2p, on the pretrained tiny base) in DIRECTORY, and each time the validators
have finished a round it copies the state the round adopted into DIRECTORY/adopted-states (from a validator's
blob store, before blob retention prunes it) and samples every node process (`sample`: resident memory, open
files, threads, its data directory's bytes and blobs). The run's settings, failure, seconds and samples go to
DIRECTORY/run.json; the simulation writes the rounds to DIRECTORY/report.json and each node its log and state
file under DIRECTORY/nodes. `load(directory)` reads a run back, so bench/simulation.py (the adopted states against
the held-out noise), bench/soak.py (growth round after round) and bench/round.py (where a round's time goes) each
run a network or read one an earlier run left (their `--reuse DIR`; the suite runs one network for all three).
Linux only (/proc). This module knows nothing about what the benchmarks make of the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from node.sim.process import SimNode, SimSettings, SimulationError
from node.sim.run import Simulation
from node.store.blobs import BlobStore
from protocol.files import write_file
from protocol.spec import load_spec

MIB = 2**20
STATES = "adopted-states"
RECORD = "run.json"


@dataclass(frozen=True)
class Run:
    """A recorded run: its settings (with `rounds` and the `commit`), the failure ("" when every round completed),
    its seconds, the rounds the simulation reported (report.json's) and, per node, one sample a round."""

    directory: Path
    settings: dict[str, Any]
    failure: str
    seconds: float
    rounds: list[dict[str, Any]]
    samples: dict[str, list[dict[str, Any]]]

    @property
    def states(self) -> Path:
        return self.directory / STATES

    def sim_settings(self) -> SimSettings:
        """The `SimSettings` the network ran with."""
        fields = {k: v for k, v in self.settings.items() if k not in ("rounds", "commit")}
        return SimSettings(**{**fields, "adversaries": tuple(fields["adversaries"]),
                              "spec_settings": tuple(tuple(pair) for pair in fields["spec_settings"])})


def run(directory: Path, settings: SimSettings, rounds: int) -> Run:
    """Run the network for `rounds` rounds in `directory` (which must not exist), recording it (module doc)."""
    started = time.perf_counter()
    sim = Simulation(directory, settings)
    entries: list[dict[str, Any]] = []
    samples: dict[str, list[dict[str, Any]]] = {}
    failure = ""
    try:
        sim.prepare()
        sim.start()
        assert sim.schedule is not None
        print(f"simulation in {directory}: genesis in {sim.schedule.genesis_ts - time.time():.0f} s",
              file=sys.stderr, flush=True)
        for r in range(rounds):
            entries.append(sim.round_entry(r, sim.wait_round(r)))
            sim.write_report(entries)
            for h in {v["global_hash"] for v in entries[-1]["validators"] if v["global_hash"]}:
                _copy_state(sim, h, directory / STATES)
            for name, node in sim.nodes.items():
                reading = sample(node)
                if reading is not None:
                    samples.setdefault(name, []).append({"round": r, **{k: round(v, 3) for k, v in reading.items()}})
            largest = max(readings[-1]["rss_mib"] for readings in samples.values())
            print(f"round {r}: base {entries[-1]['base_loss']} -> global {entries[-1]['global_loss']}, largest RSS "
                  f"{largest:.0f} MiB", file=sys.stderr, flush=True)
    except SimulationError as exc:
        failure = str(exc)
    finally:
        sim.close()
    record = {"settings": {**asdict(settings), "rounds": rounds, "commit": commit()}, "failure": failure,
              "seconds": round(time.perf_counter() - started, 1), "samples": samples}
    write_file(directory / RECORD, (json.dumps(record, indent=2) + "\n").encode("utf-8"))
    return load(directory)


def load(directory: Path) -> Run:
    """The run recorded in `directory`; ValueError where it holds none."""
    try:
        record = json.loads((directory / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory}: no readable {RECORD}; it is not the directory of a benchmark's run") from exc
    report = directory / "report.json"
    rounds = json.loads(report.read_text(encoding="utf-8"))["rounds"] if report.is_file() else []
    return Run(directory, record["settings"], record["failure"], record["seconds"], rounds, record["samples"])


def sample(node: SimNode) -> dict[str, float] | None:
    """One reading of a running node process and its data directory; None if it is not running."""
    if node.proc is None or not node.alive:
        return None
    proc = Path(f"/proc/{node.proc.pid}")
    try:
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        fds = len(list((proc / "fd").iterdir()))
    except (OSError, ValueError):
        return None  # exited between the check and the read
    data = node.directory / "data"
    files = [p for p in data.rglob("*") if p.is_file()] if data.exists() else []
    blobs = data / "blobs"
    reading = {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024,
        "fds": fds,
        "threads": int(status["Threads"]),
        "data_mib": sum(p.stat().st_size for p in files) / MIB,
        "blobs": len(BlobStore(blobs).hashes()) if blobs.is_dir() else 0,
    }
    metric = _metric(node, "process_resident_memory_bytes")
    if metric is not None:
        reading["metrics_rss_mib"] = metric / MIB
    return reading


def _metric(node: SimNode, name: str) -> float | None:
    """One unlabelled sample from the node's /metrics; None for the bootstrap or if it does not answer."""
    if node.http_port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _copy_state(sim: Simulation, state_hash: str, states: Path) -> None:
    """Copy the state blob from the first validator holding it (the genesis hash has no blob)."""
    assert sim.network is not None
    if state_hash == load_spec(sim.network.spec_path).model.base_hash:
        return
    for node in sim.validators():
        data = BlobStore(node.directory / "data" / "blobs").read_checked(state_hash)
        if data is not None:
            states.mkdir(parents=True, exist_ok=True)
            (states / state_hash).write_bytes(data)
            return
    raise SimulationError(f"no validator holds the adopted state {state_hash[:12]}")


def commit() -> str:
    """The checked-out commit, with "+dirty" when tracked files differ from it."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "log", "-1", "--format=%h"], capture_output=True, text=True, cwd=root, check=False)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, check=False).returncode != 0
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
