"""bench/successor.py at its smallest: one validator and one miner over loopback libp2p, the next group in force from
round 2, a second miner started empty in round 3; every round ends on one state on every node that ran it, no node
is restarted, and the report carries what the committed run's does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.bench.scripts import run_bench

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the simulation forks from a warm server")]


def test_a_network_moves_to_a_disjoint_group_at_its_round_with_no_restart(tmp_path: Path) -> None:
    # MERGE gets 3.1 s of a 28 s round: beside the suite, the validator's gate (three candidates) took up to 2.9 s,
    # and a state announced after the next TRAIN began reaches the miners a phase late, one round off.
    report = run_bench("successor", tmp_path / "successor.json", "--dir", str(tmp_path / "run"), "--rounds", "4",
                       "--activation", "2", "--validators", "1", "--miners", "1", "--round-seconds", "28",
                       "--train-share", "0.35", "--inner-steps", "5")
    assert report["failure"] == "" and report["restarted"] == [], report["failure"]
    assert report["late_joiner"] == "miner-1" and report["successor"]["signed_by"] == 1
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    first, after = rounds[0]["group"], rounds[2]["group"]
    assert rounds[1]["group"] == first and rounds[3]["group"] == after == report["successor"]["group"]
    assert all(not set(first[layer]) & set(after.get(layer, [])) for layer in first)
    for entry in rounds:
        assert entry["one_state"] is True, entry
        assert set(entry["heldout_loss"]) == {"first_group", "next_group"}
    assert rounds[3]["states"]["miner-1"] == rounds[3]["states"]["validator-0"]  # the late joiner's too
    assert report["heldout_loss_at_switch"] == rounds[1]["heldout_loss"]
    checks = report["checks"]
    for check in ("one_state_every_round", "no_node_restarted", "groups_disjoint", "late_joiner_scored"):
        assert checks[check] is True, check
    assert isinstance(checks["next_group_loss_fell"], bool) and isinstance(checks["first_group_within_budget"], bool)
    assert report["seconds"]["simulation"] > 0
