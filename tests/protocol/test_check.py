"""Gossip validation: every rule of `check` on a manual clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from protocol.check import TOO_EARLY, CheckContext, Verdict, check, check_bytes, window
from protocol.encoding import canonical_json
from protocol.identity import Identity
from protocol.messages import (
    MAX_ROUND,
    Commit,
    Envelope,
    GlobalState,
    Heartbeat,
    Message,
    Reveal,
    ScoreEntry,
    ScoreReport,
    SeedCommit,
    SeedReveal,
    seal,
)
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec

H = "ab" * 32
R = 5


def make_message(kind: str, r: int = R) -> Message:
    entry = ScoreEntry(miner=H, commitment=H, loss=2.5, verdict="accept")
    return {
        "seed_commit": SeedCommit(round=r, commitment=H),
        "seed_reveal": SeedReveal(round=r, seed=H),
        "commit": Commit(round=r, commitment=H),
        "reveal": Reveal(round=r, commitment=H, size=100),
        "score_report": ScoreReport(round=r, base=H, base_loss=3.0, entries=(entry,)),
        "global_state": GlobalState(round=r, hash=H, parent="cd" * 32, contributors=(H,)),
        "heartbeat": Heartbeat(round=r, role="miner", head=H),
    }[kind]


KINDS = ["seed_commit", "seed_reveal", "commit", "reveal", "score_report", "global_state", "heartbeat"]


@pytest.fixture
def schedule(spec: NetworkSpec) -> Schedule:
    return Schedule.from_spec(spec)


@pytest.fixture
def ctx_at(spec: NetworkSpec, schedule: Schedule) -> Callable[..., CheckContext]:
    def make(now: float, **kw: Any) -> CheckContext:
        return CheckContext(spec.network_id, spec.validator_weights, schedule, now, **kw)

    return make


def sender_for(kind: str, validator_ids: list[Identity], miner_ids: list[Identity]) -> Identity:
    return (
        validator_ids[0]
        if kind in {"seed_commit", "seed_reveal", "score_report", "global_state"}
        else miner_ids[0]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_on_time_is_accepted(kind, spec, schedule, ctx_at, validator_ids, miner_ids) -> None:
    env = seal(make_message(kind), spec.network_id, sender_for(kind, validator_ids, miner_ids))
    start, end = window(kind, R, schedule)
    for now in (start, (start + end) / 2, end - 0.01):
        result = check(env, ctx_at(now))
        assert result.verdict is Verdict.ACCEPT, now
        assert result.message == make_message(kind)  # what the check decoded travels on with the verdict


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "heartbeat"])
def test_outside_window_is_rejected(kind, spec, schedule, ctx_at, validator_ids, miner_ids) -> None:
    env = seal(make_message(kind), spec.network_id, sender_for(kind, validator_ids, miner_ids))
    start, end = window(kind, R, schedule)
    skew = schedule.clock_skew_s
    assert check(env, ctx_at(start - skew)).verdict is Verdict.ACCEPT
    assert check(env, ctx_at(end + skew - 0.01)).verdict is Verdict.ACCEPT
    for now in (
        start - skew - 0.01,
        end + skew,
        schedule.round_start(R - 1),
        schedule.round_start(R + 1) + 59,
    ):
        if now >= schedule.round_start(R + 2):
            continue  # two rounds later it is an old round: IGNORE, tested below
        result = check(env, ctx_at(now))
        assert (result.verdict, result.reason) == (Verdict.REJECT, f"outside {kind} window"), now


def test_windows_of_each_kind(schedule: Schedule) -> None:
    assert window("commit", R, schedule) == schedule.phase_window(R, Phase.COMMIT)
    reveal = schedule.phase_window(R, Phase.REVEAL)
    assert window("reveal", R, schedule) == reveal
    assert window("seed_reveal", R, schedule) == (reveal[0] + 2 * schedule.clock_skew_s, reveal[1])
    assert window("score_report", R, schedule) == (
        schedule.phase_window(R, Phase.EVALUATE)[0],
        schedule.round_start(R + 1),
    )
    assert window("global_state", R, schedule) == (
        schedule.phase_window(R, Phase.MERGE)[0],
        schedule.phase_window(R + 1, Phase.TRAIN)[1],
    )


@pytest.mark.parametrize("offset", [-1.0, -0.5, 0.0, 0.5, 1.0])
def test_a_seed_is_on_time_only_where_no_commit_of_its_round_is(offset, spec, schedule, ctx_at, validator_ids,
                                                                 miner_ids) -> None:
    """The round seed is unknown to every miner until commits close: a validator reveals when the
    seed_reveal window opens by its clock, and a node whose clock is off by up to the skew then takes
    no commit of the round; nor does any node that takes the seed itself. (This spec's skew is 1 s.)"""
    skew = schedule.clock_skew_s
    seed = seal(make_message("seed_reveal"), spec.network_id, validator_ids[0])
    commit = seal(make_message("commit"), spec.network_id, miner_ids[0])
    revealed_at = window("seed_reveal", R, schedule)[0]
    late = check(commit, ctx_at(revealed_at + offset * skew))
    assert (late.verdict, late.reason) == (Verdict.REJECT, "outside commit window")
    earliest = revealed_at - skew  # the first moment any node takes the seed
    assert check(seed, ctx_at(earliest)).verdict is Verdict.ACCEPT
    assert check(seed, ctx_at(earliest - 0.01)).verdict is Verdict.REJECT
    assert check(commit, ctx_at(earliest)).verdict is Verdict.REJECT


def test_a_spec_whose_skew_outgrows_reveal_opens_seeds_halfway_through_it(spec: NetworkSpec) -> None:
    wide = Schedule.from_spec(spec.model_copy(update={"timing": spec.timing.model_copy(
        update={"clock_skew_s": spec.timing.reveal_s})}))
    start, end = wide.phase_window(R, Phase.REVEAL)
    assert window("seed_reveal", R, wide) == ((start + end) / 2, end)


def test_before_genesis_round_0s_windows_judge_early_messages(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("heartbeat", 0), spec.network_id, miner_ids[0])
    early = ctx_at(schedule.genesis_ts - 3600)
    assert early.current_round == 0
    result = check(env, early)
    assert (result.verdict, result.reason, result.detail) == (Verdict.REJECT, "outside heartbeat window", TOO_EARLY)
    assert check(env, ctx_at(schedule.genesis_ts - schedule.clock_skew_s)).verdict is Verdict.ACCEPT


def test_old_round_is_ignored(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("commit"), spec.network_id, miner_ids[0])
    result = check(env, ctx_at(schedule.round_start(R + 2) + 1))
    assert (result.verdict, result.reason) == (Verdict.IGNORE, "old round")


def test_replay_is_ignored(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("commit"), spec.network_id, miner_ids[0])
    now = schedule.phase_window(R, Phase.COMMIT)[0]
    assert check(env, ctx_at(now)).verdict is Verdict.ACCEPT
    seen = {env.message_id}
    first = {("commit", env.sender, R): env.message_id}
    result = check(env, ctx_at(now, seen=seen, first_seen=first))
    assert (result.verdict, result.reason) == (Verdict.IGNORE, "duplicate")
    # A replay arriving long after its window is still not the relaying peer's fault.
    assert check(env, ctx_at(now + 600, seen=seen)).verdict is Verdict.IGNORE


def test_equivocation_is_rejected(spec, schedule, ctx_at, miner_ids) -> None:
    first = seal(Commit(round=R, commitment=H), spec.network_id, miner_ids[0])
    second = seal(Commit(round=R, commitment="ef" * 32), spec.network_id, miner_ids[0])
    ctx = ctx_at(
        schedule.phase_window(R, Phase.COMMIT)[0], first_seen={("commit", first.sender, R): first.message_id}
    )
    result = check(second, ctx)
    assert (result.verdict, result.reason) == (Verdict.REJECT, "equivocation")
    other_miner = seal(Commit(round=R, commitment="ef" * 32), spec.network_id, miner_ids[1])
    assert check(other_miner, ctx).verdict is Verdict.ACCEPT


def test_heartbeats_may_repeat(spec, schedule, ctx_at, miner_ids) -> None:
    a = seal(Heartbeat(round=R, role="miner", head=H), spec.network_id, miner_ids[0])
    b = seal(Heartbeat(round=R, role="miner", head="ef" * 32), spec.network_id, miner_ids[0])
    now = schedule.round_start(R) + 1
    ctx = ctx_at(now, seen={a.message_id}, first_seen={("heartbeat", a.sender, R): a.message_id})
    assert check(b, ctx).verdict is Verdict.ACCEPT
    late = check(b, ctx_at(schedule.round_start(R + 1) + 30))
    assert (late.verdict, late.reason) == (Verdict.IGNORE, "old heartbeat")
    early = check(b, ctx_at(schedule.round_start(R) - 30))
    assert early.verdict is Verdict.REJECT


def test_wrong_network_is_rejected(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("commit"), "00" * 32, miner_ids[0])
    result = check(env, ctx_at(schedule.phase_window(R, Phase.COMMIT)[0]))
    assert (result.verdict, result.reason) == (Verdict.REJECT, "wrong network")


@pytest.mark.parametrize("kind", ["seed_commit", "seed_reveal", "score_report", "global_state"])
def test_validator_kinds_from_non_validator_rejected(kind, spec, ctx_at, schedule, miner_ids) -> None:
    env = seal(make_message(kind), spec.network_id, miner_ids[0])
    result = check(env, ctx_at(window(kind, R, schedule)[0]))
    assert (result.verdict, result.reason) == (Verdict.REJECT, "not a validator")


def forge(identity: Identity, network: str, kind: str, r: int, body: dict) -> Envelope:
    unsigned = {"network": network, "kind": kind, "sender": identity.node_id, "round": r, "body": body}
    return Envelope.model_validate({**unsigned, "signature": identity.sign(canonical_json(unsigned)).hex()})


def test_round_mismatch_and_bad_body_rejected(spec, schedule, ctx_at, miner_ids) -> None:
    ctx = ctx_at(schedule.phase_window(R, Phase.COMMIT)[0])
    mismatch = forge(miner_ids[0], spec.network_id, "commit", R, {"round": R - 1, "commitment": H})
    assert check(mismatch, ctx).reason == "round mismatch"
    with_kind = forge(
        miner_ids[0], spec.network_id, "commit", R, {"round": R, "commitment": H, "kind": "commit"}
    )
    result = check(with_kind, ctx)
    assert (result.reason, result.detail) == ("malformed body",
                                              "commit body: the kind belongs in the envelope, not the body")
    wrong_shape = forge(miner_ids[0], spec.network_id, "commit", R, {"round": R, "commitment": 5})
    assert check(wrong_shape, ctx).reason == "malformed body"
    good = forge(miner_ids[0], spec.network_id, "commit", R, {"round": R, "commitment": H})
    assert check(good, ctx).verdict is Verdict.ACCEPT
    stolen = good.model_copy(update={"sender": miner_ids[1].node_id})
    assert check(stolen, ctx).reason == "bad signature"


def test_check_bytes(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("commit"), spec.network_id, miner_ids[0])
    ctx = ctx_at(schedule.phase_window(R, Phase.COMMIT)[0])
    result, decoded = check_bytes(env.to_bytes(), ctx, spec.limits.max_message_bytes)
    assert result.verdict is Verdict.ACCEPT and decoded == env
    assert check_bytes(env.to_bytes(), ctx, 100)[0].reason == "oversized"
    assert check_bytes(env.to_bytes(), ctx, len(env.to_bytes()))[0].verdict is Verdict.ACCEPT  # the limit is allowed
    assert check_bytes(env.to_bytes(), ctx, len(env.to_bytes()) - 1)[0].reason == "oversized"
    garbage, none = check_bytes(b"{not json", ctx, 1000)
    assert (garbage.verdict, garbage.reason, none) == (Verdict.REJECT, "malformed envelope", None)
    spaced = env.to_bytes().replace(b'","', b'", "', 1)
    assert check_bytes(spaced, ctx, 1000)[0].reason == "malformed envelope"


@pytest.mark.parametrize("r", [MAX_ROUND + 1, 10**309], ids=["MAX_ROUND+1", "10**309"])
def test_an_absurd_round_is_a_malformed_envelope_not_a_crash(r, spec, schedule, ctx_at, miner_ids) -> None:
    # 10**309 used to overflow float in the schedule maths inside check, before the signature was checked
    unsigned = {"network": spec.network_id, "kind": "heartbeat", "sender": miner_ids[0].node_id, "round": r,
                "body": {"round": r, "role": "miner", "head": H}}
    data = canonical_json({**unsigned, "signature": miner_ids[0].sign(canonical_json(unsigned)).hex()})
    result, envelope = check_bytes(data, ctx_at(schedule.phase_window(R, Phase.TRAIN)[0]),
                                   spec.limits.max_message_bytes)
    assert (result.verdict, result.reason, envelope) == (Verdict.REJECT, "malformed envelope", None)
    assert "less than or equal" in result.detail


def test_the_largest_round_is_judged_by_its_window(spec, schedule, ctx_at, miner_ids) -> None:
    env = seal(make_message("heartbeat", MAX_ROUND), spec.network_id, miner_ids[0])
    result, _ = check_bytes(env.to_bytes(), ctx_at(schedule.phase_window(R, Phase.TRAIN)[0]),
                            spec.limits.max_message_bytes)
    assert (result.verdict, result.reason, result.detail) == (Verdict.REJECT, "outside heartbeat window",
                                                              TOO_EARLY)
