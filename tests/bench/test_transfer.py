"""bench/transfer.py end to end at a small size: a 1 MB blob once each way, and ten gossip messages from
five processes, so every process publishes in two rounds (a node sends one heartbeat a round)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.bench.scripts import assert_positive, run_bench

pytestmark = pytest.mark.integration


def test_a_small_run_reports_throughput_and_the_latency_of_every_delivery(tmp_path: Path) -> None:
    report = run_bench("transfer", tmp_path / "transfer.json", "--size-mb", "1", "--messages", "10", "--repeats", "1")
    assert (report["blob_bytes"], report["repeats"]) == (1_000_000, 1)
    for runs in ("libp2p_seconds_runs", "raw_tcp_seconds_runs", "raw_tcp_bare_seconds_runs"):
        assert len(report[runs]) == 1 and all(math.isfinite(s) and s > 0 for s in report[runs]), runs
    assert_positive(report, "libp2p_mb_s", "raw_tcp_mb_s", "raw_tcp_bare_mb_s", "throughput_ratio",
                    "throughput_ratio_vs_bare_socket", "gossip_p50_ms", "gossip_p95_ms", "gossip_max_ms")
    assert (report["gossip_processes"], report["gossip_messages"]) == (5, 10)
    assert report["gossip_deliveries"] == 10 * 4  # each message reached each of the other four processes
    assert report["gossip_p50_ms"] <= report["gossip_p95_ms"] <= report["gossip_max_ms"]
