"""Behaviour-unchanged proof: whole rounds on the in-memory twins give the recorded numbers exactly.

Two validators and four miners (two honest, one lazy, one garbage) run three rounds of a tiny
qwen3_moe model whose config, data and expert group are fixed in tests/node/twins.py, with a fixed
number of inner steps, a ManualClock moved phase by phase, and validator seeds drawn from a counter
instead of the OS. Every loss, rank, reward, submission and state hash is compared with
`golden_rounds.json`, first captured before the one-pass redesign (commit 7069fea) and recorded again
once when every spec field entered the network id and tiny models stopped patching torch's init, and
once more when MERGE went through the merge gate (its new spec fields changed the network id, and the gate
adopts the best single submission in every round here), and once when two learning settings left the spec
and two defaults changed (the network id changed; every loss, rank and reward stayed), and once when the
miners' AdamW beta1 defaulted to 0.6561 (every trained loss moved; the gate's picks stayed).
The numbers depend on the CPU's vector instructions, as on torch's thread count: MKL's and ATen's kernels
sum in another order, and the trained bytes differ. `golden_rounds.json` was recorded where torch runs its
AVX2 kernels, `golden_rounds_avx512.json` where it runs AVX-512 ones (an AVX-512 and AMX Xeon, at 2f73518,
whose rounds there were byte for byte those of cb3bf0e); a CPU with neither recording skips the test.
Regenerate only when a change of behaviour is intended, each recording on its kind of CPU:
    .venv/bin/python -c "import asyncio, pathlib, tempfile, json, torch; torch.set_num_threads(2); \
from tests.node.duties.test_rounds_golden import scenario; \
print(json.dumps(asyncio.run(scenario(pathlib.Path(tempfile.mkdtemp()))), indent=1, sort_keys=True))"
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import node.duties.validator as validator_duties
from node.duties.validator import ValidatorDuties
from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime.clock import ManualClock
from node.runtime.config import NodeConfig
from node.runtime.daemon import Node
from node.sim.adversaries import miner_factory
from node.store.blobs import BlobStore
from protocol.identity import save_identity
from protocol.rounds import PHASES, Phase, Schedule
from protocol.spec import load_spec
from tests.node.twins import WAIT_S, identity, phase_done, until, write_network

pytestmark = pytest.mark.timeout(180)

RECORDED_THREADS = 2
RECORDINGS = {"AVX2": "golden_rounds.json", "AVX512": "golden_rounds_avx512.json"}
"""torch's CPU capability -> the rounds recorded on such a CPU."""
ROUNDS = 3
MINERS = {"miner-0": "honest", "miner-1": "honest", "miner-2": "lazy", "miner-3": "garbage"}


async def scenario(tmp_path: Path) -> dict[str, Any]:
    """Run the rounds and return everything that must not change."""
    counter = itertools.count()
    os_seed, validator_duties.new_seed = validator_duties.new_seed, lambda: hashlib.sha256(
        f"golden-seed:{next(counter)}".encode()).hexdigest()
    try:
        return await _run(tmp_path)
    finally:
        validator_duties.new_seed = os_seed


async def _run(tmp_path: Path) -> dict[str, Any]:
    spec_path = write_network(tmp_path / "net")
    spec = load_spec(spec_path)
    schedule = Schedule.from_spec(spec)
    clock = ManualClock(spec.genesis_ts)
    hub = MemoryHub()
    nodes: dict[str, Node] = {}
    for name in ["validator-0", "validator-1", *MINERS]:
        role = name.split("-")[0]
        key = tmp_path / f"{name}.key"
        save_identity(identity(name), key)
        config = NodeConfig(node={"role": role, "spec": spec_path, "key": key, "data_dir": tmp_path / name},
                            http={"enabled": False}, miner={"behaviour": MINERS.get(name, "honest")},
                            validator={"heldout": tmp_path / "net" / "heldout.jsonl"})
        network = hub.join(identity(name).node_id, GossipJudge(spec, clock.now), BlobStore(config.blob_dir))
        duties = miner_factory(MINERS[name]) if role == "miner" else ValidatorDuties
        nodes[name] = await Node.create(config, network=network, clock=clock, duties=duties)
    tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
    try:
        for r in range(ROUNDS):
            for phase in PHASES:
                clock.set(phase_done(schedule, r, phase))
                await until(lambda r=r, phase=phase: all(  # type: ignore[misc]
                    any((run.round, run.phase) == (r, str(phase)) for run in n.scheduler.runs) for n in nodes.values()),
                    f"round {r} {phase}")
                await until(lambda: all(n.gossip_idle for n in nodes.values()), "gossip to be consumed")
        clock.set(schedule.phase_window(ROUNDS, Phase.TRAIN)[0])
        await until(lambda: all(any(run.round == ROUNDS for run in n.scheduler.runs) for n in nodes.values()),
                    "the last round to settle")
        return await _observe(nodes)
    finally:
        for n in nodes.values():
            n.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)


async def _observe(nodes: dict[str, Node]) -> dict[str, Any]:
    name_of = {n.ctx.identity.node_id: name for name, n in nodes.items()}
    v0 = nodes["validator-0"]
    rounds = []
    for r in range(ROUNDS):
        commits = {name_of[c.miner]: c.commitment for c in await v0.ctx.storage.commits_for(r)}
        states = {s.hash: sorted(name_of[v] for v in s.voters) for s in await v0.ctx.storage.global_states(r)}
        reports = {}
        for name in ("validator-0", "validator-1"):
            report = await nodes[name].round_report(r)
            assert report is not None
            report["miners"] = {name_of[m.pop("id")]: m for m in report["miners"]}
            reports[name] = report
        rounds.append({"commits": commits, "states": states, "reports": reports})
    ledgers = {name: (await nodes[name].rewards()) for name in ("validator-0", "validator-1")}
    for ledger in ledgers.values():
        ledger["entries"] = [{**e, "miner": name_of[e["miner"]]} for e in ledger["entries"]]
        ledger["standings"] = {name_of[m]: s for m, s in ledger["standings"].items()}
    heads = {name: await n.ctx.storage.head() for name, n in nodes.items()}
    return {"rounds": rounds, "rewards": ledgers, "heads": heads}


async def test_whole_rounds_reproduce_the_recorded_losses_ranks_rewards_and_states(tmp_path: Path) -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in RECORDINGS:
        pytest.skip(f"no rounds recorded on a CPU whose torch kernels are {capability} (module docstring)")
    expected = json.loads(Path(__file__).with_name(RECORDINGS[capability]).read_text(encoding="utf-8"))
    # The numbers were recorded on two intra-op threads: a matrix product's sums run in another order on one,
    # and the trained bytes differ. The suite runs torch on one thread a worker (the Makefile).
    threads = torch.get_num_threads()
    torch.set_num_threads(RECORDED_THREADS)
    try:
        actual = json.loads(json.dumps(await scenario(tmp_path)))
    finally:
        torch.set_num_threads(threads)
    assert len(set(actual["heads"].values())) == 1, actual["heads"]  # every node ends on one state
    for r, (got, want) in enumerate(zip(actual["rounds"], expected["rounds"], strict=True)):
        assert got == want, f"round {r} differs"
    assert actual == expected
