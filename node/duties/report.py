"""A validator's report of one round: every miner's verdict, loss, rank, reward and the reason.

`round_report` is a pure function of the round plan, the head scored against, the ranking (None
when no merge happened), the miners heard from and the merge gate's verdict (`gate`: which candidate
state was adopted and each candidate's losses, `validator.merge.Adoption.report`); the loss of the
adopted state is filled in a round later by the validator duty, and with it `outvote`: where validators
holding a majority of weight adopted another state than this validator's gate did, which candidate that
was and how it measured here. This module knows nothing about storage or the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from node.store.records import GlobalStateRecord, RoundPlan
from protocol.ranking import RoundRanking


def round_report(plan: RoundPlan, head: str, ranking: RoundRanking | None, proposed: str | None,
                 heard: Set[str], gate: Mapping[str, Any] | None) -> dict[str, Any]:
    """The JSON-able report; `heard`: miners whose heartbeat of this round or later was received."""
    miners: dict[str, dict[str, Any]] = {}
    if ranking is not None:
        for r in ranking.results:
            verdict = "reject" if r.reason.startswith("rejected") else "missing" if r.loss is None else "accept"
            miners[r.miner] = {"id": r.miner, "verdict": verdict, "loss": r.loss, "rank": r.rank,
                               "reward": r.points, "reason": r.reason}
    for miner in sorted(set(heard) | set(plan.commits)):
        if miner not in miners:
            reason = ("no commit in the COMMIT window" if miner not in plan.commits
                      else "no reveal matching its commitment" if miner not in plan.revealed
                      else "not admitted: more miners revealed than a round takes" if miner not in plan.assignment
                      else "not scored against the current global state")
            miners[miner] = {"id": miner, "verdict": "missing", "loss": None, "rank": None, "reward": 0.0,
                             "reason": reason}
    return {"round": plan.round, "base": head, "base_loss": None if ranking is None else ranking.base_loss,
            "proposed_hash": proposed, "global_hash": None, "global_loss": None,
            "gate": None if gate is None else dict(gate),
            "miners": [miners[m] for m in sorted(miners)]}


def outvote(gate: Mapping[str, Any], proposed: str | None, adopted: GlobalStateRecord,
            margin: float) -> dict[str, Any] | None:
    """Where the network adopted `adopted` for a round in which this validator's gate (`gate`, its report)
    picked another candidate: {"mine", "majority" (the candidate holding the adopted state's contributors, or
    "another" where none of ours does), "state", "gain" (how much lower the majority's candidate measured here
    than ours, nats; None where it was not weighed here), "margin"}; None where the network took our pick, or
    where we proposed nothing although the gate picked a change (out of sync, or a full disk: not a vote lost).
    """
    mine = gate["adopted"]
    if proposed == adopted.hash or (proposed is None and mine != "current"):
        return None
    contributors = sorted(adopted.contributors)
    majority = next((name for name, held in gate.get("holders", {}).items() if sorted(held) == contributors
                     and name != "current"), "another")
    losses = gate["losses"]
    gain = losses[mine] - losses[majority] if majority in losses and mine in losses else None
    return {"mine": mine, "majority": majority, "state": adopted.hash, "gain": gain, "margin": margin}
