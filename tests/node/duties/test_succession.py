"""The next expert group without a flag day, on the in-memory twins: a successor signed by both validators and
offered to one is taken in by every node over gossip, and at its activation round every node changes group
without a restart, on the state adopted at the end of the round before; the ledger goes on, and a compressed miner
loads the new group's experts. A successor signed by too few validators, naming another predecessor, activating in
a round begun or too soon, or naming experts the model lacks is refused in one line and changes nothing; a miner
that keeps the old group is refused with one reason; a validator restarted in the activation round, a miner
restarted after it and a miner that joins after it all end on the same spec and state as the others."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest

from node.cli.main import main
from node.runtime.daemon import Node
from node.runtime.status import StatusViews
from node.sim.twins import Twins, identity
from protocol.messages import Successor
from protocol.rounds import Phase
from protocol.spec import NetworkSpec
from protocol.successor import GRACE_ROUNDS, SuccessorDocument, draft, load_document
from training.blob import read_header
from training.data import file_sha256

pytestmark = pytest.mark.timeout(300)

NEXT_GROUP = {0: [3, 7], 1: [0, 4]}  # disjoint from the twins' {0: [1, 5], 1: [2, 6]}
ACTIVATION = 3


def _records(count: int, offset: int) -> str:
    return "".join(json.dumps({"text": f"item {i % 13}: qty {(i * 31) % 97}, price {(i * 17) % 53}.50, "
                                       f"code X{(i * 7) % 11}."}) + "\n" for i in range(offset, offset + count))


def successor_network(net: Twins) -> SuccessorDocument:
    """The second domain's files beside the spec, the validators' held-out file of it, and an unsigned document
    that trains NEXT_GROUP on it from ACTIVATION."""
    (net.root / "net" / "train2.jsonl").write_text(_records(400, 0), encoding="utf-8")
    (net.root / "net" / "heldout2.jsonl").write_text(_records(60, 100_000), encoding="utf-8")
    net.validator_data = [net.root / "net" / "heldout2.jsonl"]
    net.chained = True
    return draft(net.spec, ACTIVATION, NEXT_GROUP, {"data": {
        "train": ["train2.jsonl"], "heldout_sha256": file_sha256(net.root / "net" / "heldout2.jsonl")}})


def signed(document: SuccessorDocument, *validators: int) -> SuccessorDocument:
    for i in validators:
        document = document.signed_by(identity(f"validator-{i}"))
    return document


def spec_of(node: Node) -> NetworkSpec:
    return node.duties.spec  # type: ignore[attr-defined, no-any-return]  # a Succession


async def heads(net: Twins) -> set[str | None]:
    return {await node.ctx.storage.head() for node in net.nodes.values()}


async def adopted(node: Node, round: int) -> str | None:
    return next((s.hash for s in await node.ctx.storage.global_states(round) if s.adopted), None)


async def test_the_group_changes_at_its_activation_round_on_every_node_without_a_restart(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    document = successor_network(net)
    net.unchained = {"miner-2"}  # runs the genesis spec's duties alone: it keeps training the old group
    try:
        compressed = {"forward": "compressed"}  # holds only its group's experts: the new group's, after the switch
        nodes = [await net.start(name, miner=compressed if name == "miner-1" else None)
                 for name in ("validator-0", "validator-1", "miner-0", "miner-1", "miner-2")]
        await net.phase(0, Phase.TRAIN)
        v0, v1, m0 = nodes[0], nodes[1], nodes[2]
        few = signed(document, 0)  # half the weight is not a majority; offered over gossip by a miner
        m0.ctx.network.serve(m0.ctx.blobs.put_bytes(few.to_bytes()))
        await m0.ctx.publish(Successor(round=0, document=_address(few), size=len(few.to_bytes())))
        refused = await v0.offer_successor(few.to_bytes())
        assert refused["verdict"] == "refuse" and refused["reason"].startswith("signed by 1 of 2 validators")
        accepted = await v0.offer_successor(signed(document, 0, 1).to_bytes())
        assert accepted["verdict"] == "accept" and accepted["activation"] == ACTIVATION, accepted
        await net.phase(0, Phase.COMMIT)  # offers are judged at a phase start
        for node in nodes[:4]:
            verdicts = {s.document: (s.verdict, s.reason) for s in await node.ctx.storage.successors()}
            assert verdicts[accepted["document"]] == ("accept", "")
            if node not in (m0, v0):  # v0 refused it as offered to it, and said so once
                assert verdicts[_address(few)][0] == "refuse", verdicts
        due = (await StatusViews(v1).status())["spec"]["successor"]
        assert (due["activation"], due["signed_by"], due["validators"]) == (ACTIVATION, 2, 2)
        assert due["in_s"] == pytest.approx(net.schedule.round_start(ACTIVATION) - net.clock.now())
        genesis_id = net.spec.network_id

        await net.rounds(0, ACTIVATION + 1)
        base = await adopted(v0, ACTIVATION - 1)
        assert base is not None
        for node in nodes[:4]:
            spec = spec_of(node)
            assert spec.group == NEXT_GROUP and spec.lineage is not None
            assert (spec.lineage.base, spec.lineage.predecessor, spec.gossip_id) == (base, genesis_id, genesis_id)
        successor_id = spec_of(v0).network_id
        assert {spec_of(n).network_id for n in nodes[:4]} == {successor_id}
        for r in range(ACTIVATION + 2):  # every round ends on one state on every chained node
            states = {await adopted(n, r) for n in nodes[:4]}
            assert len(states) == 1 and None not in states, (r, states)
            meta = read_header(v0.ctx.blobs.path(states.pop()), 1 << 20).meta
            assert (meta.group, meta.network) == ((NEXT_GROUP, successor_id) if r >= ACTIVATION
                                                  else (net.spec.group, genesis_id))
        late = await v0.round_report(ACTIVATION)
        assert late is not None
        for r in (ACTIVATION, ACTIVATION + 1):  # both miners of the new group, the compressed one too, are scored
            report = await v0.round_report(r)
            assert report is not None
            verdicts = {m["id"]: m["verdict"] for m in report["miners"]}
            assert verdicts[net.id("miner-0")] == verdicts[net.id("miner-1")] == "accept", (r, report["miners"])
        old = next(m for m in late["miners"] if m["id"] == net.id("miner-2"))
        assert old["verdict"] == "reject" and old["reason"].startswith("rejected: old expert group: a submission for the "
                                                              "spec that ended at round 2"), old
        ledger = (await v0.rewards())["entries"]
        assert {e["round"] for e in ledger} >= set(range(ACTIVATION + 2))  # the ledger goes on across the switch
        alpha = net.spec.rewards.ema_alpha
        for miner in (net.id("miner-0"), net.id("miner-1")):
            before = next(e["standing"] for e in ledger if e["miner"] == miner and e["round"] == ACTIVATION - 1)
            after = next(e for e in ledger if e["miner"] == miner and e["round"] == ACTIVATION)
            assert after["standing"] == pytest.approx((1 - alpha) * before + alpha * after["points"])
        await exported_provenance_names_both_groups(net, v0, base)
        await the_next_group_is_chosen_from_the_adopted_state(net, v0)
    finally:
        await net.close()


async def exported_provenance_names_both_groups(net: Twins, v0: Node, base: str) -> None:
    """`tessera export` of the final state: every expert of both groups with the round and state that last changed
    it; the others never trained."""
    head = await v0.ctx.storage.head()
    assert head is not None
    out = net.root / "export"
    argv = ["export", "--spec", str(net.spec_path), "--state", head, "--data-dir", str(v0.ctx.config.node.data_dir),
            "--out", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    provenance = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
    successor = spec_of(v0).network_id
    assert [s["spec"] for s in provenance["specs"]] == [net.spec.network_id, successor]
    experts = provenance["experts"]
    assert len(experts) == 2 * 8 * 2  # every expert tensor of the model: layers x experts x (gate_up, down)
    base_round = next(s.round for s in await v0.ctx.storage.global_states() if s.hash == base)
    for layer, ids in NEXT_GROUP.items():
        for e in ids:
            record = experts[f"layers.{layer}.experts.{e}.down_proj"]
            assert (record["spec"], record["round"], record["state"]) == (successor, ACTIVATION + 1, head)
            assert record["contributors"]
    for layer, ids in net.spec.group.items():
        for e in ids:
            record = experts[f"layers.{layer}.experts.{e}.gate_up_proj"]
            assert (record["spec"], record["round"], record["state"]) == (net.spec.network_id, base_round, base)
    assert experts["layers.0.experts.0.down_proj"] == {"trained": False}


async def the_next_group_is_chosen_from_the_adopted_state(net: Twins, v0: Node) -> None:
    """`select-experts --state` measures the node's model and, with --disjoint, leaves out the group trained now;
    `spec successor --data-dir` drafts its successor after the spec the node runs."""
    group = net.root / "group3.json"
    data_dir = str(v0.ctx.config.node.data_dir)
    argv = ["select-experts", "--spec", str(net.spec_path), "--data", str(net.root / "net" / "train.jsonl"),
            "--rule", "gate-mass", "--top-d", "2", "--state", data_dir, "--disjoint", "--out", str(group)]
    assert await asyncio.to_thread(main, argv) == 0
    chosen = json.loads(group.read_text(encoding="utf-8"))
    assert chosen["state"] == await v0.ctx.storage.head()
    assert all(not set(ids) & set(NEXT_GROUP[int(layer)]) for layer, ids in chosen["group"].items())
    out = net.root / "third.toml"
    later = max(ACTIVATION + 1, net.schedule.round_at(max(time.time(), net.spec.genesis_ts)) + GRACE_ROUNDS)
    argv = ["spec", "successor", "--spec", str(net.spec_path), "--data-dir", data_dir, "--round", str(later),
            "--group", str(group), "--out", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    third = load_document(out)
    assert third.predecessor == spec_of(v0).network_id and third.data == spec_of(v0).data  # the successor's data


async def test_each_bad_successor_is_refused_in_one_line_and_changes_nothing(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    document = successor_network(net)
    try:
        validator = await net.start("validator-0")
        await net.phase(1, Phase.TRAIN)
        other = draft(net.spec.model_copy(update={"name": "othernet"}), 4, NEXT_GROUP)
        lacking = draft(net.spec, 4, {0: [3, 8]})
        offers = {
            "signed by 1 of 2 validators": signed(document.model_copy(update={"activation": 4}), 0),
            "it names predecessor": signed(other, 0, 1),
            "its activation round 1 has already begun (round 1 is in progress)":
                signed(document.model_copy(update={"activation": 1}), 0, 1),
            "its activation round 2 is too soon": signed(document.model_copy(update={"activation": 2}), 0, 1),
            "group layer 0: experts [8] do not exist (the model has 8)": signed(lacking, 0, 1),
        }
        for reason, offered in offers.items():
            verdict = await validator.offer_successor(offered.to_bytes())
            assert verdict["verdict"] == "refuse" and verdict["reason"].startswith(reason), verdict
            assert "\n" not in verdict["reason"]
        malformed = await validator.offer_successor(b"{}")
        assert malformed["verdict"] == "refuse" and malformed["reason"].startswith("malformed: format")
        assert await validator.ctx.storage.successors() == []
        await net.phase(1, Phase.COMMIT)
        assert spec_of(validator).network_id == net.spec.network_id  # nothing changed
        assert (await StatusViews(validator).status())["spec"]["successor"] is None
    finally:
        await net.close()


@pytest.mark.slow  # make check keeps the switch itself (the test above); this one restarts and adds nodes across it
async def test_nodes_away_at_the_activation_round_or_new_after_it_end_on_the_network_s_spec(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    document = signed(successor_network(net), 0, 1)
    try:
        nodes = [await net.start(name) for name in ("validator-0", "validator-1", "miner-0", "miner-1")]
        await net.phase(0, Phase.TRAIN)
        assert (await nodes[0].offer_successor(document.to_bytes()))["verdict"] == "accept"
        await net.rounds(0, ACTIVATION - 2)
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(ACTIVATION - 1, phase)
        await net.stop("validator-1")  # down from the end of the round before the activation
        await net.stop("miner-1")
        await net.phase(ACTIVATION, Phase.TRAIN)
        await net.start("validator-1")  # back during the activation round: it activates the successor itself
        await net.ran(ACTIVATION, Phase.TRAIN)
        await net.phase(ACTIVATION, Phase.COMMIT)
        for phase in (Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(ACTIVATION, phase)
        await net.phase(ACTIVATION + 1, Phase.TRAIN)
        await net.start("miner-1")  # back after it: follows the validators
        await net.start("miner-2")  # new after it: learns the chain from them
        await net.ran(ACTIVATION + 1, Phase.TRAIN)  # both train in this TRAIN, as the clock stands
        await net.phase(ACTIVATION + 1, Phase.COMMIT)
        for phase in (Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(ACTIVATION + 1, phase)
        await net.phase(ACTIVATION + 2, Phase.TRAIN)
        specs = {spec_of(node).network_id for node in net.nodes.values()}
        assert len(specs) == 1 and spec_of(net.nodes["miner-2"]).group == NEXT_GROUP
        assert len(await heads(net)) == 1
        report = await net.nodes["validator-0"].round_report(ACTIVATION + 1)
        assert report is not None
        scored = {m["id"]: m["verdict"] for m in report["miners"]}
        assert scored[net.id("miner-1")] == scored[net.id("miner-2")] == "accept", report["miners"]
    finally:
        await net.close()


def _address(document: SuccessorDocument) -> str:
    return hashlib.sha256(document.to_bytes()).hexdigest()
