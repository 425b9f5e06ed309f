"""The chain of specs around a role's duties: a successor offered, checked and kept, activated at its round, and
followed by a node that missed its activation.

`Succession` is the node's `Duties`: it runs the role's duties (built by their factory from a `NodeContext` whose
spec is the one in force) and, at each phase start before them:
- judges the successor documents peers offered (`Successor` messages, at most MAX_OFFERS a phase), fetching each
  from its offerer: `protocol.successor.judge_document` and the model's experts; an accepted one is kept (storage
  and blob store) and served, a refused one logged in one line and remembered, so it is not fetched again;
- a validator announces, once a round, the accepted successor of the spec in force that is due next, so a node
  that was away when it was offered still has it in time;
- follows the spec that validators holding a weight majority name in this round's heartbeats (`Heartbeat.spec`)
  when it is not the one in force (the node missed the activation: it was down, joined late, or settled another
  base): that spec is fetched from them by its network id (its canonical bytes are a blob), with its
  predecessors back to one this node knows and the states it inherits, each checked
  (`protocol.successor.judge_successor_spec`);
- else, in a successor's activation round, activates it: the role's duties settle the round before (`close`),
  the head they end on is the successor's base, and `protocol.successor.successor_spec` derives the spec.
Changing spec rebuilds the role's duties on the new spec (their models load again, with the states the spec
inherits written in); the process, its network, storage and ledger go on. This module knows nothing about
training, scoring or merging; it moves documents, specs and state blobs and checks them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import torch

from node.net.network import NetworkError, PublishRefused
from node.runtime.context import Duties, DutiesFactory, HeartbeatDuties, NodeContext
from node.store.records import SpecRecord, SuccessorRecord
from protocol.encoding import sha256_hex
from protocol.messages import Envelope, Message, Successor
from protocol.rounds import Phase
from protocol.spec import NetworkSpec, SpecError, load_spec
from protocol.successor import (
    MAX_DOCUMENT_BYTES,
    SuccessorDocument,
    decode_document,
    judge_document,
    judge_successor_spec,
    spec_from_bytes,
    successor_spec,
)
from training.adapters import MoEAdapter, adapter_for
from training.blob import max_blob_bytes
from training.experts import expected_shapes
from training.model import meta_base, moe_experts
from training.state import adopt

log = logging.getLogger(__name__)

MAX_OFFERS = 8  # documents judged per phase: what a peer offering garbage under many keys can cost a node
OFFERS_S = 5.0  # and the seconds spent on them, before the phase's duties run
MAX_SPEC_BYTES = 1 << 20  # far over any spec's canonical bytes (a few KiB)
MAX_CHAIN_FETCH = 64  # predecessors fetched back to one this node knows


def inherited_paths(ctx: NodeContext) -> list[Path]:
    """The blob files of the states the spec in force inherits, oldest first (Succession fetched them)."""
    lineage = ctx.spec.lineage
    return [] if lineage is None else [ctx.blobs.path(state) for state in lineage.inherits]


class Succession:
    """The node's duties: the role's duties on the spec in force, and the chain of specs around them."""

    def __init__(self, ctx: NodeContext, genesis: NetworkSpec, factory: DutiesFactory, duties: Duties) -> None:
        self.ctx = ctx
        self.genesis = genesis
        self.factory = factory
        self.duties = duties
        self._skeleton: tuple[torch.nn.Module, MoEAdapter] | None = None
        self._said: set[tuple[str, str]] = set()
        """(document, spec in force) refused and (document, offerer) that failed to serve it: not tried again."""

    @staticmethod
    def around(factory: DutiesFactory) -> DutiesFactory:
        """The node's DutiesFactory for a role's: `factory`'s duties on the spec in force (the node's context's),
        inside the chain of specs that starts at the node's spec file."""
        return lambda ctx: Succession(ctx, load_spec(ctx.config.node.spec), factory, factory(ctx))

    @property
    def spec(self) -> NetworkSpec:
        """The spec in force."""
        return self.ctx.spec

    async def on_phase(self, round: int, phase: Phase) -> None:
        await self._judge_offers(round)
        if phase is Phase.TRAIN:
            await self._announce(round)
        target = await self._announced(round)
        if target is not None and target[0] != self.spec.network_id:
            await self._follow(round, *target)
        elif target is None and (document := await self._due(round)) is not None and document.activation == round:
            await self._activate(round, document)
        await self._serve_chain()
        await self.duties.on_phase(round, phase)

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        await self.duties.on_message(envelope, message)  # an offer is judged at the next phase start

    async def close(self, round: int) -> None:
        await self.duties.close(round)

    # -- documents ------------------------------------------------------------------------------

    async def offer(self, data: bytes) -> SuccessorRecord:
        """Judge a document an operator hands this node (`tessera spec offer`); kept, served and announced when
        accepted, and the verdict returned either way."""
        round = self._round()
        record, document = await self._judge(sha256_hex(data), data, round)
        if document is None:
            return record
        await asyncio.to_thread(self.ctx.blobs.put_bytes, data)
        await self.ctx.storage.judge_successor(record, self.ctx.clock.now())
        self.ctx.network.serve(record.document)
        try:
            await self.ctx.publish(Successor(round=round, document=record.document, size=len(data)))
        except PublishRefused as exc:  # this node already offered one this round: the next round's announcement
            log.info("round %d: successor %s kept; not offered to peers yet: %s", round, record.document[:12], exc)
        return record

    async def _judge_offers(self, round: int) -> None:
        """Fetch and judge what peers offered (validators' offers first), OFFERS_S at most a phase."""
        validators = self.genesis.validator_weights
        offers = sorted(await self.ctx.storage.successor_offers(round - 1), key=lambda o: o[2] not in validators)
        fresh = [o for o in offers if (o[0], self.spec.network_id) not in self._said and (o[0], o[2]) not in self._said]
        try:
            async with asyncio.timeout(OFFERS_S):
                for document, size, sender in fresh[:MAX_OFFERS]:
                    await self._take_offer(round, document, size, sender)
        except TimeoutError:
            log.info("round %d: successor offers left for the next phase (%.0f s spent)", round, OFFERS_S)

    async def _take_offer(self, round: int, document: str, size: int, sender: str) -> None:
        try:
            if size > MAX_DOCUMENT_BYTES:
                raise NetworkError(f"{size} bytes, over {MAX_DOCUMENT_BYTES}")
            path = await self.ctx.network.fetch(document, [sender], MAX_DOCUMENT_BYTES)
            data = await asyncio.to_thread(path.read_bytes)
        except (NetworkError, OSError) as exc:
            log.warning("round %d: successor %s offered by %s: %s", round, document[:12], sender[:12], exc)
            self._said.add((document, sender))
            return
        record, decoded = await self._judge(document, data, round)
        if decoded is not None or record.predecessor in ("", self.spec.network_id):
            # a document for another spec is judged again should this node come to run that spec
            await self.ctx.storage.judge_successor(record, self.ctx.clock.now())
        if decoded is not None:
            self.ctx.network.serve(document)

    async def _judge(self, address: str, data: bytes, round: int) -> tuple[SuccessorRecord, SuccessorDocument | None]:
        """The verdict on a document's bytes, logged in one line; the document when accepted."""
        try:
            document = decode_document(data)
        except SpecError as exc:
            record = SuccessorRecord(address, "", "", 0, "refuse", f"malformed: {exc}", 0)
            self._refused(round, record)
            return record, None
        skeleton, adapter = await self._model()
        reason = judge_document(document, self.spec, round, moe_experts(skeleton, adapter))
        signers = len(document.signatures)
        record = SuccessorRecord(address, document.hash, document.predecessor, document.activation,
                                 "refuse" if reason else "accept", reason or "", signers)
        if reason:
            self._refused(round, record)
            return record, None
        log.info("round %d: successor %s accepted: expert group %s from round %d, signed by %d of %d validators",
                 round, address[:12], document.group, document.activation, signers, len(self.spec.validators))
        return record, document

    def _refused(self, round: int, record: SuccessorRecord) -> None:
        if (record.document, self.spec.network_id) not in self._said:
            log.warning("round %d: successor %s refused: %s", round, record.document[:12], record.reason)
            self._said.add((record.document, self.spec.network_id))

    async def _due(self, round: int) -> SuccessorRecord | None:
        """The accepted successor of the spec in force that comes next (earliest activation, then address)."""
        due = [s for s in await self.ctx.storage.successors()
               if s.verdict == "accept" and s.predecessor == self.spec.network_id and s.activation >= round]
        return min(due, key=lambda s: (s.activation, s.document), default=None)

    async def _announce(self, round: int) -> None:
        """A validator re-offers the successor due next, once a round."""
        if self.ctx.identity.node_id not in self.genesis.validator_weights:
            return
        due = await self._due(round + 1)
        if due is None or not self.ctx.blobs.has(due.document):
            return
        self.ctx.network.serve(due.document)
        try:
            await self.ctx.publish(Successor(round=round, document=due.document,
                                             size=self.ctx.blobs.size(due.document)))
        except PublishRefused as exc:
            log.info("round %d: successor %s not announced: %s", round, due.document[:12], exc)

    # -- changing spec ------------------------------------------------------------------------

    async def _activate(self, round: int, record: SuccessorRecord) -> None:
        """Settle the round before on the spec in force, and take the successor on the head it ends on."""
        await self.duties.close(round)
        base = await self.ctx.head()
        document = decode_document(await asyncio.to_thread(self.ctx.blobs.path(record.document).read_bytes))
        spec = successor_spec(self.spec, document, base)
        await self._keep(spec)
        log.info("round %d: successor %s activated on base state %s: spec %s", round, record.document[:12],
                 base[:12], spec.network_id[:12])
        await self._switch(round, spec)

    async def _announced(self, round: int) -> tuple[str, tuple[str, ...]] | None:
        """The spec a weight majority of validators name in their heartbeats of `round`, and those validators."""
        weights = self.genesis.validator_weights
        named = {n.node_id: n.spec or self.genesis.network_id for n in await self.ctx.storage.nodes()
                 if n.node_id in weights and n.round == round}
        spec_id = adopt(named, weights)
        return None if spec_id is None else (spec_id, tuple(sorted(v for v, s in named.items() if s == spec_id)))

    async def _follow(self, round: int, spec_id: str, voters: tuple[str, ...]) -> None:
        """Take the spec `voters` run, fetching it (and what it needs) when this node does not have it."""
        try:
            spec = await self._fetch_spec(spec_id, list(voters))
            await self._fetch_inherited(spec, list(voters))
        except (NetworkError, OSError, SpecError, ValueError) as exc:
            log.warning("round %d: cannot follow spec %s that validators run: %s", round, spec_id[:12], exc)
            return
        log.warning("round %d: validators %s run spec %s, not this node's %s; following them", round,
                    ", ".join(v[:8] for v in voters), spec_id[:12], self.spec.network_id[:12])
        await self._switch(round, spec)

    async def _fetch_spec(self, spec_id: str, providers: list[str]) -> NetworkSpec:
        """The spec with network id `spec_id`: known here, or fetched with its predecessors back to a known one,
        each judged against its predecessor and kept."""
        known = {self.genesis.network_id: self.genesis}
        known.update({i: spec_from_bytes(r.body) for i, r in (await self.ctx.storage.specs()).items()})
        fetched: list[NetworkSpec] = []
        at = spec_id
        while at not in known:
            if len(fetched) >= MAX_CHAIN_FETCH:
                raise SpecError(f"spec {spec_id[:12]} is more than {MAX_CHAIN_FETCH} successors past any spec known")
            path = await self.ctx.network.fetch(at, providers, MAX_SPEC_BYTES)
            spec = spec_from_bytes(await asyncio.to_thread(path.read_bytes))
            if spec.lineage is None:
                raise SpecError(f"spec {at[:12]} is another network's genesis spec")
            fetched.append(spec)
            at = spec.lineage.predecessor
        predecessor = known[at]
        skeleton, adapter = await self._model()
        for spec in reversed(fetched):
            reason = judge_successor_spec(spec, predecessor)
            if reason is None:
                expected_shapes(skeleton, adapter, spec.group)  # ValueError for experts the model lacks
            if reason is not None:
                raise SpecError(f"spec {spec.network_id[:12]}: {reason}")
            await self._keep(spec)
            predecessor = spec
        return known.get(spec_id) or predecessor

    async def _fetch_inherited(self, spec: NetworkSpec, providers: list[str]) -> None:
        """The state blobs `spec` inherits, fetched where missing (each capped at the largest state of any group
        of the chain; the fetch checks its hash, building the model its content)."""
        if spec.lineage is None:
            return
        skeleton, adapter = await self._model()
        cap = max_blob_bytes(expected_shapes(skeleton, adapter, {layer: list(range(count)) for layer, count in
                                                                moe_experts(skeleton, adapter).items()}),
                             "float32", spec.limits.max_header_bytes)
        for state in spec.lineage.inherits:
            if not self.ctx.blobs.has(state):
                await self.ctx.network.fetch(state, providers, cap)

    async def _keep(self, spec: NetworkSpec) -> None:
        """Keep a successor spec (its canonical bytes in the blob store, served, and a row)."""
        assert spec.lineage is not None, "only successor specs are kept; the genesis spec is the node's file"
        body = spec.canonical_bytes()
        await asyncio.to_thread(self.ctx.blobs.put_bytes, body)
        await self.ctx.storage.add_spec(SpecRecord(spec.network_id, spec.lineage.predecessor, spec.first_round, body))

    async def _switch(self, round: int, spec: NetworkSpec) -> None:
        """Run the role's duties on `spec` from now on (the spec in force across restarts too). A head that is no
        state of `spec`'s (a node that followed without settling the round before, or joined late) goes back to
        its root; its consensus learns the head from there."""
        storage = self.ctx.storage
        await storage.set_spec_in_force(None if spec.lineage is None else spec.network_id)
        head = await storage.head()
        if head is not None and head != spec.root and not any(
                s.hash == head and s.round >= spec.first_round for s in await storage.global_states()):
            await storage.set_head(spec.root)
        ctx = replace(self.ctx, spec=spec)
        try:
            duties = await asyncio.to_thread(self.factory, ctx)
        except ValueError as exc:
            log.error("round %d: cannot run spec %s: %s; this node only announces itself until that is fixed and "
                      "it restarts", round, spec.network_id[:12], exc)
            duties = HeartbeatDuties(ctx)
        self.ctx, self.duties = ctx, duties
        log.info("round %d: spec %s in force: expert group %s", round, spec.network_id[:12], spec.group)

    async def _serve_chain(self) -> None:
        """Serve the successor specs this node knows and the states they inherit, for nodes that missed them."""
        for record in (await self.ctx.storage.specs()).values():
            for blob in (record.id, *record.inherits):
                if self.ctx.blobs.has(blob):
                    self.ctx.network.serve(blob)

    # -- helpers --------------------------------------------------------------------------------

    async def _model(self) -> tuple[torch.nn.Module, MoEAdapter]:
        """The base model's skeleton (no weights) and adapter, built once."""
        if self._skeleton is None:
            skeleton = await asyncio.to_thread(meta_base, self.genesis, self.ctx.config.node.spec)
            self._skeleton = skeleton, adapter_for(self.genesis.model.family)
        return self._skeleton

    def _round(self) -> int:
        now = self.ctx.clock.now()
        return self.ctx.schedule.round_at(now) if now >= self.ctx.schedule.genesis_ts else 0
