"""Restart anywhere, lose nothing (issue 11), on the in-memory twins: each test is a hole that the
one-pass redesign closed. A miner restarted after its Reveal serves its blob again and is scored; a
validator restarted after proposing serves its state again, and every node that adopted a state
serves it; a crash right after the rewards write does not stop the next MERGE; a seed revealed late
during EVALUATE cannot change the round plan, and a reveal gossip missed is taken from a peer before
the plan is fixed (score reports before the merge, global-state votes before a node settles the next
round's head); a deleted head blob is fetched again from its voters."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from node.duties.plan import unpaired
from node.duties.validator import ValidatorDuties
from node.net.twin import MemoryNetwork
from node.runtime.daemon import Node
from node.sim.twins import Twins, identity, until
from protocol.messages import SeedCommit, SeedReveal, decode_envelope, seal
from protocol.rounds import Phase
from protocol.seeds import commitment, round_seed

pytestmark = pytest.mark.timeout(180)


async def started(net: Twins, *names: str) -> list[Node]:
    return [await net.start(name) for name in names]


async def test_restarted_miner_and_validator_serve_what_they_revealed_and_proposed(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        await started(net, "validator-0", "validator-1", "miner-0", "miner-1")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        await net.restart("miner-0")  # killed after its Reveal went out
        await net.ran(0, Phase.REVEAL)
        await net.phase(0, Phase.EVALUATE)
        await net.phase(0, Phase.MERGE)
        report = await net.nodes["validator-0"].round_report(0)
        assert report is not None and report["proposed_hash"] is not None
        miner0 = next(m for m in report["miners"] if m["id"] == net.id("miner-0"))
        assert miner0["verdict"] == "accept" and miner0["reward"] > 0, miner0  # its reveal stood

        await net.restart("validator-0")  # killed after proposing
        await net.ran(0, Phase.MERGE)
        await net.stop("validator-1")  # validator-0 alone must now serve the state it proposed
        await net.phase(1, Phase.TRAIN)
        state = report["proposed_hash"]
        for name in ("miner-0", "miner-1"):
            assert await net.nodes[name].ctx.storage.head() == state
            assert net.hub.nodes[net.id(name)].read_served(state) is not None  # adopters serve it too
    finally:
        await net.close()


async def test_a_crash_right_after_the_rewards_write_does_not_stop_the_next_merge(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        v0, _, _ = await started(net, "validator-0", "validator-1", "miner-0")
        real = v0.ctx.storage.add_rewards

        async def write_then_die(*args, **kwargs):  # the ledger write commits, then the process dies
            await real(*args, **kwargs)
            raise OSError("killed")

        v0.ctx.storage.add_rewards = write_then_die  # type: ignore[method-assign]
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(0, phase)
        assert await v0.round_report(0) is None and len((await v0.rewards())["entries"]) == 1
        v0 = await net.restart("validator-0")
        await net.ran(0, Phase.MERGE)
        report = await v0.round_report(0)
        assert report is not None and report["proposed_hash"] is not None
        assert await v0.rewards() == await net.nodes["validator-1"].rewards()  # one ledger line, as v1 has
        await net.phase(1, Phase.TRAIN)
        states = await v0.ctx.storage.global_states(0)
        assert [sorted(s.voters) for s in states] == [sorted([net.id("validator-0"), net.id("validator-1")])]
    finally:
        await net.close()


async def test_a_seed_revealed_late_during_evaluate_cannot_change_the_round_plan(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=3)  # validator-2 is in the spec, but only its key is here
    try:
        v0, v1, _, _ = await started(net, "validator-0", "validator-1", "miner-0", "miner-1")
        absent, seed = identity("validator-2"), hashlib.sha256(b"late").hexdigest()
        await net.phase(0, Phase.TRAIN)
        net.hub.inject(seal(SeedCommit(round=0, commitment=commitment(seed)), net.spec.network_id, absent).to_bytes(),
                       absent.node_id)
        for phase in (Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE):
            await net.phase(0, phase)
        plan = await v0.ctx.storage.round_plan(0)
        assert plan is not None and plan.unrevealed_seeds == (absent.node_id,)
        net.clock.advance(1.0)  # inside the clock-skew tolerance of REVEAL: the reveal is accepted
        net.hub.inject(seal(SeedReveal(round=0, seed=seed), net.spec.network_id, absent).to_bytes(), absent.node_id)
        await net.hub.settle()
        seeds = await v0.ctx.storage.seeds_for(0)
        assert any(s.validator == absent.node_id and s.seed == seed for s in seeds)  # it did arrive
        late_seed = round_seed({s.validator: s.commitment for s in seeds if s.commitment},
                               {s.validator: s.seed for s in seeds if s.seed})
        assert late_seed != plan.seed
        await net.phase(0, Phase.MERGE, after_s=net.spec.timing.merge_s / 2)  # past the wait for validator-2
        for node in (v0, v1):
            assert await node.ctx.storage.round_plan(0) == plan
            assert await node.ctx.storage.round_seed(0) == plan.seed
            report = await node.round_report(0)
            assert report is not None and report["proposed_hash"] is not None
    finally:
        await net.close()


async def test_a_deleted_head_blob_is_fetched_again_from_its_voters(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        v0, _, _ = await started(net, "validator-0", "validator-1", "miner-0")
        await net.rounds(0, 0)  # round 0, then TRAIN of round 1 adopts its state
        head = await v0.ctx.storage.head()
        assert head is not None and head != net.spec.model.base_hash
        await net.phase(1, Phase.COMMIT)
        v0.ctx.blobs.delete(head)
        v0 = await net.restart("validator-0")  # reloads its head from disk (no adoption outside TRAIN)
        await net.ran(1, Phase.COMMIT)
        assert v0.ctx.blobs.has(head)
        for phase in (Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(1, phase)
        await net.phase(2, Phase.TRAIN)
        [state] = await v0.ctx.storage.global_states(1)
        assert net.id("validator-0") in state.voters and state.parent == head  # it voted in the next round
        assert all(run.ok for run in v0.scheduler.runs), v0.scheduler.runs
    finally:
        await net.close()


async def test_a_miner_down_for_all_of_evaluate_after_revealing_is_still_scored(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        await started(net, "validator-0", "validator-1", "miner-0", "miner-1")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        validators = [net.nodes["validator-0"], net.nodes["validator-1"]]
        [reveal] = [r for r in await validators[0].ctx.storage.reveals_for(0) if r.miner == net.id("miner-0")]
        await until(lambda: all(v.ctx.blobs.has(reveal.commitment) for v in validators),
                    "the validators to fetch miner-0's blob while REVEAL is open")
        await net.stop("miner-0")  # killed after revealing; not back before the round ends
        await net.phase(0, Phase.EVALUATE)
        await net.phase(0, Phase.MERGE)
        for validator in validators:
            report = await validator.round_report(0)
            assert report is not None
            miner0 = next(m for m in report["miners"] if m["id"] == net.id("miner-0"))
            assert miner0["verdict"] == "accept" and miner0["loss"] is not None, miner0
    finally:
        await net.close()


async def test_a_node_restarted_mid_round_catches_up_on_what_it_missed_and_agrees(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        await started(net, "validator-0", "validator-1", "validator-2", "miner-0", "miner-1")
        await net.phase(0, Phase.TRAIN)
        await net.stop("validator-2")  # down through COMMIT and the start of REVEAL
        await net.phase(0, Phase.COMMIT)
        await net.phase(0, Phase.REVEAL)
        v2 = await net.start("validator-2")  # asks a peer for rounds -1 and 0 before its first phase
        await net.ran(0, Phase.REVEAL)
        await net.phase(0, Phase.EVALUATE)
        plans = [await net.nodes[v].ctx.storage.round_plan(0) for v in ("validator-0", "validator-2")]
        assert plans[0] is not None and plans[0] == plans[1]  # the same commits, reveals and seeds
        assert set(plans[0].revealed) == {net.id("miner-0"), net.id("miner-1")}
        await net.phase(0, Phase.MERGE)
        await net.phase(1, Phase.TRAIN)
        [state] = await v2.ctx.storage.global_states(0)
        assert len(state.voters) == 3 and await v2.ctx.storage.head() == state.hash  # all voted for one state
    finally:
        await net.close()


@pytest.mark.parametrize("lost", [("miner-1", Phase.COMMIT), ("miner-1", Phase.REVEAL), ("validator-2", Phase.REVEAL)],
                         ids=["a-miners-commit", "a-miners-reveal", "a-seed-reveal"])
async def test_a_validator_that_gossip_missed_takes_the_reveals_from_a_peer_before_it_plans(
        tmp_path: Path, lost: tuple[str, Phase]) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        v0, v1, *_ = await started(net, "validator-0", "validator-1", "validator-2", "miner-0", "miner-1")
        sender, phase = net.id(lost[0]), lost[1]
        inbox = net.hub.nodes[net.id("validator-0")]
        receive = inbox.receive
        for p in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            if p is phase:  # what `sender` gossips in this phase never reaches validator-0
                inbox.receive = lambda data, peer: None if peer == sender else receive(data, peer)  # type: ignore[method-assign]
            await net.phase(0, p)
            inbox.receive = receive  # type: ignore[method-assign]
        assert await unpaired(v0.ctx.storage, 0)  # it holds a commit without its reveal, or the reverse
        await net.phase(0, Phase.EVALUATE)
        plans = [await node.ctx.storage.round_plan(0) for node in (v0, v1)]
        assert plans[0] is not None and plans[0] == plans[1]  # the same seed and assignment as the others
        assert plans[0].unrevealed_seeds == () and set(plans[0].revealed) == {net.id("miner-0"), net.id("miner-1")}
        await net.phase(0, Phase.MERGE)
        await net.phase(1, Phase.TRAIN)
        [state] = await v0.ctx.storage.global_states(0)
        assert len(state.voters) == 3 and await v0.ctx.storage.head() == state.hash
    finally:
        await net.close()


async def test_a_validator_that_gossip_missed_score_reports_takes_them_from_a_peer_before_it_merges(
        tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        v0, v1, *_ = await started(net, "validator-0", "validator-1", "validator-2", "miner-0", "miner-1", "miner-2")
        validators = {net.id(f"validator-{i}") for i in range(3)}
        inbox = net.hub.nodes[net.id("validator-0")]
        receive = inbox.receive
        for p in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, p)
        inbox.receive = lambda data, peer: None if peer in validators else receive(data, peer)  # type: ignore[method-assign]
        await net.phase(0, Phase.EVALUATE)  # the other validators' score reports never reach validator-0
        inbox.receive = receive  # type: ignore[method-assign]
        assert set(await v0.ctx.storage.score_reports(0)) == {net.id("validator-0")}
        net.clock.set(net.schedule.phase_window(0, Phase.MERGE)[0])
        await until(lambda: all(any((run.round, run.phase) == (0, str(Phase.MERGE)) for run in node.scheduler.runs)
                                for node in (v1, net.nodes["validator-2"])), "the others to merge")
        await net.phase(0, Phase.MERGE, after_s=net.spec.timing.merge_s * 0.6)  # validator-0's wait ends
        assert set(await v0.ctx.storage.score_reports(0)) == validators
        reports = [await node.round_report(0) for node in (v0, v1)]
        assert reports[0] is not None and reports[1] is not None
        assert reports[0]["proposed_hash"] is not None and reports[0]["proposed_hash"] == reports[1]["proposed_hash"]
        assert reports[0]["miners"] == reports[1]["miners"]  # the same ranking and rewards
    finally:
        await net.close()


async def test_a_node_whose_catch_up_runs_into_a_new_round_asks_for_that_round_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        await started(net, "validator-0", "validator-1", "validator-2", "miner-0")
        await net.rounds(0, 0)
        await net.stop("miner-0")
        net.clock.set(net.schedule.phase_window(1, Phase.MERGE)[1] - 0.5)  # back just before round 2 begins
        asked: list[int] = []
        catch_up = MemoryNetwork.catch_up

        async def slow(self: MemoryNetwork, round: int, providers: Sequence[str]) -> int:
            if self.node_id == net.id("miner-0"):
                asked.append(round)
                net.clock.set(max(net.clock.now(), net.schedule.round_start(2)))  # it takes a while
            return await catch_up(self, round, providers)

        monkeypatch.setattr(MemoryNetwork, "catch_up", slow)
        await net.start("miner-0")
        await net.ran(2, Phase.TRAIN)
        assert asked[:3] == [0, 1, 2], asked  # round 2's first messages went out while it caught up on 0 and 1
    finally:
        await net.close()


@pytest.mark.parametrize("name", ["miner-0", "validator-0"])
async def test_a_node_that_gossip_missed_the_votes_takes_them_from_a_peer_and_builds_on_the_majority(
        tmp_path: Path, name: str) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        await started(net, "validator-0", "validator-1", "validator-2", "miner-0", "miner-1")
        node, me = net.nodes[name], net.id(name)
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE):
            await net.phase(0, phase)
        inbox = net.hub.nodes[me]
        receive = inbox.receive
        votes = lambda data: decode_envelope(data, net.spec.limits.max_message_bytes).kind == "global_state"  # noqa: E731
        inbox.receive = lambda data, peer: None if votes(data) else receive(data, peer)  # type: ignore[method-assign]
        await net.phase(0, Phase.MERGE)  # no other node's vote of round 0 reaches it by gossip
        inbox.receive = receive  # type: ignore[method-assign]
        assert {v for s in await node.ctx.storage.global_states(0) for v in s.voters} <= {me}
        await net.phase(1, Phase.TRAIN, after_s=net.spec.timing.train_s / 5)  # past a validator's wait for votes
        adopted = await net.nodes["validator-1"].ctx.storage.head()
        assert adopted is not None and adopted != net.spec.model.base_hash
        assert await node.ctx.storage.head() == adopted  # taken at TRAIN, before it trained or scored on it
        for phase in (Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(1, phase)
        reports = [await net.nodes[v].round_report(1) for v in ("validator-0", "validator-1")]
        assert reports[0] is not None and reports[1] is not None
        assert reports[0]["proposed_hash"] is not None and reports[0]["proposed_hash"] == reports[1]["proposed_hash"]
        for miner in ("miner-0", "miner-1"):  # trained on the adopted state: not a stale base anywhere
            entry = next(m for m in reports[0]["miners"] if m["id"] == net.id(miner))
            assert entry["verdict"] == "accept" and entry["loss"] is not None, entry
    finally:
        await net.close()


async def test_a_validator_down_while_the_votes_went_out_follows_the_majority_and_votes_next_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        await started(net, "validator-0", "validator-1", "validator-2", "miner-0", "miner-1")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE):
            await net.phase(0, phase)
        await net.stop("validator-2")  # killed at MERGE: it never hears the others' votes of round 0
        await net.phase(0, Phase.MERGE)

        async def nothing(self: MemoryNetwork, round: int, providers: object) -> int:
            return 0  # no peer can hand over the round's history (all restarted, say)

        with monkeypatch.context() as patch:
            patch.setattr(MemoryNetwork, "catch_up", nothing)
            v2 = await net.start("validator-2")  # back before the round ends
            await net.ran(0, Phase.MERGE)
            await net.phase(1, Phase.TRAIN, after_s=net.spec.timing.train_s / 5)  # past its wait for missing votes
        adopted = await net.nodes["validator-0"].ctx.storage.head()
        assert adopted is not None and adopted != net.spec.model.base_hash
        assert await v2.ctx.storage.head() == net.spec.model.base_hash  # no majority among the votes it holds
        assert (await v2.round_report(0))["global_hash"] == net.spec.model.base_hash
        await net.phase(1, Phase.COMMIT)  # the others' heartbeats of round 1 announce the adopted head
        assert await v2.ctx.storage.head() == adopted
        assert (await v2.round_report(0))["global_hash"] == adopted  # its report of round 0 says so too
        for phase in (Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(1, phase)
        await net.phase(2, Phase.TRAIN)
        [state] = await v2.ctx.storage.global_states(1)
        assert state.parent == adopted and sorted(state.voters) == sorted(
            net.id(v) for v in ("validator-0", "validator-1", "validator-2"))  # it voted with the others
        assert await v2.ctx.storage.head() == state.hash
    finally:
        await net.close()


async def test_a_report_of_a_round_keeps_its_state_when_the_head_is_a_later_rounds(tmp_path: Path) -> None:
    """A validator restarted as round 1's MERGE ended ran that MERGE past its window, followed the others' votes to
    round 1's state, and only then finished its report of round 0, which named round 1's state (the fault-matrix
    network, once). The twins' clock cannot run a phase past its end, so the report is finished here with round
    1's state as the head, as that validator's was."""
    net = Twins(tmp_path, validators=2)
    try:
        v0, *_ = await started(net, "validator-0", "validator-1", "miner-0", "miner-1")
        await net.rounds(0, 0)
        after_round_0 = await v0.ctx.storage.head()
        assert after_round_0 != net.spec.model.base_hash
        assert (await v0.round_report(0))["global_hash"] == after_round_0
        for phase in (Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE, Phase.MERGE):
            await net.phase(1, phase)
        await net.phase(2, Phase.TRAIN)
        assert await v0.ctx.storage.head() not in (None, after_round_0)  # round 1 moved the state
        duties = v0.duties
        assert isinstance(duties, ValidatorDuties)
        await duties.reports.finish(0, duties.state, (await duties._loaded.get()).loss)
        assert (await v0.round_report(0))["global_hash"] == after_round_0
    finally:
        await net.close()
