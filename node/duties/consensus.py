"""Global-state consensus, shared by miners and validators: which state each round ended on.

At the start of TRAIN of round r (the end of round r-1's MERGE) a node tallies round r-1's GlobalState
votes from storage and adopts the hash endorsed by a strict majority of validator weight
(`training.state.adopt`); with no majority among the votes it holds it first asks a peer for round
r-1's history (votes gossip missed while it restarted or before the mesh took it in), and with still
none the head stays. Adopting means holding the state blob
(fetched from validators that voted for it when missing) after checking it: its hash (the fetch
verifies it), that it is a global state of this network and expert group with finite values, and that
it is a state of the round being settled. A vote counts for the hash it names, whatever parent it claims:
the hash binds the blob's own parent, while the stored row keeps the parent of the first vote for that
hash, which any one validator can write; adopting rewrites the row with the parent the checked blob
names. Validators also need the outer momentum: its hash rides in GlobalState (`momentum`), is
remembered per (state, voter), and a validator fetches and checks the momentum blob of the adopted
state, so a validator that computed something else re-syncs. A node with
no head past round 0 (a late joiner) learns it from the heads that validators' heartbeats announce, by
the same weight rule; so does a node whose head differs from the one a weight majority of validators
announce in this round's heartbeats (it missed the votes while it was down): after TRAIN it follows
them, with the momentum those heartbeats name. Every node serves the state it adopted (again after a
restart), so a state outlives its proposers; a head blob that went missing or corrupt on disk is
fetched again from the validators that voted for it. This module knows nothing about training, scoring
or merging; it tallies, moves and checks blobs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from node.net.network import NetworkError
from node.runtime.clock import Clock
from node.runtime.context import NodeContext
from node.store.records import GlobalStateRecord
from protocol.messages import Envelope, GlobalState, Heartbeat, Message
from protocol.rounds import Phase
from protocol.spec import NetworkSpec
from training.blob import (
    BlobError,
    BlobFile,
    BlobMeta,
    Header,
    decode_header,
    max_blob_bytes,
    read_header,
    read_tensor,
)
from training.state import (
    GLOBAL_FORMAT,
    STATE_MINER,
    GlobalExperts,
    StateError,
    adopt,
)

log = logging.getLogger(__name__)

VOTE_GRACE_SHARE = 0.1  # of TRAIN: how long to wait for missing votes when the first ones disagree
Shapes = Mapping[str, tuple[int, ...]]


class Decoded(NamedTuple):
    """A checked state blob (`decode_state`, `read_state`)."""

    meta: BlobMeta
    tensors: Mapping[str, torch.Tensor]


class SyncError(ValueError):
    """A global state could not be fetched from its voters, or its blob is not what was announced."""


@dataclass(frozen=True)
class LoadedState:
    """The state a node builds on, and whether its momentum is the network's (validators only)."""

    state: GlobalExperts
    synced: bool


def decode_state(data: bytes, spec: NetworkSpec, shapes: Shapes) -> Decoded:
    """Check a global state blob of this network and group (`shapes`: the group's); its metadata and
    tensors. SyncError names what does not fit."""
    try:
        header = decode_header(data, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise SyncError(f"state blob: {exc.reason}") from exc
    return _checked_state(header, {name: read_tensor(data, header, name) for name in header.tensors}, spec, shapes)


def read_state(path: Path, spec: NetworkSpec, shapes: Shapes) -> Decoded:
    """`decode_state` of a blob file whose bytes hash to its name: its tensors are read from the file a tensor
    at a time when asked for (`training.blob.BlobFile`), so a node holds no copy of a state it adopted (the
    group in fp32: 0.8 GB at OLMoE-1B-7B's size)."""
    try:
        header = read_header(path, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise SyncError(f"state blob: {exc.reason}") from exc
    return _checked_state(header, BlobFile(path, header), spec, shapes)


def _checked_state(header: Header, tensors: Mapping[str, torch.Tensor], spec: NetworkSpec, shapes: Shapes) -> Decoded:
    meta = header.meta
    if meta.format != GLOBAL_FORMAT or meta.miner != STATE_MINER:
        raise SyncError(f"state blob has format {meta.format!r} and miner {meta.miner[:12]!r}; "
                        "not a global state")
    if meta.network != spec.network_id:
        raise SyncError("state blob is for another network")
    if meta.group != {layer: sorted(ids) for layer, ids in spec.group.items()}:
        raise SyncError("state blob is for another expert group")
    held = {name: tuple(info.shape) for name, info in header.tensors.items()}
    if held != {name: tuple(s) for name, s in shapes.items()}:
        raise SyncError("state blob tensors do not match the expert group's names and shapes")
    if not all(bool(torch.isfinite(tensors[name]).all()) for name in tensors):  # one tensor at a time
        raise SyncError("state blob holds non-finite values")
    return Decoded(meta, tensors)


def _without_momentum(spec: NetworkSpec, decoded: Decoded) -> GlobalExperts:
    """A checked state with zero momentum: a validator's before it syncs the momentum, or a miner's, which
    never reads it."""
    zero = torch.zeros((), dtype=torch.float32)  # broadcast, as the genesis momentum (training.state): no memory
    zeros = {name: zero.expand(shapes) for name, shapes in _shapes(decoded.tensors).items()}
    return GlobalExperts(spec=spec, round=decoded.meta.round, parent=decoded.meta.base, tensors=decoded.tensors,
                         momentum=zeros)


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from a blob file's header where the tensors are one (without reading them)."""
    if isinstance(tensors, BlobFile):
        return {name: info.shape for name, info in tensors.header.tensors.items()}
    return {name: tuple(t.shape) for name, t in tensors.items()}


async def wait_until(clock: Clock, arrivals: asyncio.Event, ready: Callable[[], Awaitable[bool]],
                     deadline: float) -> bool:
    """Re-check `ready` whenever `arrivals` is set, until it holds (True) or the clock passes `deadline`."""
    while True:
        arrivals.clear()
        if await ready():
            return True
        if clock.now() >= deadline:
            return False
        waiters = [asyncio.ensure_future(arrivals.wait()), asyncio.ensure_future(clock.sleep_until(deadline))]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)


class Consensus:
    """One node's view of the chain of global states; `need_momentum` for validators."""

    def __init__(self, ctx: NodeContext, need_momentum: bool) -> None:
        self.ctx = ctx
        self.need_momentum = need_momentum
        self.votes_arrived = asyncio.Event()
        self._serving: str | None = None
        self._adopted: tuple[str, LoadedState] | None = None

    def state_cap(self, shapes: Shapes) -> int:
        """The largest a state or momentum blob can be (both are fp32)."""
        return max_blob_bytes(shapes, "float32", self.ctx.spec.limits.max_header_bytes)

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        """Remember the momentum hash a GlobalState or a validator's Heartbeat announces; wake a tally
        waiting for votes."""
        if isinstance(message, Heartbeat):
            if message.momentum is not None and envelope.sender in self.ctx.spec.validator_weights:
                await self.ctx.storage.set_momentum_of(message.head, envelope.sender, message.momentum)
            return
        if not isinstance(message, GlobalState):
            return
        if message.momentum is not None:
            await self.ctx.storage.set_momentum_of(message.hash, envelope.sender, message.momentum)
        self.votes_arrived.set()

    async def on_phase(self, round: int, phase: Phase, shapes: Shapes) -> None:
        """At each phase start: settle the previous round at TRAIN, else just make sure the head is known;
        then serve the head (again after a restart)."""
        if phase is Phase.TRAIN:
            await self.settle(round, shapes)
        elif await self.ensure_head(round, shapes):
            await self.follow(round, shapes)
        await self._serve_head()

    async def _serve_head(self) -> None:
        head = await self.ctx.storage.head()
        if head is None or head == self.ctx.spec.root or head == self._serving:
            return
        if not self.ctx.blobs.has(head):
            return  # re-fetched by `load` when next needed
        self.ctx.network.serve(head)
        if self._serving is not None:
            self.ctx.network.unserve(self._serving)
        self._serving = head

    async def settle(self, round: int, shapes: Shapes) -> str:
        """At TRAIN of `round`: adopt round-1's majority state (a late joiner learns the head); the head. A
        successor spec settles no round before its first: the spec it succeeds settled that one."""
        if round > self.ctx.spec.first_round:
            await self._adopt(round - 1, shapes)
        await self.ensure_head(round, shapes)
        return await self.ctx.head()

    async def ensure_head(self, round: int, shapes: Shapes) -> bool:
        """Make sure the head is known: the base in round 0, else learnt from heartbeats; False if not yet."""
        if await self.ctx.storage.head() is not None:
            return True
        if round == 0:
            await self.ctx.storage.set_head(self.ctx.spec.root)
            return True
        return await self.learn_head(round, shapes)

    async def head_known(self) -> bool:
        """False for a late joiner that has not learnt the head yet."""
        return await self.ctx.storage.head() is not None

    async def learn_head(self, round: int, shapes: Shapes) -> bool:
        """Take the head that validators holding a weight majority announced in recent heartbeats."""
        head, voters = await self._announced(round - 1)
        if head is None:
            log.info("round %d: head unknown; waiting for validators' heartbeats or global states", round)
            return False
        if head != self.ctx.spec.root:
            try:
                await self._fetch_checked(head, list(voters), shapes)
            except SyncError as exc:
                if not self.ctx.disk.quiet(exc):
                    log.warning("round %d: cannot take the announced head %s: %s", round, head[:12], exc)
                return False
        await self.ctx.storage.set_head(head)
        log.info("round %d: learnt head %s from validators' heartbeats", round, head[:12])
        return True

    async def follow(self, round: int, shapes: Shapes) -> None:
        """Take the head a weight majority of validators announced in this round's heartbeats, when ours
        differs: this node missed the votes that decided it (it was down, or joined the mesh late)."""
        head, voters = await self._announced(round)
        if head is None or head == await self.ctx.storage.head():
            return
        try:
            decoded = await self._fetch_checked(head, list(voters), shapes)
        except SyncError as exc:
            if not self.ctx.disk.quiet(exc):
                log.warning("round %d: cannot follow the head %s that validators announce: %s", round, head[:12],
                            exc)
            return
        record = GlobalStateRecord(head, decoded.meta.base, decoded.meta.round, (), False, voters)
        await self.ctx.storage.set_head(head)
        log.warning("round %d: my head differed from the one validators announce; now following %s (voters %s)",
                    round, head[:12], ", ".join(v[:8] for v in voters))
        await self._take(round, record, decoded, shapes)

    async def _announced(self, since: int) -> tuple[str | None, tuple[str, ...]]:
        """The head a weight majority of validators announce in heartbeats of round `since` or later, and
        those validators; (None, ()) without a majority."""
        weights = self.ctx.spec.validator_weights
        votes = {n.node_id: n.head for n in await self.ctx.storage.nodes() if n.node_id in weights and n.round >= since}
        head = adopt(votes, weights)
        return head, tuple(v for v, h in sorted(votes.items()) if h == head) if head is not None else ()

    async def load(self, head: str, genesis: GlobalExperts, shapes: Shapes) -> LoadedState:
        """The state `head` names, from the blob store (and its momentum, when this node holds it)."""
        if head == genesis.hash:
            return LoadedState(genesis, True)
        if self._adopted is not None and self._adopted[0] == head:
            return self._adopted[1]  # decoded once, when it was fetched and checked for adoption
        path = await asyncio.to_thread(self.ctx.blobs.verified, head)
        if path is None:
            path = await self._refetch(head, shapes)
        if self.need_momentum and (momentum := await self.ctx.storage.momentum()):
            try:
                moments = await asyncio.to_thread(self.ctx.blobs.verified, momentum)
                if moments is None:
                    raise OSError(f"momentum {momentum[:12]} is missing or corrupt in the blob store")
                state = await asyncio.to_thread(GlobalExperts.from_files, head, path, moments, self.ctx.spec,
                                                shapes)
                return LoadedState(state, True)
            except (OSError, StateError) as exc:
                log.warning("momentum %s does not belong to head %s (%s); not in sync", momentum[:12],
                            head[:12], exc)
        decoded = await asyncio.to_thread(read_state, path, self.ctx.spec, shapes)
        return LoadedState(_without_momentum(self.ctx.spec, decoded), not self.need_momentum)

    async def _refetch(self, head: str, shapes: Shapes) -> Path:
        """The head's blob, missing or corrupt here, fetched again from the validators that voted for it."""
        voters = [v for s in await self.ctx.storage.global_states() if s.hash == head for v in s.voters]
        providers = voters or sorted(self.ctx.spec.validator_weights)
        log.warning("the head state %s is missing or corrupt in the blob store; fetching it from %d peer(s)",
                    head[:12], len(providers))
        await self._fetch_checked(head, providers, shapes)
        path = await asyncio.to_thread(self.ctx.blobs.verified, head)
        if path is None:
            raise SyncError(f"state {head[:12]}: gone from the blob store right after it was fetched")
        return path

    async def _adopt(self, round: int, shapes: Shapes) -> None:
        winner = await self._winner(round)
        if winner is None:
            train_s = self.ctx.schedule.train_s
            deadline = self.ctx.schedule.phase_window(round + 1, Phase.TRAIN)[0] + VOTE_GRACE_SHARE * train_s

            async def decided() -> bool:
                return await self._winner(round) is not None or not await self._pending(round)

            await wait_until(self.ctx.clock, self.votes_arrived, decided, deadline)
            winner = await self._winner(round)
        if winner is None:  # gossip may have missed the votes (a restart, a late join, a thin mesh): ask a peer

            async def undecided() -> bool:
                return await self._winner(round) is None

            await self.ctx.take_in_from_peer(round, undecided)
            winner = await self._winner(round)
        if winner is None:
            if await self.ctx.storage.global_states(round):
                log.warning("round %d: no global state has a majority of validator weight; the head stays",
                            round)
            return
        try:
            decoded = await self._fetch_checked(winner.hash, list(winner.voters), shapes, round)
        except SyncError as exc:
            if not self.ctx.disk.quiet(exc):
                log.error("round %d: cannot adopt %s: %s; the head stays", round, winner.hash[:12], exc)
            return
        moved = await self.ctx.storage.head() != winner.hash
        await self.ctx.storage.mark_adopted(winner.hash, decoded.meta.base)
        if moved:
            log.info("round %d: adopted global state %s (voters %s)", round, winner.hash[:12],
                     ", ".join(v[:8] for v in winner.voters))
        await self._take(round, winner, decoded, shapes)

    async def _take(self, round: int, winner: GlobalStateRecord, decoded: Decoded, shapes: Shapes) -> None:
        """Hold the decoded head `winner` names (a validator: with the momentum one of its voters announced)."""
        loaded = LoadedState(_without_momentum(self.ctx.spec, decoded), not self.need_momentum)
        if self.need_momentum:
            try:
                loaded = LoadedState(await self._sync_momentum(winner, decoded, shapes), True)
            except SyncError as exc:
                if not self.ctx.disk.quiet(exc):
                    log.error("round %d: %s; this validator is out of sync and abstains from merging", round, exc)
        self._adopted = (winner.hash, loaded)

    async def _winner(self, round: int) -> GlobalStateRecord | None:
        states = await self.ctx.storage.global_states(round)
        votes = {voter: s.hash for s in states for voter in s.voters}
        chosen = adopt(votes, self.ctx.spec.validator_weights)
        return next((s for s in states if s.hash == chosen), None)

    async def _pending(self, round: int) -> bool:
        """Some validators voted and others, who could still tip the tally, have not (yet)."""
        states = await self.ctx.storage.global_states(round)
        voted = {voter for s in states for voter in s.voters}
        return bool(voted) and bool(set(self.ctx.spec.validator_weights) - voted)

    async def _fetch_checked(self, state_hash: str, providers: list[str], shapes: Shapes,
                             round: int | None = None) -> Decoded:
        """The state blob (fetched when not held), decoded and checked, with `round` the round whose state
        it must be; SyncError names what is wrong."""
        try:
            path = await self.ctx.network.fetch(state_hash, providers, self.state_cap(shapes))
            decoded = await asyncio.to_thread(read_state, path, self.ctx.spec, shapes)
        except (NetworkError, OSError) as exc:
            raise SyncError(f"state {state_hash[:12]}: {exc}") from exc
        if round is not None and decoded.meta.round != round:
            raise SyncError(f"state {state_hash[:12]} is a state of round {decoded.meta.round}, not of round {round}")
        return decoded

    async def _sync_momentum(self, winner: GlobalStateRecord, decoded: Decoded, shapes: Shapes) -> GlobalExperts:
        """The adopted state with the momentum a voter announced with it: ours when it is one of those,
        else the first a voter serves that belongs to the state; SyncError when none does."""
        announced = {}
        for voter in winner.voters:
            momentum = await self.ctx.storage.momentum_of(winner.hash, voter)
            if momentum is not None:
                announced[voter] = momentum
        me, mine = self.ctx.identity.node_id, await self.ctx.storage.momentum()
        for voter, momentum in sorted(announced.items(), key=lambda item: (item[1] != mine, item[0] != me)):
            try:
                path = await self.ctx.network.fetch(momentum, [voter, *winner.voters], self.state_cap(shapes))
                state = await asyncio.to_thread(GlobalExperts.with_momentum_file, winner.hash, decoded.meta,
                                                decoded.tensors, path, self.ctx.spec, shapes)
            except (NetworkError, OSError, StateError) as exc:
                if not self.ctx.disk.quiet(exc):
                    log.warning("momentum %s from %s: %s", momentum[:12], voter[:12], exc)
                continue
            if momentum == mine:
                return state
            await self.ctx.storage.set_momentum(momentum)
            if voter != self.ctx.identity.node_id:
                log.info("re-synced outer momentum %s of state %s from %s", momentum[:12], winner.hash[:12],
                         voter[:12])
            return state
        raise SyncError(f"no voter of state {winner.hash[:12]} served a momentum blob that belongs to it")


