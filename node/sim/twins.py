"""Whole rounds of a network in one process: a tiny network fixed here, nodes on one in-memory hub and one
manual clock, moved phase by phase; a node can be stopped and started again on its own files.

`write_network` writes a network directory whose model config, data and expert group are fixed in this file
(not the simulation layout's), so numbers recorded from it stay valid while the layout changes. `Twins.phase(r,
phase)` sets the clock to the phase start and waits until every running node ran that phase and consumed its
gossip; nothing sleeps on the wall clock. Tests drive whole rounds with it, and bench/twins_load.py hundreds of
miners. Every node runs its real duties, storage and blob store, and every message passes the libp2p judge.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from node.duties.succession import Succession
from node.duties.validator import ValidatorDuties
from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime.clock import ManualClock
from node.runtime.config import NodeConfig
from node.runtime.daemon import Node
from node.sim.adversaries import miner_factory
from node.store.blobs import BlobStore
from protocol.check import window
from protocol.identity import Identity, save_identity
from protocol.rounds import PHASES, Phase, Schedule
from protocol.spec import load_spec
from training.data import file_sha256
from training.model import state_hash
from training.tiny import build_tiny_model

GENESIS = datetime(2026, 3, 1, tzinfo=UTC)
MODEL = {
    "vocab_size": 260, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "tie_word_embeddings": False, "num_experts_per_tok": 2,
    "pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258, "num_hidden_layers": 2,
    "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
    "norm_topk_prob": True,
}
WAIT_S = 120.0
"""Seconds of wall time a wait on a few nodes may take before it fails."""


def identity(name: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"tessera-golden:{name}".encode()).digest())


def _arithmetic(count: int, offset: int) -> str:
    lines = []
    for i in range(offset, offset + count):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(json.dumps({"text": f"{a} + {b} = {a + b}; {a} * {b} = {a * b}."}))
    return "\n".join(lines) + "\n"


def write_network(root: Path, validators: int = 2, extra: str = "") -> Path:
    """The network directory: model config, data, and a spec naming a fixed expert group (`extra`:
    TOML tables appended to the spec, e.g. a `[submission]` section)."""
    root.mkdir(parents=True)
    (root / "model.json").write_text(json.dumps(MODEL, sort_keys=True), encoding="utf-8")
    (root / "train.jsonl").write_text(_arithmetic(400, 0), encoding="utf-8")
    (root / "heldout.jsonl").write_text(_arithmetic(60, 100_000), encoding="utf-8")
    base_hash = state_hash(build_tiny_model("qwen3_moe", dict(MODEL), 0))
    entries = "\n".join(f'[[validators]]\nkey = "{identity(f"validator-{i}").node_id}"\nweight = 1.0\n'
                        for i in range(validators))
    spec = f"""name = "golden"
genesis = {GENESIS.isoformat().replace("+00:00", "Z")}
group = {{ "0" = [1, 5], "1" = [2, 6] }}

[timing]
train_s = 40.0
commit_s = 4.0
reveal_s = 8.0
evaluate_s = 8.0
merge_s = 6.0

[model]
family = "qwen3_moe"
config = "model.json"
init_seed = 0
base_hash = "{base_hash}"

[data]
train = ["train.jsonl"]
heldout_sha256 = "{file_sha256(root / "heldout.jsonl")}"
tokenizer = "byte"
seq_len = 32
heldout_sequences = 16
gate_sequences = 32

[training]
inner_steps = 4
batch_size = 4

[aggregation]
outer_lr = 0.5
momentum = 0.5

{entries}{extra}"""
    (root / "spec.toml").write_text(spec, encoding="utf-8")
    return root / "spec.toml"


def phase_done(schedule: Schedule, r: int, phase: Phase) -> float:
    """The earliest time every node can have finished its handler of `phase`: its start, or for REVEAL
    the opening of the seed_reveal window, which validators wait for."""
    if phase is Phase.REVEAL:
        return window("seed_reveal", r, schedule)[0]
    return schedule.phase_window(r, phase)[0]


async def until(condition: Callable[[], bool], what: str, wait_s: float = WAIT_S, poll_s: float = 0.005) -> None:
    """Return once `condition` holds, asked every `poll_s`; AssertionError naming `what` after `wait_s` seconds of
    wall time."""
    deadline = time.monotonic() + wait_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(poll_s)


class Twins:
    """Nodes of one network written by `write_network`, on one MemoryHub and one ManualClock."""

    def __init__(self, root: Path, validators: int = 2, extra: str = "", wait_s: float = WAIT_S) -> None:
        """`wait_s`: how long any one wait on the nodes (a phase, a start, a stop) may take."""
        self.root = root
        self.wait_s = wait_s
        self.spec_path = write_network(root / "net", validators, extra)
        self.spec = load_spec(self.spec_path)
        self.schedule = Schedule.from_spec(self.spec)
        self.clock = ManualClock(self.spec.genesis_ts - 1)  # nodes started one by one all hear round 0
        self.hub = MemoryHub()
        self.nodes: dict[str, Node] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.behaviours: dict[str, str] = {}
        self.miner_settings: dict[str, dict[str, object]] = {}
        self.validator_data: list[Path] = []
        """Validators' `[validator] data`: held-out files of successor specs."""
        self.chained = False
        """Whether nodes run their role's duties inside node.duties.succession, as `tessera miner|validator` does
        (off by default: other tests reach into the role's duties as `node.duties`)."""
        self.unchained: set[str] = set()
        """Nodes that run their role's duties alone all the same (they never change spec)."""

    async def start(self, name: str, behaviour: str = "honest", miner: dict[str, object] | None = None) -> Node:
        """Create and run node `name` ("validator-0", "miner-3") on its own files (kept across restarts);
        `miner`: more of its `[miner]` config, kept across restarts too."""
        role = name.split("-")[0]
        self.behaviours[name] = behaviour
        self.miner_settings[name] = miner = miner if miner is not None else self.miner_settings.get(name, {})
        key = self.root / f"{name}.key"
        if not key.exists():
            save_identity(identity(name), key)
        config = NodeConfig(node={"role": role, "spec": self.spec_path, "key": key, "data_dir": self.root / name},
                            http={"enabled": False}, miner=miner,
                            validator={"heldout": self.root / "net" / "heldout.jsonl", "data": self.validator_data})
        network = self.hub.join(identity(name).node_id, GossipJudge(self.spec, self.clock.now),
                                BlobStore(config.blob_dir))
        duties = miner_factory(behaviour) if role == "miner" else ValidatorDuties
        if self.chained and name not in self.unchained:
            duties = Succession.around(duties)
        node = await Node.create(config, network=network, clock=self.clock, duties=duties)
        self.nodes[name] = node
        waiting = self.clock.sleepers
        task = self.tasks[name] = asyncio.create_task(node.run())
        if self.clock.now() < self.spec.genesis_ts:
            # Before genesis a node has nothing to catch up on, and waits on the clock for genesis. Moving the
            # clock before it got there would make it a node started after genesis, and one alone on the hub
            # would wait CATCH_UP_WAIT_S of wall time for a peer to catch up from.
            await until(lambda: self.clock.sleepers > waiting or task.done(), f"{name} to wait for genesis",
                        self.wait_s)
            if task.done():
                task.result()  # it failed while starting: its error, not a timeout
        return node

    async def stop(self, name: str) -> None:
        """Stop one node (as a kill would, between phases) and take it off the hub."""
        node = self.nodes.pop(name)
        node.stop()
        await asyncio.wait_for(self.tasks.pop(name), self.wait_s)
        del self.hub.nodes[node.ctx.identity.node_id]

    async def restart(self, name: str) -> Node:
        await self.stop(name)
        return await self.start(name, self.behaviours[name])

    async def phase(self, r: int, phase: Phase, after_s: float = 0.0) -> None:
        """Move the clock to `after_s` past the start of `phase` and wait until every node ran it and
        took in its gossip."""
        start = self.schedule.phase_window(r, phase)[0]
        self.clock.set(max(self.clock.now(), start + after_s, phase_done(self.schedule, r, phase)))
        await self.ran(r, phase)

    async def ran(self, r: int, phase: Phase) -> None:
        await until(lambda: all(any((run.round, run.phase) == (r, str(phase)) for run in n.scheduler.runs)
                                for n in self.nodes.values()), f"round {r} {phase}", self.wait_s)
        await until(lambda: all(n.gossip_idle for n in self.nodes.values()), "gossip to be consumed", self.wait_s)

    async def rounds(self, first: int, last: int) -> None:
        """Run every phase of rounds `first`..`last`, then TRAIN of the next (which settles `last`)."""
        for r in range(first, last + 1):
            for phase in PHASES:
                await self.phase(r, phase)
        await self.phase(last + 1, Phase.TRAIN)

    def id(self, name: str) -> str:
        return identity(name).node_id

    async def close(self) -> None:
        for name in list(self.nodes):
            await self.stop(name)
