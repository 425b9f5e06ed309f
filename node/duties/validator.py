"""Validator duties: seeds, Proof-of-Loss scoring, and the merge that proposes the next global state.

TRAIN of round r: settle round r-1's global state (node.duties.consensus; a validator in the minority
re-syncs state and momentum), then commit to a fresh seed, persisted BEFORE it is published so a
restart reuses it. REVEAL: reveal the seed. EVALUATE: the round seed s_r comes from the validators
that committed and revealed; the miners are those with a Commit and a matching Reveal; the blobs
of the miners assigned to this validator are fetched from them (capped), checked and scored off
the event loop, and a ScoreReport is published. MERGE: wait for the other validators' reports (or
most of the phase), fetch the blobs of candidates not yet held, rank, reward and aggregate
(`validator.merge.merge_round`), serve the new state and momentum blobs and publish GlobalState.
Rewards go to the storage ledger, and a per-round report (kv `round_report:{r}`) records every
miner's verdict, loss, rank, reward and reason; the loss of the ADOPTED state on round r's held-out
subset is filled in once round r+1 has settled it. Each step checks storage first, so a restarted
validator resumes without publishing anything twice.
This module knows nothing about libp2p; torch work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from node.duties.consensus import GLOBAL_RNG_LOCK, MOMENTUM_OF_KEY, Consensus, wait_until
from node.net.network import NetworkError, PublishRefused
from node.runtime.daemon import ROUND_REPORT_KEY, BuiltOnce, HeartbeatDuties, NodeContext
from node.store.db import RewardRecord
from protocol.assignment import assign
from protocol.messages import Envelope, GlobalState, Message, ScoreEntry, ScoreReport, SeedCommit, SeedReveal
from protocol.ranking import RoundRanking, update_standing
from protocol.rounds import Phase
from protocol.seeds import commitment, new_seed, round_seed
from training.blob import max_blob_bytes
from training.data import file_sha256, heldout_subset, load_sequences
from training.evaluate import heldout_loss
from training.experts import extract
from training.model import load_base
from training.tokenizer import load_tokenizer
from validator.merge import MergeInputError, MergeResult, candidates, merge_round
from validator.scoring import Scorer, apply_global
from validator.state import GlobalExperts

log = logging.getLogger(__name__)

SEED_KEY = "seed:{}"
REWARDED_KEY = "rewarded:{}"
MERGE_WAIT_SHARE = 0.5  # of MERGE: how long to wait for the other validators' reports


class ValidatorDuties:
    """A validator's phase work; build with `ValidatorDuties(ctx)` (a DutiesFactory).

    Refuses to start (ValueError) when the held-out file does not hash to the spec's heldout_sha256.
    """

    def __init__(self, ctx: NodeContext) -> None:
        heldout = ctx.config.validator.heldout
        assert heldout is not None, "the config requires validator.heldout for a validator"
        if not heldout.is_file():
            raise ValueError(f"validator.heldout: {heldout} is not a file")
        actual = file_sha256(heldout)
        if actual != ctx.spec.data.heldout_sha256:
            raise ValueError(f"validator.heldout: {heldout} hashes to {actual}, but the spec pins "
                             f"data.heldout_sha256 = {ctx.spec.data.heldout_sha256}; "
                             "use the network's held-out file")
        self.ctx = ctx
        self.me = ctx.identity.node_id
        self.consensus = Consensus(ctx, need_momentum=True)
        self.heartbeat = HeartbeatDuties(ctx)
        self.arrivals = asyncio.Event()
        self.state: GlobalExperts | None = None
        self.synced = False
        self._loaded = BuiltOnce(lambda: _Loaded.create(ctx))
        self._accepted: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    async def on_phase(self, round: int, phase: Phase) -> None:
        loaded = await self._loaded.get()
        await self.consensus.on_phase(round, phase, loaded.scorer.shapes)
        await self._load_head(loaded)
        await self.heartbeat.on_phase(round, phase)
        if phase is Phase.TRAIN:
            await self._finish_report(round - 1, loaded)
            await self._commit_seed(round)
        elif phase is Phase.REVEAL:
            await self._reveal_seed(round)
        elif phase is Phase.EVALUATE:
            await self._evaluate(round, loaded)
        elif phase is Phase.MERGE:
            await self._merge(round, loaded)

    async def on_message(self, envelope: Envelope) -> None:
        await self.consensus.on_message(envelope)
        self.arrivals.set()

    async def _load_head(self, loaded: _Loaded) -> None:
        head = await self.ctx.head()
        if self.state is not None and self.state.hash == head and self.synced:
            return
        result = await self.consensus.load(head, loaded.genesis, loaded.scorer.shapes)
        self.state, self.synced = result.state, result.synced

    # -- seeds --------------------------------------------------------------------------------

    async def _commit_seed(self, round: int) -> None:
        seed = await self.ctx.storage.get_state(SEED_KEY.format(round))
        if seed is None:
            seed = new_seed()
            await self.ctx.storage.set_state(SEED_KEY.format(round), seed)
        if not any(s.validator == self.me and s.commitment for s in await self.ctx.storage.seeds_for(round)):
            await self._publish(SeedCommit(round=round, commitment=commitment(seed)))

    async def _reveal_seed(self, round: int) -> None:
        seed = await self.ctx.storage.get_state(SEED_KEY.format(round))
        mine = [s for s in await self.ctx.storage.seeds_for(round) if s.validator == self.me]
        if seed is not None and mine and mine[0].commitment and not mine[0].seed:
            await self._publish(SeedReveal(round=round, seed=seed))

    # -- EVALUATE -----------------------------------------------------------------------------

    async def _evaluate(self, round: int, loaded: _Loaded) -> None:
        plan = await self._plan(round)
        if plan is None or await self._published(round, "score_report"):
            return
        assert self.state is not None
        mine = sorted(m for m, chosen in plan.assignment.items() if self.me in chosen)
        fetched = await asyncio.gather(*(self._fetch(plan.revealed[m], m, loaded) for m in mine))
        submissions = {m: (plan.revealed[m], data) for m, data in zip(mine, fetched, strict=True)}
        head = await self.ctx.head()
        result = await asyncio.to_thread(loaded.scorer.score_round, round, plan.seed, self.state.tensors,
                                         head, submissions)
        self._accepted[round] = result.accepted
        log.info("round %d: validator %s scored %d miner(s) against %s with seed %s: base loss %.4f", round,
                 self.me[:8], len(mine), head[:12], plan.seed[:12], result.base_loss)
        for entry in result.entries:
            log.info("round %d: miner %s %s %s", round, entry.miner[:12], entry.verdict,
                     f"loss {entry.loss:.4f}" if entry.loss is not None else entry.reason)
        await self._publish(result.report(round, head))

    async def _plan(self, round: int) -> _Plan | None:
        """The round seed, the miners that committed and revealed, and who evaluates whom."""
        seeds = await self.ctx.storage.seeds_for(round)
        try:
            seed = round_seed({s.validator: s.commitment for s in seeds if s.commitment},
                              {s.validator: s.seed for s in seeds if s.seed})
        except ValueError as exc:
            log.warning("round %d: %s", round, exc)
            return None
        await self.ctx.storage.set_round_seed(round, seed)
        reveals = {r.miner: r.commitment for r in await self.ctx.storage.reveals_for(round)}
        commits = {c.miner: c.commitment for c in await self.ctx.storage.commits_for(round)}
        revealed = {m: c for m, c in commits.items() if reveals.get(m) == c}
        validators = sorted(self.ctx.spec.validator_weights)
        assignment = assign(seed, revealed, validators, self.ctx.spec.rewards.replication) if revealed else {}
        return _Plan(seed, revealed, commits, assignment)

    async def _fetch(self, blob_hash: str, miner: str, loaded: _Loaded) -> bytes | None:
        try:
            path = await self.ctx.network.fetch(blob_hash, [miner], loaded.cap)
            return await asyncio.to_thread(path.read_bytes)
        except (NetworkError, OSError) as exc:
            log.warning("blob %s of miner %s: %s", blob_hash[:12], miner[:12], exc)
            return None

    # -- MERGE --------------------------------------------------------------------------------

    async def _merge(self, round: int, loaded: _Loaded) -> None:
        plan = await self._plan(round)
        if plan is None or await self.ctx.storage.get_state(ROUND_REPORT_KEY.format(round)) is not None:
            return
        expected = {s.validator for s in await self.ctx.storage.seeds_for(round) if s.commitment}
        start, end = self.ctx.schedule.phase_window(round, Phase.MERGE)

        async def reports_in() -> bool:
            messages = await self.ctx.storage.messages(round)
            return expected <= {m.sender for m in messages if m.kind == "score_report"}

        if not await wait_until(self.ctx.clock, self.arrivals, reports_in,
                                start + MERGE_WAIT_SHARE * (end - start)):
            log.warning("round %d: merging without the reports of every validator that committed a seed",
                        round)
        assert self.state is not None
        head = await self.ctx.head()
        reports = await self._reports(round)
        try:
            result = await self._merge_result(round, plan, reports, head, loaded)
        except MergeInputError as exc:
            log.warning("round %d: no merge: %s", round, exc)
            await self._write_report(round, plan, head, None, None)
            return
        await self._record_rewards(round, result)
        proposed = await self._propose(round, result, head) if result.changed else None
        await self._write_report(round, plan, head, result.ranking, proposed)

    async def _merge_result(self, round: int, plan: _Plan, reports: dict[str, ScoreReport], head: str,
                            loaded: _Loaded) -> MergeResult:
        assert self.state is not None
        blobs = dict(self._accepted.get(round, {}))
        for miner in candidates(reports, plan.assignment, plan.revealed, head, self.ctx.spec):
            if miner in blobs:
                continue
            data = await self._fetch(plan.revealed[miner], miner, loaded)
            if data is None:
                continue
            verdict = await asyncio.to_thread(loaded.scorer.check, round, miner, plan.revealed[miner], data,
                                              head)
            if verdict.ok and verdict.tensors is not None:
                blobs[miner] = verdict.tensors
            else:
                log.warning("round %d: candidate %s fails my checks: %s", round, miner[:12], verdict.reason)
        state = self.state
        return await asyncio.to_thread(merge_round, reports, plan.assignment, plan.revealed, blobs,
                                       dict(state.tensors), dict(state.momentum), self.ctx.spec, head)

    async def _propose(self, round: int, result: MergeResult, head: str) -> str | None:
        """Store, serve and announce the merged state; None when this validator abstains."""
        assert self.state is not None
        if not self.synced:
            log.warning("round %d: my outer momentum is not the network's; not proposing a state", round)
            return None
        proposal = self.state.child(round, result.new_global, result.new_momentum)
        state_bytes = await asyncio.to_thread(proposal.to_blob)
        momentum_bytes = await asyncio.to_thread(proposal.momentum_blob)
        state_hash = await asyncio.to_thread(self.ctx.blobs.put_bytes, state_bytes)
        momentum_hash = await asyncio.to_thread(self.ctx.blobs.put_bytes, momentum_bytes)
        self.ctx.network.serve(state_hash)
        self.ctx.network.serve(momentum_hash)
        await self.ctx.storage.set_state(MOMENTUM_OF_KEY.format(state_hash, self.me), momentum_hash)
        if not await self._published(round, "global_state"):
            await self._publish(GlobalState(round=round, hash=state_hash, parent=head,
                                            contributors=tuple(result.contributors), momentum=momentum_hash))
        log.info("round %d: proposed state %s from %d contributor(s)", round, state_hash[:12],
                 len(result.contributors))
        return state_hash

    async def _reports(self, round: int) -> dict[str, ScoreReport]:
        """Every validator's report of `round` as stored (reports without entries leave no rows)."""
        grouped: dict[str, list[Any]] = defaultdict(list)
        for record in await self.ctx.storage.scores_for(round):
            grouped[record.validator].append(record)
        return {
            validator: ScoreReport(
                round=round, base=records[0].base, base_loss=records[0].base_loss,
                entries=tuple(ScoreEntry(miner=r.miner, commitment=r.commitment, loss=r.loss,
                                         verdict=r.verdict, reason=r.reason) for r in records))
            for validator, records in grouped.items()
        }

    async def _record_rewards(self, round: int, result: MergeResult) -> None:
        if await self.ctx.storage.get_state(REWARDED_KEY.format(round)) is not None:
            return
        ledger = await self.ctx.storage.rewards()
        standings = update_standing(ledger.standings, result.points, self.ctx.spec.rewards.ema_alpha)
        entries = [RewardRecord(round, r.miner, r.rank, r.points, r.utility, standings.get(r.miner, 0.0))
                   for r in result.ranking.results if r.rank is not None]
        await self.ctx.storage.add_rewards(round, entries, standings)
        await self.ctx.storage.set_state(REWARDED_KEY.format(round), "1")

    # -- the round report ---------------------------------------------------------------------

    async def _write_report(self, round: int, plan: _Plan, head: str, ranking: RoundRanking | None,
                            proposed: str | None) -> None:
        miners: dict[str, dict[str, Any]] = {}
        if ranking is not None:
            for r in ranking.results:
                verdict = ("reject" if r.reason.startswith("rejected")
                           else "missing" if r.loss is None else "accept")
                miners[r.miner] = {"id": r.miner, "verdict": verdict, "loss": r.loss, "rank": r.rank,
                                   "reward": r.points, "reason": r.reason}
        heard = {n.node_id for n in await self.ctx.storage.nodes() if n.role == "miner" and n.round >= round}
        for miner in sorted(heard | set(plan.commits)):
            if miner not in miners:
                reason = ("no commit in the COMMIT window" if miner not in plan.commits
                          else "no reveal matching its commitment" if miner not in plan.revealed
                          else "not scored against the current global state")
                miners[miner] = {"id": miner, "verdict": "missing", "loss": None, "rank": None, "reward": 0.0,
                                 "reason": reason}
        report = {"round": round, "base": head, "base_loss": None if ranking is None else ranking.base_loss,
                  "proposed_hash": proposed, "global_hash": None, "global_loss": None,
                  "miners": [miners[m] for m in sorted(miners)]}
        await self.ctx.storage.set_state(ROUND_REPORT_KEY.format(round), json.dumps(report, sort_keys=True))

    async def _finish_report(self, round: int, loaded: _Loaded) -> None:
        """Fill in the state round `round` ended on and its loss on that round's held-out subset."""
        key = ROUND_REPORT_KEY.format(round)
        text = await self.ctx.storage.get_state(key) if round >= 0 else None
        if text is None:
            return
        report = json.loads(text)
        seed = await self.ctx.storage.round_seed(round)
        if report["global_hash"] is not None or seed is None or self.state is None:
            return
        tensors = self.state.tensors
        report["global_hash"] = await self.ctx.head()
        report["global_loss"] = await asyncio.to_thread(loaded.loss, tensors, seed)
        await self.ctx.storage.set_state(key, json.dumps(report, sort_keys=True))

    # -- helpers ------------------------------------------------------------------------------

    async def _published(self, round: int, kind: str) -> bool:
        return any(m.kind == kind and m.sender == self.me for m in await self.ctx.storage.messages(round))

    async def _publish(self, message: Message) -> None:
        try:
            await self.ctx.publish(message)
        except PublishRefused as exc:
            log.warning("round %d: %s refused: %s", message.round, message.kind, exc)


@dataclass(frozen=True)
class _Plan:
    seed: str
    revealed: dict[str, str]
    commits: dict[str, str]
    assignment: dict[str, tuple[str, ...]]


class _Loaded:
    """What a validator loads once: the scorer (base model + held-out data) and the genesis state."""

    def __init__(self, scorer: Scorer, genesis: GlobalExperts, cap: int) -> None:
        self.scorer = scorer
        self.genesis = genesis
        self.cap = cap

    @classmethod
    def create(cls, ctx: NodeContext) -> _Loaded:
        spec, spec_path = ctx.spec, ctx.config.node.spec
        assert ctx.config.validator.heldout is not None
        with GLOBAL_RNG_LOCK:
            model, adapter = load_base(spec, spec_path)
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        heldout = load_sequences([ctx.config.validator.heldout], tokenizer, spec.data.seq_len)
        scorer = Scorer(model, adapter, spec, heldout, pad_id=tokenizer.pad_id)
        genesis = GlobalExperts.genesis(spec, extract(model, adapter, spec.group))
        cap = max_blob_bytes(scorer.shapes, spec.model.dtype, spec.limits.max_header_bytes)
        return cls(scorer, genesis, cap)

    def loss(self, tensors: dict[str, torch.Tensor], seed: str) -> float:
        """Held-out loss of the model holding `tensors` on the subset `seed` picks."""
        s = self.scorer
        apply_global(s.model, s.adapter, tensors)
        sequences = heldout_subset(s.heldout, seed, s.spec.data.heldout_sequences)
        return heldout_loss(s.model, sequences, pad_id=s.pad_id).loss
