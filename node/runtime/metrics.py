"""Prometheus metrics for one node, in a registry of its own (several nodes can share a process).

Two sources: the network's counters (messages by kind and verdict, rejects per peer, bytes, blob
fetches, peers), read at scrape time from `NetworkStats` so there is one count, not two; and the
scheduler's round and phase timings, pushed in by the node. Peer ids are unbounded and chosen by
peers, so rejects per peer are exported for the top N only (labelled by the id's first 16
alphanumeric characters) plus one `other` series. This module knows nothing about how the numbers
are produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from node.net.network import NetworkStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 3600)


class NodeMetrics:
    """All of one node's metrics; `render()` gives the Prometheus text exposition."""

    def __init__(self, top_peers: int = 10) -> None:
        assert top_peers >= 1
        self.top_peers = top_peers
        self.registry = CollectorRegistry(auto_describe=True)
        self.round = Gauge("tessera_round", "The round in progress.", registry=self.registry)
        self.phase_seconds = Histogram("tessera_phase_duration_seconds", "Time the phase handler ran, by phase.",
                                       ["phase"], buckets=_PHASE_BUCKETS, registry=self.registry)
        self.phase_late = Gauge("tessera_phase_late_seconds", "How late the last handler of each phase started.",
                                ["phase"], registry=self.registry)
        self.phase_failures = Counter("tessera_phase_failures", "Phase handlers that raised, by phase.",
                                    ["phase"], registry=self.registry)
        self.phases_skipped = Gauge("tessera_phases_skipped", "Phases skipped because a handler overran.",
                                    registry=self.registry)

    def bind_network(self, stats: Callable[[], NetworkStats], peers: Callable[[], int]) -> None:
        """Export the network's counters, read at each scrape."""
        self.registry.register(_NetworkCollector(stats, peers, self.top_peers))

    def phase_run(self, round: int, phase: str, duration_s: float, late_s: float, ok: bool) -> None:
        self.round.set(round)
        self.phase_seconds.labels(phase=phase).observe(duration_s)
        self.phase_late.labels(phase=phase).set(late_s)
        if not ok:
            self.phase_failures.labels(phase=phase).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _NetworkCollector:
    def __init__(self, stats: Callable[[], NetworkStats], peers: Callable[[], int], top: int) -> None:
        self._stats = stats
        self._peers = peers
        self._top = top

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
        yield CounterMetricFamily("tessera_dropped_deliveries", "Accepted messages dropped on a full queue.",
                                  value=s.dropped_deliveries)
        yield GaugeMetricFamily("tessera_peers", "Connected peers.", value=peers)


def _top_rejects(s: NetworkStats, top: int) -> Metric:
    family = CounterMetricFamily("tessera_peer_rejects", "Rejected messages per peer (top N, rest as 'other').",
                                 labels=["peer"])
    by_label: dict[str, int] = {}
    for peer, n in s.rejects_by_peer.items():
        label = peer_label(peer)
        by_label[label] = by_label.get(label, 0) + n
    ranked = sorted(by_label.items(), key=lambda kv: (-kv[1], kv[0]))
    for label, n in ranked[:top]:
        family.add_metric([label], n)
    rest = sum(n for _, n in ranked[top:])
    if rest:
        family.add_metric(["other"], rest)
    return family


def peer_label(peer: str) -> str:
    """A bounded, label-safe name for a peer (hex node id or base58 peer id): its first 16 characters."""
    prefix = peer[:16]
    return prefix if len(prefix) == 16 and prefix.isascii() and prefix.isalnum() else "invalid"
