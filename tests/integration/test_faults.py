"""Faults in a real simulated network (separate processes, loopback libp2p), over 3 rounds:
a validator SIGKILLed during EVALUATE of round 0 and restarted agrees on round 1's global state,
and a miner that first starts in round 1 catches up to the head and is scored in round 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.sim.run import SimSettings, Simulation
from protocol.rounds import Phase

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]


def test_a_killed_validator_rejoins_and_a_late_miner_catches_up(tmp_path: Path) -> None:
    with Simulation(tmp_path / "sim", SimSettings(validators=2, miners=2, round_seconds=60, train_share=0.7)) as sim:
        sim.start()

        sim.wait_phase(0, Phase.EVALUATE)
        sim.kill("validator-1")
        assert not sim.nodes["validator-1"].alive
        sim.restart("validator-1")

        sim.wait_phase(1, Phase.TRAIN)
        late = sim.add_node()

        round1 = sim.wait_round(1)
        assert set(round1) == {"validator-0", "validator-1"}, "the restarted validator did not finish round 1"
        hashes = {name: report["global_hash"] for name, report in round1.items()}
        assert hashes["validator-0"] == hashes["validator-1"], hashes

        round2 = sim.wait_round(2)
        # Scored at all means it trained from round 1's state (a stale base fails the checks).
        state = round2["validator-0"]["global_hash"]
        sim.wait_until(lambda: (sim.get(late.name, "/status") or {}).get("head") == state, 30,
                       "the late miner to adopt round 2's global state")
        for name, report in round2.items():
            scored = {m["id"]: m for m in report["miners"]}
            assert late.node_id in scored, f"{name} did not score the late miner in round 2"
            entry = scored[late.node_id]
            assert entry["loss"] is not None, entry
        assert sim.nodes["validator-1"].starts == 2
        sim.check_alive()
