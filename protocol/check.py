"""Gossip validation: a pure function that gives every incoming envelope ACCEPT, IGNORE or REJECT.

REJECT means the sender is at fault (malformed, oversized, wrong network, bad signature, a
validator message from a non-validator, equivocation, outside its phase window); IGNORE means it
is not (a replay of something already accepted, a round too old to matter). Anyone may mine, so a
miner message from an unknown sender is judged like any other. The caller owns the clock, the set
of accepted ids and the first message seen per (kind, sender, round); this module never raises
for bad peer input, keeps no state and knows nothing about transport or storage.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from protocol.messages import VALIDATOR_KINDS, DecodeError, Envelope, Message, decode_envelope
from protocol.rounds import Phase, Schedule

TOO_LATE = "too late"
"""The detail of a REJECT for a message past its window: the one REJECT a relayer cannot avoid causing, since
gossip peers push their caches of recent messages to a newcomer (node.net.judge counts it but does not
penalise the peer for it)."""
EQUIVOCATION = "equivocation"
"""The reason of a REJECT for a sender's second, different message of one kind in one round."""
TOO_EARLY = "too early"
"""The detail of a REJECT for an authentic message before its window: its sender's clock is ahead, or ours is
behind (node.net.judge notes the senders; several at once point at our clock)."""


class Verdict(StrEnum):
    ACCEPT = "accept"
    IGNORE = "ignore"
    REJECT = "reject"


@dataclass(frozen=True)
class CheckResult:
    """A verdict, a short stable reason (used as a metric label) and an optional free-text detail.

    An ACCEPT carries the message the check decoded, so nobody downstream decodes the body again.
    `signed` says the sender's signature was verified first: only its sender can have caused such a
    verdict in this round (a stale message, which anyone may replay, is judged before the signature).
    """

    verdict: Verdict
    reason: str
    detail: str = ""
    message: Message | None = field(default=None, compare=False)
    signed: bool = field(default=False, compare=False)

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.ACCEPT


# (kind, sender, round) -> id of the first accepted message with that key.
SeenKey = tuple[str, str, int]


@dataclass(frozen=True)
class CheckContext:
    """What a receiver knows when a message arrives."""

    network_id: str
    validators: Mapping[str, float]
    schedule: Schedule
    now: float
    seen: Container[str] = frozenset()
    first_seen: Mapping[SeenKey, str] = field(default_factory=dict)

    @property
    def current_round(self) -> int:
        """The round in progress, or 0 before genesis (round 0's windows then judge early messages)."""
        if self.now < self.schedule.genesis_ts:
            return 0
        return self.schedule.round_at(self.now)


def window(kind: str, r: int, schedule: Schedule) -> tuple[float, float]:
    """The window [start, end) in which a `kind` message of round `r` is on time, before skew."""
    if kind == "seed_commit":
        return schedule.phase_window(r, Phase.TRAIN)
    if kind == "commit":
        return schedule.phase_window(r, Phase.COMMIT)
    if kind == "reveal":
        return schedule.phase_window(r, Phase.REVEAL)
    if kind == "seed_reveal":
        # 2 x skew into REVEAL every node whose clock is within the skew of the revealer's has closed its
        # commit window, so no miner can see a seed and still commit. A skew over a quarter of REVEAL
        # cannot keep that (seeds then open halfway through REVEAL); spec presets and simulations keep it.
        start, end = schedule.phase_window(r, Phase.REVEAL)
        return start + min(2 * schedule.clock_skew_s, (end - start) / 2), end
    if kind == "score_report":
        return schedule.phase_window(r, Phase.EVALUATE)[0], schedule.phase_window(r, Phase.MERGE)[1]
    if kind == "global_state":
        return schedule.phase_window(r, Phase.MERGE)[0], schedule.phase_window(r + 1, Phase.TRAIN)[1]
    if kind in ("heartbeat", "successor"):
        return schedule.round_start(r), schedule.round_start(r + 1)
    raise AssertionError(f"no window defined for message kind {kind!r}")


def check(envelope: Envelope, ctx: CheckContext) -> CheckResult:
    """Judge a decoded envelope against the context; never raises for peer input.

    What the envelope's header alone decides (network, duplicate, a round or window already past)
    comes before the signature: anyone can replay a message its sender signed rounds ago.
    """
    if envelope.network != ctx.network_id:
        return CheckResult(Verdict.REJECT, "wrong network")
    message_id = envelope.message_id
    if message_id in ctx.seen:
        return CheckResult(Verdict.IGNORE, "duplicate")
    stale = _check_stale(envelope, ctx)
    if stale is not None:
        return stale
    try:
        message = envelope.message()
    except DecodeError as exc:
        return CheckResult(Verdict.REJECT, "malformed body", str(exc))
    if message.round != envelope.round:
        return CheckResult(Verdict.REJECT, "round mismatch")
    if not envelope.signature_ok():
        return CheckResult(Verdict.REJECT, "bad signature")
    return _check_signed(envelope, message, message_id, ctx)


def _check_stale(envelope: Envelope, ctx: CheckContext) -> CheckResult | None:
    if envelope.round < ctx.current_round - 1:
        return CheckResult(Verdict.IGNORE, "old round")
    end = window(envelope.kind, envelope.round, ctx.schedule)[1]
    if ctx.now >= end + ctx.schedule.clock_skew_s:
        if envelope.kind == "heartbeat":
            return CheckResult(Verdict.IGNORE, "old heartbeat")
        return CheckResult(Verdict.REJECT, f"outside {envelope.kind} window", TOO_LATE)
    return None


def _check_signed(envelope: Envelope, message: Message, message_id: str, ctx: CheckContext) -> CheckResult:
    if envelope.kind in VALIDATOR_KINDS and envelope.sender not in ctx.validators:
        return CheckResult(Verdict.REJECT, "not a validator", signed=True)
    if envelope.kind != "heartbeat":
        first = ctx.first_seen.get((envelope.kind, envelope.sender, envelope.round))
        if first is not None and first != message_id:
            return CheckResult(Verdict.REJECT, EQUIVOCATION, signed=True)
    start = window(envelope.kind, envelope.round, ctx.schedule)[0]
    if ctx.now < start - ctx.schedule.clock_skew_s:
        return CheckResult(Verdict.REJECT, f"outside {envelope.kind} window", TOO_EARLY, signed=True)
    return CheckResult(Verdict.ACCEPT, "ok", message=message, signed=True)


def check_bytes(data: bytes, ctx: CheckContext, max_bytes: int) -> tuple[CheckResult, Envelope | None]:
    """Decode and judge raw gossip bytes; the envelope is None when the bytes did not decode."""
    if len(data) > max_bytes:
        return CheckResult(Verdict.REJECT, "oversized", f"{len(data)} > {max_bytes} bytes"), None
    try:
        envelope = decode_envelope(data, max_bytes)
    except DecodeError as exc:
        return CheckResult(Verdict.REJECT, "malformed envelope", str(exc)), None
    return check(envelope, ctx), envelope
