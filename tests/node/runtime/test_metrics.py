"""NodeMetrics' methods for round work and results: what each sets, parsed back with prometheus-client's
parser, and that free-text reasons stay a bounded set of labels."""

from __future__ import annotations

import mmap
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.net.config import P2PConfig
from node.net.judge import REJECT_PEERS_KEPT, GossipJudge
from node.net.network import NetworkStats
from node.runtime.metrics import MAX_REASONS, NodeMetrics
from protocol.spec import NetworkSpec
from protocol.version import PROTOCOL_VERSION, RELEASE


def samples(metrics: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    parsed = text_string_to_metric_families(metrics.render().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in parsed for s in family.samples}


def test_train_progress_counts_steps_and_tokens_and_sets_throughput() -> None:
    metrics = NodeMetrics()
    metrics.train_progress(steps=10, tokens=4000, seconds=2.0, last_loss=3.5, lr=1e-3)
    metrics.train_progress(steps=5, tokens=1000, seconds=0.5, last_loss=None, lr=2.5e-4)
    got = samples(metrics)
    assert got[("tessera_train_steps_total", ())] == 15
    assert got[("tessera_train_tokens_total", ())] == 5000
    assert got[("tessera_train_tokens_per_second", ())] == 2000.0  # the last round's rate
    assert got[("tessera_train_loss", ())] == 3.5  # kept when a round reports no loss
    assert got[("tessera_train_lr", ())] == 2.5e-4  # the last round's


def test_submissions_scored_observes_seconds_per_submission_and_counts_verdicts() -> None:
    metrics = NodeMetrics()
    metrics.submissions_scored(3.0, [("accept", ""), ("accept", ""), ("reject", "hash mismatch: got ab, want cd")])
    got = samples(metrics)
    assert got[("tessera_eval_seconds_count", ())] == 3
    assert got[("tessera_eval_seconds_sum", ())] == 3.0
    assert got[("tessera_eval_seconds_bucket", (("le", "1.0"),))] == 3  # 1 s each
    assert got[("tessera_scored_total", (("reason", "ok"), ("verdict", "accept")))] == 2
    assert got[("tessera_scored_total", (("reason", "hash mismatch"), ("verdict", "reject")))] == 1


def test_round_results_set_losses_own_result_agreement_and_replace_verdicts() -> None:
    metrics = NodeMetrics()
    metrics.round_results(base_loss=3.0, adopted_loss=2.5, own={"loss": 2.4, "rank": 2, "reward": 0.5},
                          agreement={"share": 0.75}, verdicts=[("accept", ""), ("reject", "rejected: bad")])
    metrics.round_results(base_loss=None, adopted_loss=2.25, own={"loss": None, "rank": None, "reward": 0.0},
                          agreement=None, verdicts=[("accept", ""), ("accept", "")])
    got = samples(metrics)
    assert got[("tessera_base_loss", ())] == 3.0  # unknown this time: the last known value stays
    assert got[("tessera_adopted_loss", ())] == 2.25
    assert ("tessera_miner_loss", ()) not in got  # not scored in the last round: no loss, not its old one
    assert got[("tessera_miner_rank", ())] == 0  # unranked
    assert got[("tessera_miner_reward", ())] == 0.0
    assert got[("tessera_validator_agreement", ())] == 0.75
    verdicts = {labels: v for (name, labels), v in got.items() if name == "tessera_round_verdicts"}
    assert verdicts == {(("reason", "ok"), ("verdict", "accept")): 2}  # the last round's, not a running sum


def test_a_miners_loss_is_not_shown_stale_once_a_round_scores_it_none() -> None:
    metrics = NodeMetrics()
    metrics.round_results(base_loss=None, adopted_loss=None, own={"loss": 2.4, "rank": 1, "reward": 1.0},
                          agreement=None, verdicts=[])
    assert samples(metrics)[("tessera_miner_loss", ())] == 2.4
    metrics.round_results(base_loss=None, adopted_loss=None, own={"loss": None, "rank": None, "reward": 0.0},
                          agreement=None, verdicts=[])
    got = samples(metrics)
    assert ("tessera_miner_loss", ()) not in got
    assert got[("tessera_miner_reward", ())] == 0.0 and got[("tessera_miner_rank", ())] == 0


def test_only_a_miner_exports_its_own_result_gauges() -> None:
    """TesseraMinerUnrewarded fires on `tessera_miner_reward == 0`: a validator (no `own`) must export no such
    sample, or the alert needs a role label that only the bundled scrape config adds."""
    metrics = NodeMetrics()
    metrics.round_results(base_loss=3.0, adopted_loss=2.5, own=None, agreement={"share": 1.0},
                          verdicts=[("accept", "")])
    text = metrics.render().decode()
    assert "# TYPE tessera_miner_reward gauge" in text  # described, so the name is known
    got = samples(metrics)
    assert not [name for name, _ in got if name.startswith("tessera_miner_")]


def test_reasons_are_bounded_labels() -> None:
    metrics = NodeMetrics()
    metrics.submissions_scored(1.0, [("reject", f"reason {i}: detail") for i in range(MAX_REASONS + 5)])
    reasons = {dict(labels)["reason"] for (name, labels) in samples(metrics) if name == "tessera_scored_total"}
    assert len(reasons) == MAX_REASONS + 1 and "other" in reasons
    assert "reason 0" in reasons and not any(":" in r for r in reasons)


def test_the_last_rounds_verdicts_are_labelled_whatever_came_before() -> None:
    """Scored reasons name tensors (a miner picks some of the names), so that counter's labels run out;
    the last round's verdicts must still show their own reasons, and reasons sharing a label add up."""
    metrics = NodeMetrics()
    metrics.submissions_scored(1.0, [("reject", f"unexpected tensor t{i}") for i in range(MAX_REASONS)])
    for r in range(3):  # each round's reasons new
        metrics.round_results(base_loss=None, adopted_loss=None, own=None, agreement=None,
                              verdicts=[("accept", f"reason {r}.{i}") for i in range(MAX_REASONS)])
    metrics.round_results(base_loss=None, adopted_loss=None, own=None, agreement=None,
                          verdicts=[("accept", "not ranked in top-K"), ("reject", "rejected: hash mismatch"),
                                    ("reject", "rejected: blob too large")])
    verdicts = {labels: v for (name, labels), v in samples(metrics).items() if name == "tessera_round_verdicts"}
    assert verdicts == {(("reason", "not ranked in top-K"), ("verdict", "accept")): 1,
                        (("reason", "rejected"), ("verdict", "reject")): 2}
    many = [("reject", f"rejected {i}") for i in range(MAX_REASONS + 3)] + [("reject", "rejected 0")]
    metrics.round_results(base_loss=None, adopted_loss=None, own=None, agreement=None, verdicts=many)
    verdicts = {dict(labels)["reason"]: v for (name, labels), v in samples(metrics).items()
                if name == "tessera_round_verdicts"}
    assert len(verdicts) == MAX_REASONS + 1 and verdicts["rejected 0"] == 2 and verdicts["other"] == 3


def test_phase_runs_count_overruns_and_skips() -> None:
    metrics = NodeMetrics()
    metrics.phase_run(4, "evaluate", 12.0, 0.1, ok=True, overran=True, skipped=2)
    metrics.phase_run(4, "merge", 1.0, 0.0, ok=True)
    got = samples(metrics)
    assert got[("tessera_phase_overruns_total", (("phase", "evaluate"),))] == 1
    assert got[("tessera_phase_overruns_total", (("phase", "merge"),))] == 0
    assert got[("tessera_phases_skipped", ())] == 0  # the latest count the scheduler reported
    assert got[("tessera_round", ())] == 4


def test_network_penalties_are_exported() -> None:
    metrics = NodeMetrics()
    stats = NetworkStats(penalties=3, penalised={"a" * 64: 99.0})
    metrics.bind_network(lambda: stats, lambda: 2)
    got = samples(metrics)
    assert got[("tessera_penalties_total", ())] == 3
    assert got[("tessera_penalised_peers", ())] == 1
    assert got[("tessera_peers", ())] == 2



def test_the_build_and_peers_refused_for_their_protocol_version_are_exported(spec: NetworkSpec) -> None:
    judge = GossipJudge(spec, lambda: spec.genesis_ts)
    metrics = NodeMetrics()
    metrics.bind_network(judge.snapshot, lambda: 0)
    got = samples(metrics)
    assert got[("tessera_build_info", (("protocol", str(PROTOCOL_VERSION)), ("version", RELEASE)))] == 1
    assert got[("tessera_protocol_refusals_total", ())] == 0 and got[("tessera_other_protocol_peers", ())] == 0
    for peer in ("aa" * 32, "bb" * 32, "aa" * 32):
        judge.refuse_protocol(peer, PROTOCOL_VERSION + 1, "9.9.9")
    got = samples(metrics)
    assert got[("tessera_protocol_refusals_total", ())] == 3 and got[("tessera_other_protocol_peers", ())] == 2


def test_blob_counts_are_exported() -> None:
    metrics = NodeMetrics()
    stats = NetworkStats(blobs_fetched=4, blob_fetch_failures=1, blobs_served=2)
    metrics.bind_network(lambda: stats, lambda: 0)
    got = samples(metrics)
    assert got[("tessera_blob_fetches_total", (("result", "ok"),))] == 4
    assert got[("tessera_blob_fetches_total", (("result", "failed"),))] == 1
    assert got[("tessera_blobs_served_total", ())] == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prometheus-client reads the process from /proc")
def test_the_process_exports_its_memory_open_files_and_cpu() -> None:
    """What Prometheus needs to see a node's memory grow: the process metrics, read at each scrape."""
    metrics = NodeMetrics()
    before = samples(metrics)
    # A fresh anonymous mapping, every page written: resident whatever the allocator kept from earlier tests
    # (a 64 MiB bytearray can land on pages freed but still resident, and leave the RSS unchanged).
    ballast = mmap.mmap(-1, 64 * 2**20)
    ballast[:: mmap.PAGESIZE] = b"\1" * len(ballast[:: mmap.PAGESIZE])
    opened = [open(__file__, "rb") for _ in range(8)]  # noqa: SIM115
    try:
        after = samples(metrics)
    finally:
        for f in opened:
            f.close()
        ballast.close()
    rss = ("process_resident_memory_bytes", ())
    assert after[rss] - before[rss] >= 60 * 2**20
    assert after[("process_open_fds", ())] - before[("process_open_fds", ())] >= 8
    assert after[("process_cpu_seconds_total", ())] > 0
    assert any(name == "python_info" for name, _ in after)  # labelled by the Python version


def test_peers_that_come_and_go_do_not_grow_the_reject_counts_without_bound(spec: NetworkSpec) -> None:
    """Fresh peer ids cost nothing: past REJECT_PEERS_KEPT peers the judge adds up those with the fewest
    REJECTs, and the exported counts neither lose one nor go down."""
    judge = GossipJudge(spec, lambda: spec.genesis_ts + 1.0, P2PConfig(penalty_threshold=1000))
    metrics = NodeMetrics(top_peers=4)
    metrics.bind_network(lambda: judge.snapshot(), lambda: 0)
    for _ in range(5):
        judge.judge(b"not an envelope", "Q" * 16 + "loud")
    totals = []
    for i in range(3 * REJECT_PEERS_KEPT):
        judge.judge(b"not an envelope", f"{i:016d}")
        if i % 500 == 0:
            totals.append(sum(v for (name, _), v in samples(metrics).items() if name == "tessera_peer_rejects_total"))
    assert len(judge.stats.rejects_by_peer) <= REJECT_PEERS_KEPT + 1
    got = samples(metrics)
    assert got[("tessera_peer_rejects_total", (("peer", "Q" * 16),))] == 5  # the loudest peer keeps its own count
    assert sum(v for (name, _), v in got.items() if name == "tessera_peer_rejects_total") == 5 + 3 * REJECT_PEERS_KEPT
    assert totals == sorted(totals) and got[("tessera_peer_rejects_total", (("peer", "other"),))] > totals[-1] - 5
