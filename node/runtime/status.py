"""The JSON views a node serves (/status, /rounds, /rounds/{r}, /miners/{id}) and the status page polls.

Read from storage on each request. A round's miners come from the node's own round report where it
wrote one (a validator: it also lists miners that never committed), else from the leaderboard every
node stores once the round settled (`storage.round_results`, ranked from the public score reports
by node.duties.results), plus miners that committed without revealing. Each miner row carries every
validator's score. The held-out loss of the state adopted after round r is the validator's report
of it, else the median base loss of round r+1's score reports (measured against that state): so on a
miner a round's adopted loss shows once the next round's reports are in, also for a round it could not
rank (then without miner rows). A validator's rounds also carry its merge gate's verdict (`gate`: the
candidate adopted, each one's loss, and where it was outvoted, `outvoted`), and its status the latest
outvote among the rounds shown. At each scrape, `refresh_metrics` copies the same numbers, and the disk's
free and needed bytes, into the node's Prometheus gauges. This module knows nothing about HTTP, computes no
ranking, and never writes to storage.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protocol.messages import ScoreReport
from protocol.ranking import update_standing
from protocol.rounds import PHASES
from protocol.spec import SpecError
from protocol.successor import decode_document, spec_from_bytes

if TYPE_CHECKING:
    from node.runtime.context import NodeContext
    from node.store.records import GlobalStateRecord
    from protocol.spec import NetworkSpec

ROUNDS_SHOWN = 32
STANDINGS_SHOWN = 20
"""/rewards lists this many best standings, as many as the page shows (STANDINGS in page/app.js): the ledger
keeps a standing for every miner key it ever rewarded."""


@dataclass(frozen=True)
class RoundView:
    """One round as this node knows it; `source` says whose numbers: "validator" (own report) or "public"."""

    round: int
    source: str
    base: str | None
    base_loss: float | None
    global_hash: str | None
    global_loss: float | None
    miners: list[dict[str, Any]]
    seeds: dict[str, list[str]] | None = None
    """Validators only, from the round plan: {"withheld": [validators that withheld their seed this round],
    "excluded": [validators left out of its assignment for withholding one in a recent round]}."""
    proposed_hash: str | None = None
    """Validators only: the state this validator proposed for the round (None: it proposed none)."""
    gate: dict[str, Any] | None = None
    """Validators only: the merge gate's verdict, {"adopted": "current" | "merged" | "best_single", "losses" and
    "general_losses": by candidate, "refused": [candidates over the forgetting budget]} (None: no merge)."""

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "source": self.source, "base": self.base, "base_loss": self.base_loss,
                "global_hash": self.global_hash, "global_loss": self.global_loss, "miners": self.miners,
                "seeds": self.seeds, "proposed_hash": self.proposed_hash, "gate": self.gate}


class NodeState(Protocol):
    """What the views read of a running node (`node.runtime.daemon.Node` is one): its context, and what it says
    of itself."""

    ctx: NodeContext
    genesis: NetworkSpec
    """The network's spec file (`ctx.spec` is the spec in force when the node started)."""

    async def status(self) -> dict[str, Any]: ...

    async def rewards(self, last_rounds: int | None = None, top: int | None = None) -> dict[str, Any]: ...

    async def round_report(self, round: int) -> dict[str, Any] | None: ...

    def metrics_text(self) -> bytes: ...

    async def offer_successor(self, data: bytes) -> dict[str, Any]: ...


class StatusViews:
    """The HTTP API's `StatusSource` for one running node: JSON-able views read from its storage."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.ctx = node.ctx

    async def status(self) -> dict[str, Any]:
        """The node's status plus the countdown, head round, validator agreement and (miners) own results."""
        ctx = self.ctx
        status = await self.node.status()
        now = ctx.clock.now()
        r, phase, start = ctx.schedule.next_phase_start(now)
        status["next_phase"] = {"round": r, "phase": str(phase), "in_s": round(max(0.0, start - now), 1)}
        status["phase_seconds"] = {str(p): length for p, length in zip(PHASES, ctx.schedule.lengths, strict=True)}
        head = status.get("head")
        states = await self._recent_states()
        status["head_round"] = next((s.round for s in states if s.hash == head), None)
        status["agreement"] = self._agreement(states)
        status["me"] = await self.miner(ctx.identity.node_id) if ctx.config.node.role == "miner" else None
        status["outvoted"] = await self._outvoted()
        status["spec"] = await self._spec(-1 if status.get("round") is None else status["round"], now)
        return status

    async def offer_successor(self, data: bytes) -> dict[str, Any]:
        return await self.node.offer_successor(data)

    async def _spec(self, current: int, now: float) -> dict[str, Any]:
        """The spec in force (network id, first round, group) and the accepted successor due next, if any: its
        activation round, the seconds until it, how many validators signed it and its group."""
        storage, genesis = self.ctx.storage, self.node.genesis
        spec_id = await storage.spec_in_force()
        spec = genesis if spec_id is None else spec_from_bytes((await storage.specs())[spec_id].body)
        due = [s for s in await storage.successors() if s.verdict == "accept" and s.predecessor == spec.network_id
               and s.activation > current]
        view: dict[str, Any] = {"id": spec.network_id, "since_round": spec.first_round, "successor": None,
                                "group": {str(layer): experts for layer, experts in spec.group.items()}}
        if due:
            next_ = min(due, key=lambda s: (s.activation, s.document))
            try:
                document = decode_document(await asyncio.to_thread(self.ctx.blobs.path(next_.document).read_bytes))
                group: dict[str, list[int]] | None = {str(k): v for k, v in document.group.items()}
            except (OSError, SpecError):
                group = None
            view["successor"] = {"document": next_.document, "activation": next_.activation,
                                 "in_s": round(max(0.0, self.ctx.schedule.round_start(next_.activation) - now), 1),
                                 "signed_by": int(next_.signed), "validators": len(genesis.validators),
                                 "group": group}
        return view

    async def _outvoted(self) -> dict[str, Any] | None:
        """A validator's latest round among those shown in which validators holding a majority of weight adopted
        another state than its gate picked (`node.duties.report.outvote`, with its round); else None."""
        latest = await self.ctx.storage.latest_round()
        if self.ctx.config.node.role != "validator" or latest is None:
            return None
        for r in range(latest, max(-1, latest - ROUNDS_SHOWN), -1):
            gate = ((await self.ctx.storage.round_report(r)) or {}).get("gate") or {}
            if gate.get("outvoted"):
                return {"round": r, **gate["outvoted"]}
        return None

    async def rewards(self) -> dict[str, Any]:
        """The ledger's entries of its last ROUNDS_SHOWN rounds and its STANDINGS_SHOWN best standings (the whole
        ledger is the exported JSONL, each line with the miner's standing after its round); on a node without
        a ledger (a miner), the best standings computed from public rankings."""
        rewards = await self.node.rewards(last_rounds=ROUNDS_SHOWN, top=STANDINGS_SHOWN)
        if not rewards["standings"]:
            standings = _standings(await self._views(), self.ctx.spec.rewards.ema_alpha)
            rewards["standings"] = dict(list(standings.items())[:STANDINGS_SHOWN])
        return rewards

    async def rounds(self) -> list[dict[str, Any]]:
        """The last rounds this node has seen, oldest first."""
        return [view.as_dict() for view in await self._views()]

    async def round_report(self, round: int) -> dict[str, Any] | None:
        """One round's view; None when this node knows nothing of it."""
        view = await self._view(round, await self.ctx.storage.score_reports(round + 1))
        return None if view is None else view.as_dict()

    async def miner(self, miner: str) -> list[dict[str, Any]]:
        """A miner's history, oldest first: its commitment, each validator's score, loss, rank and reward."""
        history = []
        for view in await self._views():
            entry = next((m for m in view.miners if m["id"] == miner), None)
            if entry is not None:
                history.append({"round": view.round, **entry})
        return history

    async def metrics_text(self) -> bytes:
        """The Prometheus text, with the round-result gauges read from storage just now."""
        await self.refresh_metrics()
        return self.node.metrics_text()

    async def refresh_metrics(self) -> None:
        """Set the gauges that come from round results (losses, own rank and reward, agreement, verdicts) and the
        data directory's free and needed bytes."""
        await asyncio.to_thread(self.ctx.disk.look)
        views = await self._views()
        states = await self._recent_states()
        me = self.ctx.identity.node_id
        last = next((v for v in reversed(views) if v.miners), None)
        own = None  # a miner's result in the last round with miners: nothing scored there earned nothing, and
        if self.ctx.config.node.role == "miner":  # a loss not scored there is not shown (not its last one)
            rows = [] if last is None else last.miners
            row = next((m for m in rows if m["id"] == me and m["verdict"] != "missing"), None)
            own = {"loss": None, "rank": None, "reward": 0.0} if row is None else {
                "loss": row["loss"] if row["verdict"] == "accept" else None, "rank": row["rank"],
                "reward": row["reward"]}
        self.ctx.metrics.round_results(
            base_loss=next((v.base_loss for v in reversed(views) if v.base_loss is not None), None),
            adopted_loss=next((v.global_loss for v in reversed(views) if v.global_loss is not None), None),
            own=own, agreement=self._agreement(states),
            verdicts=[] if last is None else [(m["verdict"], m["reason"]) for m in last.miners],
            gate=next((v.gate for v in reversed(views) if v.gate and v.gate["losses"]), None))

    # -- building the views ---------------------------------------------------------------------

    async def _views(self) -> list[RoundView]:
        latest = await self.ctx.storage.latest_round()
        if latest is None:
            return []
        views: list[RoundView] = []
        next_reports = await self.ctx.storage.score_reports(latest + 1)
        for r in range(latest, max(-1, latest - ROUNDS_SHOWN), -1):
            reports = await self.ctx.storage.score_reports(r)
            view = await self._view(r, next_reports, reports)
            next_reports = reports
            if view is not None:
                views.append(view)
        return views[::-1]

    async def _view(self, round: int, next_reports: dict[str, ScoreReport],
                    reports: dict[str, ScoreReport] | None = None) -> RoundView | None:
        storage = self.ctx.storage
        if reports is None:
            reports = await storage.score_reports(round)
        own = await self.node.round_report(round)
        results = await storage.round_results(round)
        public_loss = _median([rep.base_loss for rep in next_reports.values()])  # round r+1's base: this state
        scores = _scores_by_miner(reports)
        if own is not None:
            miners = [{**m, "scores": scores.get(m["id"], {})} for m in own.get("miners", [])]
            loss = own.get("global_loss")
            return RoundView(round, "validator", own.get("base"), own.get("base_loss"), own.get("global_hash"),
                             loss if loss is not None else public_loss, miners, await self._seeds(round),
                             own.get("proposed_hash"), own.get("gate"))
        if results is None:  # a round this node could not rank (no report against the head it held)
            if not next_reports:
                return None  # not settled yet, or nothing public says how it ended
            return RoundView(round, "public", _most_common([rep.base for rep in reports.values()]),
                             _median([rep.base_loss for rep in reports.values()]), None, public_loss, [])
        rows = {line["miner"]: _row(line) for line in results["miners"]}
        for commit in await storage.commits_for(round):
            rows.setdefault(commit.miner, {"id": commit.miner, "verdict": "missing", "loss": None, "rank": None,
                                           "reward": 0.0, "reason": "no reveal matching its commitment",
                                           "scores": {}})
        return RoundView(round, "public", results["base"], results["base_loss"], None, public_loss,
                         [rows[m] for m in sorted(rows)])

    async def _recent_states(self) -> list[GlobalStateRecord]:
        """The global states from ROUNDS_SHOWN rounds before the clock's on, oldest first.

        Storage keeps every state ever announced, so reading them all would grow with the network's age."""
        now, schedule = self.ctx.clock.now(), self.ctx.schedule
        if now < schedule.genesis_ts:
            return []
        return await self.ctx.storage.global_states(since=max(0, schedule.round_at(now) - ROUNDS_SHOWN))

    async def _seeds(self, round: int) -> dict[str, list[str]] | None:
        """From the round plan this validator fixed: who withheld a seed, who was left out of the assignment."""
        plan = await self.ctx.storage.round_plan(round)
        return None if plan is None else {"withheld": list(plan.unrevealed_seeds), "excluded": list(plan.excluded)}

    def _agreement(self, states: list[GlobalStateRecord]) -> dict[str, Any] | None:
        """The share of validator weight behind the most-voted state of the latest round with votes."""
        if not states:
            return None
        latest = max(s.round for s in states)
        weights = self.ctx.spec.validator_weights
        total = sum(weights.values())
        tally = {s.hash: sum(weights.get(v, 0.0) for v in s.voters) for s in states if s.round == latest}
        best = max(sorted(tally), key=lambda h: tally[h])
        voted = sum(tally.values())
        return {"round": latest, "hash": best, "share": tally[best] / total if total else 0.0,
                "voted": voted / total if total else 0.0, "states": len(tally)}


def learning_settings(spec: NetworkSpec) -> dict[str, Any]:
    """How this network learns, as /status shows it: what miners send, how they train, how the state is merged."""
    submission, training, aggregation = spec.submission, spec.training, spec.aggregation
    return {
        "format": submission.format,
        "pgrad": submission.model_dump(exclude={"format"}) if submission.format == "pgrad" else None,
        "experts": sum(len(ids) for ids in spec.group.values()),
        "inner_steps": training.inner_steps,
        "inner_lr": training.lr,
        "inner_beta1": training.beta1,
        "batch_size": training.batch_size,
        "top_g": aggregation.top_g,
        "outer_lr": aggregation.outer_lr,
        "momentum": aggregation.momentum,
        "weighting": aggregation.weighting,
    }


def _row(line: dict[str, Any]) -> dict[str, Any]:
    """A leaderboard line (node.duties.results) in the views' miner-row shape."""
    reason = line["reason"]
    verdict = "reject" if reason.startswith("rejected") else "missing" if line["loss"] is None else "accept"
    return {"id": line["miner"], "verdict": verdict, "loss": line["loss"], "rank": line["rank"],
            "reward": line["points"], "reason": reason, "scores": line["scores"]}


def _scores_by_miner(reports: dict[str, ScoreReport]) -> dict[str, dict[str, dict[str, Any]]]:
    """miner -> validator -> that validator's verdict, loss and reason."""
    scores: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for validator, report in sorted(reports.items()):
        for e in report.entries:
            scores[e.miner][validator] = {"verdict": e.verdict, "loss": e.loss, "reason": e.reason}
    return scores


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _most_common(values: list[str]) -> str | None:
    """The value most of `values` name (the smallest of a tie); None for none."""
    return min(set(values), key=lambda v: (-values.count(v), v)) if values else None


def _standings(views: list[RoundView], alpha: float) -> dict[str, float]:
    standing: dict[str, float] = {}
    for view in views:
        standing = update_standing(standing, {m["id"]: m["reward"] for m in view.miners if m["reward"]}, alpha)
    return dict(sorted(standing.items(), key=lambda kv: (-kv[1], kv[0])))
