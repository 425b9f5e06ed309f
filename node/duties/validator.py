"""Validator duties: seeds, Proof-of-Loss scoring, and the merge that proposes the next global state.

TRAIN of round r: settle round r-1's global state (node.duties.consensus; a validator in the minority
re-syncs state and momentum), then commit to a fresh seed, persisted BEFORE it is published so a restart
reuses it. REVEAL: reveal the seed; the blobs of the round's accepted Reveals are fetched in the background
(node.duties.prefetch: assigned ones first, within a byte budget), so a miner that goes down after revealing
is still scored. EVALUATE: a commit here without its reveal (or the reverse) sends us to a peer for the
round's envelopes; then the round plan (node.duties.plan: seed s_r from the validators that committed and
revealed, the miners with a Commit and a matching Reveal, the assignment) is fixed and persisted; the blobs of the miners assigned
to this validator are fetched (capped), checked and scored off the event loop, and a ScoreReport is
published. MERGE: wait for the other validators' reports (half the phase, then ask a peer for them),
then `validator.merge.merge_round` on the SAME plan and the reports as stored whole; its
MissingBlobError names the candidates this validator did not score, which are fetched and checked once
into the round's checked-blob cache (`_Checked`, emptied after the merge). The merge gate
(`validator.merge.gate`) then adopts the lowest of the current, merged and best-single states on held-out
rows the round seed draws apart from the scored ones, refusing one that forgets more of the general-domain
file (`validator.general`, where the spec pins one) than the spec's budget. The validators whose reports
the merge used are fixed in storage before anything follows from it, so a merge run again after a
restart ranks, rewards and proposes from the same reports (not from any that came in since), and the
ledger, leaderboard, round report and vote agree. Rewards and their mark are one storage write; the new
state and momentum are recorded as our proposal, served (again after any restart) and announced in
GlobalState. A round that merges nothing proposes no state. The round report, with the gate's
candidates' losses (node.duties.report), and the leaderboard (node.duties.results) are stored; the loss of
the ADOPTED state on round r's held-out subset is filled in once round r+1 has settled it. Each step checks storage first, so a restarted validator resumes
without publishing anything twice.
This module knows nothing about libp2p; torch work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from node.duties.consensus import Consensus, wait_until
from node.duties.plan import make_plan, unpaired
from node.duties.prefetch import Prefetcher, early_assignment
from node.duties.report import round_report
from node.duties.results import leaderboard, learn_results
from node.net.network import NetworkError, PublishRefused
from node.runtime.context import BuiltOnce, HeartbeatDuties, NodeContext
from node.store.records import Proposal, RewardRecord, RoundPlan
from protocol.check import window
from protocol.messages import (
    Envelope,
    GlobalState,
    Message,
    Reveal,
    ScoreReport,
    SeedCommit,
    SeedReveal,
    fit_report,
    report_capacity,
)
from protocol.ranking import RoundRanking, update_standing
from protocol.rounds import Phase
from protocol.seeds import commitment, new_seed
from protocol.spec import spec_dir_path
from training.adapters import tensor_attr
from training.blob import BlobFile
from training.data import (
    check_disjoint,
    check_general_file,
    check_heldout_file,
    heldout_subset,
    load_sequences,
    read_documents,
)
from training.device import check_device
from training.experts import Tensors, extract
from training.model import load_base
from training.state import GlobalExperts
from training.tokenizer import load_tokenizer
from validator.checks import submission_cap
from validator.device import skeleton
from validator.merge import Adoption, MergeInputError, MergeResult, MissingBlobError, gate, merge_round
from validator.scoring import Scorer, apply_global, check_gate_data, gate_measure

log = logging.getLogger(__name__)

MERGE_WAIT_SHARE = 0.5  # of MERGE: how long to wait for the other validators' reports


class ValidatorDuties:
    """A validator's phase work; build with `ValidatorDuties(ctx)` (a DutiesFactory).

    Refuses to start (ValueError) when the held-out file does not hash to the spec's heldout_sha256.
    """

    def __init__(self, ctx: NodeContext) -> None:
        heldout = ctx.config.validator.heldout
        assert heldout is not None, "the config requires validator.heldout for a validator"
        try:
            check_heldout_file(heldout, ctx.spec.data.heldout_sha256)
        except ValueError as exc:
            raise ValueError(f"validator.heldout: {exc}") from None
        _check_disjoint(ctx)
        _check_general(ctx)
        section = ctx.config.validator
        check_device(section.device, skeleton(ctx.spec, ctx.config.node.spec), section.batch_size, ctx.spec.data.seq_len)
        self.ctx = ctx
        self.me = ctx.identity.node_id
        self.consensus = Consensus(ctx, need_momentum=True)
        self.heartbeat = HeartbeatDuties(ctx)
        self.arrivals = asyncio.Event()
        self.state: GlobalExperts | None = None
        self.synced = False
        self._loaded = BuiltOnce(lambda: _Loaded.create(ctx))
        self._checked = _Checked(-1)
        self._prefetch = Prefetcher(ctx.network, report_capacity(ctx.spec.limits.max_message_bytes),
                                    section.prefetch_bytes)
        self._cap: int | None = None  # known once the model is loaded

    async def on_phase(self, round: int, phase: Phase) -> None:
        if phase is Phase.TRAIN:
            # First, and without the model: a validator still loading it (51-62 s at real size, beside a miner
            # loading its own) commits its seed inside the window all the same.
            await self._commit_seed(round)
        loaded = await self._loaded.get()
        self._cap = loaded.cap
        await self.consensus.on_phase(round, phase, loaded.scorer.shapes)
        await self._load_head(loaded)
        await self.heartbeat.on_phase(round, phase)
        await self._serve_proposals(round)
        await self._finish_report(round - 1, loaded)
        if phase is Phase.TRAIN:
            self._checked = _Checked(round)
            self._prefetch.clear()
            await learn_results(self.ctx.storage, self.ctx.spec, round - 1)  # a round it did not merge
        elif phase is Phase.REVEAL:
            await self._reveal_seed(round)
        elif phase is Phase.EVALUATE:
            await self._evaluate(round, loaded)
        elif phase is Phase.MERGE:
            await self._merge(round, loaded)

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

    async def _load_head(self, loaded: _Loaded) -> None:
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

    # -- seeds --------------------------------------------------------------------------------

    async def _commit_seed(self, round: int) -> None:
        seed = await self.ctx.storage.own_seed(round)
        if seed is None:
            seed = new_seed()
            await self.ctx.storage.set_own_seed(round, seed)
        if not any(s.validator == self.me and s.commitment for s in await self.ctx.storage.seeds_for(round)):
            await self._publish(SeedCommit(round=round, commitment=commitment(seed)))

    async def _reveal_seed(self, round: int) -> None:
        """Reveal our seed of `round` when its window opens, 2 x clock_skew_s into REVEAL: until then some node
        whose clock is behind ours may still take a commit, and a miner that saw the seed could choose its
        commit by it."""
        opens = window("seed_reveal", round, self.ctx.schedule)[0]
        while self.ctx.clock.now() < opens:
            await self.ctx.clock.sleep_until(opens)
        seed = await self.ctx.storage.own_seed(round)
        mine = [s for s in await self.ctx.storage.seeds_for(round) if s.validator == self.me]
        if seed is not None and mine and mine[0].commitment and not mine[0].seed:
            await self._publish(SeedReveal(round=round, seed=seed))

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

    async def _evaluate(self, round: int, loaded: _Loaded) -> None:
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

    async def _fetch(self, blob_hash: str, miner: str, loaded: _Loaded) -> Path | None:
        """The blob's file in the local store, fetched from its miner if it is not there; None if that fails."""
        await self._prefetch.wait(blob_hash)  # in the local store now, unless that fetch failed
        try:
            return await self.ctx.network.fetch(blob_hash, [miner], loaded.cap)
        except (NetworkError, OSError) as exc:
            log.warning("blob %s of miner %s: %s", blob_hash[:12], miner[:12], exc)
            return None

    async def _check_candidates(self, round: int, plan: RoundPlan, miners: list[str], head: str,
                                loaded: _Loaded) -> None:
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

    async def _merge(self, round: int, loaded: _Loaded) -> None:
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
        except MergeInputError as exc:
            log.warning("round %d: no merge: %s", round, exc)
            await self._write_report(round, plan, head, None, None, None)
            return
        finally:
            self._checked = _Checked(round + 1)  # accepted submissions are kept only until their merge
        await self.ctx.storage.fix_merged_from(round, reports)
        await self._record_rewards(round, result)
        await self.ctx.storage.set_round_results(round, leaderboard(round, head, result.ranking, reports, exact=True))
        proposed = await self._propose(round, adoption, head) if adoption.changed else None
        await self._write_report(round, plan, head, result.ranking, proposed, adoption)

    async def _merge_result(self, round: int, plan: RoundPlan, head: str, loaded: _Loaded,
                            reports: Mapping[str, ScoreReport]) -> tuple[MergeResult, Adoption]:
        """`merge_round` on `reports` and this round's checked blobs, fetching missing candidates once, and
        the state its gate adopts."""
        assert self.state is not None
        state = self.state

        def merge() -> tuple[MergeResult, Adoption]:
            blobs = self._checked.of(round)
            tensors, momentum = dict(state.tensors), dict(state.momentum)
            result = merge_round(reports, plan.assignment, plan.revealed, blobs, tensors, momentum, self.ctx.spec,
                                 head)
            return result, gate(result, blobs, tensors, momentum, self.ctx.spec,
                                gate_measure(loaded.scorer, plan.seed, loaded.general))

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
            log.error("round %d: cannot store the proposed state in the blob store (%s); not proposing a state",
                      round, exc)
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

    # -- the round report ---------------------------------------------------------------------

    async def _write_report(self, round: int, plan: RoundPlan, head: str, ranking: RoundRanking | None,
                            proposed: str | None, adoption: Adoption | None) -> None:
        heard = {n.node_id for n in await self.ctx.storage.nodes() if n.role == "miner" and n.round >= round}
        gated = None if adoption is None else adoption.report()
        await self.ctx.storage.set_round_report(round, round_report(plan, head, ranking, proposed, heard, gated))
        self.ctx.metrics.seeds_withheld(plan.unrevealed_seeds, plan.excluded)

    async def _finish_report(self, round: int, loaded: _Loaded) -> None:
        """Fill in the state round `round` ended on and its loss on that round's held-out subset; again
        when this node later follows another head (node.duties.consensus `follow`)."""
        report = await self.ctx.storage.round_report(round) if round >= 0 else None
        plan = await self.ctx.storage.round_plan(round) if report is not None else None
        head = await self.ctx.head()
        state = self.state  # round + 1's, where a restart late in round + 1's MERGE followed its votes first
        if report is None or plan is None or report["global_hash"] == head or state is None or state.round > round:
            return
        report["global_hash"] = head
        report["global_loss"] = await asyncio.to_thread(loaded.loss, dict(state.tensors), plan.seed)
        await self.ctx.storage.set_round_report(round, report)

    # -- helpers ------------------------------------------------------------------------------

    async def _published(self, round: int, kind: str) -> bool:
        return any(m.kind == kind and m.sender == self.me for m in await self.ctx.storage.messages(round))

    async def _publish(self, message: Message) -> None:
        try:
            await self.ctx.publish(message)
        except PublishRefused as exc:
            log.warning("round %d: %s refused: %s", message.round, message.kind, exc)


class _Checked:
    """The checked submissions of one round, by miner, as `Scorer.held` keeps them (read from their blob files
    a tensor at a time): what EVALUATE and MERGE both use."""

    def __init__(self, round: int) -> None:
        self.round = round
        self._tensors: dict[str, Tensors] = {}

    def add(self, round: int, tensors: Mapping[str, Tensors]) -> None:
        if round != self.round:
            self.round, self._tensors = round, {}
        self._tensors.update(tensors)

    def of(self, round: int) -> dict[str, Tensors]:
        """The round's checked submissions whose blob files are still stored (one gone since is fetched again)."""
        if round != self.round:
            return {}
        return {miner: t for miner, t in self._tensors.items() if not isinstance(t, BlobFile) or t.path.is_file()}


class _Loaded:
    """What a validator loads once: the scorer (base model + held-out data), the general-domain held-out
    sequences (None: the spec pins none) and the genesis state."""

    def __init__(self, scorer: Scorer, general: torch.Tensor | None, genesis: GlobalExperts, cap: int) -> None:
        self.scorer = scorer
        self.general = general
        self.genesis = genesis
        self.cap = cap

    @classmethod
    def create(cls, ctx: NodeContext) -> _Loaded:
        spec, spec_path = ctx.spec, ctx.config.node.spec
        assert ctx.config.validator.heldout is not None
        device_map = "auto" if ctx.config.validator.device == "auto" else None  # spread over all GPUs
        model, adapter = load_base(spec, spec_path, device_map=device_map)
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        heldout = load_sequences([ctx.config.validator.heldout], tokenizer, spec.data.seq_len)
        try:
            check_gate_data(spec, heldout.shape[0])
        except ValueError as exc:
            raise ValueError(f"validator.heldout: {exc}") from None
        general_file = ctx.config.validator.general
        general = None if general_file is None else load_sequences([general_file], tokenizer, spec.data.seq_len)
        section = ctx.config.validator
        check_device(section.device, model, section.batch_size, spec.data.seq_len)
        scorer = Scorer(model, adapter, spec, heldout, tokenizer.pad_id, section.device, section.batch_size,
                        section.weights)
        # The base's experts in the dtype the model holds them (bf16 for a bf16 checkpoint): their exact values at
        # half fp32's bytes (0.4 GB at OLMoE-1B-7B's size), as a miner holds them; every use takes them to fp32.
        held = tensor_attr(adapter.experts(model, min(spec.group)), "gate_up_proj").dtype
        genesis = GlobalExperts.genesis(spec, extract(model, adapter, spec.group, held))
        cap = submission_cap(spec, scorer.shapes)  # the format's own cap: a pgrad blob is far smaller
        return cls(scorer, general, genesis, cap)

    def loss(self, tensors: dict[str, torch.Tensor], seed: str) -> float:
        """Held-out loss of the model holding `tensors` on the subset `seed` picks."""
        s = self.scorer
        apply_global(s.model, s.adapter, tensors)
        sequences = heldout_subset(s.heldout, seed, s.spec.data.heldout_sequences)
        return s.loss(sequences)


def _check_general(ctx: NodeContext) -> None:
    """Refuse a general-domain held-out file the spec does not pin, or a missing or other one where it pins one."""
    check_general_file(ctx.config.validator.general, ctx.spec.data.general_sha256, "validator.general")


def _check_disjoint(ctx: NodeContext) -> None:
    """Refuse a held-out file that shares a document with the spec's training files (those present here)."""
    assert ctx.config.validator.heldout is not None
    train = [spec_dir_path(ctx.config.node.spec, p) for p in ctx.spec.data.train]
    present = [p for p in train if p.is_file()]
    if not present:
        log.warning("none of the spec's training files is here; cannot check the held-out file is disjoint")
        return
    documents = [doc for p in present for doc in read_documents(p)]
    try:
        check_disjoint(documents, read_documents(ctx.config.validator.heldout))
    except ValueError as exc:
        raise ValueError(f"validator.heldout: {ctx.config.validator.heldout}: {exc}; "
                         "a held-out file must share nothing with the training files") from exc
