"""Miner duties: train the target experts from the adopted global state, then commit and reveal the blob.

TRAIN of round r: settle the global state (node.duties.consensus), put it into the model and train H
inner steps on this miner's shard, off the event loop, stopping early when TRAIN is about to end (or
after the current step when the node stops); the canonical blob (metadata: network, round, this
miner, base = head, group) goes into the blob store and storage remembers it (`Submission`). COMMIT:
publish Commit(r, c). REVEAL: serve the blob (never earlier) and publish Reveal(r, c, size). At
TRAIN the miner also ranks the settled round from the public score reports (node.duties.results), so
it knows its loss, rank and reward. Each step checks storage first, so a restarted miner never
trains, commits or reveals twice in a round, and from REVEAL on a restarted miner serves the blob it
revealed again, so its reveal stands.

What the miner submits and when is a `MinerStrategy`: `HonestStrategy` here; the simulation's
adversaries (node.sim.adversaries) are other strategies injected through `MinerDuties.factory`.
`build_submission` is THE honest build: the duty and `tessera train` both call it.

A network whose spec says `[submission] format = "pgrad"` gets compressed pseudo-gradients
(training.pgrad): G = Φ_t − Φ_i in fp32 plus the miner's error-feedback buffer, top-k per chunk and
quantised; what was left unsent is the new buffer, kept across rounds and restarts by
node.duties.feedback.

A miner with `[miner] keep_optimizer` carries its AdamW state from round to round (`InnerOptimizer`).
Unless `[miner] rewind_optimizer` is off, it rewinds that state when the merged experts it is about to
train from are the ones it last trained from: a round that merged nothing left the network where it
was, so the miner steps from the same point again, from the moments it had there, and (unless `[miner]
backtrack_lr` is off) at half the lr it last trained at, until an update is merged. A round whose
training diverged (NaN or Inf in the trained experts) has no submission: the miner encodes nothing,
keeps its error-feedback buffer as it was and drops its kept AdamW state, which the diverged steps
left non-finite (`Diverged`). This module knows nothing about scoring or merging.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from node.duties.consensus import Consensus
from node.duties.feedback import ErrorFeedback, keep_feedback, load_feedback
from node.duties.results import learn_results, unheard_by
from node.net.network import PublishRefused
from node.runtime.config import MinerSection
from node.runtime.context import BuiltOnce, DutiesFactory, HeartbeatDuties, NodeContext
from node.runtime.metrics import NodeMetrics
from node.store.records import RoundPlan, Submission
from protocol.messages import Commit, Envelope, Message, Reveal
from protocol.rounds import Phase
from protocol.spec import NetworkSpec, spec_dir_path
from training.adapters import MoEAdapter
from training.blob import BLOB_FORMAT, PGRAD_FORMAT, BlobMeta, encode_blob
from training.compressed import CompressedModel
from training.data import batches, load_sequences, shard
from training.experts import extract, insert, pseudo_gradient
from training.model import load_base, load_compressed_base
from training.pgrad import chunk_draw
from training.pgrad import encode as encode_pgrad
from training.tokenizer import load_tokenizer
from training.trainer import TrainConfig, TrainResult, backtracked, train_experts
from validator.checks import pgrad_config
from validator.device import check_device
from validator.state import GlobalExperts

log = logging.getLogger(__name__)

TRAIN_MARGIN_SHARE = 0.1  # of TRAIN, kept free after training to write the blob
TRAIN_MARGIN_MAX_S = 120.0
Tensors = dict[str, torch.Tensor]


def miner_seed(miner: str, round: int) -> int:
    """The seed of a miner's batch order (and an adversary's noise) in a round."""
    return int.from_bytes(hashlib.sha256(f"tessera-miner:{miner}:{round}".encode()).digest()[:8], "big") >> 1


class Diverged(ValueError):
    """The trained experts hold NaN or Inf: training diverged, and there is nothing to submit."""


def _check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Diverged naming the first tensor, by name, that holds a NaN or an Inf."""
    for name in sorted(tensors):
        if not bool(torch.isfinite(tensors[name]).all()):
            raise Diverged(f"training diverged: non-finite values in {name}")


def encode_submission(spec: NetworkSpec, round: int, miner: str, head: str, tensors: Mapping[str, torch.Tensor],
                      base: Mapping[str, torch.Tensor] | None = None, feedback: ErrorFeedback | None = None) -> bytes:
    """The canonical blob of `tensors` in the spec's submission format, naming this round, miner and base.

    `experts`: the tensors in the spec's dtype. `pgrad`: G = `base` − `tensors` plus `feedback.error`,
    compressed on the chunks this round and miner draw; `feedback.error` becomes what those
    chunks left unsent (without `feedback` nothing is kept). Diverged, with `feedback` untouched, when
    `tensors` hold a NaN or an Inf.
    """
    _check_finite(tensors)
    cfg = pgrad_config(spec)
    meta = BlobMeta(network=spec.network_id, round=round, miner=miner, base=head,
                    group={layer: list(ids) for layer, ids in spec.group.items()},
                    format=BLOB_FORMAT if cfg is None else PGRAD_FORMAT)
    if cfg is None:
        dtype = getattr(torch, spec.model.dtype)
        return _within_header_cap(spec, encode_blob({name: t.to(dtype) for name, t in tensors.items()}, meta))
    if base is None:
        raise ValueError("a pgrad submission needs the state it was trained from (base)")
    draw = chunk_draw(spec.network_id, round, miner)
    blob, error = encode_pgrad(pseudo_gradient(base, tensors), None if feedback is None else feedback.error, cfg, draw)
    data = _within_header_cap(spec, encode_blob(blob, meta))
    if feedback is not None:
        feedback.error = error
    return data


def _within_header_cap(spec: NetworkSpec, data: bytes) -> bytes:
    """`data`, unless its header is over the spec's cap, which every validator would refuse it for."""
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > spec.limits.max_header_bytes:
        raise ValueError(f"the blob's header is {header_bytes} bytes, over the spec's limits.max_header_bytes "
                         f"({spec.limits.max_header_bytes}): validators refuse every blob of this expert group in "
                         f"this format; the network's spec needs a larger limits.max_header_bytes")
    return data


@dataclass
class InnerOptimizer:
    """What a miner with `[miner] keep_optimizer` carries from one round's training to the next: the AdamW
    state (`TrainResult.optimizer_state`) on the training device. In memory only; a restart starts at zero.

    Unless `rewind` is off, before each training (`start`) it also keeps a CPU copy of that state and a
    digest of the merged tensors it trains from. When the next training starts from tensors with the same
    digest, no update was merged in between, and the state goes back to the copy: moments that counted a
    step the network did not take would count the same point's gradient again, and from a state no update
    leaves, AdamW's steps can grow toward the sign of that gradient until none passes Proof-of-Loss
    (docs/learning.md, "Rewinding the miners' AdamW state after a level round"). The copy costs twice the
    group's size in host memory, not on the device.

    Unless `backtrack` is off too, each level round also halves the lr the miner trains at (`lr_scale`, down to
    1/64), and the first round after an update was merged trains at the spec's lr again
    (`training.trainer.backtracked`): rewound, a miner would retry the same step, and where that step overshoots
    every retry fails the gate (docs/learning.md, "Backtracking the miners' lr after a level round")."""

    state: dict[str, Any] | None = None
    rewind: bool = True
    """Whether a level round rewinds the state (`[miner] rewind_optimizer`); False keeps no copy."""
    before: dict[str, Any] | None = None
    """A CPU copy of `state` as it was when the last training started: what a level round rewinds to."""
    trained_from: str | None = None
    """`tensors_digest` of the merged tensors the last training started from (None: no training yet)."""
    backtrack: bool = True
    """Whether a level round also halves `lr_scale` (`[miner] backtrack_lr`); only where `rewind` is on."""
    lr_scale: float = 1.0
    """The fraction of the spec's inner lr the next training runs at (set by `start`)."""

    def start(self, base: Mapping[str, torch.Tensor], round: int) -> None:
        """Ready the state for training `round` from `base`: rewound when `base` is what the last training
        started from, then copied, so that the round after can rewind to it."""
        if not self.rewind:
            return
        digest = tensors_digest(base)
        level = digest == self.trained_from
        if self.backtrack:
            self.lr_scale = backtracked(self.lr_scale, merged=not level)
        if level:
            log.info("round %d: no update was merged since this miner last trained (the merged experts are the "
                     "same); its AdamW state goes back to what it was before that training%s", round,
                     f", and it trains at {self.lr_scale:g} of the spec's lr" if self.backtrack else "")
            self.state = self.before
        self.before = _host_copy(self.state)
        self.trained_from = digest

    def drop(self) -> None:
        """Start AdamW at zero next round at the spec's lr, with nothing to rewind to (a training that diverged)."""
        self.state = self.before = self.trained_from = None
        self.lr_scale = 1.0


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over `tensors`' names, dtypes, shapes and bytes, in name order: equal exactly when the tensors are."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _host_copy(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of an AdamW `state_dict` with every tensor on the CPU. Torch loads a state into an optimizer without
    copying tensors already on the parameters' device, and its steps then update them in place."""
    if state is None:
        return None
    return {"state": {key: {name: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                            for name, v in moments.items()} for key, moments in state["state"].items()},
            "param_groups": [dict(group, params=list(group["params"])) for group in state["param_groups"]]}


class MinerModel:
    """What a miner loads once: the base model (compressed to its group in `compressed` mode), its genesis
    state and the training sequences."""

    def __init__(self, spec: NetworkSpec, model: torch.nn.Module | CompressedModel, adapter: MoEAdapter,
                 genesis: GlobalExperts, sequences: torch.Tensor, pad_id: int) -> None:
        self.spec = spec
        self.model = model
        self.adapter = adapter
        self.genesis = genesis
        self.shapes = {name: tuple(t.shape) for name, t in genesis.tensors.items()}
        self.sequences = sequences
        self.pad_id = pad_id

    @classmethod
    def load(cls, spec: NetworkSpec, spec_path: Path, data: Sequence[Path] = (), progress: bool = False,
             forward: Literal["full", "compressed"] = "full") -> MinerModel:
        """Build the base model and pack the training files (`data`, else the spec's); blocking.

        `compressed`: the model is Θ̃0 alone (training.model.load_compressed_base), never holding the
        unselected experts; it can then only train with `forward = "compressed"`."""
        model: torch.nn.Module | CompressedModel
        if forward == "compressed":
            model = load_compressed_base(spec, spec_path, progress=progress)
            adapter, experts = model.adapter, model.tensors()
        else:
            model, adapter = load_base(spec, spec_path, progress=progress)
            experts = extract(model, adapter, spec.group)
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        sequences = load_sequences(training_files(spec, spec_path, data), tokenizer, spec.data.seq_len)
        genesis = GlobalExperts.genesis(spec, experts, held_average=False)  # a miner trains from the merged state
        return cls(spec, model, adapter, genesis, sequences, tokenizer.pad_id)

    def train(self, miner: str, round: int, base: Mapping[str, torch.Tensor], section: MinerSection,
              keep_going: Callable[[], bool], steps: int | None = None, progress: bool = False,
              optimizer: InnerOptimizer | None = None) -> TrainResult:
        """H inner steps (or `steps`) from `base` on this miner's shard; fewer when `keep_going` turns False.

        `progress`: a tqdm bar on a terminal (the `tessera train` command; the daemon logs instead).
        `optimizer`: the AdamW state to go on from (rewound first where `base` is what it last trained from,
        `InnerOptimizer.start`), and where the new one is left (None: start at zero)."""
        inner = self.spec.training
        if isinstance(self.model, CompressedModel):
            self.model.load(dict(base))
        else:
            insert(self.model, self.adapter, dict(base))
        if optimizer is not None:
            optimizer.start(base, round)
        lr_scale = 1.0 if optimizer is None else optimizer.lr_scale
        cfg = TrainConfig(steps=steps or inner.inner_steps, lr=inner.lr * lr_scale, beta1=inner.beta1,
                          weight_decay=inner.weight_decay, batch_size=inner.batch_size,
                          micro_batch_size=section.micro_batch_size, grad_clip=inner.grad_clip,
                          forward=section.forward, device=section.device,
                          checkpointing=section.checkpointing, autocast=section.autocast,
                          pad_id=self.pad_id, progress=progress)
        rows = shard(self.sequences, miner, round)
        order = batches(rows, cfg.batch_size, miner_seed(miner, round))
        result = train_experts(self.model, self.adapter, self.spec.group, _while(order, keep_going), cfg,
                               None if optimizer is None else optimizer.state)
        if optimizer is not None:
            optimizer.state = result.optimizer_state
        return result


def build_submission(model: MinerModel, miner: str, round: int, head: str, base: Mapping[str, torch.Tensor],
                     section: MinerSection, keep_going: Callable[[], bool] = lambda: True,
                     steps: int | None = None, progress: bool = False,
                     feedback: ErrorFeedback | None = None,
                     optimizer: InnerOptimizer | None = None) -> tuple[bytes, TrainResult]:
    """An honest miner's blob for `round`, trained from the state `head` (whose tensors are `base`);
    a pgrad network's blob carries `feedback`'s buffer in and leaves the new one there, and a miner that
    keeps its optimizer (`[miner] keep_optimizer`) goes on from `optimizer`'s state and leaves the new one.

    ValueError when `keep_going` is already False: the TRAIN deadline passed before training began.
    Diverged when training did: `feedback` is left as it was, and `optimizer`'s state is dropped."""
    if not keep_going():  # the trainer would get no batch and blame the data
        raise ValueError("no time left to train: the TRAIN deadline had already passed when training would start")
    result = model.train(miner, round, base, section, keep_going, steps, progress, optimizer)
    try:
        return encode_submission(model.spec, round, miner, head, result.tensors, base, feedback), result
    except Diverged:
        # The diverged steps updated the kept AdamW moments in place (torch loads a state without copying
        # it). The host copy from before this round is finite, but its moments led here: the next round
        # starts AdamW at zero, with nothing to rewind to.
        if optimizer is not None:
            optimizer.drop()
            log.warning("round %d: training diverged; dropping the kept optimizer state", round)
        raise


@dataclass(frozen=True)
class Job:
    """One round's submission to make (in a worker thread): who, which round, from which state."""

    model: MinerModel
    miner: str
    round: int
    head: str
    base: GlobalExperts
    section: MinerSection
    keep_going: Callable[[], bool]
    metrics: NodeMetrics
    feedback: ErrorFeedback | None = None
    """A pgrad network's error-feedback buffer (None: full experts); honest builds update it."""
    optimizer: InnerOptimizer | None = None
    """The inner AdamW state carried from round to round (None: `keep_optimizer` is off); honest builds update it."""

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
                                        job.section, job.keep_going, feedback=job.feedback, optimizer=job.optimizer)
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


def training_files(spec: NetworkSpec, spec_path: Path, data: Sequence[Path] = ()) -> list[Path]:
    """The files a miner trains on: `data` when given, else the spec's `data.train`."""
    return list(data) or [spec_dir_path(spec_path, p) for p in spec.data.train]


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
        self.model = BuiltOnce(lambda: MinerModel.load(ctx.spec, ctx.config.node.spec,
                                                       [section.data] if section.data else [],
                                                       forward=section.forward))
        self._served: str | None = None
        self.optimizer = InnerOptimizer(rewind=section.rewind_optimizer, backtrack=section.backtrack_lr) \
            if section.keep_optimizer else None

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
                  self.ctx.metrics, feedback, self.optimizer)
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
        try:
            await self.ctx.publish(message)
        except PublishRefused as exc:
            log.warning("round %d: %s refused: %s", message.round, message.kind, exc)

    async def own_commit(self, round: int) -> str | None:
        commits = await self.ctx.storage.commits_for(round)
        return next((c.commitment for c in commits if c.miner == self.me), None)


def _while(items: Iterator[torch.Tensor], keep_going: Callable[[], bool]) -> Iterator[torch.Tensor]:
    for item in items:
        if not keep_going():
            return
        yield item
