"""A validator's report of one round: every miner's verdict, loss, rank, reward and the reason.

`round_report` is a pure function of the round plan, the head scored against, the ranking (None
when no merge happened), the miners heard from and the merge gate's verdict (`gate`: which candidate
state was adopted and each candidate's losses, `validator.merge.Adoption.report`). `RoundReports` keeps
them in storage: written when the validator merges, completed once the next round settled the state the
round ended on (its hash and its loss on the round's held-out subset), and with it `outvote`: where
validators holding a majority of weight adopted another state than this validator's gate did, which
candidate that was and how it measured here. This module knows nothing about the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Set
from typing import Any

import torch

from node.runtime.context import NodeContext
from node.store.records import GlobalStateRecord, RoundPlan
from protocol.ranking import RoundRanking
from training.state import GlobalExperts

log = logging.getLogger(__name__)


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


class RoundReports:
    """A validator's round reports in its storage (module doc)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    async def write(self, round: int, plan: RoundPlan, head: str, ranking: RoundRanking | None,
                    proposed: str | None, gate: Mapping[str, Any] | None) -> None:
        """Store the report of a round this validator merged (`gate`: its gate's verdict, None without a merge)."""
        heard = {n.node_id for n in await self.ctx.storage.nodes() if n.role == "miner" and n.round >= round}
        await self.ctx.storage.set_round_report(round, round_report(plan, head, ranking, proposed, heard, gate))
        self.ctx.metrics.seeds_withheld(plan.unrevealed_seeds, plan.excluded)

    async def finish(self, round: int, state: GlobalExperts | None,
                     loss: Callable[[dict[str, torch.Tensor], str], float]) -> None:
        """Fill in the state round `round` ended on (the head; `state` holds it) and its `loss` on that round's
        held-out subset; again when this node later follows another head (node.duties.consensus `follow`)."""
        report = await self.ctx.storage.round_report(round) if round >= self.ctx.spec.first_round else None
        plan = await self.ctx.storage.round_plan(round) if report is not None else None
        head = await self.ctx.head()
        # `state` is round + 1's where a restart late in round + 1's MERGE followed its votes first
        if report is None or plan is None or report["global_hash"] == head or state is None or state.round > round:
            return
        report["global_hash"] = head
        report["global_loss"] = await asyncio.to_thread(loss, dict(state.tensors), plan.seed)
        await self._note_outvote(round, report, head)
        await self.ctx.storage.set_round_report(round, report)

    async def _note_outvote(self, round: int, report: dict[str, Any], head: str) -> None:
        """Say so, once, where validators holding a majority of weight adopted for `round` a state other than the
        one our gate picked (the report's `gate.outvoted`, one line in the log, a counter)."""
        gate = report.get("gate")
        adopted = next((s for s in await self.ctx.storage.global_states(round) if s.hash == head), None)
        if not gate or not gate.get("losses") or "outvoted" in gate or adopted is None:
            return
        note = outvote(gate, report["proposed_hash"], adopted, self.ctx.spec.aggregation.gate_margin)
        if note is None:
            return
        gate["outvoted"] = note
        self.ctx.metrics.outvoted()
        gain = "" if note["gain"] is None else f"; here it measured {note['gain']:+.3g} nats against ours"
        log.warning("round %d: outvoted: my gate adopted the %s state; validators holding a majority of weight "
                    "adopted the %s state %s%s (the gate changes state only on a gain whose interval clears "
                    "%g nats)", round, note["mine"], note["majority"], head[:12], gain, note["margin"])
