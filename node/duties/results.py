"""Each round's leaderboard, kept by every node: a miner learns its own loss, rank and reward per round.

A validator stores the ranking its merge produced (`exact`: it knew the near-duplicate flags). Any
other node, once the round settled (TRAIN of the next round), ranks the round itself from the
public score reports with the validators' function (`protocol.ranking.rank_reports`), on the plan
it computes from the seeds, commits and reveals it heard (`node.duties.plan`), without duplicate
flags, which only holders of the blobs can see. Leaderboard shape (JSON-able):
    {"round", "base", "base_loss", "exact",
     "miners": [{"miner", "commitment", "loss", "utility", "rank", "points", "reason",
                 "scores": {validator: {"loss", "verdict"}}}]}
Read back through node.store: `round_results(r)`, `miner_history(miner)`, `adopted_losses()`.
This module knows nothing about training or blobs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from node.duties.plan import make_plan
from node.store.db import Storage
from node.store.records import RoundPlan
from protocol.messages import ScoreReport
from protocol.ranking import NoCountedReports, RoundRanking, rank_reports
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)


def leaderboard(round: int, head: str, ranking: RoundRanking, reports: Mapping[str, ScoreReport],
                exact: bool) -> dict[str, Any]:
    """The leaderboard of one ranked round (shape in the module doc)."""
    scores: dict[str, dict[str, dict[str, Any]]] = {}
    for validator, report in sorted(reports.items()):
        if report.base != head:
            continue
        for entry in report.entries:
            scores.setdefault(entry.miner, {})[validator] = {"loss": entry.loss, "verdict": entry.verdict}
    miners = [{"miner": r.miner, "commitment": r.commitment, "loss": r.loss, "utility": r.utility, "rank": r.rank,
               "points": r.points, "reason": r.reason, "scores": scores.get(r.miner, {})}
              for r in ranking.results]
    return {"round": round, "base": head, "base_loss": ranking.base_loss, "exact": exact, "miners": miners}


async def learn_results(storage: Storage, spec: NetworkSpec, round: int) -> RoundPlan | None:
    """Rank a settled round from the public reports, unless its leaderboard is already stored; the plan it
    was ranked on, or None where it was not ranked now."""
    if round < spec.first_round or await storage.round_results(round) is not None:
        return None
    reports = await storage.score_reports(round)
    plan = await storage.round_plan(round) or await make_plan(storage, spec, round)
    if not reports or plan is None:
        return None
    head = await _round_head(storage, spec, round)
    try:
        ranking = rank_reports(reports, plan.assignment, plan.revealed, head, spec.rewards.top_k)
    except NoCountedReports as exc:
        log.info("round %d: no leaderboard: %s", round, exc)
        return None
    await storage.set_round_results(round, leaderboard(round, head, ranking, reports, exact=False))
    return plan


def unheard_by(plan: RoundPlan, reports: Mapping[str, ScoreReport], miner: str) -> tuple[str, ...]:
    """The validators assigned to `miner` in `plan` when every one of them reported on the round without
    naming it, so none took its commit or reveal in its window; () otherwise (not assigned, named by one,
    or a report that has not arrived, which says nothing)."""
    assigned = plan.assignment.get(miner, ())
    if not all(v in reports for v in assigned):
        return ()
    if any(entry.miner == miner for v in assigned for entry in reports[v].entries):
        return ()
    return assigned


async def _round_head(storage: Storage, spec: NetworkSpec, round: int) -> str:
    """The state `round` built on: the parent of the state it ended on, else the (unchanged) head."""
    adopted = [s for s in await storage.global_states(round) if s.adopted]
    return adopted[0].parent if adopted else await storage.head() or spec.root
