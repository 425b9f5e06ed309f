"""`tessera simulate` end to end: 2 validators, 3 honest miners and one miner of each adversary kind
run 2 real rounds as separate processes over loopback libp2p (the second trains from the first's
merged state, so the chain of states is exercised); report.json must show the network learning,
honest miners taking every reward, every adversary refused with a reason, and both validators
agreeing on the global state every round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.sim.run import ADVERSARY_KINDS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(540)]

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 2
HONEST = 3


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("simulate") / "sim"
    command = [sys.executable, "-m", "node.cli", "simulate", "--validators", "2",
               "--miners", str(HONEST + len(ADVERSARY_KINDS)), "--adversaries", ",".join(ADVERSARY_KINDS),
               "--rounds", str(ROUNDS), "--dir", str(directory),
               # More slack after TRAIN than the default gives: this runs 11 processes on 2 cores.
               "--round-seconds", "60", "--train-share", "0.7"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=500)
    logs = "\n".join(f"--- {p.parent.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(directory.glob("nodes/*/log.txt")))
    assert result.returncode == 0, f"simulate failed:\n{result.stdout}\n{result.stderr}\n{logs}"
    assert "round" in result.stdout and "reward" in result.stdout  # the progress lines and the table
    return json.loads((directory / "report.json").read_text())


def test_every_round_completes_with_the_report_shape(report: dict) -> None:
    assert [r["round"] for r in report["rounds"]] == list(range(ROUNDS))
    for entry in report["rounds"]:
        assert set(entry) == {"round", "base_loss", "global_loss", "miners", "validators", "phase_seconds"}
        assert len(entry["validators"]) == 2
        kinds = sorted(m["kind"] for m in entry["miners"])
        assert kinds == sorted(["honest"] * HONEST + list(ADVERSARY_KINDS)), entry["miners"]
        for miner in entry["miners"]:
            assert set(miner) == {"id", "kind", "verdict", "loss", "rank", "reward", "reason"}


def test_the_adopted_global_state_lowers_the_held_out_loss_every_round(report: dict) -> None:
    for entry in report["rounds"]:
        assert entry["global_loss"] < entry["base_loss"], entry


def test_honest_miners_take_every_reward(report: dict) -> None:
    for entry in report["rounds"]:
        honest = [m for m in entry["miners"] if m["kind"] == "honest"]
        others = [m for m in entry["miners"] if m["kind"] != "honest"]
        assert sum(m["reward"] for m in honest) > 0, entry["miners"]
        assert all(m["reward"] == 0 for m in others), others


def test_each_adversary_gets_nothing_and_a_reason(report: dict) -> None:
    for entry in report["rounds"]:
        for miner in entry["miners"]:
            if miner["kind"] != "honest":
                assert miner["reward"] == 0, miner
                assert miner["reason"], f"round {entry['round']}: {miner['kind']} miner refused without a reason"


def test_both_validators_publish_the_same_global_state_every_round(report: dict) -> None:
    hashes = [[v["global_hash"] for v in entry["validators"]] for entry in report["rounds"]]
    for entry_hashes in hashes:
        assert entry_hashes[0] and entry_hashes[0] == entry_hashes[1], hashes
    assert len({h[0] for h in hashes}) == ROUNDS  # the state moved every round
