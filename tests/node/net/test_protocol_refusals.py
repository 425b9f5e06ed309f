"""What a node keeps of the peers it refused for speaking another protocol version (node.net.hello refuses them;
the judge keeps them for /status, /metrics and the page): one log line per peer and version, every refusal
counted, shown for OTHER_PROTOCOL_SHOWN_S, and at most OTHER_PROTOCOL_PEERS_KEPT peers."""

from __future__ import annotations

from node.net.judge import OTHER_PROTOCOL_PEERS_KEPT, OTHER_PROTOCOL_SHOWN_S, GossipJudge, other_protocols
from node.runtime.clock import ManualClock
from protocol.spec import NetworkSpec

A, B, C = "aa" * 32, "bb" * 32, "cc" * 32


def test_a_refused_peer_is_logged_once_per_version_and_counted_every_time(spec: NetworkSpec) -> None:
    clock = ManualClock(spec.genesis_ts)
    judge = GossipJudge(spec, clock.now)
    assert judge.refuse_protocol(A, 3, "0.3.0")  # the first refusal is logged
    assert not judge.refuse_protocol(A, 3, "0.3.0")  # the same peer again: counted, not logged again
    assert judge.refuse_protocol(A, 4, "0.4.0")  # it upgraded once more: logged
    assert judge.refuse_protocol(B, 3, "0.3.1")
    assert judge.refuse_protocol(C, 1, "0.1.0")
    stats = judge.snapshot()
    assert stats.protocol_refusals == 5
    assert other_protocols(stats) == [{"protocol": 1, "peers": 1, "releases": ["0.1.0"]},
                                      {"protocol": 3, "peers": 1, "releases": ["0.3.1"]},
                                      {"protocol": 4, "peers": 1, "releases": ["0.4.0"]}]


def test_a_peer_not_refused_for_a_while_is_no_longer_shown(spec: NetworkSpec) -> None:
    clock = ManualClock(spec.genesis_ts)
    judge = GossipJudge(spec, clock.now)
    judge.refuse_protocol(A, 3, "0.3.0")
    clock.advance(OTHER_PROTOCOL_SHOWN_S / 2)
    judge.refuse_protocol(B, 3, "0.3.0")
    assert other_protocols(judge.snapshot()) == [{"protocol": 3, "peers": 2, "releases": ["0.3.0"]}]
    clock.advance(OTHER_PROTOCOL_SHOWN_S / 2 + 1)  # A went away; B was refused since
    assert other_protocols(judge.snapshot()) == [{"protocol": 3, "peers": 1, "releases": ["0.3.0"]}]
    assert judge.snapshot().protocol_refusals == 2  # the count stays


def test_peers_that_make_up_ids_keep_a_bounded_list(spec: NetworkSpec) -> None:
    clock = ManualClock(spec.genesis_ts)
    judge = GossipJudge(spec, clock.now)
    for i in range(OTHER_PROTOCOL_PEERS_KEPT + 10):
        judge.refuse_protocol(f"{i:064x}", 3, "0.3.0")
    judge.refuse_protocol(f"{0:064x}", 3, "0.3.0")  # refused again: the newest, so kept
    kept = judge.snapshot().other_protocols
    assert len(kept) == OTHER_PROTOCOL_PEERS_KEPT and f"{0:064x}" in kept and f"{1:064x}" not in kept
