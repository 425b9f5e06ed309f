"""The pieces of a process simulation: `SimSettings` (its shape and timing) and `SimNode` (one child).

A `SimNode` knows how to start its `tessera` process with a clean environment (no TESSERA_*
variables, one torch thread) logging to its own file, and how to stop or kill it; a child dies
with the simulator. This module knows nothing about what the nodes do; node.sim.run drives them.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from node.sim import defaults
from node.sim.warm import WarmProcess, die_with_parent
from protocol.spec import FAMILIES, TimingSpec, judge_settings

ADVERSARY_KINDS = ("lazy", "noise", "copier", "late", "garbage")
"""The adversarial miners' behaviours: node.sim.adversaries' strategies but the honest one (named here, where
`tessera simulate`'s arguments are checked, without the miner's imports)."""
ADVERSARY_PROGRAM = "node.sim.adversaries"
"""The program of an adversarial miner: `tessera miner` playing the behaviour its first argument names."""
# How the time after TRAIN is split between the other phases.
AFTER_TRAIN_SHARES = {"commit_s": 0.2, "reveal_s": 0.33, "evaluate_s": 0.3, "merge_s": 0.17}
MIN_AFTER_TRAIN_S = 6.0
DEFAULT_SKEW_S: float = TimingSpec.model_fields["clock_skew_s"].default
MAX_START_DELAY_S = 86400.0
MAX_VALIDATORS = 64  # a simulation runs on one machine; every validator's key goes into the spec
ROOT = Path(__file__).resolve().parents[2]


class SimulationError(RuntimeError):
    """A simulated node died, or the network did not reach a round in time; the message says which."""


@dataclass(frozen=True)
class SimSettings:
    """The shape and timing of a local simulation."""

    validators: int = defaults.VALIDATORS
    """Validator processes (equal weight)."""
    miners: int = defaults.MINERS
    """Miner processes, adversaries included."""
    adversaries: tuple[str, ...] = ()
    """Kinds of the adversarial miners (the last ones), from ADVERSARY_KINDS."""
    round_seconds: float = defaults.ROUND_SECONDS
    """Length of a round."""
    train_share: float = defaults.TRAIN_SHARE
    """TRAIN's share of the round; the rest goes to COMMIT, REVEAL, EVALUATE, MERGE."""
    inner_steps: int = defaults.INNER_STEPS
    """H written into the spec. Miners that trained until TRAIN ended (thousands of steps on a small shard)
    overfit it: after round 0 they gained less than the held-out noise, and in rounds 3 and 5 no submission
    beat the state (docs/architecture.md, "A simulation learns every round"). At 30 steps a round every round
    of a 6-round run lowers the whole held-out loss (bench/results/simulation.json)."""
    start_delay_s: float | None = None
    """Seconds from writing the spec to genesis; None = defaults.START_DELAY_S + defaults.START_DELAY_PER_NODE_S per node. The nodes'
    fork server has imported torch by then (node.sim.warm); each node still loads its model and starts libp2p."""
    base_port: int = 0
    """First TCP port (each node takes two: p2p, http); 0 picks free ports below the ephemeral range."""
    seed: int = defaults.SEED
    """Seed of the model, data and keys."""
    family: str = defaults.FAMILY
    """Model family of the tiny pretrained base (`protocol.spec.FAMILIES`)."""
    submission_format: Literal["experts", "pgrad"] = defaults.FORMAT
    """What miners submit: full experts, or compressed pseudo-gradients (the spec's `[submission]`)."""
    spec_settings: tuple[tuple[str, Any], ...] = ()
    """(`section.field`, value) pairs written into the spec after everything else (timing, inner_steps, the
    format), in the spec's settable sections; judged by `protocol.spec.judge_settings` (`parse_setting` reads
    them from a command line)."""
    stop_timeout_s: float = 20.0
    """How long a node may take to stop after SIGTERM before it gets SIGKILL."""

    def __post_init__(self) -> None:
        if not 1 <= self.validators <= MAX_VALIDATORS:
            raise ValueError(f"a simulation takes 1 to {MAX_VALIDATORS} validators, got {self.validators}")
        if self.miners < 0:
            raise ValueError(f"miners must be >= 0, got {self.miners}")
        unknown = sorted(set(self.adversaries) - set(ADVERSARY_KINDS))
        if unknown:
            raise ValueError(f"unknown adversary kind(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(ADVERSARY_KINDS)}")
        if len(self.adversaries) > self.miners:
            raise ValueError(f"{len(self.adversaries)} adversaries but only {self.miners} miners")
        # Messages name the options of `tessera simulate` (and bench/simulation.py), which set these fields.
        if not 0 < self.round_seconds < math.inf:
            raise ValueError(f"--round-seconds must be a positive finite number of seconds, got {self.round_seconds}")
        if not 0 < self.train_share < 1:
            raise ValueError(f"--train-share must be between 0 and 1, got {self.train_share}")
        if self.start_delay_s is not None and not 0 <= self.start_delay_s <= MAX_START_DELAY_S:
            raise ValueError(f"--start-delay must be from 0 to {MAX_START_DELAY_S:.0f} seconds (a day), "
                             f"got {self.start_delay_s}")
        nodes = 1 + self.validators + self.miners  # a bootstrap, then two ports a node
        last = 65536 - 2 * nodes
        if self.base_port != 0 and not 1 <= self.base_port <= last:
            raise ValueError(f"--base-port must be 0 (free ports) or from 1 to {last}, so that the {nodes} nodes' "
                             f"{2 * nodes} ports fit below 65536, got {self.base_port}")
        if (1 - self.train_share) * self.round_seconds < MIN_AFTER_TRAIN_S - 1e-9:
            raise ValueError(f"only {(1 - self.train_share) * self.round_seconds:.1f} s of a round left after "
                             f"TRAIN; give commit, reveal, evaluate and merge {MIN_AFTER_TRAIN_S:.0f} s or more")
        if self.family not in FAMILIES:
            raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {self.inner_steps}")
        judge_settings(self.spec_settings)  # now, before anything is written

    def timing(self) -> dict[str, float]:
        rest = (1 - self.train_share) * self.round_seconds
        timing = {"train_s": round(self.train_share * self.round_seconds, 3)}
        timing |= {name: round(share * rest, 3) for name, share in AFTER_TRAIN_SHARES.items()}
        # The spec's default skew, unless REVEAL is too short for seeds to wait 2 x skew (protocol.check.window)
        return timing | {"clock_skew_s": min(DEFAULT_SKEW_S, math.floor(timing["reveal_s"] / 4 * 1000) / 1000)}

    def miner_kinds(self) -> list[str]:
        return ["honest"] * (self.miners - len(self.adversaries)) + list(self.adversaries)

    def delay_s(self) -> float:
        nodes = 1 + self.validators + self.miners
        return self.start_delay_s if self.start_delay_s is not None else defaults.START_DELAY_S + defaults.START_DELAY_PER_NODE_S * nodes


@dataclass
class SimNode:
    """One node process: how to start it, where it logs, and the process while it runs."""

    name: str
    role: str
    kind: str
    node_id: str
    directory: Path
    args: list[str]
    """What follows the program on its command line: the role and `--config FILE` (an adversary's behaviour
    before them)."""
    http_port: int | None
    program: str = "node.cli.main"
    """The module whose `main(args)` the process runs: `tessera` itself, or a test's wrapper around it."""
    proc: subprocess.Popen[bytes] | WarmProcess | None = None
    stopped_on_purpose: bool = False
    starts: int = 0

    @property
    def log_path(self) -> Path:
        return self.directory / "log.txt"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def died(self) -> bool:
        """Exited without being told to."""
        return self.proc is not None and self.proc.poll() is not None and not self.stopped_on_purpose

    @property
    def command(self) -> list[str]:
        """The node as a program of its own: `python -m node.cli ARGS` (or its `program`)."""
        return [sys.executable, "-m", "node.cli" if self.program == "node.cli.main" else self.program, *self.args]

    def start(self) -> None:
        """Start the node, forked from the warm fork server (node.sim.warm), or, where the environment
        asks for a preloaded library (LD_PRELOAD, which only an exec applies), as a fresh interpreter."""
        assert not self.alive, f"{self.name} is already running"
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TESSERA_")}
        # Many torch processes share few cores: one thread each avoids oversubscription.
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts} at {datetime.now(UTC).isoformat()} ---\n".encode())
            log.flush()
            if env.get("LD_PRELOAD"):
                self.proc = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
            else:
                self.proc = WarmProcess(self.args, str(self.log_path), env, str(ROOT), self.program)
        self.starts += 1
        self.stopped_on_purpose = False

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds."""
        self.stopped_on_purpose = True
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self.stopped_on_purpose = True
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(30)


@contextlib.contextmanager
def interrupts_noted() -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM are appended to the yielded list instead of handled.

    For clean-up that must finish: a Ctrl-C there would otherwise raise KeyboardInterrupt half-way
    and leave node processes running. Only the main thread can set handlers; elsewhere the list
    stays empty and signals are handled as before."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: noted.append(signum)) for signum in signums}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def first_listen_port() -> int:
    """Where a simulation starts looking for listening ports: a random port below the kernel's
    ephemeral range.

    Ports for outgoing connections (every libp2p dial) and for binds to port 0 come from that range,
    so a port picked there now could be taken before its node listens on it, seconds later; below it,
    only another listener can take it."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return random.randrange(10_000, max(10_001, low - 2_000))


def next_free_port(port: int) -> int:
    """The first TCP port from `port` on that 127.0.0.1 lets us bind now."""
    while port < 65_536:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                port += 1
                continue
            return port
    raise SimulationError("no free TCP port left on 127.0.0.1")
