"""Miner duties: train the target experts from the adopted global state, then commit and reveal the blob.

TRAIN of round r: settle the global state (node.duties.consensus), put it into the model and train H
inner steps on this miner's shard, off the event loop, stopping early when TRAIN is about to end;
the canonical blob (metadata: network, round, this miner, base = head, group) goes into the blob
store and its hash c is remembered in storage. COMMIT: publish Commit(r, c). REVEAL: serve the blob
(never earlier) and publish Reveal(r, c, size). Each step checks storage first, so a restarted
miner never trains, commits or reveals twice in a round.

`miner.behaviour` plays a simulation adversary instead: `lazy` submits the global state unchanged,
`noise` submits it with random noise added, `copier` commits the first other miner's commitment
and reveals that miner's blob as its own, `late` commits only after the COMMIT window (its own
node refuses to send it; the refusal is logged), `garbage` commits to random bytes.
This module knows nothing about scoring or merging.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Iterator

import torch

from node.duties.consensus import GLOBAL_RNG_LOCK, Consensus, wait_until
from node.net.network import NetworkError, PublishRefused
from node.runtime.daemon import BuiltOnce, HeartbeatDuties, NodeContext
from protocol.messages import Commit, Envelope, Reveal
from protocol.rounds import Phase
from protocol.spec import spec_dir_path
from training.adapters import MoEAdapter
from training.blob import BlobMeta, encode_blob, max_blob_bytes
from training.data import batches, load_sequences, shard
from training.experts import expected_shapes, extract, insert
from training.model import load_base
from training.tokenizer import load_tokenizer
from training.trainer import TrainConfig, train_experts
from validator.state import GlobalExperts

log = logging.getLogger(__name__)

SUBMISSION_KEY = "submission:{}"  # round -> JSON {hash, size} of the blob this miner submits
TRAIN_MARGIN_SHARE = 0.1  # of TRAIN, kept free after training to write the blob
TRAIN_MARGIN_MAX_S = 120.0
COPY_WAIT_SHARE = 0.6  # of COMMIT: how long a copier waits for a commitment to copy
NOISE_SCALE = 5.0  # noise std as a multiple of each tensor's std: large enough to hurt the loss
GARBAGE_BYTES = 4096


class MinerDuties:
    """A miner's phase work; build with `MinerDuties(ctx)` (a DutiesFactory)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.me = ctx.identity.node_id
        self.behaviour = ctx.config.miner.behaviour
        self.consensus = Consensus(ctx, need_momentum=False)
        self.heartbeat = HeartbeatDuties(ctx)
        self.arrivals = asyncio.Event()
        self._loaded = BuiltOnce(lambda: _Loaded.create(ctx))
        self._served: str | None = None

    async def on_phase(self, round: int, phase: Phase) -> None:
        loaded = await self._loaded.get()
        await self.consensus.on_phase(round, phase, loaded.shapes)
        await self.heartbeat.on_phase(round, phase)
        if phase is Phase.TRAIN:
            await self._train(round, loaded)
        elif phase is Phase.COMMIT:
            await self._commit(round)
        elif phase is Phase.REVEAL:
            await self._reveal(round)

    async def on_message(self, envelope: Envelope) -> None:
        await self.consensus.on_message(envelope)
        self.arrivals.set()

    # -- TRAIN --------------------------------------------------------------------------------

    async def _train(self, round: int, loaded: _Loaded) -> None:
        if self.behaviour == "copier" or await self._submission(round) is not None:
            return
        if not await self.consensus.head_known():
            log.warning("round %d: the global head is unknown; not training this round", round)
            return
        head = await self.ctx.head()
        base = (await self.consensus.load(head, loaded.genesis, loaded.shapes)).state
        deadline = self._train_deadline(round)
        try:
            data = await asyncio.to_thread(self._build, loaded, round, head, base,
                                           lambda: self.ctx.clock.now() < deadline)
        except ValueError as exc:
            log.error("round %d: no submission: %s", round, exc)
            return
        blob_hash = await asyncio.to_thread(self.ctx.blobs.put_bytes, data)
        record = json.dumps({"hash": blob_hash, "size": len(data)})
        await self.ctx.storage.set_state(SUBMISSION_KEY.format(round), record)
        log.info("round %d: %s submission %s (%d bytes) from base %s", round, self.behaviour, blob_hash[:12],
                 len(data), head[:12])

    def _train_deadline(self, round: int) -> float:
        margin = min(TRAIN_MARGIN_SHARE * self.ctx.schedule.train_s, TRAIN_MARGIN_MAX_S)
        return self.ctx.schedule.phase_window(round, Phase.TRAIN)[1] - margin

    def _build(self, loaded: _Loaded, round: int, head: str, base: GlobalExperts,
               keep_going: Callable[[], bool]) -> bytes:
        """The submission's bytes (runs in a worker thread: torch)."""
        seed = _seed(self.me, round)
        if self.behaviour == "garbage":
            return torch.randint(0, 256, (GARBAGE_BYTES,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
        if self.behaviour == "lazy":
            tensors = dict(base.tensors)
        elif self.behaviour == "noise":
            generator = torch.Generator().manual_seed(seed)
            tensors = {name: t + NOISE_SCALE * t.std() * torch.randn(t.shape, generator=generator)
                       for name, t in base.tensors.items()}
        else:
            tensors = loaded.train(self.ctx, round, base, seed, keep_going)
        spec = self.ctx.spec
        dtype = getattr(torch, spec.model.dtype)
        meta = BlobMeta(network=spec.network_id, round=round, miner=self.me, base=head,
                        group={layer: list(ids) for layer, ids in spec.group.items()})
        return encode_blob({name: t.to(dtype) for name, t in tensors.items()}, meta)

    # -- COMMIT and REVEAL --------------------------------------------------------------------

    async def _commit(self, round: int) -> None:
        if self.behaviour == "late" or await self._own_commit(round) is not None:
            return
        if self.behaviour == "copier":
            commitment = await self._copy_commitment(round)
        else:
            submission = await self._submission(round)
            commitment = None if submission is None else submission[0]
        if commitment is None:
            log.info("round %d: nothing to commit", round)
            return
        await self._publish(Commit(round=round, commitment=commitment))

    async def _reveal(self, round: int) -> None:
        if self.behaviour == "late":
            await self._late_commit(round)
            return
        commitment = await self._own_commit(round)
        if commitment is None or any(r.miner == self.me for r in await self.ctx.storage.reveals_for(round)):
            return
        if self.behaviour == "copier" and not await self._copy_blob(round, commitment):
            return
        if not self.ctx.blobs.has(commitment):
            log.error("round %d: the committed blob %s is not in the blob store; cannot reveal", round,
                      commitment[:12])
            return
        self.ctx.network.serve(commitment)
        if self._served not in (None, commitment):
            self.ctx.network.unserve(self._served)
        self._served = commitment
        await self._publish(Reveal(round=round, commitment=commitment, size=self.ctx.blobs.size(commitment)))

    async def _late_commit(self, round: int) -> None:
        submission = await self._submission(round)
        if submission is None:
            return
        await self.ctx.clock.sleep_until(self.ctx.schedule.phase_window(round, Phase.COMMIT)[1]
                                         + self.ctx.schedule.clock_skew_s)
        await self._publish(Commit(round=round, commitment=submission[0]))

    async def _copy_commitment(self, round: int) -> str | None:
        """The commitment of the first other miner that committed this round (waits for one)."""
        start, end = self.ctx.schedule.phase_window(round, Phase.COMMIT)
        found: list[str] = []

        async def other_commit() -> bool:
            others = [c for c in await self.ctx.storage.commits_for(round) if c.miner != self.me]
            if others:
                first = min(others, key=lambda c: (c.received_at, c.miner))
                found[:] = [first.commitment, first.miner]
            return bool(found)

        deadline = start + COPY_WAIT_SHARE * (end - start)
        if not await wait_until(self.ctx.clock, self.arrivals, other_commit, deadline):
            return None
        commitment, victim = found
        await self.ctx.storage.set_state(f"copied:{round}", victim)
        log.info("round %d: copying the commitment %s of miner %s", round, commitment[:12], victim[:12])
        return commitment

    async def _copy_blob(self, round: int, commitment: str) -> bool:
        victim = await self.ctx.storage.get_state(f"copied:{round}")
        if victim is None:
            return False
        end = self.ctx.schedule.phase_window(round, Phase.REVEAL)[1]

        async def revealed() -> bool:
            return any(r.miner == victim for r in await self.ctx.storage.reveals_for(round))

        await wait_until(self.ctx.clock, self.arrivals, revealed, end)
        loaded = await self._loaded.get()
        cap = max_blob_bytes(loaded.shapes, self.ctx.spec.model.dtype, self.ctx.spec.limits.max_header_bytes)
        try:
            await self.ctx.network.fetch(commitment, [victim], cap)
        except (NetworkError, OSError) as exc:
            log.warning("round %d: cannot fetch the copied blob: %s", round, exc)
            return False
        return True

    # -- helpers ------------------------------------------------------------------------------

    async def _publish(self, message: Commit | Reveal) -> None:
        try:
            await self.ctx.publish(message)
        except PublishRefused as exc:
            log.warning("round %d: %s refused: %s", message.round, message.kind, exc)

    async def _submission(self, round: int) -> tuple[str, int] | None:
        text = await self.ctx.storage.get_state(SUBMISSION_KEY.format(round))
        if text is None:
            return None
        record = json.loads(text)
        return record["hash"], record["size"]

    async def _own_commit(self, round: int) -> str | None:
        commits = await self.ctx.storage.commits_for(round)
        return next((c.commitment for c in commits if c.miner == self.me), None)


class _Loaded:
    """What a miner loads once: the base model, its genesis state and the training sequences."""

    def __init__(self, model: torch.nn.Module, adapter: MoEAdapter, genesis: GlobalExperts,
                 shapes: dict[str, tuple[int, ...]], sequences: torch.Tensor, pad_id: int) -> None:
        self.model = model
        self.adapter = adapter
        self.genesis = genesis
        self.shapes = shapes
        self.sequences = sequences
        self.pad_id = pad_id

    @classmethod
    def create(cls, ctx: NodeContext) -> _Loaded:
        spec, spec_path = ctx.spec, ctx.config.node.spec
        with GLOBAL_RNG_LOCK:
            model, adapter = load_base(spec, spec_path)
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        files = [ctx.config.miner.data] if ctx.config.miner.data else [
            spec_dir_path(spec_path, p) for p in spec.data.train]
        sequences = load_sequences(files, tokenizer, spec.data.seq_len)
        genesis = GlobalExperts.genesis(spec, extract(model, adapter, spec.group))
        shapes = expected_shapes(model, adapter, spec.group)
        return cls(model, adapter, genesis, shapes, sequences, tokenizer.pad_id)

    def train(self, ctx: NodeContext, round: int, base: GlobalExperts, seed: int,
              keep_going: Callable[[], bool]) -> dict[str, torch.Tensor]:
        """H inner steps from `base` on this miner's shard; fewer when `keep_going` turns False."""
        spec, section = ctx.spec, ctx.config.miner
        insert(self.model, self.adapter, base.tensors)
        inner = spec.training
        cfg = TrainConfig(steps=inner.inner_steps, lr=inner.lr, weight_decay=inner.weight_decay,
                          batch_size=inner.batch_size, micro_batch_size=section.micro_batch_size,
                          grad_clip=inner.grad_clip, forward=section.forward, device=section.device,
                          seed=seed, pad_id=self.pad_id)
        rows = shard(self.sequences, ctx.identity.node_id, round)
        with GLOBAL_RNG_LOCK:
            result = train_experts(self.model, self.adapter, spec.group,
                                   _while(batches(rows, cfg.batch_size, seed), keep_going), cfg)
        log.info("round %d: trained %d steps in %.1f s, loss %.4f -> %.4f", round, len(result.losses),
                 result.seconds, result.losses[0], result.losses[-1])
        return result.tensors


def _while(items: Iterator[torch.Tensor], keep_going: Callable[[], bool]) -> Iterator[torch.Tensor]:
    for item in items:
        if not keep_going():
            return
        yield item


def _seed(miner: str, round: int) -> int:
    return int.from_bytes(hashlib.sha256(f"tessera-miner:{miner}:{round}".encode()).digest()[:8], "big") >> 1
