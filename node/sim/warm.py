"""Simulated nodes forked from one warm interpreter that has imported the node's modules once.

A node process spends most of its start importing torch, transformers and libp2p (about 8 s of CPU
each): sixteen nodes on two cores took 83-94 s to listen, and one SIGKILLed and restarted mid-round
took 33-42 s. `WarmProcess` starts a node as a child of a multiprocessing fork server that has done
those imports already (it is started once per simulator process, on the first node), so a node
listens within a second or two of its start; it is still its own process, with its own pid, log,
signals and exit code, killed and restarted like any other.

The fork server inherits the environment of the process that started it; each node then sets its
own (`env`) before it runs `tessera ROLE --config FILE`. A fork cannot apply LD_PRELOAD, which acts
only when a program is executed: `SimNode` starts such a node with a fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

# The modules every node imports before it listens. Importing them in the fork server starts no thread
# (tests/test_layering.py checks that no module does at import), so the fork is safe.
PRELOAD = ["torch", "transformers", "node.cli.main", "node.cli.daemon", "node.runtime.daemon",
           "node.duties.miner", "node.duties.validator", "node.net.p2p", "training.tiny"]

_context = multiprocessing.get_context("forkserver")


def warm_up() -> None:
    """Start the fork server and wait until it has imported PRELOAD (seconds on an idle machine, once per
    simulator process), so that a schedule computed afterwards does not spend its start delay on imports."""
    _context.set_forkserver_preload(PRELOAD)
    ready = _context.Process(target=_nothing)
    ready.start()
    ready.join()


def _nothing() -> None:
    """A fork server's first child, which has nothing to do."""


class WarmProcess:
    """A node forked from the warm fork server, with the part of `subprocess.Popen`'s interface the
    simulator uses: `pid`, `poll`, `returncode`, `wait`, `send_signal`, `terminate` and `kill`."""

    def __init__(self, argv: Sequence[str], log_path: str, env: dict[str, str], cwd: str) -> None:
        _context.set_forkserver_preload(PRELOAD)  # read when the fork server starts (warm_up, or the first node)
        self._process = _context.Process(target=_run_node, args=(list(argv), log_path, env, cwd), daemon=False)
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once it has exited (negative: killed by that signal), else None."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"node {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_node(argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """In the forked child: become the node, as `python -m node.cli ARGV` would, and exit with its code."""
    from node.sim.process import die_with_parent

    die_with_parent()  # the fork server ends with the simulator, and the node with the fork server
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)  # OMP_NUM_THREADS in `env` comes too late for the fork server's torch
    from node.cli.main import main

    sys.exit(main(argv))
