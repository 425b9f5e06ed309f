"""The in-memory network twin: the gossip judge, delivery, reject counting and blob transfer."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from node.net.config import P2PConfig
from node.net.judge import GossipJudge, clock_behind, clock_suspects
from node.net.network import (
    SUBSCRIPTION_QUEUE,
    VALIDATOR_RESERVE,
    BlobFetchError,
    Delivery,
    NetworkError,
    NetworkStats,
    PublishRefused,
    Subscribers,
)
from node.net.twin import MemoryHub, MemoryNetwork
from node.runtime.clock import ManualClock
from node.store.blobs import BlobStore
from protocol.check import CheckResult, Verdict
from protocol.identity import Identity
from protocol.messages import Commit, Envelope, GlobalState, Heartbeat, Reveal, ScoreReport, seal
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import make_identity


@pytest.fixture
def clock(spec: NetworkSpec) -> ManualClock:
    return ManualClock(spec.genesis_ts + 1.0)


@pytest.fixture
def nodes(
    spec: NetworkSpec, clock: ManualClock, validator_ids: list[Identity], miner_ids: list[Identity], tmp_path: Path
) -> dict[str, MemoryNetwork]:
    hub = MemoryHub()
    members = {"v0": validator_ids[0], "m0": miner_ids[0], "m1": miner_ids[1]}
    return {
        name: hub.join(ident.node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / name))
        for name, ident in members.items()
    }


def heartbeat(spec: NetworkSpec, who: Identity, r: int = 0, network: str | None = None) -> Envelope:
    return seal(Heartbeat(round=r, role="miner", head="ab" * 32), network or spec.network_id, who)


async def test_published_envelopes_reach_every_other_node_but_not_the_sender(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    subs = {name: net.subscribe() for name, net in nodes.items()}
    envelope = heartbeat(spec, miner_ids[0])
    await nodes["m0"].publish(envelope)
    for name in ("v0", "m1"):
        delivery = await subs[name].get(timeout=1)
        assert delivery.envelope == envelope
        assert delivery.peer == miner_ids[0].node_id
        assert delivery.result.accepted
        assert delivery.message == envelope.message()
    with pytest.raises(asyncio.TimeoutError):
        await subs["m0"].get(timeout=0.05)
    assert nodes["v0"].stats.messages[("heartbeat", "accept")] == 1
    assert nodes["m0"].stats.messages[("heartbeat", "published")] == 1


async def test_what_a_node_accepts_before_it_subscribes_waits_for_its_first_subscription(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    envelope = heartbeat(spec, miner_ids[0])
    await nodes["m0"].publish(envelope)  # v0 is on the network (judged, seen) but not subscribed yet
    first = nodes["v0"].subscribe(["heartbeat"])
    later = nodes["v0"].subscribe()
    assert (await first.get(timeout=1)).envelope == envelope
    with pytest.raises(asyncio.TimeoutError):
        await later.get(timeout=0.05)  # a later subscription starts from now
    nodes["m0"]._hub.inject(envelope.to_bytes(), miner_ids[0].node_id, to=[nodes["v0"].node_id])
    with pytest.raises(asyncio.TimeoutError):
        await first.get(timeout=0.05)  # seen: a replay is not delivered again


async def test_duplicates_are_ignored_and_bad_messages_rejected_and_counted(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    hub_sender = miner_ids[1].node_id
    sub = nodes["v0"].subscribe()
    good = heartbeat(spec, miner_ids[1])
    await nodes["m1"].publish(good)
    hub = nodes["m1"]._hub  # the twin's hub lets a test play a misbehaving peer
    hub.inject(good.to_bytes(), hub_sender, to=[nodes["v0"].node_id])  # replay: IGNORE, no penalty
    forged = good.model_copy(update={"signature": "0" * 128})
    hub.inject(forged.to_bytes(), hub_sender, to=[nodes["v0"].node_id])
    hub.inject(heartbeat(spec, miner_ids[1], network="ee" * 32).to_bytes(), hub_sender, to=[nodes["v0"].node_id])
    hub.inject(b"{not json", hub_sender, to=[nodes["v0"].node_id])

    assert (await sub.get(timeout=1)).envelope == good
    with pytest.raises(asyncio.TimeoutError):
        await sub.get(timeout=0.05)
    assert nodes["v0"].reject_counts() == {hub_sender: 3}
    stats = nodes["v0"].stats.messages
    assert stats[("heartbeat", "ignore")] == 1
    assert stats[("heartbeat", "reject")] == 2
    assert stats[("unknown", "reject")] == 1


async def test_subscriptions_filter_by_kind_and_close(
    spec: NetworkSpec, clock: ManualClock, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    commits = nodes["v0"].subscribe(["commit"])
    everything = nodes["v0"].subscribe()
    await nodes["m0"].publish(heartbeat(spec, miner_ids[0]))
    clock.set(Schedule.from_spec(spec).phase_window(0, Phase.COMMIT)[0])
    commit = seal(Commit(round=0, commitment="11" * 32), spec.network_id, miner_ids[0])
    await nodes["m0"].publish(commit)
    assert (await commits.get(timeout=1)).envelope == commit
    assert (await everything.get(timeout=1)).envelope.kind == "heartbeat"
    assert (await everything.get(timeout=1)).envelope == commit
    commits.close()
    assert [d async for d in commits] == []
    with pytest.raises(NetworkError, match="unknown message kinds"):
        nodes["v0"].subscribe(["comit"])


async def test_publishing_what_peers_would_reject_is_refused(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    report = seal(ScoreReport(round=0, base="ab" * 32, base_loss=1.0, entries=()), spec.network_id, miner_ids[0])
    with pytest.raises(PublishRefused, match="not a validator"):
        await nodes["m0"].publish(report)
    commit_in_train = seal(Commit(round=0, commitment="11" * 32), spec.network_id, miner_ids[0])
    with pytest.raises(PublishRefused, match="outside commit window"):
        await nodes["m0"].publish(commit_in_train)


async def test_equivocation_is_rejected(
    spec: NetworkSpec, clock: ManualClock, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    clock.set(Schedule.from_spec(spec).phase_window(0, Phase.COMMIT)[0])
    first = seal(Commit(round=0, commitment="11" * 32), spec.network_id, miner_ids[0])
    second = seal(Commit(round=0, commitment="22" * 32), spec.network_id, miner_ids[0])
    nodes["v0"].receive(first.to_bytes(), miner_ids[0].node_id)
    nodes["v0"].receive(second.to_bytes(), miner_ids[0].node_id)
    assert nodes["v0"].reject_counts() == {miner_ids[0].node_id: 1}


def test_the_judge_forgets_ids_from_rounds_no_check_would_accept(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    judge = GossipJudge(spec, clock.now)
    round_s = Schedule.from_spec(spec).round_seconds
    for r in range(8):
        clock.set(spec.genesis_ts + r * round_s + 1.0)
        for who in miner_ids:
            result, _ = judge.judge(heartbeat(spec, who, r).to_bytes(), who.node_id)
            assert result.accepted
    assert judge.remembered == 4 * len(miner_ids)  # rounds 4..7


async def test_blobs_are_fetched_from_a_serving_provider_and_verified(
    nodes: dict[str, MemoryNetwork], tmp_path: Path
) -> None:
    data = bytes(range(256)) * 1000
    store_m0 = BlobStore(tmp_path / "m0")
    blob_hash = store_m0.put_bytes(data)
    with pytest.raises(BlobFetchError, match="not served"):
        await nodes["v0"].fetch(blob_hash, [nodes["m0"].node_id], len(data))
    nodes["m0"].serve(blob_hash)
    with pytest.raises(BlobFetchError, match="more than"):
        await nodes["v0"].fetch(blob_hash, [nodes["m0"].node_id], len(data) - 1)
    path = await nodes["v0"].fetch(blob_hash, [nodes["m1"].node_id, nodes["m0"].node_id], len(data))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == blob_hash
    assert list((tmp_path / "v0" / "tmp").iterdir()) == []
    # m0 sent it twice (the first copy the fetcher refused as over its cap); v0 kept one
    assert (nodes["m0"].stats.blobs_served, nodes["v0"].stats.blobs_fetched) == (2, 1)
    nodes["m0"].unserve(blob_hash)
    assert await nodes["v0"].fetch(blob_hash, [], len(data)) == path  # already stored: no transfer


async def test_a_closed_node_neither_serves_nor_receives(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity], tmp_path: Path
) -> None:
    blob_hash = BlobStore(tmp_path / "m1").put_bytes(b"payload")
    nodes["m1"].serve(blob_hash)
    await nodes["m1"].close()
    assert nodes["m1"].node_id not in nodes["v0"].peers()
    with pytest.raises(BlobFetchError):
        await nodes["v0"].fetch(blob_hash, [nodes["m1"].node_id], 100)
    await nodes["m0"].publish(heartbeat(spec, miner_ids[0]))
    assert nodes["m1"].stats.messages == {}


def test_p2p_settings_are_validated_where_declared() -> None:
    assert P2PConfig().port == 4001
    with pytest.raises(ValueError, match="port"):
        P2PConfig(port=70000)
    with pytest.raises(ValueError, match="dial_timeout_s"):
        P2PConfig(dial_timeout_s=0)


async def test_one_heartbeat_per_sender_per_round_is_accepted(
    spec: NetworkSpec, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity]
) -> None:
    sub = nodes["v0"].subscribe(["heartbeat"])
    await nodes["m0"].publish(heartbeat(spec, miner_ids[0]))
    with pytest.raises(PublishRefused, match="already sent one this round"):
        await nodes["m0"].publish(seal(Heartbeat(round=0, role="miner", head="cd" * 32), spec.network_id, miner_ids[0]))
    for i in range(50):  # a peer replaying validly signed heartbeats with other heads
        spam = seal(Heartbeat(round=0, role="miner", head=f"{i:02x}" * 32), spec.network_id, miner_ids[1])
        nodes["v0"].receive(spam.to_bytes(), miner_ids[1].node_id)
    senders = [(await sub.get(timeout=1)).envelope.sender for _ in range(2)]
    assert sorted(senders) == sorted([miner_ids[0].node_id, miner_ids[1].node_id])
    assert sub.pending == 0
    stats = nodes["v0"].stats
    assert stats.messages[("heartbeat", "accept")] == 2
    assert stats.messages[("heartbeat", "ignore")] == 49
    assert stats.rejects_by_peer == {}  # repeats are not the forwarder's fault


def test_a_sender_over_its_budget_is_ignored_unread_until_the_next_round(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(sender_budget=8, penalty_threshold=1000))
    early = [seal(Commit(round=0, commitment=f"{i:02x}" * 32), spec.network_id, miner_ids[0]) for i in range(12)]
    reasons = [judge.judge(e.to_bytes(), "relay")[0].reason for e in early]  # TRAIN: commits are too early
    assert reasons == ["outside commit window"] * 8 + ["over budget"] * 4
    forged = early[0].model_copy(update={"sender": miner_ids[1].node_id})
    assert judge.judge(forged.to_bytes(), "relay")[0].reason == "bad signature"  # forgeries spend no budget
    assert judge.judge(heartbeat(spec, miner_ids[1]).to_bytes(), "relay")[0].accepted
    clock.set(spec.genesis_ts + Schedule.from_spec(spec).round_seconds + 1.0)
    assert judge.judge(heartbeat(spec, miner_ids[0], r=1).to_bytes(), "relay")[0].accepted


def test_replayed_old_messages_do_not_use_up_their_senders_budget(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(sender_budget=8, penalty_threshold=1000))
    schedule = Schedule.from_spec(spec)
    sender = miner_ids[0]
    signed = [seal(Commit(round=r, commitment=f"{i:02x}" * 32), spec.network_id, sender) for r in (0, 2) for i in range(12)]
    clock.set(schedule.phase_window(3, Phase.COMMIT)[0] + 1.0)
    results = [judge.judge(e.to_bytes(), "replayer")[0] for e in signed]  # messages the sender signed rounds ago
    assert {(r.verdict.value, r.reason, r.detail) for r in results} == {
        ("ignore", "old round", ""), ("reject", "outside commit window", "too late")}
    fresh = seal(Commit(round=3, commitment="ab" * 32), spec.network_id, sender)
    assert judge.judge(fresh.to_bytes(), "relay")[0].accepted  # 24 replays spent none of its budget of 8


async def test_a_peer_past_the_penalty_threshold_is_dropped_until_its_backoff_ends(
    spec: NetworkSpec, clock: ManualClock, validator_ids: list[Identity], miner_ids: list[Identity], tmp_path: Path
) -> None:
    hub = MemoryHub()
    config = P2PConfig(penalty_threshold=3, penalty_backoff_s=10.0)
    v0 = hub.join(validator_ids[0].node_id, GossipJudge(spec, clock.now, config), BlobStore(tmp_path / "v0"))
    bad = miner_ids[0].node_id
    hub.join(bad, GossipJudge(spec, clock.now), BlobStore(tmp_path / "bad"))
    sub = v0.subscribe()
    for _ in range(3):
        v0.receive(b"junk", bad)
    assert v0.peers() == [bad] and v0.stats.peer_scores == {bad: 3} and not v0.stats.penalised
    v0.receive(b"junk", bad)
    assert v0.peers() == [] and v0.stats.penalised == {bad: clock.now() + 10.0} and v0.stats.penalties == 1
    v0.receive(heartbeat(spec, miner_ids[0]).to_bytes(), bad)  # even valid gossip from it is dropped unread
    assert sub.pending == 0 and v0.stats.messages[("unknown", "ignore")] == 1
    clock.advance(10.0)
    assert v0.peers() == [bad] and v0.stats.penalised == {}
    v0.receive(heartbeat(spec, miner_ids[0]).to_bytes(), bad)
    assert (await sub.get(timeout=1)).peer == bad


def test_what_a_relayer_could_not_have_refused_counts_against_it_but_does_not_penalise_it(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=3))
    clock.set(Schedule.from_spec(spec).phase_window(0, Phase.REVEAL)[0] + 5.0)  # the commit window has closed
    late = [seal(Commit(round=0, commitment=f"{i:02x}" * 32), spec.network_id, miner_ids[0]) for i in range(10)]
    results = [judge.judge(e.to_bytes(), "relay")[0] for e in late]  # a cache a peer pushes to a newcomer
    assert {(r.verdict.value, r.reason, r.detail) for r in results} == {("reject", "outside commit window", "too late")}
    # A relayer whose clock runs a little ahead of ours passes on what it took to be on time.
    early = [seal(Commit(round=1, commitment=f"{i:02x}" * 32), spec.network_id, miner_ids[1]) for i in range(4)]
    assert [judge.judge(e.to_bytes(), "relay")[0].detail for e in early] == ["too early"] * 4
    # Senders that signed two reveals each and gave the other one to another honest peer, which relayed it first.
    for i, sender in enumerate(miner_ids[:4]):
        first, second = (seal(Reveal(round=0, commitment=f"{i:02x}{n:02x}" * 16, size=10), spec.network_id, sender)
                         for n in (1, 2))
        assert judge.judge(first.to_bytes(), "other relay")[0].accepted
        assert judge.judge(second.to_bytes(), "relay")[0].reason == "equivocation"
    assert judge.stats.rejects_by_peer == {"relay": 18} and judge.stats.peer_scores == {}
    assert not judge.is_penalised("relay")
    for _ in range(4):  # what any relayer would refuse does add up
        judge.judge(b"junk", "relay")
    assert judge.is_penalised("relay")


def test_several_validators_early_at_once_point_at_this_nodes_clock(
    spec: NetworkSpec, clock: ManualClock, validator_ids: list[Identity], miner_ids: list[Identity],
    caplog: pytest.LogCaptureFixture,
) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=1000))
    schedule = Schedule.from_spec(spec)
    opens = schedule.phase_window(0, Phase.COMMIT)[0]
    clock.set(opens - 20.0)  # TRAIN: a commit now is 20 s before its window (1 s tolerated)

    def commit(who: Identity) -> bytes:
        return seal(Commit(round=0, commitment="ab" * 32), spec.network_id, who).to_bytes()

    with caplog.at_level("WARNING", logger="node.net.judge"):
        # Anyone can make keys: miners' early messages, however many and however early, say nothing.
        for who in miner_ids:
            assert judge.judge(commit(who), "relay")[0].detail == "too early"
            assert judge.judge(heartbeat(spec, who, r=100_000).to_bytes(), "relay")[0].detail == "too early"
        assert judge.stats.early == {} and clock_behind(judge.stats, judge.clock_suspects) is None
        assert judge.judge(commit(validator_ids[0]), "relay")[0].detail == "too early"
        assert clock_behind(judge.stats, judge.clock_suspects) is None  # one early validator: its clock, most likely
        forged = seal(Commit(round=0, commitment="cd" * 32), spec.network_id, validator_ids[0])
        forged = forged.model_copy(update={"sender": validator_ids[1].node_id})
        assert judge.judge(forged.to_bytes(), "relay")[0].reason == "bad signature"
        assert clock_behind(judge.stats, judge.clock_suspects) is None  # a forgery names a sender it cannot speak for
        assert not caplog.records
        clock.advance(5.0)
        assert judge.judge(commit(validator_ids[1]), "relay")[0].detail == "too early"
        assert clock_behind(judge.snapshot(), 2) == {"early_validators": 2, "behind_by_at_least_s": 15.0}
        clock.advance(1.0)
        assert judge.judge(commit(validator_ids[2]), "relay")[0].detail == "too early"
    assert clock_behind(judge.stats, 2) == {"early_validators": 3, "behind_by_at_least_s": 15.0}  # the 2nd largest
    assert [r.getMessage() for r in caplog.records] == [
        "messages from 2 validator(s) arrived before their windows opened, up to 20.0 s early (the spec tolerates "
        "1.0 s): this node's clock is probably at least 15.0 s behind; check that it keeps time (NTP)"]
    clock.set(opens + 2 * schedule.round_seconds)  # two rounds without an early message: forgotten
    assert clock_behind(judge.snapshot(), 2) is None
    assert judge.judge(heartbeat(spec, miner_ids[0], r=2).to_bytes(), "relay")[0].accepted
    assert judge.stats.early == {}


def test_in_a_network_of_one_validator_that_validator_early_is_enough(
    spec_dict: dict[str, Any], clock: ManualClock, validator_ids: list[Identity]
) -> None:
    spec = parse_spec({**spec_dict, "validators": spec_dict["validators"][:1]})
    judge = GossipJudge(spec, clock.now)
    assert judge.clock_suspects == 1
    clock.set(Schedule.from_spec(spec).round_start(1) - 10.0)
    early = seal(Heartbeat(round=1, role="validator", head="ab" * 32), spec.network_id, validator_ids[0])
    assert judge.judge(early.to_bytes(), "relay")[0].detail == "too early"
    assert clock_behind(judge.stats, judge.clock_suspects) == {"early_validators": 1, "behind_by_at_least_s": 10.0}


def test_a_judge_seeded_from_storage_knows_what_it_accepted_before_a_restart(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    first = GossipJudge(spec, clock.now)
    beat = heartbeat(spec, miner_ids[0])
    assert first.judge(beat.to_bytes(), "relay")[0].accepted
    restarted = GossipJudge(spec, clock.now)
    restarted.seed([(beat.message_id, beat.kind, beat.sender, beat.round)])
    assert restarted.judge(beat.to_bytes(), "relay")[0].reason == "duplicate"
    other_head = seal(Heartbeat(round=0, role="miner", head="cd" * 32), spec.network_id, miner_ids[0])
    assert restarted.judge(other_head.to_bytes(), "relay")[0].reason == "repeat heartbeat"
    with pytest.raises(PublishRefused, match="already sent"):
        restarted.admit_own(other_head)


def test_replayed_envelopes_are_judged_on_time_in_their_own_window_and_otherwise_as_gossip(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity], validator_ids: list[Identity]
) -> None:
    schedule = Schedule.from_spec(spec)
    clock.set(schedule.phase_window(0, Phase.COMMIT)[0])
    provider, late = GossipJudge(spec, clock.now), GossipJudge(spec, clock.now)
    commit = seal(Commit(round=0, commitment="11" * 32), spec.network_id, miner_ids[0]).to_bytes()
    assert provider.judge(commit, miner_ids[0].node_id)[0].accepted
    assert provider.recent(0) == [commit] and provider.recent(1) == []

    clock.set(schedule.phase_window(0, Phase.EVALUATE)[0])  # the restarted node is back after COMMIT
    assert late.judge(commit, "peer")[0].reason == "outside commit window"  # as gossip: too late
    result, envelope = late.judge_replayed(commit, validator_ids[0].node_id, 0)
    assert result.accepted and envelope is not None and late.recent(0) == [commit]
    assert late.judge_replayed(commit, validator_ids[0].node_id, 0)[0].reason == "duplicate"
    forged = bytearray(seal(Commit(round=0, commitment="22" * 32), spec.network_id, miner_ids[1]).to_bytes())
    forged[-5] ^= 1
    assert not late.judge_replayed(bytes(forged), validator_ids[0].node_id, 0)[0].accepted
    equivocation = seal(Commit(round=0, commitment="33" * 32), spec.network_id, miner_ids[0]).to_bytes()
    assert late.judge_replayed(equivocation, validator_ids[0].node_id, 0)[0].reason == "equivocation"
    future = seal(Commit(round=1, commitment="44" * 32), spec.network_id, miner_ids[1]).to_bytes()
    assert late.judge_replayed(future, validator_ids[0].node_id, 1)[0].reason == "outside commit window"
    assert late.judge_replayed(future, validator_ids[0].node_id, 0)[0].reason == "not the round asked for"

    clock.set(schedule.phase_window(1, Phase.TRAIN)[0])  # a round on, the previous round's history is still kept
    later = GossipJudge(spec, clock.now)
    assert later.judge_replayed(commit, validator_ids[0].node_id, 0)[0].accepted and later.recent(0) == [commit]
    clock.set(schedule.phase_window(2, Phase.TRAIN)[0])  # two rounds on, it is dropped
    assert later.judge(heartbeat(spec, miner_ids[0], r=2).to_bytes(), "relay")[0].accepted
    assert later.recent(0) == []


async def test_a_catch_up_skips_a_provider_that_holds_no_history(
    spec: NetworkSpec, clock: ManualClock, nodes: dict[str, MemoryNetwork], miner_ids: list[Identity],
    validator_ids: list[Identity], tmp_path: Path
) -> None:
    await nodes["m0"].publish(heartbeat(spec, miner_ids[0]))  # v0 and m1 accept it; m0 keeps its own
    hub = nodes["v0"]._hub
    hub.join(validator_ids[1].node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / "v1"))
    late = hub.join(miner_ids[2].node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / "m2"))
    sub = late.subscribe()
    providers = [validator_ids[1].node_id, validator_ids[0].node_id]  # the first joined after it went out
    assert await late.catch_up(0, providers) == 1
    assert (await sub.get(timeout=1)).envelope == heartbeat(spec, miner_ids[0])
    assert await late.catch_up(0, providers) == 0  # v0 answers again; nothing is new now


async def test_a_flood_of_miner_messages_cannot_crowd_out_validators_messages(
    spec: NetworkSpec, validator_ids: list[Identity], miner_ids: list[Identity]
) -> None:
    """Any key may mine, so heartbeats and commits from throwaway keys fill a queue only up to the
    validators' reserve; seeds, reports and votes still get in, and closing ends the iteration."""
    stats = NetworkStats()
    subs = Subscribers(stats)
    sub = subs.add(None)
    beat = heartbeat(spec, miner_ids[0])
    vote = seal(GlobalState(round=0, hash="cd" * 32, parent="ab" * 32, contributors=()), spec.network_id,
                validator_ids[0])
    result = CheckResult(Verdict.ACCEPT, "ok", message=beat.message())
    for _ in range(SUBSCRIPTION_QUEUE):
        subs.deliver(Delivery(beat, result, "relay"))
    assert sub.pending == SUBSCRIPTION_QUEUE - VALIDATOR_RESERVE
    assert stats.dropped_deliveries == VALIDATOR_RESERVE
    for _ in range(VALIDATOR_RESERVE):
        subs.deliver(Delivery(vote, CheckResult(Verdict.ACCEPT, "ok", message=vote.message()), "relay"))
    assert sub.pending == SUBSCRIPTION_QUEUE
    sub.close()  # full as it is, the end marker still fits
    got = [d.envelope.kind async for d in sub]
    assert got.count("global_state") == VALIDATOR_RESERVE and len(got) == SUBSCRIPTION_QUEUE


def test_a_validator_does_not_count_itself_among_the_validators_that_could_be_early(
    spec_dict: dict[str, Any], clock: ManualClock, validator_ids: list[Identity]
) -> None:
    """A node never judges its own messages: a validator of a network of two has one other validator to hear
    early, and the one validator of a network of one has none, so it cannot tell."""
    two = parse_spec({**spec_dict, "validators": spec_dict["validators"][:2]})
    judge = GossipJudge(two, clock.now, node_id=validator_ids[0].node_id)
    assert (judge.clock_suspects, clock_suspects(two), clock_suspects(two, validator_ids[0].node_id)) == (1, 2, 1)
    clock.set(Schedule.from_spec(two).round_start(1) - 10.0)
    early = seal(Heartbeat(round=1, role="validator", head="ab" * 32), two.network_id, validator_ids[1])
    assert judge.judge(early.to_bytes(), "relay")[0].detail == "too early"
    assert clock_behind(judge.stats, judge.clock_suspects) == {"early_validators": 1, "behind_by_at_least_s": 10.0}
    one = parse_spec({**spec_dict, "validators": spec_dict["validators"][:1]})
    assert clock_suspects(one, validator_ids[0].node_id) == 0
    assert clock_behind(judge.stats, 0) is None  # whatever was early


async def test_settle_waits_for_deliveries_whose_handling_runs_in_a_thread(
    spec: NetworkSpec, clock: ManualClock, validator_ids: list[Identity], miner_ids: list[Identity], tmp_path: Path
) -> None:
    """A node's consumer takes its next delivery once the last one's work (a SQLite write, in a thread) is
    done: settle returns when every queue is empty however long those threads take, and not before."""
    hub, v0 = MemoryHub(), validator_ids[0].node_id
    net = hub.join(v0, GossipJudge(spec, clock.now), BlobStore(tmp_path / "v0"))
    handled: list[Envelope] = []

    async def consume() -> None:
        async for delivery in net.subscribe():
            await asyncio.to_thread(time.sleep, 0.05)  # longer than 10,000 idle loop turns take
            handled.append(delivery.envelope)

    def flood(first: int) -> None:
        for i in range(first, first + 4):
            hub.inject(heartbeat(spec, make_identity(200 + i)).to_bytes(), miner_ids[0].node_id, to=[v0])

    consumer = asyncio.create_task(consume())
    try:
        flood(0)
        await hub.settle()
        assert hub.idle() and len(handled) >= 3  # the last one taken may still be in its thread
        flood(4)
        with pytest.raises(AssertionError, match="still busy after 0.01 s"):
            await hub.settle(timeout_s=0.01)
    finally:
        consumer.cancel()
