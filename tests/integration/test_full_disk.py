"""A node whose disk fills and then gets room again, over real processes on loopback libp2p: one validator
and two miners, `FULL`'s data directory on a 1 MiB tmpfs that other files fill before genesis (as a disk
fills under an operator) and that grows to 64 MiB during round 0's MERGE (as an operator makes room).

While full, the node says so in its log once a round at most and without a traceback, and its /status and
/metrics show too little room; it stays up, and once there is room it takes the network's head at round 1's
TRAIN with no restart, trains from it, and the validator accepts its submission of round 1 (a blob trained
from any other state is refused as stale). Mounting a tmpfs needs root; elsewhere the test is skipped.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node.sim.process import SimSettings
from node.sim.run import Simulation
from protocol.rounds import Phase

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs, which needs root")]

FULL = "miner-1"
VALIDATOR = "validator-0"
SETTINGS = SimSettings(validators=1, miners=2, round_seconds=40, train_share=0.4, inner_steps=10, start_delay_s=25)
DISK_LINE = re.compile(r"(?:round (\d+): )?the (?:disk (?:is full|of )|blob store .* is at its budget)")


@pytest.fixture
def tmpfs() -> Iterator[Callable[[Path, str], None]]:
    """`mount(path, size)` puts a tmpfs of `size` (mount's syntax: 1m) at `path`; `mount(path, size)` again
    resizes it. Unmounted at the end, once the test has stopped the nodes."""
    mounted: list[Path] = []

    def mount(path: Path, size: str) -> None:
        if path in mounted:
            subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
            return
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounted.append(path)

    try:
        yield mount
    finally:
        for path in mounted:
            if subprocess.run(["umount", str(path)], check=False).returncode:
                subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(directory: Path) -> None:
    """Take every free byte of `directory`'s filesystem with a file of other data."""
    fd = os.open(directory / "other-data", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def disk_metrics(sim: Simulation, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{sim.nodes[name].http_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("tessera_disk_")}


def test_a_node_whose_disk_fills_says_so_once_a_round_shows_it_and_resumes_on_the_networks_state(
        tmp_path: Path, tmpfs: Callable[[Path, str], None]) -> None:
    began = time.monotonic()
    with Simulation(tmp_path / "sim", SETTINGS) as sim:
        sim.prepare()
        assert sim.schedule is not None
        data = sim.nodes[FULL].directory / "data"
        tmpfs(data, "1m")
        sim.start()
        sim.wait_until(lambda: sim.get(FULL, "/status"), sim.schedule.genesis_ts - time.time(), f"{FULL} to start")
        assert time.time() < sim.schedule.genesis_ts, "genesis passed before the disk could be filled"
        fill(data)

        sim.wait_phase(0, Phase.COMMIT)  # TRAIN has failed to record the round; gossip cannot be recorded either
        disk: dict[str, Any] = sim.wait_until(
            lambda: (d := (sim.get(FULL, "/status") or {}).get("disk")) and d["refused"] and d, 30,
            f"{FULL} to report a write refused for a full disk")
        assert disk["path"] == str(data) and disk["low"] and disk["free_bytes"] < 64 << 10, disk
        assert disk["needed_bytes"] > 4 << 20 and disk["refused"]["round"] == 0, disk
        metrics = disk_metrics(sim, FULL)
        assert metrics["tessera_disk_free_bytes"] < metrics["tessera_disk_needed_bytes"], metrics

        sim.wait_phase(0, Phase.MERGE)
        tmpfs(data, "64m")  # room again; the other data stays

        sim.wait_phase(1, Phase.COMMIT)  # round 1's TRAIN adopted round 0's state
        head = sim.wait_until(lambda: (s := sim.get(VALIDATOR, "/status")) and s["head"], 10, "the validator's head")
        assert (sim.get(FULL, "/status") or {}).get("head") == head  # the network's state, fetched into the tmpfs

        def scored() -> dict[str, Any] | None:
            report = sim.get(VALIDATOR, "/rounds/1") or {}
            return next((m for m in report.get("miners", []) if m["id"] == sim.nodes[FULL].node_id), None)

        mine = sim.wait_until(scored, sim.schedule.round_start(2) + 20 - time.time(), f"round 1's score of {FULL}")
        assert mine["verdict"] == "accept", mine  # trained from the network's state of round 0
        status = sim.get(FULL, "/status")
        assert status is not None and not status["disk"]["low"], status["disk"]
        assert sim.nodes[FULL].starts == 1 and sim.nodes[FULL].alive  # no restart

    log = sim.nodes[FULL].log_path.read_text(encoding="utf-8")
    assert "Traceback" not in log
    said = [m for line in log.splitlines() if (m := DISK_LINE.search(line))]
    rounds = [int(m[1]) for m in said if m[1] is not None]
    assert 0 in rounds and len(rounds) == len(set(rounds)), [m.string for m in said]  # once a round at most
    print(f"\nfull-disk network: {time.monotonic() - began:.0f} s")
