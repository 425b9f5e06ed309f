"""A node whose clock runs behind says so: real node processes over loopback libp2p, one miner started
with Debian's libfaketime preloaded (the `faketime` package, which `make test` installs with apt) and
its clock BEHIND_S seconds slow. The validator's messages reach it before their windows open by its
clock, and its /status and /metrics say its clock is probably behind; the nodes on time say nothing."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from node.sim.process import SimSettings
from node.sim.run import Simulation

BEHIND_S = 12.0
SLOW = "miner-1"


def libfaketime() -> Path | None:
    """Debian's libfaketime (the `faketime` package). Preloaded into the node itself rather than run through
    the `faketime` command, which would put a process between the simulator and the node."""
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1")) + sorted(
        Path("/usr/lib/faketime").glob("libfaketime.so.1"))
    return found[0] if found else None


def test_a_node_whose_clock_is_behind_reports_it_and_the_others_do_not(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    library = libfaketime()
    assert library, "libfaketime is not installed; `make test` installs the faketime package with apt"
    settings = SimSettings(validators=1, miners=2, round_seconds=60, train_share=0.6, inner_steps=5,
                           start_delay_s=35)
    with Simulation(tmp_path / "sim", settings) as sim:
        sim.prepare()
        slow = sim.nodes[SLOW]
        with monkeypatch.context() as env:  # the slow node's environment only
            env.setenv("LD_PRELOAD", str(library))
            env.setenv("FAKETIME", f"-{BEHIND_S:g}s")
            slow.start()
        sim.start()  # the others, on time
        assert sim.schedule is not None
        # The validator's seed commit and round-0 heartbeat are early for the slow miner at genesis (the
        # other miner's are too, but anyone can make a miner's key, so they are not counted).
        behind = sim.wait_until(lambda: (sim.get(SLOW, "/status") or {}).get("clock_behind"),
                                sim.schedule.genesis_ts - time.time() + 90, "the slow miner's report")
        assert behind["early_validators"] == 1  # the network's one validator
        # each early sender's lead is a lower bound on the lag: a little under it by the delivery time
        assert BEHIND_S - 5 < behind["behind_by_at_least_s"] <= BEHIND_S + 0.5
        with urllib.request.urlopen(f"http://127.0.0.1:{slow.http_port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert any(line.startswith("tessera_clock_behind_seconds ") and float(line.split()[1]) > 0
                   for line in metrics.splitlines())
        for name in ("validator-0", "miner-0"):
            status = sim.get(name, "/status")
            assert status is not None and status["clock_behind"] is None, name
        assert "this node's clock is probably at least" in slow.log_path.read_text(encoding="utf-8")
    assert slow.proc is not None and slow.proc.returncode is not None  # the node itself was stopped
