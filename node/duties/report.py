"""A validator's report of one round: every miner's verdict, loss, rank, reward and the reason.

`round_report` is a pure function of the round plan, the head scored against, the ranking (None
when no merge happened), the miners heard from and the merge gate's verdict (`gate`: which candidate
state was adopted and each candidate's losses, `validator.merge.Adoption.report`); the loss of the
adopted state is filled in a round later by the validator duty. This module knows nothing about storage or the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from node.store.records import RoundPlan
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
