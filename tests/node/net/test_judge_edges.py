"""The gossip judge at its edges: size limits, what it publishes, budgets and penalties across rounds,
the catch-up history it keeps, early validators and the counters it hands to metrics."""

from __future__ import annotations

from typing import Any

import pytest

import node.net.judge
from node.net.config import P2PConfig
from node.net.judge import OTHER_PEERS, REJECT_PEERS_KEPT, GossipJudge, clock_behind
from node.net.network import NetworkStats, PublishRefused
from node.runtime.clock import ManualClock
from protocol.identity import Identity
from protocol.messages import Commit, Envelope, Heartbeat, ScoreEntry, ScoreReport, seal
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec, parse_spec

JUNK = b"not an envelope"


@pytest.fixture
def clock(spec: NetworkSpec) -> ManualClock:
    return ManualClock(spec.genesis_ts + 1.0)


def heartbeat(spec: NetworkSpec, who: Identity, r: int = 0, head: str = "ab" * 32) -> Envelope:
    return seal(Heartbeat(round=r, role="miner", head=head), spec.network_id, who)


def report_of_size(spec: NetworkSpec, who: Identity, size: int) -> Envelope:
    """A score report by `who` whose envelope is exactly `size` bytes (padded with two entries' reasons)."""

    def report(pad: int) -> Envelope:
        reasons = ("x" * min(pad, 200), "x" * max(pad - 200, 0))
        entries = tuple(ScoreEntry(miner=f"{i + 1:064x}", commitment="cd" * 32, verdict="reject", reason=reason)
                        for i, reason in enumerate(reasons))
        return seal(ScoreReport(round=0, base="ab" * 32, base_loss=1.0, entries=entries), spec.network_id, who)

    envelope = report(size - len(report(0).to_bytes()))
    assert len(envelope.to_bytes()) == size
    return envelope


def test_bytes_of_exactly_the_size_limit_are_read_and_one_byte_more_is_oversized(
    spec: NetworkSpec, clock: ManualClock
) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=1000))
    limit = spec.limits.max_message_bytes
    assert judge.judge(b"x" * limit, "relay")[0].reason == "malformed envelope"
    result, envelope = judge.judge(b"x" * (limit + 1), "relay")
    assert (result.verdict.value, result.reason, result.detail) == ("reject", "oversized", f"{limit + 1} > {limit} bytes")
    assert envelope is None


def test_this_node_publishes_an_envelope_of_exactly_the_size_limit_and_refuses_one_byte_more(
    spec_dict: dict[str, Any], clock: ManualClock, validator_ids: list[Identity]
) -> None:
    """A validator cuts its report's reasons short to fit; what fits for its peers must fit for itself."""
    spec = parse_spec({**spec_dict, "limits": {"max_message_bytes": 1024}})
    clock.set(Schedule.from_spec(spec).phase_window(0, Phase.EVALUATE)[0])
    judge = GossipJudge(spec, clock.now)
    with pytest.raises(PublishRefused, match="score_report envelope is 1025 bytes, over 1024"):
        judge.admit_own(report_of_size(spec, validator_ids[0], 1025))
    fits = report_of_size(spec, validator_ids[1], 1024)
    assert judge.admit_own(fits) == fits.to_bytes()


def test_publishing_what_peers_would_ignore_is_refused(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    """Peers drop an IGNOREd envelope as surely as a REJECTed one: a node told it went out would wait in vain."""
    judge = GossipJudge(spec, clock.now)
    beat = heartbeat(spec, miner_ids[0])
    judge.admit_own(beat)
    with pytest.raises(PublishRefused, match="heartbeat for round 0: duplicate"):
        judge.admit_own(beat)  # the same one again, as a node restarted mid-round would sign it
    clock.set(Schedule.from_spec(spec).round_start(3) + 1.0)
    with pytest.raises(PublishRefused, match="commit for round 0: old round"):
        judge.admit_own(seal(Commit(round=0, commitment="11" * 32), spec.network_id, miner_ids[1]))
    assert judge.stats.messages == {("heartbeat", "published"): 1}


def test_gossip_bytes_are_counted_in_whatever_the_verdict_and_out_as_sent(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    judge = GossipJudge(spec, clock.now)
    received = heartbeat(spec, miner_ids[0]).to_bytes()
    judge.judge(received, "relay")
    judge.judge(JUNK, "relay")
    sent = judge.admit_own(heartbeat(spec, miner_ids[1]))
    assert (judge.stats.gossip_bytes_in, judge.stats.gossip_bytes_out) == (len(received) + len(JUNK), len(sent))


def test_a_catch_up_for_one_round_ignores_envelopes_of_an_earlier_round(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity], validator_ids: list[Identity]
) -> None:
    clock.set(Schedule.from_spec(spec).phase_window(1, Phase.TRAIN)[0] + 1.0)
    judge = GossipJudge(spec, clock.now)
    earlier = heartbeat(spec, miner_ids[0], r=0).to_bytes()
    assert judge.judge_replayed(earlier, validator_ids[0].node_id, 1)[0].reason == "not the round asked for"
    assert judge.recent(0) == [] and judge.remembered == 0


def test_a_seeded_judge_forgets_rounds_no_check_would_accept_as_a_judging_one_does(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    """`seed` is "as if they had just been judged": the same rounds are remembered."""
    beats = [heartbeat(spec, who, r) for r in range(8) for who in miner_ids]
    judge = GossipJudge(spec, clock.now)
    judge.seed((b.message_id, b.kind, b.sender, b.round) for b in beats)
    assert judge.remembered == 4 * len(miner_ids)  # rounds 4..7


def test_catch_up_history_is_capped_per_round_and_what_is_over_the_cap_is_still_accepted(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity], monkeypatch: pytest.MonkeyPatch
) -> None:
    beats = [heartbeat(spec, who).to_bytes() for who in miner_ids[:3]]
    monkeypatch.setattr(node.net.judge, "RECENT_BYTES_PER_ROUND", len(beats[0]) + len(beats[1]))
    judge = GossipJudge(spec, clock.now)
    assert all(judge.judge(b, "relay")[0].accepted for b in beats)
    assert judge.recent(0) == beats[:2]  # the cap, to the byte
    assert judge.judge(beats[2], "relay")[0].reason == "duplicate"  # seen all the same


def test_the_previous_rounds_history_outlives_the_change_of_round(
    spec: NetworkSpec, clock: ManualClock, miner_ids: list[Identity]
) -> None:
    """A peer restarted early in round 1 asks for round 0 too."""
    judge = GossipJudge(spec, clock.now)
    beat = heartbeat(spec, miner_ids[0], r=0).to_bytes()
    assert judge.judge(beat, "relay")[0].accepted
    clock.set(Schedule.from_spec(spec).round_start(1) + 1.0)
    assert judge.judge(heartbeat(spec, miner_ids[0], r=1).to_bytes(), "relay")[0].accepted  # the round rolls
    assert judge.recent(0) == [beat]


def test_penalty_scores_start_afresh_each_round(spec: NetworkSpec, clock: ManualClock) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=3))
    for _ in range(3):
        judge.judge(JUNK, "relay")
    clock.set(Schedule.from_spec(spec).round_start(1) + 1.0)
    judge.judge(JUNK, "relay")
    assert judge.stats.peer_scores == {"relay": 1} and not judge.is_penalised("relay")
    assert judge.reject_counts() == {"relay": 4}  # the count of REJECTs is kept since start


def test_a_peer_that_served_its_penalty_starts_from_a_clean_score(spec: NetworkSpec, clock: ManualClock) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=3, penalty_backoff_s=10.0))
    for _ in range(4):
        judge.judge(JUNK, "relay")
    assert judge.is_penalised("relay") and judge.stats.peer_scores == {"relay": 0}
    clock.advance(10.0)  # still the same round
    judge.judge(JUNK, "relay")
    assert not judge.is_penalised("relay") and judge.stats.penalties == 1


def test_a_sender_cannot_renew_its_budget_by_spending_it_before_genesis(
    spec: NetworkSpec, miner_ids: list[Identity]
) -> None:
    """Before genesis is round 0, as for the check: early messages for round 0 spend round 0's budget."""
    clock = ManualClock(spec.genesis_ts - 10.0)
    judge = GossipJudge(spec, clock.now, P2PConfig(sender_budget=8, penalty_threshold=1000))
    early = [seal(Commit(round=0, commitment=f"{i:02x}" * 32), spec.network_id, miner_ids[0]) for i in range(8)]
    assert [judge.judge(e.to_bytes(), "relay")[0].detail for e in early] == ["too early"] * 8
    clock.set(spec.genesis_ts + 1.0)
    assert judge.judge(heartbeat(spec, miner_ids[0]).to_bytes(), "relay")[0].reason == "over budget"


def test_a_validator_early_twice_keeps_its_largest_lead_and_is_warned_about_once(
    spec_dict: dict[str, Any], clock: ManualClock, validator_ids: list[Identity], caplog: pytest.LogCaptureFixture
) -> None:
    spec = parse_spec({**spec_dict, "validators": spec_dict["validators"][:1]})
    schedule = Schedule.from_spec(spec)
    judge = GossipJudge(spec, clock.now)
    clock.set(schedule.round_start(1) - 10.0)
    with caplog.at_level("WARNING", logger="node.net.judge"):
        for r in (2, 1):  # 70 s, then 10 s before their windows
            beat = seal(Heartbeat(round=r, role="validator", head="ab" * 32), spec.network_id, validator_ids[0])
            assert judge.judge(beat.to_bytes(), "relay")[0].detail == "too early"
    assert clock_behind(judge.stats, 1) == {"early_validators": 1, "behind_by_at_least_s": 70.0}
    assert len(caplog.records) == 1


def test_how_far_behind_the_clock_is_is_reported_to_a_tenth_of_a_second() -> None:
    stats = NetworkStats(early={"a": (12.34, 0.0), "b": (20.0, 0.0)})
    assert clock_behind(stats, 2) == {"early_validators": 2, "behind_by_at_least_s": 12.3}


def test_an_early_validator_is_remembered_for_two_rounds_from_its_last_early_message(
    spec: NetworkSpec, clock: ManualClock, validator_ids: list[Identity]
) -> None:
    schedule = Schedule.from_spec(spec)
    judge = GossipJudge(spec, clock.now)
    noted = schedule.phase_window(0, Phase.COMMIT)[0] - 20.0
    clock.set(noted)
    for who in validator_ids[:2]:
        commit = seal(Commit(round=0, commitment="ab" * 32), spec.network_id, who)
        assert judge.judge(commit.to_bytes(), "relay")[0].detail == "too early"
    clock.set(noted + 2 * schedule.round_seconds - 1.0)
    assert clock_behind(judge.snapshot(), 2) == {"early_validators": 2, "behind_by_at_least_s": 20.0}
    clock.set(noted + 2 * schedule.round_seconds)
    assert clock_behind(judge.snapshot(), 2) is None


def test_reject_counts_are_folded_only_past_the_cap_and_by_half(spec: NetworkSpec, clock: ManualClock) -> None:
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=1000))
    for i in range(REJECT_PEERS_KEPT):
        judge.judge(JUNK, f"{i:016d}")
    assert len(judge.reject_counts()) == REJECT_PEERS_KEPT and OTHER_PEERS not in judge.reject_counts()
    judge.judge(JUNK, "one more")
    counts = judge.reject_counts()
    assert counts[OTHER_PEERS] == (REJECT_PEERS_KEPT + 1) // 2
    assert len(counts) == REJECT_PEERS_KEPT + 1 - (REJECT_PEERS_KEPT + 1) // 2 + 1


def test_folded_reject_counts_add_up_when_the_folded_total_is_among_the_fewest(
    spec: NetworkSpec, clock: ManualClock
) -> None:
    """REJECT counts are kept since start: on a node up for long, most peers' own counts can exceed the total
    of those folded earlier, which must then not be folded into itself."""
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=1000))
    judge.stats.rejects_by_peer.update({OTHER_PEERS: 1} | {f"{i:016d}": 1000 for i in range(REJECT_PEERS_KEPT - 1)})
    judge.judge(JUNK, "newcomer")
    counts = judge.reject_counts()
    assert sum(counts.values()) == 1 + 1000 * (REJECT_PEERS_KEPT - 1) + 1  # no REJECT counted twice
    assert counts[OTHER_PEERS] == 1 + 1 + 1000 * (REJECT_PEERS_KEPT // 2 - 1)  # itself, the newcomer, 511 others


def test_counts_handed_out_do_not_change_as_the_judge_keeps_counting(spec: NetworkSpec, clock: ManualClock) -> None:
    """Metrics and the sim's control channel read them on another thread."""
    judge = GossipJudge(spec, clock.now, P2PConfig(penalty_threshold=1000))
    judge.judge(JUNK, "relay")
    counts, snapshot = judge.reject_counts(), judge.snapshot()
    judge.judge(JUNK, "relay")
    assert counts == {"relay": 1} and snapshot.messages == {("unknown", "reject"): 1}
    assert snapshot.rejects_by_peer == {"relay": 1} and judge.snapshot().rejects_by_peer == {"relay": 2}


def test_blob_transfers_are_counted_each_under_its_own_name(spec: NetworkSpec, clock: ManualClock) -> None:
    judge = GossipJudge(spec, clock.now)
    judge.count_blob(bytes_in=100, fetched=1)
    judge.count_blob(bytes_out=70, served=2)
    judge.count_blob(failed=3)
    s = judge.snapshot()
    assert (s.blob_bytes_in, s.blob_bytes_out, s.blobs_fetched, s.blobs_served, s.blob_fetch_failures) == (
        100, 70, 1, 2, 3)
