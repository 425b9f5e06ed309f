"""One simulated network that the integration tests of test_network.py read: real node processes over
loopback libp2p, 3 validators, honest miners and one miner of every adversary kind, 3 rounds.

While it runs, the fault matrix is played: at the start of a phase the nodes `KILLS` names are
SIGKILLed and restarted at once — a miner and a validator at each of TRAIN, COMMIT, REVEAL,
EVALUATE and MERGE (10 cases) — and a miner that was not there at genesis joins at TRAIN of round 1.
A restarted node takes in what it missed before its first phase (from GossipSub's message cache and
by asking a peer for the round's history), but what went out while it was still starting can be
lost to it: a validator restarted during COMMIT..MERGE may then plan and merge differently from the
others, and only the validators that saw the whole round are sure to agree. With 3 validators of equal weight two that agree are a majority: round 0 (one
validator killed, at EVALUATE) and round 2 (no kills) must move the state; round 1 takes the other
four validator cases and may end without a majority, and then the state stays as it was. The miners
killed after revealing (EVALUATE, MERGE) are killed in round 0, where two validators are whole.
A validator that missed other validators' seed reveals counts them as withheld (node.duties.plan)
and can keep an assignment of its own, so a vote of its own, for up to SEED_WITHHOLD_ROUNDS more
rounds; it still ends each round on the majority's state (node.duties.consensus follows the head a
weight majority of validators announce). `miner-5` is never killed: the metrics test reads it.

`run_network` returns a `NetworkRun`: the simulation (still running, for the status page and
/metrics) and what each validator reported of each round, read after the last round settled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.sim.process import ADVERSARY_KINDS
from node.sim.run import SimSettings, Simulation
from protocol.rounds import PHASES, Phase

ROUNDS = 3
HONEST = 6
VALIDATORS = ("validator-0", "validator-1", "validator-2")
SETTINGS = SimSettings(validators=len(VALIDATORS), miners=HONEST + len(ADVERSARY_KINDS), adversaries=ADVERSARY_KINDS,
                       # Training stops after 10 steps, well before TRAIN ends, so a node restarted in
                       # TRAIN is not starved of CPU by 11 training miners on 2 cores; run alone, the network
                       # used about 250 s of CPU at 30 steps and 162 s at 10. Nodes fork from a
                       # fork server that has imported torch and the node (node.sim.warm): the 16 listen
                       # within seconds of their start, so 40 s before genesis is plenty. A restarted miner
                       # listened in 2 s, a validator in 15 s, and beside the suite's other tests it took
                       # 16 s more to load its model at TRAIN (TRAIN is 27 s); it commits its seed first
                       # (node.duties.validator), so the one killed in round 0's EVALUATE commits in round 1.
                       round_seconds=60, train_share=0.45, inner_steps=10,
                       start_delay_s=40)
# (round, phase) -> the nodes SIGKILLed at the start of that phase and restarted at once.
KILLS: dict[tuple[int, Phase], tuple[str, ...]] = {
    (0, Phase.COMMIT): ("miner-1",),
    (0, Phase.EVALUATE): ("miner-3", "validator-1"),
    (0, Phase.MERGE): ("miner-4",),
    (1, Phase.TRAIN): ("miner-0", "validator-0"),
    (1, Phase.COMMIT): ("validator-0",),
    (1, Phase.REVEAL): ("miner-2", "validator-2"),
    (1, Phase.MERGE): ("validator-2",),
}
# Rounds in which at most one validator is disturbed: they must move the state, and every miner that
# revealed is scored in them whatever happened to it afterwards.
WHOLE_ROUNDS = (0, 2)
LATE_JOIN = (1, Phase.TRAIN)
OBSERVED = "miner-5"


@dataclass
class NetworkRun:
    sim: Simulation
    reports: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """round -> validator name -> its own report of the round (/rounds/{round}), where it made one."""
    late: str = ""
    """The name of the miner that joined at LATE_JOIN."""

    def whole(self, round: int) -> list[str]:
        """The validators that reported `round` and were not killed during it."""
        return [v for v in VALIDATORS if v in self.reports[round]
                and not any(r == round and v in names for (r, _), names in KILLS.items())]

    def deciders(self, round: int) -> list[str]:
        """The validators whose proposal became the round's state: their ranking is the network's."""
        return [v for v, report in self.reports[round].items()
                if report.get("proposed_hash") is not None and report["proposed_hash"] == report["global_hash"]]

    def id(self, name: str) -> str:
        return self.sim.nodes[name].node_id

    def entry(self, round: int, validator: str, miner: str) -> dict[str, Any] | None:
        """The miner's line in a validator's report of `round` (None when the report does not name it)."""
        report = self.reports[round].get(validator) or {}
        return next((m for m in report.get("miners", []) if m["id"] == self.id(miner)), None)


def run_network(directory: Path) -> NetworkRun:
    """Start the network, play the kill schedule, wait for the last round to settle; returns it running.

    The caller closes `run.sim` (it is a context manager)."""
    sim = Simulation(directory, SETTINGS)
    run = NetworkRun(sim)
    try:
        sim.start()
        events = sorted(set(KILLS) | {LATE_JOIN}, key=lambda rp: (rp[0], PHASES.index(rp[1])))
        for r, phase in events:
            sim.wait_phase(r, phase)
            for name in KILLS.get((r, phase), ()):
                sim.kill(name)
                sim.restart(name)
            if (r, phase) == LATE_JOIN:
                run.late = sim.add_node().name
        for r in range(ROUNDS):
            sim.wait_round(r)
        for r in range(ROUNDS):
            # Its own report: a validator killed before merging a round shows only the public view of it.
            run.reports[r] = {v: report for v in VALIDATORS if isinstance(report := sim.get(v, f"/rounds/{r}"), dict)
                              and report.get("source") == "validator"}
    except BaseException:
        sim.close()
        raise
    return run
