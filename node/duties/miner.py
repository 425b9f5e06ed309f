"""Miner duties: train the target experts from the adopted global state, then commit and reveal the blob.

TRAIN of round r: settle the global state (node.duties.consensus) and build the round's submission off
the event loop (miner.submission.build_submission: the training stops early when TRAIN is about to end,
or after the current step when the node stops); the blob (base = head) goes into the blob store and
storage remembers it (`Submission`), with a pgrad miner's error-feedback buffer (node.duties.feedback).
COMMIT: publish Commit(r, c). REVEAL: serve the blob (never earlier) and publish Reveal(r, c, size). At
TRAIN the miner also ranks the settled round from the public score reports (node.duties.results), so it
knows its loss, rank and reward. Each step checks storage first, so a restarted miner never trains,
commits or reveals twice in a round, and from REVEAL on a restarted miner serves the blob it revealed
again, so its reveal stands.

What the miner submits and when is a `MinerStrategy`: `HonestStrategy` here; the simulation's
adversaries (node.sim.adversaries) are other strategies injected through `MinerDuties.factory`. This
module knows nothing about how a round is trained or encoded (miner/), nor about scoring or merging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from miner.model import MinerModel, miner_seed, training_files
from miner.settings import MinerSettings
from miner.submission import ErrorFeedback, build_submission, encode_submission
from node.duties.consensus import Consensus
from node.duties.feedback import keep_feedback, load_feedback
from node.duties.results import learn_results, unheard_by
from node.duties.succession import inherited_paths
from node.runtime.config import MinerSection
from node.runtime.context import BuiltOnce, DutiesFactory, HeartbeatDuties, NodeContext
from node.runtime.metrics import NodeMetrics
from node.store.records import RoundPlan, Submission
from protocol.messages import Commit, Envelope, Message, Reveal
from protocol.rounds import Phase
from protocol.spec import NetworkSpec, spec_dir_path
from training.device import check_device
from training.state import GlobalExperts, inherited_experts

log = logging.getLogger(__name__)

TRAIN_MARGIN_SHARE = 0.1  # of TRAIN, kept free after training to write the blob
TRAIN_MARGIN_MAX_S = 120.0


@dataclass(frozen=True)
class Job:
    """One round's submission to make (in a worker thread): who, which round, from which state."""

    model: MinerModel
    miner: str
    round: int
    head: str
    base: GlobalExperts
    settings: MinerSettings
    keep_going: Callable[[], bool]
    metrics: NodeMetrics
    feedback: ErrorFeedback | None = None
    """A pgrad network's error-feedback buffer (None: full experts); honest builds update it."""

    @property
    def seed(self) -> int:
        return miner_seed(self.miner, self.round)

    def encode(self, tensors: Mapping[str, torch.Tensor]) -> bytes:
        """`tensors` in the network's submission format (pgrad: against this round's base, no feedback)."""
        return encode_submission(self.model.spec, self.round, self.miner, self.head, tensors, self.base.tensors)


class HonestStrategy:
    """Train, commit the blob in COMMIT, reveal it in REVEAL. Adversaries override these hooks."""

    name = "honest"
    trains = True
    """False: TRAIN builds no submission."""

    def build(self, job: Job) -> bytes:
        """The submission's bytes (runs in a worker thread: torch)."""
        data, result = build_submission(job.model, job.miner, job.round, job.head, job.base.tensors,
                                        job.settings, job.keep_going, feedback=job.feedback)
        tokens_s = result.tokens / result.seconds if result.seconds > 0 else 0.0
        log.info("round %d: trained %d steps at lr %g in %.1f s (%.0f tokens/s), loss %.4f -> %.4f", job.round,
                 len(result.losses), result.lr, result.seconds, tokens_s, result.losses[0], result.losses[-1])
        job.metrics.train_progress(len(result.losses), result.tokens, result.seconds, result.losses[-1], result.lr)
        return data

    async def commitment(self, duty: MinerDuties, round: int) -> str | None:
        """What to commit in COMMIT (None: nothing)."""
        submission = await duty.ctx.storage.submission(round)
        return None if submission is None else submission.hash

    async def before_reveal(self, duty: MinerDuties, round: int, commitment: str | None) -> bool:
        """Work due at REVEAL before revealing `commitment`; False: do not reveal."""
        return commitment is not None


def check_inputs(spec: NetworkSpec, spec_path: Path, section: MinerSection) -> None:
    """Refuse to start (ValueError naming the setting) without the training device, the base checkpoint
    or a training file, rather than failing at every phase."""
    if section.device == "auto":
        raise ValueError("miner.device = 'auto' spreads a validator's model; a miner trains on one device "
                         "(cpu, cuda or cuda:N)")
    check_device(section.device, None, 1, spec.data.seq_len, setting="miner.device")
    if spec.model.checkpoint is not None:
        checkpoint = spec_dir_path(spec_path, spec.model.checkpoint)
        if not checkpoint.is_dir():
            raise ValueError(f"model.checkpoint: {checkpoint} is not a directory (the spec's base checkpoint)")
    setting = "miner.data" if section.data else "data.train"
    for path in training_files(spec, spec_path, [section.data] if section.data else []):
        if not path.is_file():
            raise ValueError(f"{setting}: {path} is not a file")


class MinerDuties:
    """A miner's phase work; `MinerDuties.factory(strategy)` is its DutiesFactory (honest by default)."""

    def __init__(self, ctx: NodeContext, strategy: HonestStrategy | None = None) -> None:
        check_inputs(ctx.spec, ctx.config.node.spec, ctx.config.miner)
        self.ctx = ctx
        self.me = ctx.identity.node_id
        self.strategy = strategy or HonestStrategy()
        self.consensus = Consensus(ctx, need_momentum=False)
        self.heartbeat = HeartbeatDuties(ctx)
        self.arrivals = asyncio.Event()
        section = ctx.config.miner
        self.model = BuiltOnce(lambda: MinerModel.load(
            ctx.spec, ctx.config.node.spec, [section.data] if section.data else [], forward=section.forward,
            inherited=inherited_experts(inherited_paths(ctx), ctx.spec.limits.max_header_bytes)))
        self._served: str | None = None

    @staticmethod
    def factory(strategy: HonestStrategy | None = None) -> DutiesFactory:
        return lambda ctx: MinerDuties(ctx, strategy)

    async def on_phase(self, round: int, phase: Phase) -> None:
        model = await self.model.get()
        await self.consensus.on_phase(round, phase, model.shapes)
        await self.heartbeat.on_phase(round, phase)
        if phase is Phase.TRAIN:
            plan = await learn_results(self.ctx.storage, self.ctx.spec, round - 1)
            if plan is not None:
                await self._say_if_unheard(plan)
            await self._train(round, model)
        elif phase is Phase.COMMIT:
            await self._commit(round)
        elif phase is Phase.REVEAL:
            await self._reveal(round)
        else:
            await self._serve_revealed(round)

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        await self.consensus.on_message(envelope, message)
        self.arrivals.set()

    async def close(self, round: int) -> None:
        model = await self.model.get()
        await self.consensus.settle(round, model.shapes)
        await learn_results(self.ctx.storage, self.ctx.spec, round - 1)

    async def _say_if_unheard(self, plan: RoundPlan) -> None:
        """Warn when every validator assigned to this miner reported on the round and none named it."""
        unheard = unheard_by(plan, await self.ctx.storage.score_reports(plan.round), self.ctx.identity.node_id)
        if unheard:
            log.warning("round %d: the validator(s) assigned to this miner (%s) reported on the round without "
                        "naming it: its commit or reveal did not reach them within their windows. Check that "
                        "this machine keeps time (NTP; peers refuse messages from a clock that runs ahead as "
                        "early) and that peers can reach it", plan.round, ", ".join(v[:12] for v in unheard))

    # -- TRAIN --------------------------------------------------------------------------------

    async def _train(self, round: int, model: MinerModel) -> None:
        if not self.strategy.trains or await self.ctx.storage.submission(round) is not None:
            return
        if not await self.consensus.head_known():
            log.warning("round %d: the global head is unknown; not training this round", round)
            return
        head = await self.ctx.head()
        base = (await self.consensus.load(head, model.genesis, model.shapes)).state
        deadline = self._train_deadline(round)
        feedback = await load_feedback(self.ctx, model.shapes)
        # Set when this phase is cancelled (the node stops): the training thread, which cancelling cannot
        # reach, ends after its current step instead of at the deadline, and the process can exit.
        stopping = threading.Event()
        job = Job(model, self.me, round, head, base, self.ctx.config.miner,
                  lambda: not stopping.is_set() and self.ctx.clock.now() < deadline,
                  self.ctx.metrics, feedback)
        try:
            data = await asyncio.to_thread(self.strategy.build, job)
        except ValueError as exc:
            log.error("round %d: no submission: %s", round, exc)
            return
        except asyncio.CancelledError:
            stopping.set()
            raise
        try:
            blob_hash = await asyncio.to_thread(self.ctx.blobs.put_bytes, data)
            error_hash = await keep_feedback(self.ctx, feedback)
        except OSError as exc:  # a full or failing disk: no submission recorded, so nothing is committed
            if not self.ctx.disk.quiet(exc):
                log.error("round %d: cannot store the submission (%d bytes) in the blob store (%s); "
                          "no submission this round", round, len(data), exc)
            return
        await self.ctx.storage.set_submission(round, Submission(blob_hash, len(data)), error_hash)
        log.info("round %d: %s submission %s (%d bytes) from base %s", round, self.strategy.name, blob_hash[:12],
                 len(data), head[:12])

    def _train_deadline(self, round: int) -> float:
        margin = min(TRAIN_MARGIN_SHARE * self.ctx.schedule.train_s, TRAIN_MARGIN_MAX_S)
        return self.ctx.schedule.phase_window(round, Phase.TRAIN)[1] - margin

    # -- COMMIT and REVEAL --------------------------------------------------------------------

    async def _commit(self, round: int) -> None:
        if await self.own_commit(round) is not None:
            return
        commitment = await self.strategy.commitment(self, round)
        if commitment is None:
            log.info("round %d: nothing to commit", round)
            return
        await self.publish(Commit(round=round, commitment=commitment))

    async def _reveal(self, round: int) -> None:
        commitment = await self.own_commit(round)
        if any(r.miner == self.me for r in await self.ctx.storage.reveals_for(round)):
            await self._serve_revealed(round)  # a restart after revealing: the reveal stands
            return
        if not await self.strategy.before_reveal(self, round, commitment):
            return
        assert commitment is not None
        if not self.ctx.blobs.has(commitment):
            log.error("round %d: the committed blob %s is not in the blob store; cannot reveal", round,
                      commitment[:12])
            return
        self._serve(commitment)
        await self.publish(Reveal(round=round, commitment=commitment, size=self.ctx.blobs.size(commitment)))

    async def _serve_revealed(self, round: int) -> None:
        """Serve the blob this miner revealed in `round` (validators fetch it until MERGE ends)."""
        mine = [r for r in await self.ctx.storage.reveals_for(round) if r.miner == self.me]
        if mine and self.ctx.blobs.has(mine[0].commitment):
            self._serve(mine[0].commitment)

    def _serve(self, blob_hash: str) -> None:
        if self._served == blob_hash:
            return
        self.ctx.network.serve(blob_hash)
        if self._served is not None:
            self.ctx.network.unserve(self._served)
        self._served = blob_hash

    # -- helpers for strategies ---------------------------------------------------------------

    async def publish(self, message: Commit | Reveal) -> None:
        await self.ctx.announce(message)

    async def own_commit(self, round: int) -> str | None:
        commits = await self.ctx.storage.commits_for(round)
        return next((c.commitment for c in commits if c.miner == self.me), None)
