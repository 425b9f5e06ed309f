"""`Simulation.close()` ends with every node process gone, however often it is interrupted.

Real child processes that ignore SIGTERM (a node stuck in its shutdown) stand in for nodes; a Ctrl-C
(SIGINT) or SIGTERM to the simulator while it waits for them, and more while it kills them, must not
leave any running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.sim.process import SimNode, SimSettings
from node.sim.run import Simulation

pytestmark = pytest.mark.timeout(120)

STUCK = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)")
STOP_TIMEOUT_S = 60.0


@pytest.fixture
def stuck_sim(tmp_path: Path) -> Iterator[Simulation]:
    """A simulation of three running processes that ignore SIGTERM and SIGINT."""
    sim = Simulation(tmp_path, SimSettings(stop_timeout_s=STOP_TIMEOUT_S))
    for i in range(3):
        directory = tmp_path / f"stuck-{i}"
        directory.mkdir()
        node = SimNode(f"stuck-{i}", "miner", "honest", f"{i:064x}", directory, ["miner"], None)
        with node.log_path.open("ab") as log:
            node.proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=log, stderr=subprocess.STDOUT)
        sim.nodes[node.name] = node
    deadline = time.monotonic() + 30
    while not all("ready" in n.log_path.read_text() for n in sim.nodes.values()):
        assert time.monotonic() < deadline, "the stuck processes did not start"
        time.sleep(0.05)
    yield sim
    for node in sim.nodes.values():
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()


def interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_an_interrupt_while_nodes_stop_kills_them_at_once_then_raises(stuck_sim: Simulation) -> None:
    # the handler close() must put back: Python's own, or SIG_IGN where the suite was started as a background job
    handler = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    timer = interrupt_after(0.5)
    with pytest.raises(KeyboardInterrupt):
        stuck_sim.close()
    timer.join()
    assert time.monotonic() - started < STOP_TIMEOUT_S / 2, "the interrupt did not cut the wait short"
    assert [n.name for n in stuck_sim.nodes.values() if n.proc is not None and n.proc.poll() is None] == []
    assert signal.getsignal(signal.SIGINT) is handler


def test_interrupts_while_nodes_are_killed_still_kill_every_node(stuck_sim: Simulation,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C, then a SIGTERM and another Ctrl-C before each SIGKILL (`tessera simulate` turns SIGTERM into
    KeyboardInterrupt)."""
    kill = SimNode.kill

    def interrupted_kill(node: SimNode) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        kill(node)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(SimNode, "kill", interrupted_kill)
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        timer = interrupt_after(0.5)
        with pytest.raises(KeyboardInterrupt):
            stuck_sim.close()
        timer.join()
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [n.name for n in stuck_sim.nodes.values() if n.proc is not None and n.proc.poll() is None] == []
