"""Prometheus metrics for one node, in a registry of its own (several nodes can share a process).

Five sources: the release and protocol version (`tessera_build_info`); the process's own (prometheus-client's `process_*` memory, CPU, open files and
threads, `python_gc_*` and `python_info`, as any Prometheus target exports them); the network's
counters (messages by kind and verdict, rejects per peer, bytes, blob fetches, peers), read at
scrape time from `NetworkStats` so there is one count, not two; the scheduler's round and phase
timings, pushed in by the node; and the work and results of the round, pushed in through small
methods: `train_progress` (miner), `submissions_scored` and `seeds_withheld` (validator),
`round_results` (any node, from the status views; a validator's also carries its merge gate), and `disk` (the
data directory's free bytes and what the rounds ahead need, node.runtime.disk). Peer ids are unbounded and chosen by peers, so
rejects per peer are exported for the top N only (labelled by the id's first 16 alphanumeric
characters) plus one `other` series; verdict reasons are free text, so they are cut to their first
clause and bounded in number (the scored counter for the process's life, the last round's verdicts per
round); validator labels come from the spec's validator set.
This module knows nothing about how the numbers are produced.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from node.net.judge import CLOCK_SUSPECT_VALIDATORS, OTHER_PEERS, OTHER_PROTOCOL_SHOWN_S, clock_behind
from node.net.network import NetworkStats
from protocol.version import PROTOCOL_VERSION, RELEASE

CONTENT_TYPE = CONTENT_TYPE_LATEST
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 3600)
_EVAL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
MAX_REASONS = 16  # distinct verdict reasons a metric exports; the rest are counted as "other"
_REASON_CHARS = 48


class NodeMetrics:
    """All of one node's metrics; `render()` gives the Prometheus text exposition."""

    def __init__(self, top_peers: int = 10) -> None:
        assert top_peers >= 1
        self.top_peers = top_peers
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (ProcessCollector, GCCollector, PlatformCollector):
            collector(registry=self.registry)
        self.round = Gauge("tessera_round", "The round in progress.", registry=self.registry)
        self.phase_seconds = Histogram("tessera_phase_duration_seconds", "Time the phase handler ran, by phase.",
                                       ["phase"], buckets=_PHASE_BUCKETS, registry=self.registry)
        self.phase_late = Gauge("tessera_phase_late_seconds", "How late the last handler of each phase started.",
                                ["phase"], registry=self.registry)
        self.phase_failures = Counter("tessera_phase_failures", "Phase handlers that raised, by phase.",
                                    ["phase"], registry=self.registry)
        self.phases_skipped = Gauge("tessera_phases_skipped", "Phases skipped because a handler overran.",
                                    registry=self.registry)
        self.phase_overruns = Counter("tessera_phase_overruns", "Phase handlers that ran past their phase's end.",
                                      ["phase"], registry=self.registry)
        r = self.registry
        self.train_steps = Counter("tessera_train_steps", "Inner training steps this miner ran.", registry=r)
        self.train_tokens = Counter("tessera_train_tokens", "Tokens this miner trained on.", registry=r)
        self.train_tokens_per_s = Gauge("tessera_train_tokens_per_second", "Training throughput of the last round.",
                                        registry=r)
        self.train_loss = Gauge("tessera_train_loss", "Last inner training loss of the last round.", registry=r)
        self.train_lr = Gauge("tessera_train_lr", "Inner AdamW lr of the last round's training.", registry=r)
        self.eval_seconds = Histogram("tessera_eval_seconds", "Seconds to check and score one submission.",
                                      buckets=_EVAL_BUCKETS, registry=r)
        self.scored = Counter("tessera_scored", "Submissions this validator scored, by verdict and reason.",
                              ["verdict", "reason"], registry=r)
        self.base_loss = Gauge("tessera_base_loss", "Held-out loss of the state the last scored round started from.",
                               registry=r)
        self.adopted_loss = Gauge("tessera_adopted_loss", "Held-out loss of the last adopted global state.",
                                  registry=r)
        self.own = _OwnResults()
        r.register(self.own)
        self.verdicts = Gauge("tessera_round_verdicts", "Miners of the last round with results, by verdict and reason.",
                              ["verdict", "reason"], registry=r)
        self.gate_loss = Gauge("tessera_gate_loss", "Validators: each merge-gate candidate's loss on the gate rows "
                               "of the last round that weighed candidates.", ["candidate"], registry=r)
        self.gate_general_loss = Gauge("tessera_gate_general_loss", "Validators: each merge-gate candidate's loss "
                                       "on the general-domain rows of that round (where the spec pins a file).",
                                       ["candidate"], registry=r)
        self.gate_adopted = Gauge("tessera_gate_adopted", "Validators: 1 for the candidate the merge gate adopted in "
                                  "the last round that weighed candidates, 0 for the others.", ["candidate"], registry=r)
        self.gate_outvoted = Counter("tessera_gate_outvoted", "Validators: rounds in which validators holding a "
                                     "majority of weight adopted another state than this validator's merge gate "
                                     "picked.", registry=r)
        self.agreement = Gauge("tessera_validator_agreement", "Share of validator weight behind the most-voted "
                               "global state of the last round with votes.", registry=r)
        self.seed_withheld = Counter("tessera_seed_withheld", "Rounds in which a validator committed a seed "
                                     "and did not reveal it, by validator.", ["validator"], registry=r)
        self.validators_excluded = Gauge("tessera_validators_excluded", "Validators left out of the last planned "
                                         "round's assignment for withholding a seed.", registry=r)
        self.key_elsewhere = Counter("tessera_key_used_elsewhere", "Messages signed with this node's key that "
                                     "reached it from the network and that it has no record of sending.", registry=r)
        self.disk_free = Gauge("tessera_disk_free_bytes", "Free bytes of the data directory's disk.", registry=r)
        self.disk_needed = Gauge("tessera_disk_needed_bytes", "Free bytes the rounds ahead need on the data "
                                 "directory's disk, as the node estimates them from the spec and its config.", registry=r)
        build = Gauge("tessera_build_info", "Always 1: the release this node runs and the protocol version it speaks.",
                      ["version", "protocol"], registry=r)
        build.labels(version=RELEASE, protocol=str(PROTOCOL_VERSION)).set(1)
        self._scored_reasons: set[str] = set()

    def bind_network(self, stats: Callable[[], NetworkStats], peers: Callable[[], int],
                     clock_suspects: int = CLOCK_SUSPECT_VALIDATORS) -> None:
        """Export the network's counters, read at each scrape; `clock_suspects`: node.net.judge.clock_suspects."""
        self.registry.register(_NetworkCollector(stats, peers, self.top_peers, clock_suspects))

    def phase_run(self, round: int, phase: str, duration_s: float, late_s: float, ok: bool,
                  overran: bool = False, skipped: int = 0) -> None:
        """One phase handler finished; `overran`: it ran past its phase's end; `skipped`: phases skipped so far."""
        self.round.set(round)
        self.phase_seconds.labels(phase=phase).observe(duration_s)
        self.phase_late.labels(phase=phase).set(late_s)
        self.phase_overruns.labels(phase=phase).inc(int(overran))
        self.phases_skipped.set(skipped)
        if not ok:
            self.phase_failures.labels(phase=phase).inc()

    def train_progress(self, steps: int, tokens: int, seconds: float, last_loss: float | None,
                       lr: float | None = None) -> None:
        """A miner finished a round's training: `steps` inner steps over `tokens` tokens in `seconds` at `lr`."""
        if lr is not None:
            self.train_lr.set(lr)
        self.train_steps.inc(steps)
        self.train_tokens.inc(tokens)
        self.train_tokens_per_s.set(tokens / seconds if seconds > 0 else 0.0)
        if last_loss is not None:
            self.train_loss.set(last_loss)

    def submissions_scored(self, seconds: float, verdicts: list[tuple[str, str]]) -> None:
        """A validator scored `len(verdicts)` submissions (verdict, reason) in `seconds` all told."""
        for verdict, reason in verdicts:
            self.eval_seconds.observe(seconds / len(verdicts))
            self.scored.labels(verdict=verdict, reason=self._scored_reason(reason)).inc()

    def outvoted(self) -> None:
        """A round settled on another state than the one this validator's gate picked."""
        self.gate_outvoted.inc()

    def seeds_withheld(self, withheld: Sequence[str], excluded: Sequence[str]) -> None:
        """A validator's round plan: validators that withheld their seed in it, and those it excluded."""
        for validator in withheld:
            self.seed_withheld.labels(validator=peer_label(validator)).inc()
        self.validators_excluded.set(len(excluded))

    def round_results(self, base_loss: float | None, adopted_loss: float | None, own: dict[str, Any] | None,
                      agreement: dict[str, Any] | None, verdicts: list[tuple[str, str]],
                      gate: dict[str, Any] | None = None) -> None:
        """The latest round results: losses, agreement, verdicts, on a miner (`own` given, also when its last
        round did not score it: `{loss: None, rank: None, reward: 0.0}`) its own `{loss, rank, reward}`, and on a
        validator the last merge gate that weighed candidates (a round report's `gate`)."""
        if gate is not None:
            for gauge, losses in ((self.gate_loss, gate["losses"]), (self.gate_general_loss, gate["general_losses"])):
                for candidate, loss in (losses or {}).items():
                    gauge.labels(candidate=candidate).set(loss)
            for candidate in gate["losses"]:
                self.gate_adopted.labels(candidate=candidate).set(int(candidate == gate["adopted"]))
        for gauge, value in ((self.base_loss, base_loss), (self.adopted_loss, adopted_loss)):
            if value is not None:
                gauge.set(value)
        if own is not None:
            self.own.result = (own.get("loss"), own.get("rank") or 0, own.get("reward") or 0.0)
        if agreement is not None:
            self.agreement.set(agreement["share"])
        # A gauge rebuilt from one round: its MAX_REASONS most common reasons get a label of their own, whatever
        # earlier rounds or the scored counter saw; reasons that share a label add up.
        labelled = [(verdict, _clause(reason)) for verdict, reason in verdicts]
        common = collections.Counter(label for _, label in labelled)
        shown = set(sorted(common, key=lambda label: (-common[label], label))[:MAX_REASONS])
        self.verdicts.clear()
        for (verdict, label), n in sorted(collections.Counter(
                (verdict, label if label in shown else "other") for verdict, label in labelled).items()):
            self.verdicts.labels(verdict=verdict, reason=label).set(n)

    def _scored_reason(self, reason: str) -> str:
        """A counter's label for a reason: its first clause, the first MAX_REASONS distinct ones for good (a
        counter cannot relabel what it counted), the rest "other". Reasons name tensors, some of them chosen by
        miners ("unexpected tensor <name>"), so they are not a closed set."""
        label = _clause(reason)
        if label not in self._scored_reasons and len(self._scored_reasons) >= MAX_REASONS:
            return "other"
        self._scored_reasons.add(label)
        return label

    def disk(self, free_bytes: int, needed_bytes: int) -> None:
        """The data directory's free bytes and what the rounds ahead need (node.runtime.disk)."""
        self.disk_free.set(free_bytes)
        self.disk_needed.set(needed_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _clause(reason: str) -> str:
    """A free-text reason's first clause, cut short: "rejected: hash mismatch" -> "rejected"; "" -> "ok"."""
    return (reason.split(":")[0].strip() or "ok")[:_REASON_CHARS]


class _OwnResults:
    """A miner's own result in the last round with miners, exported by miners only (`result` set), so that
    an alert on them needs no role label from the scrape config. The loss has no sample in a round that
    scored no loss for the miner (left out, rejected): its last loss would read as current."""

    def __init__(self) -> None:
        self.result: tuple[float | None, int, float] | None = None
        """(loss, rank with 0 for unranked, reward) once the node has told it is a miner."""

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.result)

    @staticmethod
    def _families(result: tuple[float | None, int, float] | None) -> Iterator[Metric]:
        loss = GaugeMetricFamily("tessera_miner_loss", "This miner's held-out loss as validators scored it in the "
                                 "last round with miners; no sample when that round scored it no loss.")
        rank = GaugeMetricFamily("tessera_miner_rank", "This miner's rank in the last round with miners "
                                 "(0: unranked or not scored). Miners only.")
        reward = GaugeMetricFamily("tessera_miner_reward", "Points this miner earned in the last round with "
                                   "miners (0: none or not scored). Miners only.")
        if result is not None:
            if result[0] is not None:
                loss.add_metric([], result[0])
            rank.add_metric([], result[1])
            reward.add_metric([], result[2])
        yield from (loss, rank, reward)


class _NetworkCollector:
    def __init__(self, stats: Callable[[], NetworkStats], peers: Callable[[], int], top: int,
                 clock_suspects: int) -> None:
        self._stats = stats
        self._peers = peers
        self._top = top
        self._clock_suspects = clock_suspects

    def describe(self) -> list[Metric]:
        return list(self._families(NetworkStats(), 0))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._stats(), self._peers())

    def _families(self, s: NetworkStats, peers: int) -> Iterator[Metric]:
        messages = CounterMetricFamily("tessera_messages", "Gossip messages by kind and verdict "
                                       "(verdict 'published' counts our own).", labels=["kind", "verdict"])
        for (kind, verdict), n in sorted(s.messages.items()):
            messages.add_metric([kind, verdict], n)
        yield messages
        yield _top_rejects(s, self._top)
        moved = CounterMetricFamily("tessera_bytes", "Bytes moved, by channel and direction.",
                                    labels=["channel", "direction"])
        for channel, direction, n in (("gossip", "in", s.gossip_bytes_in), ("gossip", "out", s.gossip_bytes_out),
                                      ("blob", "in", s.blob_bytes_in), ("blob", "out", s.blob_bytes_out)):
            moved.add_metric([channel, direction], n)
        yield moved
        fetches = CounterMetricFamily("tessera_blob_fetches", "Blob fetches by result.", labels=["result"])
        fetches.add_metric(["ok"], s.blobs_fetched)
        fetches.add_metric(["failed"], s.blob_fetch_failures)
        yield fetches
        yield CounterMetricFamily("tessera_blobs_served", "Blobs this node served to a peer in full.",
                                  value=s.blobs_served)
        yield CounterMetricFamily("tessera_dropped_deliveries", "Accepted messages dropped on a full queue.",
                                  value=s.dropped_deliveries)
        yield GaugeMetricFamily("tessera_peers", "Connected peers.", value=peers)
        yield CounterMetricFamily("tessera_penalties", "Times a peer crossed the penalty threshold.",
                                  value=s.penalties)
        yield GaugeMetricFamily("tessera_penalised_peers", "Peers disconnected for penalties right now.",
                                value=len(s.penalised))
        yield GaugeMetricFamily("tessera_early_validators", "Validators whose messages arrived before their "
                                "window opened in the last two rounds.", value=len(s.early))
        yield CounterMetricFamily("tessera_protocol_refusals", "Times a peer was refused for speaking another protocol "
                                  "version.", value=s.protocol_refusals)
        yield GaugeMetricFamily("tessera_other_protocol_peers", "Peers refused for speaking another protocol version "
                                f"in the last {OTHER_PROTOCOL_SHOWN_S / 60:g} minutes.", value=len(s.other_protocols))
        behind = clock_behind(s, self._clock_suspects)
        yield GaugeMetricFamily("tessera_clock_behind_seconds", "How far this node's clock lags the validators' "
                                "at least, where enough of them were early to say (0: not known to lag).",
                                value=0.0 if behind is None else behind["behind_by_at_least_s"])


def _top_rejects(s: NetworkStats, top: int) -> Metric:
    family = CounterMetricFamily("tessera_peer_rejects", "Rejected messages per peer (top N, rest as 'other').",
                                 labels=["peer"])
    by_label: dict[str, int] = {}
    folded = 0  # peers the judge already added up as OTHER_PEERS
    for peer, n in s.rejects_by_peer.items():
        if peer == OTHER_PEERS:
            folded = n
            continue
        label = peer_label(peer)
        by_label[label] = by_label.get(label, 0) + n
    ranked = sorted(by_label.items(), key=lambda kv: (-kv[1], kv[0]))
    for label, n in ranked[:top]:
        family.add_metric([label], n)
    rest = folded + sum(n for _, n in ranked[top:])
    if rest:
        family.add_metric(["other"], rest)
    return family


def peer_label(peer: str) -> str:
    """A bounded, label-safe name for a peer (hex node id or base58 peer id): its first 16 characters."""
    prefix = peer[:16]
    return prefix if len(prefix) == 16 and prefix.isascii() and prefix.isalnum() else "invalid"
