"""Whole rounds of miner and validator duties on the in-memory network, driven phase by phase by a
ManualClock on a tiny simulation network: validators agree on the global state, the adopted state
lowers the held-out loss, honest miners take the rewards while lazy and garbage miners get nothing
and a logged reason, a validator in the minority re-syncs, and a miner that joins late catches up."""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import torch

from node.duties.validator import ValidatorDuties
from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime.clock import ManualClock
from node.runtime.config import NodeConfig
from node.runtime.daemon import Node
from node.runtime.http import HttpApi
from node.sim.adversaries import miner_factory
from node.sim.layout import SimNetwork, make_sim_network, sim_identity, to_toml
from node.sim.twins import phase_done, write_network
from node.store.blobs import BlobStore
from protocol.identity import save_identity
from protocol.rounds import PHASES, Phase, Schedule
from protocol.spec import apply_settings, load_spec
from training.blob import decode_header
from training.data import file_sha256
from training.device import Int8Linear
from training.state import GlobalExperts
from validator.merge import CANDIDATES
from validator.model import ValidatorModel

pytestmark = pytest.mark.timeout(120)

GENESIS = datetime(2026, 3, 1, tzinfo=UTC)
WAIT_S = 60.0


class Net:
    """Nodes of one simulation network on one MemoryHub and one ManualClock."""

    def __init__(self, sim: SimNetwork, root: Path) -> None:
        self.sim = sim
        self.root = root
        self.spec = load_spec(sim.spec_path)
        self.schedule = Schedule.from_spec(self.spec)
        self.clock = ManualClock(self.spec.genesis_ts)
        self.hub = MemoryHub()
        self.nodes: dict[str, Node] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def add(self, name: str, behaviour: str = "honest") -> Node:
        """Join a node to the hub; `launch` runs it, so nodes launched together hear all gossip."""
        role, index = name.split("-")
        if role == "validator":
            key = self.sim.validator_keys[int(index)]
        else:
            key = self.root / f"{name}.key"
            save_identity(sim_identity(0, "miner", int(index)), key)
        config = NodeConfig(
            node={"role": role, "spec": self.sim.spec_path, "key": key, "data_dir": self.root / name},
            http={"enabled": False},
            validator={"heldout": self.sim.directory / "data" / "heldout.jsonl"},
        )
        node_id = (sim_identity(0, "miner", int(index)).node_id if role == "miner"
                   else self.sim.validator_ids[int(index)])
        network = self.hub.join(node_id, GossipJudge(self.spec, self.clock.now), BlobStore(config.blob_dir))
        duties = miner_factory(behaviour) if role == "miner" else ValidatorDuties
        node = await Node.create(config, network=network, clock=self.clock, duties=duties)
        self.nodes[name] = node
        return node

    def launch(self) -> None:
        for node in list(self.nodes.values())[len(self.tasks):]:
            self.tasks.append(asyncio.create_task(node.run()))

    async def phase(self, r: int, phase: Phase) -> None:
        """Move the clock to the start of `phase` and wait until every node ran it and took in its gossip."""
        self.clock.set(max(self.clock.now(), phase_done(self.schedule, r, phase)))
        await until(lambda: all(any((run.round, run.phase) == (r, str(phase)) for run in n.scheduler.runs)
                                for n in self.nodes.values()), f"round {r} {phase}")
        await until(lambda: all(n.gossip_idle for n in self.nodes.values()), "gossip to be consumed")

    async def rounds(self, count: int) -> None:
        for r in range(count):
            for phase in PHASES:
                await self.phase(r, phase)

    async def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        await asyncio.wait_for(asyncio.gather(*self.tasks), WAIT_S)


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def report(node: Node, r: int) -> dict[str, Any]:
    stored = await node.ctx.storage.round_report(r)
    assert stored is not None, f"no report for round {r}"
    return stored


@pytest.fixture
async def network(tmp_path: Path):
    sim = make_sim_network(tmp_path / "sim", validators=2, genesis=GENESIS)
    net = Net(sim, tmp_path)
    yield net
    await net.stop()


async def test_two_rounds_reward_honest_miners_and_lower_the_loss(network: Net) -> None:
    net = network
    for name in ("validator-0", "validator-1"):
        await net.add(name)
    kinds = {"miner-0": "honest", "miner-1": "honest", "miner-2": "lazy", "miner-3": "garbage"}
    for name, kind in kinds.items():
        await net.add(name, kind)
    net.launch()
    kind_of = {net.nodes[name].ctx.identity.node_id: kind for name, kind in kinds.items()}
    v0, v1 = net.nodes["validator-0"], net.nodes["validator-1"]

    await net.rounds(2)
    await net.phase(2, Phase.TRAIN)  # settles round 1

    heads = []
    for r in (0, 1):
        states = await v0.ctx.storage.global_states(r)
        assert len(states) == 1, states  # both validators published the same state
        assert sorted(states[0].voters) == sorted(net.sim.validator_ids)
        heads.append(states[0].hash)
        r0, r1 = await report(v0, r), await report(v1, r)
        assert r0["global_hash"] == r1["global_hash"] == r0["proposed_hash"] == states[0].hash
        assert r0["global_loss"] < r0["base_loss"], r0
        by_kind = defaultdict(list)
        for m in r0["miners"]:
            by_kind[kind_of[m["id"]]].append(m)
        assert sorted(kind_of[m["id"]] for m in r0["miners"]) == sorted(kinds.values())
        assert all(m["reward"] > 0 and m["verdict"] == "accept" for m in by_kind["honest"]), by_kind["honest"]
        [lazy], [garbage] = by_kind["lazy"], by_kind["garbage"]
        assert (lazy["reward"], lazy["reason"], lazy["loss"]) == (0.0, "no utility", r0["base_loss"])
        assert garbage["reward"] == 0.0 and garbage["verdict"] == "reject"
        assert garbage["reason"].startswith("rejected: "), garbage
        # both validators' gates weighed the same candidates the same way and adopted a change below the current
        # state, by the gate's rule: a candidate replaces the one held only where its gain's interval clears the margin
        gate = r0["gate"]
        assert gate == r1["gate"] and gate["adopted"] in ("merged", "best_single") and gate["refused"] == []
        assert gate["losses"][gate["adopted"]] < gate["losses"]["current"]
        held = "current"
        for name in (c for c in CANDIDATES if c in gate["gains"]):  # in the order of preference
            gain = gate["gains"][name]
            assert gain["against"] == held, gate
            held = name if gain["low"] > net.spec.aggregation.gate_margin else held
        assert held == gate["adopted"]
        honest = {m for m, k in kind_of.items() if k == "honest"}
        best = next(m["id"] for m in r0["miners"] if m["rank"] == 1)
        assert set(states[0].contributors) == (honest if gate["adopted"] == "merged" else {best})
    first, second = await report(v0, 0), await report(v0, 1)
    assert second["base"] == heads[0] and second["base_loss"] < first["base_loss"]  # round 1 built on round 0
    api = await HttpApi.start(v0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{api.url}/rounds") as response:
                assert await response.json() == [first, second]
            async with session.get(f"{api.url}/rounds/1") as response:
                assert await response.json() == second
            for path, status in (("7", 404), ("-1", 400), ("x", 400)):
                async with session.get(f"{api.url}/rounds/{path}") as response:
                    assert response.status == status
    finally:
        await api.close()
    assert await net.nodes["miner-0"].rounds() == []

    ledger = await v0.ctx.storage.rewards()
    assert ledger.as_dict() == (await v1.ctx.storage.rewards()).as_dict()
    assert {kind_of[e.miner] for e in ledger.entries if e.points > 0} == {"honest"}
    assert {kind_of[m] for m in ledger.standings} == {"honest"}
    for node in net.nodes.values():
        assert await node.ctx.storage.head() == heads[1]  # every node adopted round 1's state


async def test_a_diverging_validator_resyncs_and_a_late_miner_catches_up(tmp_path: Path) -> None:
    sim = make_sim_network(tmp_path / "sim", validators=2, genesis=GENESIS)
    spec = tomllib.loads(sim.spec_path.read_text(encoding="utf-8"))
    spec["validators"][0]["weight"] = 2.0
    # momentum must matter to drift: at lr 0.7 a step of 1.05 times the two miners' averaged update is the gate's
    # pick (a lone contributor's merged state would be its submission, with no momentum in it)
    apply_settings(spec, [("aggregation.momentum", 0.5), ("aggregation.outer_lr", 0.7)])
    sim.spec_path.write_text(to_toml(spec), encoding="utf-8")
    net = Net(sim, tmp_path)
    try:
        v0, v1 = await net.add("validator-0"), await net.add("validator-1")
        assert net.spec.validator_weights[sim.validator_ids[0]] == 2.0  # validator-0 alone is a majority
        await net.add("miner-0")
        await net.add("miner-2")
        net.launch()
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        late = await net.add("miner-1")  # joins in EVALUATE of round 0
        net.launch()
        await net.phase(0, Phase.EVALUATE)
        genesis = v1.duties.state
        assert isinstance(genesis, GlobalExperts)
        # validator-1's momentum drifts: it adopts another state than validator-0's
        v1.duties.state = GlobalExperts(spec=genesis.spec, round=genesis.round, parent=genesis.parent,
                                        tensors=genesis.tensors,
                                        momentum={n: torch.ones_like(t) for n, t in genesis.momentum.items()})
        await net.phase(0, Phase.MERGE)
        votes = {s.hash: s.voters for s in await v0.ctx.storage.global_states(0)}
        # validator-0's gate adopts the merged state; validator-1's, drifted far off, the miner's own experts
        assert [(await report(v, 0))["gate"]["adopted"] for v in (v0, v1)] == ["merged", "best_single"]
        assert len(votes) == 2
        adopted = next(h for h, voters in votes.items() if voters == (sim.validator_ids[0],))
        assert (await report(v1, 0))["proposed_hash"] != adopted

        await net.phase(1, Phase.TRAIN)
        for node in (v0, v1, late):
            assert await node.ctx.storage.head() == adopted
        assert v1.duties.synced and v1.duties.state.hash == adopted
        assert await v1.ctx.storage.momentum() == await v0.ctx.storage.momentum()
        for name, tensor in v0.duties.state.momentum.items():
            assert torch.equal(v1.duties.state.momentum[name], tensor)
        assert (await report(v1, 0))["global_hash"] == adopted
        submission = await late.ctx.storage.submission(1)
        assert submission is not None
        blob = late.ctx.blobs.path(submission.hash).read_bytes()
        # the late miner trained from the adopted head
        assert decode_header(blob, net.spec.limits.max_header_bytes).meta.base == adopted
    finally:
        await net.stop()


def test_a_validator_refuses_a_held_out_file_the_spec_does_not_pin(tmp_path: Path) -> None:
    sim = make_sim_network(tmp_path / "sim", validators=1, genesis=GENESIS)
    wrong = tmp_path / "heldout.jsonl"
    wrong.write_text('{"text": "1 + 1 = 2"}\n', encoding="utf-8")
    config = NodeConfig(node={"role": "validator", "spec": sim.spec_path, "data_dir": tmp_path / "v"},
                        validator={"heldout": wrong})
    ctx = SimpleNamespace(config=config, spec=load_spec(sim.spec_path))
    with pytest.raises(ValueError, match=r"validator.heldout: .* but the spec pins data.heldout_sha256"):
        ValidatorDuties(ctx)  # type: ignore[arg-type]


def test_a_validator_refuses_a_held_out_file_that_shares_documents_with_the_training_files(tmp_path: Path) -> None:
    spec_path = write_network(tmp_path / "net")
    heldout = tmp_path / "net" / "heldout.jsonl"
    before = file_sha256(heldout)
    train_line = (tmp_path / "net" / "train.jsonl").read_text(encoding="utf-8").splitlines()[3]
    heldout.write_text(heldout.read_text(encoding="utf-8") + train_line + "\n", encoding="utf-8")
    spec_path.write_text(spec_path.read_text(encoding="utf-8").replace(before, file_sha256(heldout)), encoding="utf-8")
    config = NodeConfig(node={"role": "validator", "spec": spec_path, "data_dir": tmp_path / "v"},
                        validator={"heldout": heldout})
    ctx = SimpleNamespace(config=config, spec=load_spec(spec_path))
    with pytest.raises(ValueError, match=r"validator.heldout: .*shares 1 document\(s\) with the training data; "
                                         r"a held-out file must share nothing"):
        ValidatorDuties(ctx)  # type: ignore[arg-type]


def test_a_validator_holds_the_general_domain_file_exactly_where_the_spec_pins_one(tmp_path: Path) -> None:
    spec_path = write_network(tmp_path / "net")
    general = tmp_path / "net" / "general.jsonl"
    general.write_text('{"text": "The river runs past the mill."}\n', encoding="utf-8")
    heldout = tmp_path / "net" / "heldout.jsonl"

    def duties(spec_file: Path, **validator: Path) -> None:
        config = NodeConfig(node={"role": "validator", "spec": spec_file, "data_dir": tmp_path / "v"},
                            validator={"heldout": heldout, **validator})
        ValidatorDuties(SimpleNamespace(config=config, spec=load_spec(spec_file)))  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"validator.general: the spec pins no general-domain held-out file"):
        duties(spec_path, general=general)
    pinned = tmp_path / "net" / "pinned.toml"
    text = spec_path.read_text(encoding="utf-8")
    pinned.write_text(text.replace("[data]\n", f'[data]\ngeneral_sha256 = "{file_sha256(general)}"\n'),
                      encoding="utf-8")
    with pytest.raises(ValueError, match=r"validator.general: the spec pins a general-domain held-out file"):
        duties(pinned)
    with pytest.raises(ValueError, match=r"validator.general: .* hashes to .*, but the spec pins data.general_sha256"):
        duties(pinned, general=heldout)


def test_a_validator_set_to_int8_weights_scores_with_its_frozen_layers_in_int8(tmp_path: Path) -> None:
    spec_path = write_network(tmp_path / "net")
    config = NodeConfig(node={"role": "validator", "spec": spec_path, "data_dir": tmp_path / "v"},
                        validator={"heldout": tmp_path / "net" / "heldout.jsonl", "weights": "int8"})
    section = config.validator
    assert section.heldout is not None
    loaded = ValidatorModel.load(load_spec(spec_path), spec_path, section.heldout, None, section.device,
                                 section.batch_size, section.weights)
    assert any(isinstance(module, Int8Linear) for module in loaded.scorer.model.modules())
