"""`GossipJudge`: every envelope a peer sends passes here before anyone sees it.

It applies protocol.check with this node's clock and an in-memory seen-set, and adds what a
pure check cannot keep: at most one heartbeat per sender per round (later ones IGNOREd), a
budget per sender per round of the messages only that sender can have caused (IGNOREd unread past
it; forgeries and replays of its stale messages do not count), and peer penalties: a
peer that sends more than `penalty_threshold` REJECTed messages in one round is penalised for
`penalty_backoff_s` (its messages are IGNOREd unread; the libp2p host disconnects it and does not
redial it meanwhile). Only REJECTs that every honest relayer would have judged the same way add
to a penalty (malformed, oversized, wrong network, bad signature, a validator's kind from another
key): a message outside its window, or a second message of a sender for one round, is counted
against the peer but does not add to its penalty, since the relayer accepted it by its own clock
and seen-set (GossipSub peers push their caches of recent messages to a node that just joined, a
relayer's clock may run a little ahead of ours, and a sender that signs two messages can hand one
to each of two honest peers, who each relay theirs). The seen-set can be seeded from
storage after a restart, and an envelope its node could not record (a full disk) taken out of it (`forget`),
to be judged afresh when a peer's history hands it on again. It also keeps the bytes of the envelopes it accepted in the current and the
previous round (`recent`, capped at RECENT_BYTES_PER_ROUND), for a restarted peer to catch up on
(`judge_replayed` judges those on the other side). It notes the validators whose authentic messages
arrive before their window opens (`NetworkStats.early`): one such validator has a clock that runs
ahead, several at once mean ours runs behind (`clock_behind`), which the node reports. Only validators
count: they are few and known, where anyone can make keys, and two fresh keys' heartbeats for a far
round would otherwise tell every node that its clock is days behind. It also keeps the peers the
host refused for speaking another protocol version (`refuse_protocol`, `other_protocols`), which the node shows.
Thread-safe: the libp2p host judges on its own thread. This module knows nothing about transports
or storage.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from node.net.config import P2PConfig
from node.net.network import NetworkStats, PublishRefused
from protocol.check import (
    EQUIVOCATION,
    TOO_EARLY,
    TOO_LATE,
    CheckContext,
    CheckResult,
    SeenKey,
    Verdict,
    check,
    window,
)
from protocol.messages import DecodeError, Envelope, decode_envelope
from protocol.rounds import Schedule
from protocol.spec import NetworkSpec

SEEN_ROUNDS_KEPT = 3
EARLY_ROUNDS_KEPT = 2
CLOCK_SUSPECT_VALIDATORS = 2
"""Distinct validators whose messages arrived before their windows (in EARLY_ROUNDS_KEPT rounds) that make
this node suspect its own clock rather than theirs; all of them in a network with fewer."""
RECENT_BYTES_PER_ROUND = 16 * 2**20
REJECT_PEERS_KEPT = 1024
"""Peers whose REJECT counts are kept one by one; past that the half with the fewest are added up under
OTHER_PEERS, so that peers that come and go (fresh ids cost nothing) cannot grow the counts without bound."""
OTHER_PEERS = "other"
OTHER_PROTOCOL_SHOWN_S = 600.0
"""How long a peer refused for speaking another protocol version counts among those a node shows: it is redialled
(and refused again) every minute or so while it is up."""
OTHER_PROTOCOL_PEERS_KEPT = 256
SeenEntry = tuple[str, str, str, int]
"""(message id, kind, sender, round) of an envelope accepted earlier, as storage keeps it."""

REPEAT_HEARTBEAT = CheckResult(Verdict.IGNORE, "repeat heartbeat", "one heartbeat per sender per round")
OVER_BUDGET = CheckResult(Verdict.IGNORE, "over budget")
PENALISED = CheckResult(Verdict.IGNORE, "penalised peer")
NOT_ASKED_FOR = CheckResult(Verdict.IGNORE, "not the round asked for")

log = logging.getLogger(__name__)


def _relayer_could_know(result: CheckResult) -> bool:
    """Whether an honest peer relaying the message would have REJECTed it too: true unless the verdict
    depends on the receiver's clock (the message's window) or on what it saw before (equivocation)."""
    return result.detail not in (TOO_EARLY, TOO_LATE) and result.reason != EQUIVOCATION


def clock_suspects(spec: NetworkSpec, node_id: str | None = None) -> int:
    """How many early validators make node `node_id` of `spec`'s network suspect its own clock: two of the
    others, or the one other; 0 (it cannot tell) for the one validator of a network of one, whose clock is
    the only validator clock there is. A node never judges its own messages, so it does not count itself."""
    return min(CLOCK_SUSPECT_VALIDATORS, len(set(spec.validator_weights) - {node_id}))


def clock_behind(stats: NetworkStats, suspects: int) -> dict[str, float] | None:
    """What the early validators in `stats` say about this node's clock; None while fewer than `suspects`
    (`clock_suspects`) are early.

    A message sent inside its window by a validator whose clock is right arrives here no earlier than
    our clock's lag before that window, so each early validator's largest lead is a lower bound on the
    lag. The bound reported is the `suspects`-th largest, so one validator whose own clock runs ahead
    cannot inflate it where there are more.
    """
    if suspects < 1 or len(stats.early) < suspects:
        return None
    leads = sorted((lead for lead, _ in stats.early.values()), reverse=True)
    return {"early_validators": len(leads), "behind_by_at_least_s": round(leads[suspects - 1], 1)}


def other_protocols(stats: NetworkStats) -> list[dict[str, Any]]:
    """The peers refused for speaking another protocol version (in `stats`, a snapshot) by the version they speak:
    `[{"protocol": N, "peers": count, "releases": [their releases]}]`, lowest version first."""
    by_version: dict[int, list[str]] = {}
    for protocol, release, _ in stats.other_protocols.values():
        by_version.setdefault(protocol, []).append(release)
    return [{"protocol": v, "peers": len(releases), "releases": sorted(set(releases))}
            for v, releases in sorted(by_version.items())]


class GossipJudge:
    """Judges incoming gossip and our own envelopes; counts verdicts, budgets senders, penalises peers.

    `seen` holds ids of accepted envelopes and `first_seen` the first accepted id per
    (kind, sender, round); both are pruned to the last few rounds.
    """

    def __init__(self, spec: NetworkSpec, now: Callable[[], float], config: P2PConfig | None = None,
                 node_id: str | None = None) -> None:
        """`node_id`: this node's, which is not counted among the validators that could be early."""
        config = config or P2PConfig()
        self.network_id = spec.gossip_id
        self.max_bytes = spec.limits.max_message_bytes
        self.sender_budget = config.sender_budget
        self.penalty_threshold = config.penalty_threshold
        self.penalty_backoff_s = config.penalty_backoff_s
        self._validators = spec.validator_weights
        self.clock_suspects = clock_suspects(spec, node_id)
        self._schedule = Schedule.from_spec(spec)
        self._now = now
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._first_seen: dict[SeenKey, str] = {}
        self._pruned_below = 0
        self._round = -1  # the round that `_spent` and the peer scores belong to
        self._spent: Counter[str] = Counter()
        self._recent: dict[int, list[bytes]] = {}
        self._recent_bytes: Counter[int] = Counter()
        self.stats = NetworkStats()

    def _context(self, now: float) -> CheckContext:
        return CheckContext(
            network_id=self.network_id,
            validators=self._validators,
            schedule=self._schedule,
            now=now,
            seen=self._seen,
            first_seen=self._first_seen,
        )

    def judge(self, data: bytes, peer: str) -> tuple[CheckResult, Envelope | None]:
        """Judge bytes received from `peer`; records accepted envelopes, counts the verdict, penalises."""
        return self._verdict(data, peer, asked=None)

    def judge_replayed(self, data: bytes, peer: str, round: int) -> tuple[CheckResult, Envelope | None]:
        """Judge an envelope of `round` that `peer` accepted earlier and hands on to us as we catch up.

        As `judge`, but timed at the start of the envelope's own window once that has begun: a message
        that was on time when the peer accepted it is on time here. Signature, network, sender's role,
        duplicates and equivocation are checked as for gossip; a peer can make us take late messages
        only if it lies about them, and then only messages their authors signed. An envelope of another
        round than the one asked for is IGNOREd.
        """
        return self._verdict(data, peer, asked=round)

    def recent(self, round: int) -> list[bytes]:
        """The envelopes accepted (and our own published) in `round`, if it is the current or the previous one."""
        with self._lock:
            return list(self._recent.get(round, ()))

    def _verdict(self, data: bytes, peer: str, asked: int | None) -> tuple[CheckResult, Envelope | None]:
        with self._lock:
            now = self._now()
            self._roll(now)
            self.stats.gossip_bytes_in += len(data)
            result, envelope = self._judge(data, peer, now, asked)
            kind = envelope.kind if envelope is not None else "unknown"
            self.stats.messages[(kind, result.verdict.value)] += 1
            if result.verdict is Verdict.REJECT:
                self._penalise(peer, now, scored=_relayer_could_know(result))
                if result.detail == TOO_EARLY:
                    assert envelope is not None
                    if envelope.sender in self._validators:
                        self._note_early(envelope, now)
            elif result.verdict is Verdict.ACCEPT:
                assert envelope is not None
                self._record(envelope, data)
            return result, envelope

    def _judge(self, data: bytes, peer: str, now: float, asked: int | None = None) -> tuple[CheckResult, Envelope | None]:
        """`asked`: the round a catch-up asked a peer for (None for gossip)."""
        if self.stats.penalised.get(peer, 0.0) > now:
            return PENALISED, None
        if len(data) > self.max_bytes:
            return CheckResult(Verdict.REJECT, "oversized", f"{len(data)} > {self.max_bytes} bytes"), None
        try:
            envelope = decode_envelope(data, self.max_bytes)
        except DecodeError as exc:
            return CheckResult(Verdict.REJECT, "malformed envelope", str(exc)), None
        if self._spent[envelope.sender] >= self.sender_budget:
            return OVER_BUDGET, envelope
        if asked is not None:
            if envelope.round != asked:
                return NOT_ASKED_FOR, envelope
            now = min(now, window(envelope.kind, envelope.round, self._schedule)[0])
        result = check(envelope, self._context(now))
        if result.signed:  # a forgery or a replay may name any sender: it must not use up that sender's budget
            self._spent[envelope.sender] += 1
        if result.accepted and envelope.kind == "heartbeat" and self._repeats_heartbeat(envelope):
            return REPEAT_HEARTBEAT, envelope
        return result, envelope

    def admit_own(self, envelope: Envelope) -> bytes:
        """Check and record an envelope we are about to publish; raises PublishRefused if peers would drop it."""
        with self._lock:
            if envelope.kind == "heartbeat" and self._repeats_heartbeat(envelope):
                raise PublishRefused(f"heartbeat for round {envelope.round}: already sent one this round")
            result = check(envelope, self._context(self._now()))
            if result.verdict is not Verdict.ACCEPT:
                raise PublishRefused(f"{envelope.kind} for round {envelope.round}: {result.reason} {result.detail}")
            data = envelope.to_bytes()
            if len(data) > self.max_bytes:
                raise PublishRefused(f"{envelope.kind} envelope is {len(data)} bytes, over {self.max_bytes}")
            self._record(envelope, data)
            self.stats.gossip_bytes_out += len(data)
            self.stats.messages[(envelope.kind, "published")] += 1
            return data

    def seed(self, entries: Iterable[SeenEntry]) -> None:
        """Remember envelopes accepted before a restart, oldest first, as if they had just been judged."""
        with self._lock:
            for message_id, kind, sender, round in entries:
                self._seen[message_id] = round
                self._first_seen.setdefault((kind, sender, round), message_id)
                self._prune(round)

    def forget(self, envelope: Envelope) -> None:
        """Take an accepted envelope out of the seen-set, as if it had never come: its node could not record it."""
        with self._lock:
            self._seen.pop(envelope.message_id, None)
            key = (envelope.kind, envelope.sender, envelope.round)
            if self._first_seen.get(key) == envelope.message_id:
                del self._first_seen[key]

    def _repeats_heartbeat(self, envelope: Envelope) -> bool:
        first = self._first_seen.get(("heartbeat", envelope.sender, envelope.round))
        return first is not None and first != envelope.message_id

    def _record(self, envelope: Envelope, data: bytes | None = None) -> None:
        message_id = envelope.message_id
        self._seen[message_id] = envelope.round
        self._first_seen.setdefault((envelope.kind, envelope.sender, envelope.round), message_id)
        self._prune(envelope.round)
        if data is not None and envelope.round >= self._round - 1 \
                and self._recent_bytes[envelope.round] + len(data) <= RECENT_BYTES_PER_ROUND:
            self._recent.setdefault(envelope.round, []).append(data)
            self._recent_bytes[envelope.round] += len(data)

    def _note_early(self, envelope: Envelope, now: float) -> None:
        lead = window(envelope.kind, envelope.round, self._schedule)[0] - now
        known = self.stats.early.get(envelope.sender)
        self.stats.early[envelope.sender] = (max(lead, known[0] if known else lead), now)
        if known is None and len(self.stats.early) == self.clock_suspects:
            behind = clock_behind(self.stats, self.clock_suspects)
            assert behind is not None
            log.warning("messages from %d validator(s) arrived before their windows opened, up to %.1f s early "
                        "(the spec tolerates %.1f s): this node's clock is probably at least %.1f s behind; "
                        "check that it keeps time (NTP)", len(self.stats.early),
                        max(lead for lead, _ in self.stats.early.values()), self._schedule.clock_skew_s,
                        behind["behind_by_at_least_s"])

    def _prune(self, latest: int) -> None:
        oldest = latest - SEEN_ROUNDS_KEPT
        if oldest > self._pruned_below:
            # protocol.check ignores rounds this old anyway, so their ids need not be remembered.
            self._pruned_below = oldest
            self._seen = {m: r for m, r in self._seen.items() if r >= oldest}
            self._first_seen = {k: m for k, m in self._first_seen.items() if k[2] >= oldest}

    def _roll(self, now: float) -> None:
        """Start budgets and scores afresh when the round changes; forget penalties that ran out and early
        validators not heard from in EARLY_ROUNDS_KEPT rounds."""
        current = self._schedule.round_at(now) if now >= self._schedule.genesis_ts else 0
        if current != self._round:
            self._round = current
            for old in [r for r in self._recent if r < current - 1]:
                del self._recent[old], self._recent_bytes[old]
            self._spent.clear()
            self.stats.peer_scores.clear()
            self.stats.penalised = {p: t for p, t in self.stats.penalised.items() if t > now}
            self.stats.early = self._recent_early(now)  # `snapshot` filters by time between round changes

    def _recent_early(self, now: float) -> dict[str, tuple[float, float]]:
        since = now - EARLY_ROUNDS_KEPT * self._schedule.round_seconds
        return {s: e for s, e in self.stats.early.items() if e[1] > since}

    def _penalise(self, peer: str, now: float, scored: bool = True) -> None:
        counts = self.stats.rejects_by_peer
        counts[peer] += 1
        if len(counts) > REJECT_PEERS_KEPT:
            fewest = sorted((n, p) for p, n in counts.items() if p != OTHER_PEERS)[: len(counts) // 2]
            for _, p in fewest:
                counts[OTHER_PEERS] += counts.pop(p)
        if not scored:
            return
        score = self.stats.peer_scores.get(peer, 0) + 1
        self.stats.peer_scores[peer] = score
        if score > self.penalty_threshold:
            self.stats.penalised[peer] = now + self.penalty_backoff_s
            self.stats.peer_scores[peer] = 0
            self.stats.penalties += 1

    def refuse_protocol(self, peer: str, protocol: int, release: str) -> bool:
        """Note that `peer`, which speaks protocol version `protocol` of release `release`, was refused; True the
        first time it is noted with that version (the host logs it then, and only counts it later)."""
        with self._lock:
            known = self.stats.other_protocols.pop(peer, None)
            self.stats.other_protocols[peer] = (protocol, release, self._now())
            self.stats.protocol_refusals += 1
            if len(self.stats.other_protocols) > OTHER_PROTOCOL_PEERS_KEPT:  # fresh ids cost a peer nothing
                del self.stats.other_protocols[next(iter(self.stats.other_protocols))]  # the longest not refused
            return known is None or known[0] != protocol

    def is_penalised(self, peer: str) -> bool:
        """Whether `peer` is serving a penalty now (disconnect it, do not dial it)."""
        with self._lock:
            return self.stats.penalised.get(peer, 0.0) > self._now()

    @property
    def remembered(self) -> int:
        """How many accepted message ids are remembered for de-duplication."""
        return len(self._seen)

    def reject_counts(self) -> Mapping[str, int]:
        with self._lock:
            return dict(self.stats.rejects_by_peer)

    def count_blob(self, bytes_in: int = 0, bytes_out: int = 0, fetched: int = 0, failed: int = 0,
                   served: int = 0) -> None:
        """Add blob-transfer counts (called from whichever thread moves the bytes)."""
        with self._lock:
            self.stats.blob_bytes_in += bytes_in
            self.stats.blob_bytes_out += bytes_out
            self.stats.blobs_fetched += fetched
            self.stats.blobs_served += served
            self.stats.blob_fetch_failures += failed

    def snapshot(self) -> NetworkStats:
        """A copy of the counters that another thread may read while this one keeps counting."""
        with self._lock:
            s = self.stats
            now = self._now()
            return replace(s, messages=Counter(s.messages), rejects_by_peer=Counter(s.rejects_by_peer),
                           peer_scores=dict(s.peer_scores),
                           penalised={p: t for p, t in s.penalised.items() if t > now},
                           early=self._recent_early(now),
                           other_protocols={p: o for p, o in s.other_protocols.items()
                                            if o[2] > now - OTHER_PROTOCOL_SHOWN_S})
