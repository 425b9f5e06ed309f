"""Simulated nodes forked from one warm interpreter that has imported the node's modules once.

A node process spends most of its start importing torch, transformers and libp2p (about 8 s of CPU
each): sixteen nodes on two cores took 83-94 s to listen, and one SIGKILLed and restarted mid-round
took 33-42 s. `WarmProcess` starts a node as a child of a multiprocessing fork server that has done
those imports already (it is started once per simulator process, on the first node), so a node
listens within a second or two of its start; it is still its own process, with its own pid, log,
signals and exit code, killed and restarted like any other. A `node.sim.peer` (the test and benchmark
peer, about 3 s of CPU to import libp2p) starts the same way, its stdin and stdout a socket each.

The fork server inherits the environment of the process that started it; each node then sets its
own (`env`) before it runs `tessera ROLE --config FILE`. A fork cannot apply LD_PRELOAD, which acts
only when a program is executed: `SimNode` starts such a node with a fresh interpreter instead.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import socket
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
    simulator uses: `pid`, `poll`, `returncode`, `wait`, `send_signal`, `terminate` and `kill`.

    It runs `python -m PROGRAM ARGV` (`program`: a module with a `main(argv)`; `tessera` by default), its
    stdout and stderr appended to `log_path`; `stdin` and `stdout`, where given, are sockets that become
    its stdin and stdout (the caller closes its copies once the process has started)."""

    def __init__(self, argv: Sequence[str], log_path: str, env: dict[str, str], cwd: str,
                 program: str = "node.cli.main", stdin: socket.socket | None = None,
                 stdout: socket.socket | None = None) -> None:
        _context.set_forkserver_preload(PRELOAD)  # read when the fork server starts (warm_up, or the first node)
        self._process = _context.Process(target=_run, args=(program, list(argv), log_path, env, cwd, stdin, stdout),
                                         daemon=False)
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


def _run(program: str, argv: list[str], log_path: str, env: dict[str, str], cwd: str,
         stdin: socket.socket | None, stdout: socket.socket | None) -> None:
    """In the forked child: become `python -m PROGRAM ARGV` and exit with what its `main` returns."""
    die_with_parent()  # the fork server ends with the simulator, and the node with the fork server
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    into = stdin.detach() if stdin is not None else os.open(os.devnull, os.O_RDONLY)
    out = stdout.detach() if stdout is not None else os.dup(log)
    for fd, target in ((into, 0), (out, 1), (log, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115  # multiprocessing left /dev/null there
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)  # OMP_NUM_THREADS in `env` comes too late for the fork server's torch
    code = importlib.import_module(program).main(argv)
    sys.exit(code)


def die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM it if the simulator dies, so no node outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
