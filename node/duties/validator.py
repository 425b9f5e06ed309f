"""Validator duties: seeds, Proof-of-Loss scoring, and the merge that proposes the next global state.

TRAIN of round r: commit to a fresh seed (node.duties.seeds), settle round r-1's state (node.duties.consensus;
a validator in the minority re-syncs state and momentum). REVEAL: reveal the seed; the round's revealed blobs
are fetched in the background (node.duties.prefetch, assigned ones first, within a byte budget). EVALUATE: the
round plan (node.duties.plan: the round seed, the miners, the assignment) is fixed and persisted, and the blobs
assigned to this validator are fetched, checked and scored off the event loop; a ScoreReport is published.
MERGE: after waiting for the other validators' reports (half the phase, then asking a peer),
`validator.merge.merge_round` on the same plan and the reports as stored, fetching and checking once the
candidates this validator did not score; then the merge gate (`validator.merge.gate`) adopts a state on held-out
rows the round seed draws apart from the scored ones. The reports the merge used are fixed in storage before
anything follows from them, so a merge run again after a restart ranks, rewards and proposes the same; rewards
and their mark are one write; the adopted state and momentum are stored, served and announced in GlobalState
(a round that adopts nothing proposes no state). The round report (node.duties.report) is completed once the
next round settled the state. Each step checks storage first, so a restarted validator publishes nothing twice.
This module knows nothing about libp2p; torch work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from node.duties.consensus import Consensus, wait_until
from node.duties.plan import make_plan, unpaired
from node.duties.prefetch import Prefetcher, early_assignment
from node.duties.report import RoundReports
from node.duties.results import leaderboard, learn_results
from node.duties.seeds import Seeds
from node.duties.succession import inherited_paths
from node.net.network import NetworkError
from node.runtime.context import BuiltOnce, HeartbeatDuties, NodeContext
from node.store.records import Proposal, RewardRecord, RoundPlan
from protocol.messages import (
    Envelope,
    GlobalState,
    Message,
    Reveal,
    ScoreReport,
    SeedReveal,
    fit_report,
    report_capacity,
)
from protocol.ranking import NoCountedReports, update_standing
from protocol.rounds import Phase
from training.device import check_device
from training.state import GlobalExperts, inherited_experts
from validator.device import skeleton
from validator.merge import Adoption, MergeInputError, MergeResult, MissingBlobError, gate, merge_round
from validator.model import ValidatorModel, check_files, spec_files
from validator.scoring import CheckedSubmissions, gate_measure

log = logging.getLogger(__name__)

MERGE_WAIT_SHARE = 0.5  # of MERGE: how long to wait for the other validators' reports


class ValidatorDuties:
    """A validator's phase work; build with `ValidatorDuties(ctx)` (a DutiesFactory).

    Refuses to start (ValueError) when the held-out file does not hash to the spec's heldout_sha256.
    """

    def __init__(self, ctx: NodeContext) -> None:
        section, spec_path = ctx.config.validator, ctx.config.node.spec
        assert section.heldout is not None, "the config requires validator.heldout for a validator"
        heldout, general = spec_files(ctx.spec, section.heldout, section.general, section.data)
        check_files(ctx.spec, spec_path, heldout, general)
        check_device(section.device, skeleton(ctx.spec, spec_path), section.batch_size, ctx.spec.data.seq_len)
        self.ctx = ctx
        self.me = ctx.identity.node_id
        self.consensus = Consensus(ctx, need_momentum=True)
        self.heartbeat = HeartbeatDuties(ctx)
        self.seeds = Seeds(ctx, self._publish)
        self.reports = RoundReports(ctx)
        self.arrivals = asyncio.Event()
        self.state: GlobalExperts | None = None
        self.synced = False
        self._loaded = BuiltOnce(lambda: ValidatorModel.load(
            ctx.spec, spec_path, heldout, general, section.device, section.batch_size, section.weights,
            inherited_experts(inherited_paths(ctx), ctx.spec.limits.max_header_bytes)))
        self._checked = CheckedSubmissions(-1)
        self._prefetch = Prefetcher(ctx.network, report_capacity(ctx.spec.limits.max_message_bytes),
                                    section.prefetch_bytes, ctx.disk.quiet)
        self._cap: int | None = None  # known once the model is loaded

    async def on_phase(self, round: int, phase: Phase) -> None:
        if phase is Phase.TRAIN:
            # First, and without the model: a validator still loading it (51-62 s at real size, beside a miner
            # loading its own) commits its seed inside the window all the same.
            await self.seeds.commit(round)
        loaded = await self._loaded.get()
        self._cap = loaded.cap
        await self.consensus.on_phase(round, phase, loaded.scorer.shapes)
        await self._load_head(loaded)
        await self.heartbeat.on_phase(round, phase)
        await self._serve_proposals(round)
        await self.reports.finish(round - 1, self.state, loaded.loss)
        if phase is Phase.TRAIN:
            self._checked = CheckedSubmissions(round)
            self._prefetch.clear()
            await learn_results(self.ctx.storage, self.ctx.spec, round - 1)  # a round it did not merge
        elif phase is Phase.REVEAL:
            await self.seeds.reveal(round)
        elif phase is Phase.EVALUATE:
            await self._evaluate(round, loaded)
        elif phase is Phase.MERGE:
            await self._merge(round, loaded)

    async def close(self, round: int) -> None:
        loaded = await self._loaded.get()
        await self.consensus.settle(round, loaded.scorer.shapes)
        await self._load_head(loaded)
        await self.reports.finish(round - 1, self.state, loaded.loss)

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        await self.consensus.on_message(envelope, message)
        if isinstance(message, Reveal | SeedReveal) and self._cap is not None:
            current = self.ctx.schedule.round_at(self.ctx.clock.now())
            if message.round == current:
                if isinstance(message, Reveal):
                    self._prefetch.offer(message.commitment, envelope.sender, message.size, self._cap)
                if self._prefetch.assigned is None:
                    assigned = await early_assignment(self.ctx.storage, self.ctx.spec, current, self.me)
                    if assigned is not None:
                        self._prefetch.assign(assigned)
        self.arrivals.set()

    async def _load_head(self, loaded: ValidatorModel) -> None:
        head = await self.ctx.head()
        if self.state is not None and self.state.hash == head and self.synced:
            return
        result = await self.consensus.load(head, loaded.genesis, loaded.scorer.shapes)
        self.state, self.synced = result.state, result.synced

    async def _serve_proposals(self, round: int) -> None:
        """Serve what we proposed in this round and the last (again after a restart)."""
        for r in (round - 1, round):
            proposal = await self.ctx.storage.proposal(r)
            for blob_hash in () if proposal is None else (proposal.state, proposal.momentum):
                if self.ctx.blobs.has(blob_hash):
                    self.ctx.network.serve(blob_hash)

    # -- the round plan -----------------------------------------------------------------------

    async def _plan(self, round: int) -> RoundPlan | None:
        """The round's plan: fixed and persisted the first time it is asked for (at EVALUATE)."""
        plan = await self.ctx.storage.round_plan(round)
        if plan is not None:
            return plan
        if self.ctx.schedule.phase_at(self.ctx.clock.now()) == (round, Phase.EVALUATE):  # not restarted late
            await self.ctx.take_in_from_peer(round, lambda: unpaired(self.ctx.storage, round))
        plan = await make_plan(self.ctx.storage, self.ctx.spec, round)
        if plan is None:
            return None
        if plan.unrevealed_seeds:
            log.warning("round %d: validator(s) %s committed a seed and did not reveal it", round,
                        ", ".join(v[:12] for v in plan.unrevealed_seeds))
        return await self.ctx.storage.fix_round_plan(plan)

    # -- EVALUATE -----------------------------------------------------------------------------

    async def _evaluate(self, round: int, loaded: ValidatorModel) -> None:
        plan = await self._plan(round)
        if plan is None or await self._published(round, "score_report"):
            return
        assert self.state is not None
        mine = sorted(m for m, chosen in plan.assignment.items() if self.me in chosen)
        fetched = await asyncio.gather(*(self._fetch(plan.revealed[m], m, loaded) for m in mine))
        submissions = {m: (plan.revealed[m], path) for m, path in zip(mine, fetched, strict=True)}
        head = await self.ctx.head()
        started = time.perf_counter()
        stopping = threading.Event()  # as a miner's training: cancelling cannot reach the scoring thread
        try:
            result = await asyncio.to_thread(loaded.scorer.score_round, round, plan.seed, self.state.tensors,
                                             head, submissions, lambda: not stopping.is_set())
        except asyncio.CancelledError:
            stopping.set()  # the thread stops before its next submission, so the process can exit
            raise
        self.ctx.metrics.submissions_scored(time.perf_counter() - started,
                                            [(e.verdict, e.reason) for e in result.entries])
        self._checked.add(round, result.accepted)
        log.info("round %d: validator %s scored %d miner(s) against %s with seed %s: base loss %.4f", round,
                 self.me[:8], len(mine), head[:12], plan.seed[:12], result.base_loss)
        for entry in result.entries:
            log.info("round %d: miner %s %s %s", round, entry.miner[:12], entry.verdict,
                     f"loss {entry.loss:.4f}" if entry.loss is not None else entry.reason)
        await self._publish(fit_report(result.report(round, head), self.ctx.spec.limits.max_message_bytes))

    async def _fetch(self, blob_hash: str, miner: str, loaded: ValidatorModel) -> Path | None:
        """The blob's file in the local store, fetched from its miner if it is not there; None if that fails."""
        await self._prefetch.wait(blob_hash)  # in the local store now, unless that fetch failed
        try:
            return await self.ctx.network.fetch(blob_hash, [miner], loaded.cap)
        except (NetworkError, OSError) as exc:
            if not self.ctx.disk.quiet(exc):
                log.warning("blob %s of miner %s: %s", blob_hash[:12], miner[:12], exc)
            return None

    async def _check_candidates(self, round: int, plan: RoundPlan, miners: list[str], head: str,
                                loaded: ValidatorModel) -> None:
        """Fetch and check the blobs of merge candidates this validator did not score itself."""
        for miner in miners:
            path = await self._fetch(plan.revealed[miner], miner, loaded)
            try:
                data = None if path is None else await asyncio.to_thread(path.read_bytes)
            except OSError as exc:
                log.warning("blob %s of miner %s: %s", plan.revealed[miner][:12], miner[:12], exc)
                data = None
            if path is None or data is None:
                continue
            state = None if self.state is None else self.state.tensors  # a pgrad blob is rebuilt against it
            verdict = await asyncio.to_thread(loaded.scorer.check, round, miner, plan.revealed[miner], data,
                                              head, state)
            del data  # the checked bytes: up to a GB; the merge reads the file again, a tensor at a time
            if verdict.ok:
                self._checked.add(round, {miner: loaded.scorer.held(verdict, path)})
            else:
                log.warning("round %d: candidate %s fails my checks: %s", round, miner[:12], verdict.reason)

    # -- MERGE --------------------------------------------------------------------------------

    async def _merge(self, round: int, loaded: ValidatorModel) -> None:
        plan = await self._plan(round)
        if plan is None or await self.ctx.storage.round_report(round) is not None:
            return
        expected = {s.validator for s in await self.ctx.storage.seeds_for(round) if s.commitment}
        start, end = self.ctx.schedule.phase_window(round, Phase.MERGE)

        async def reports_in() -> bool:
            return expected <= set(await self.ctx.storage.score_reports(round))

        async def reports_missing() -> bool:
            return not await reports_in()

        deadline = start + MERGE_WAIT_SHARE * (end - start)
        late = self.ctx.clock.now() >= deadline  # restarted past the wait: no time to ask a peer either
        merged_from = await self.ctx.storage.merged_from(round)  # set: merged before a restart
        if (merged_from is None and not await wait_until(self.ctx.clock, self.arrivals, reports_in, deadline)
                and (late or await self.ctx.take_in_from_peer(round, reports_missing))):
            log.warning("round %d: merging without the reports of every validator that committed a seed",
                        round)
        head = await self.ctx.head()
        reports = await self.ctx.storage.score_reports(round)
        if merged_from is not None:  # reports that came in since must not change what we rewarded and voted
            reports = {v: report for v, report in reports.items() if v in merged_from}
        try:
            result, adoption = await self._merge_result(round, plan, head, loaded, reports)
        except (MergeInputError, NoCountedReports) as exc:
            log.warning("round %d: no merge: %s", round, exc)
            await self.reports.write(round, plan, head, None, None, None)
            return
        finally:
            self._checked = CheckedSubmissions(round + 1)  # accepted submissions are kept only until their merge
        await self.ctx.storage.fix_merged_from(round, reports)
        await self._record_rewards(round, result)
        await self.ctx.storage.set_round_results(round, leaderboard(round, head, result.ranking, reports, exact=True))
        proposed = await self._propose(round, adoption, head) if adoption.changed else None
        await self.reports.write(round, plan, head, result.ranking, proposed, adoption.report())

    async def _merge_result(self, round: int, plan: RoundPlan, head: str, loaded: ValidatorModel,
                            reports: Mapping[str, ScoreReport]) -> tuple[MergeResult, Adoption]:
        """`merge_round` on `reports` and this round's checked blobs, fetching missing candidates once, and
        the state its gate adopts."""
        assert self.state is not None
        state = self.state

        def merge() -> tuple[MergeResult, Adoption]:
            blobs = self._checked.of(round)
            tensors, momentum = dict(state.tensors), dict(state.momentum)
            spec = self.ctx.spec
            result = merge_round(reports, plan.assignment, plan.revealed, blobs, tensors, momentum, spec, head)
            measure = gate_measure(loaded.scorer, plan.seed, loaded.general)
            # A successor counts its forgetting budget from its base, the value at the switch: its general-domain
            # file is the group it replaced, and the budget bounds what the new group takes from it in all.
            counts_from_base = spec.lineage is not None and spec.aggregation.forgetting_budget is not None
            reference = measure(loaded.genesis.tensors).general if counts_from_base and result.best else None
            return result, gate(result, blobs, tensors, momentum, spec, measure, reference)

        try:
            return await asyncio.to_thread(merge)
        except MissingBlobError as exc:
            await self._check_candidates(round, plan, exc.miners, head, loaded)
        return await asyncio.to_thread(merge)

    async def _propose(self, round: int, result: Adoption, head: str) -> str | None:
        """Store, serve and announce the adopted state; None when this validator abstains. Once our vote is
        out, the proposal it named stands: a merge run again after a restart may see reports that came
        in since, and must not serve or report a state other than the one we voted for."""
        assert self.state is not None
        voted = await self.ctx.storage.proposal(round) if await self._published(round, "global_state") else None
        if voted is not None:
            self.ctx.network.serve(voted.state)
            self.ctx.network.serve(voted.momentum)
            return voted.state
        if not self.synced:
            log.warning("round %d: my outer momentum is not the network's; not proposing a state", round)
            return None
        proposal = self.state.child(round, result.new_global, result.new_momentum)

        def store() -> tuple[str, str]:  # a tensor at a time: the state and momentum are GBs at real size
            return (self.ctx.blobs.put_parts(proposal.hash, proposal.blob_parts()),
                    self.ctx.blobs.put_parts(proposal.momentum_hash, proposal.momentum_parts()))

        try:
            state_hash, momentum_hash = await asyncio.to_thread(store)
        except OSError as exc:  # a full or failing disk: nothing recorded, announced or served
            if not self.ctx.disk.quiet(exc):
                log.error("round %d: cannot store the proposed state (%s); not proposing a state", round, exc)
            return None
        await self.ctx.storage.set_proposal(round, Proposal(state_hash, momentum_hash), self.me)
        self.ctx.network.serve(state_hash)
        self.ctx.network.serve(momentum_hash)
        if not await self._published(round, "global_state"):
            await self._publish(GlobalState(round=round, hash=state_hash, parent=head,
                                            contributors=tuple(result.contributors), momentum=momentum_hash))
        log.info("round %d: proposed state %s from %d contributor(s)", round, state_hash[:12],
                 len(result.contributors))
        return state_hash

    async def _record_rewards(self, round: int, result: MergeResult) -> None:
        if await self.ctx.storage.rewarded(round):
            return
        standings = update_standing(await self.ctx.storage.standings(), result.points, self.ctx.spec.rewards.ema_alpha)
        entries = [RewardRecord(round, r.miner, r.rank, r.points, r.utility, standings.get(r.miner, 0.0))
                   for r in result.ranking.results if r.rank is not None]
        await self.ctx.storage.add_rewards(round, entries, standings)  # one transaction with the mark

    # -- helpers ------------------------------------------------------------------------------

    async def _published(self, round: int, kind: str) -> bool:
        return any(m.kind == kind and m.sender == self.me for m in await self.ctx.storage.messages(round))

    async def _publish(self, message: Message) -> None:
        await self.ctx.announce(message)
