"""The node daemon: wires config, key, storage, network, scheduler, HTTP API and duties, and runs them.

`await Node.create(config, ...)` locks the data directory and key (node.store.lock: one running node
each) and opens everything; `await node.run()` owns ONE TaskGroup holding every background task (the
scheduler, the gossip consumer) until `stop()`, then closes HTTP, the network and storage in that
order and lets the locks go. Gossip arrives already judged by the network's check (only
ACCEPTed envelopes are delivered); each is recorded in storage BEFORE the duties see it, so a node
killed at any point restarts knowing every message its duties acted on. Our own published envelopes
take the same path (`_handle`): recorded, then handed to the duties with the decoded message. A
node started after genesis first catches up: before the scheduler starts, it asks a peer for what
that peer accepted in the previous and the current round (`Network.catch_up`) and takes it in.

Miner and validator work plugs in through `Duties` (`on_phase`, `on_message`), built from a
`NodeContext` (node.runtime.context, the duties' whole view of the node); without a factory a node
runs `HeartbeatDuties`, which only announces liveness and head, once a round.

Before it takes the locks, a node refuses what would run but never work (node.runtime.preflight); once
running it says in its log when it has no peer and what to check, and when it has peers again, and, at
start and at each TRAIN, when its disk has less room than the rounds ahead need (node.runtime.disk, which
also says a write refused for a full disk, once a round).
This module knows nothing about training, scoring or merging, nor about libp2p (node.net.p2p).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import time
from typing import Any

from node.net.judge import GossipJudge, clock_behind, clock_suspects, other_protocols
from node.net.network import Network, Subscription
from node.runtime.clock import Clock, SystemClock
from node.runtime.config import ConfigError, NodeConfig
from node.runtime.context import (
    Duties,
    DutiesFactory,
    HeartbeatDuties,
    LocalDelivery,
    NodeContext,
    TakesSuccessors,
)
from node.runtime.disk import DiskWatch, group_shapes, round_need
from node.runtime.http import HttpApi
from node.runtime.metrics import NodeMetrics
from node.runtime.preflight import alone_hint, check_disk, check_listen, check_memory, check_role_key
from node.runtime.scheduler import Scheduler
from node.runtime.status import StatusViews, learning_settings
from node.store.blobs import BlobStore
from node.store.db import Storage
from node.store.lock import NodeLock, Owner
from node.store.records import PhaseRun
from protocol.identity import Identity, load_or_create_identity
from protocol.messages import Envelope, Message
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec, SpecError, load_spec
from protocol.successor import spec_from_bytes
from protocol.version import PROTOCOL_VERSION, RELEASE, describe, other_protocol_line
from training import allocator

log = logging.getLogger(__name__)

CATCH_UP_WAIT_S = 10.0  # how long a node started after genesis waits for a peer to catch up from
ALONE_WARN_S = 15.0  # how long a node goes without a peer before its log says so
PEER_WATCH_S = 1.0  # how often it looks

ROUNDS_LISTED = 32


class Node:
    """One running node. Build with `await Node.create(...)`; `await run()`; `stop()` from anywhere on the loop."""

    def __init__(self, ctx: NodeContext, duties: Duties, lock: NodeLock, new_data_round: int = -1,
                 genesis: NetworkSpec | None = None) -> None:
        self.ctx = ctx
        self.genesis = genesis or ctx.spec
        """The network's spec file (`ctx.spec` is the spec in force when the node started: a successor's, maybe)."""
        self.duties = duties
        self._lock = lock
        self.scheduler = Scheduler(ctx.schedule, ctx.clock, self._on_phase, self._on_run, quiet=ctx.disk.quiet)
        self.http: HttpApi | None = None
        self._stop = asyncio.Event()
        self.key_elsewhere: dict[str, Any] | None = None
        """Messages signed with our key that another node sent (`_signed_elsewhere`); None: none seen."""
        self._new_data_round = new_data_round
        """The round this node started in when its database was new then (else -1): messages of that round or
        before signed with our key may be this key's own from before the data directory was made."""
        # Subscribe now, not in run(): gossip that arrives in between waits in the queue.
        self._subscription: Subscription = ctx.network.subscribe()
        ctx.local.handler = self._handle

    @classmethod
    async def create(cls, config: NodeConfig, network: Network | None = None, clock: Clock | None = None,
                     duties: DutiesFactory | None = None) -> Node:
        """Load spec and key, lock the data directory and key (AlreadyRunning if another node holds them),
        open storage and blobs, and join the network (libp2p when none is given)."""
        try:
            spec = load_spec(config.node.spec)
        except SpecError as exc:
            raise ConfigError(f"node.spec: {exc}") from exc
        if spec.lineage is not None:
            raise ConfigError(f"node.spec: {config.node.spec} is a successor spec; give the network's genesis spec "
                              "(a node follows the successors from there)")
        identity = await asyncio.to_thread(load_or_create_identity, config.node.key)
        check_role_key(config, spec, identity)
        await asyncio.to_thread(check_memory, config, spec)  # the role's step traced, before any weight loads
        try:
            shapes = await asyncio.to_thread(group_shapes, spec, config.node.spec)
        except ValueError as exc:
            raise ConfigError(f"node.spec: {exc}") from exc
        need = round_need(config, spec, shapes)
        check_disk(config, need)
        if network is None:  # before the lock, which makes the data directory: a mistake leaves nothing behind
            await asyncio.to_thread(check_listen, config)
        clock = clock or SystemClock()
        # before sweeping the blob store's temporary files, which a running node may be writing
        owner = Owner(network=spec.network_id, role=config.node.role, node=identity.node_id)
        lock = await asyncio.to_thread(NodeLock.acquire, config.node.data_dir, config.node.key, owner)
        now, schedule = clock.now(), Schedule.from_spec(spec)
        new_data_round = schedule.round_at(now) if not config.db_path.exists() and now >= schedule.genesis_ts else -1
        try:
            blobs = BlobStore(config.blob_dir, config.storage.blob_budget_bytes)
            blobs.sweep_temporary()  # ours alone now: what a crash left behind
            storage = await Storage.open(config.db_path)
        except BaseException:
            lock.release()
            raise
        try:
            if network is None:
                network = await _open_libp2p(config, spec, identity, blobs, clock, storage)
            elif network.node_id != identity.node_id:
                raise ValueError(f"network joined as {network.node_id[:12]} but the key is {identity.node_id[:12]}")
            metrics = NodeMetrics()
            metrics.bind_network(lambda: network.stats, lambda: len(network.peers()),
                                 clock_suspects(spec, identity.node_id))
            in_force = await spec_in_force(storage, spec)
            disk = DiskWatch(config, blobs, need, metrics,
                             lambda: schedule.round_at(clock.now()) if clock.now() >= schedule.genesis_ts else -1)
            ctx = NodeContext(config, in_force, schedule, identity, clock, storage, blobs, network,
                              metrics, LocalDelivery(), disk)
            # in a thread: a factory may hash or read files; it may refuse, e.g. a held-out file with the wrong hash
            node_duties = await asyncio.to_thread(duties or HeartbeatDuties, ctx)
        except BaseException:
            if network is not None:
                await network.close()
            await storage.close()
            lock.release()
            raise
        return cls(ctx, node_duties, lock, new_data_round, spec)

    async def run(self) -> None:
        """Serve until `stop()`; always closes HTTP, network and storage on the way out."""
        try:
            self.ctx.disk.warn_if_low(await asyncio.to_thread(self.ctx.disk.look))
            if self.ctx.config.http.enabled:
                self.http = await HttpApi.start(StatusViews(self), self.ctx.config.http.host,
                                                self.ctx.config.http.port)
                log.info("http api on %s", self.http.url)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._consume(self._subscription), name="gossip-consumer"),
                         tg.create_task(self._watch_peers(), name="peer-watch"),
                         tg.create_task(self._catch_up(), name="catch-up")]
                stopped = tg.create_task(self._stop.wait(), name="stop")
                await asyncio.wait([tasks[-1], stopped], return_when=asyncio.FIRST_COMPLETED)
                if not stopped.done():  # caught up: phases may run
                    tasks.append(tg.create_task(self.scheduler.run(), name="scheduler"))
                await stopped
                for task in tasks:
                    task.cancel()
        finally:
            await self._close()

    def stop(self) -> None:
        self._stop.set()

    @property
    def gossip_idle(self) -> bool:
        """Every delivery so far has been handled: the gossip consumer waits on an empty subscription."""
        return self._subscription.pending == 0 and self._subscription.waiting > 0

    async def _catch_up(self) -> None:
        """Started after genesis (a restart, a late join): before any phase runs, take in what a peer
        accepted of this round and the last while we were away, validators asked first (and of the
        round that began meanwhile, if one did)."""
        ctx = self.ctx
        if ctx.clock.now() < ctx.schedule.genesis_ts:
            return
        waited = 0.0
        if not ctx.network.peers():
            log.info("waiting up to %.0f s for a peer to catch up on this round from", CATCH_UP_WAIT_S)
        while not ctx.network.peers() and waited < CATCH_UP_WAIT_S:
            await asyncio.sleep(0.2)
            waited += 0.2
        asked: set[int] = set()
        while ctx.network.peers():  # again if a new round began meanwhile: its first messages went out unheard
            current = ctx.schedule.round_at(ctx.clock.now())
            rounds = [r for r in (current - 1, current) if r >= 0 and r not in asked]
            if not rounds:
                break
            for round in rounds:
                got = await ctx.catch_up(round)
                asked.add(round)
                log.info("round %d: caught up on %d message(s) accepted while this node was away", round, got)
        while self._subscription.pending:  # let the consumer take them in before the first phase runs
            await asyncio.sleep(0.05)

    async def _watch_peers(self) -> None:
        """Say when the node has had no peer for ALONE_WARN_S, and what to check; when it has peers; and when
        it has had peers for a whole round after genesis and heard no message of its network from them."""
        ctx = self.ctx
        alone_since: float | None = time.monotonic()
        warned = silent_warned = False
        with_peers_since: float | None = None  # clock time from which this node has had peers, after genesis
        while True:
            peers = len(ctx.network.peers())
            if peers and alone_since is not None:
                log.info("p2p: connected to %d peer(s)", peers)
                alone_since, warned = None, False
            elif not peers:
                alone_since = time.monotonic() if alone_since is None else alone_since
                if not warned and time.monotonic() - alone_since >= ALONE_WARN_S:
                    log.warning("p2p: no peers for %.0f s: %s", ALONE_WARN_S, alone_hint(ctx.config, ctx.network))
                    warned = True
            now = ctx.clock.now()
            if not peers or now < ctx.schedule.genesis_ts:
                with_peers_since = None
            elif with_peers_since is None:
                with_peers_since = now
            elif not silent_warned and now - with_peers_since >= ctx.schedule.round_seconds:
                silent_warned = True  # one look: a node that heard its network has nothing more to say of it
                if not any(verdict == "accept" for _, verdict in ctx.network.stats.messages):
                    log.warning("p2p: connected to %d peer(s) for a whole round and no message of network %s has "
                                "arrived: they may run another spec (compare the network ids `tessera spec check` "
                                "prints), or no other node of this network is up", peers, ctx.spec.gossip_id[:12])
            await asyncio.sleep(PEER_WATCH_S)

    async def _close(self) -> None:
        if self.http is not None:
            await self.http.close()
        await self.ctx.network.close()
        await self.ctx.storage.close()
        self._lock.release()

    async def _consume(self, subscription: Subscription) -> None:
        async for delivery in subscription:
            envelope = delivery.envelope
            if envelope.sender == self.ctx.identity.node_id and not await self.ctx.storage.sent(envelope.message_id):
                self._signed_elsewhere(envelope)
            await self._handle(envelope, delivery.message)

    def _signed_elsewhere(self, envelope: Envelope) -> None:
        """A message signed with our key that this node has no note of sending (`Storage.sent`, written
        before each of ours goes out and kept across restarts) came from another node that has the key.
        Our own come back after a restart: peers re-gossip them and hand them on as we catch up. It is
        still recorded and handed to the duties, as any accepted message is.

        Unless the database was new when this node started and the message is of that round or the one
        before: a data directory removed while its key was kept leaves the key's earlier messages of the
        round with peers, who hand them back. Those are logged, not counted; a node that really runs with
        this key is reported from the next round on.
        """
        if envelope.round <= self._new_data_round:
            log.warning("round %d: a %s signed with this node's key reached it from the network, and this "
                        "node has no record of sending it; its database is new, so it is probably this key's "
                        "own from before (if another node runs with the key, the next round shows it)",
                        envelope.round, envelope.kind)
            return
        self.key_elsewhere = {"messages": (self.key_elsewhere or {}).get("messages", 0) + 1,
                              "last_kind": envelope.kind, "last_round": envelope.round}
        self.ctx.metrics.key_elsewhere.inc()
        log.error("round %d: a %s signed with this node's key reached it from the network, and this node has "
                  "no record of sending it: another node is running with the key %s; stop one of them, or give "
                  "each its own key (tessera keygen)", envelope.round, envelope.kind, self.ctx.config.node.key)

    async def _handle(self, envelope: Envelope, message: Message) -> None:
        """Record an accepted envelope, then hand it and its decoded message to the duties.

        A message that cannot be recorded (a full or failing disk) is logged (a full disk once a round) and
        left out, and the node goes on: the duties never act on what storage does not hold. The network forgets
        it was delivered, so catching up from a peer (as at TRAIN, when votes are missing) takes it in again."""
        try:
            if not await self.ctx.storage.record_accepted(envelope, message, self.ctx.clock.now()):
                return  # stored before a restart (the duties saw it then), or an equivocation across one
        except (sqlite3.Error, OSError) as exc:
            self.ctx.network.forget(envelope)  # a peer's history may hand it on again, once there is room
            if not self.ctx.disk.quiet(exc):
                log.error("round %d: cannot record a %s from %s, so it is left out: %s", envelope.round,
                          envelope.kind, envelope.sender[:12], exc)
            return
        try:
            await self.duties.on_message(envelope, message)
        except Exception as exc:
            if not self.ctx.disk.quiet(exc):
                log.exception("duty failed on %s from %s (round %d)", envelope.kind, envelope.sender[:12],
                              envelope.round)

    async def _on_phase(self, round: int, phase: Phase) -> None:
        log.info("round %d: %s", round, phase)
        self.ctx.metrics.round.set(round)
        if phase is Phase.TRAIN:
            began = [r for r in (await self.ctx.storage.latest_round(), *(run.round for run in self.scheduler.runs))
                     if r is not None]
            latest = max(began, default=None)
            await self.ctx.storage.record_round(round, self.ctx.schedule.round_start(round))
            if latest is not None and round > latest + 1:
                # A long absence, or a wall clock stepped ahead (to be corrected later): what the rounds in
                # between would have aged out is pruned next round, once this round is known to be real.
                log.info("round %d: the last round this node ran was %d; pruning waits a round", round, latest)
            else:
                await self.ctx.storage.prune(round - self.ctx.config.storage.message_retention_rounds)
                await self._prune_blobs(round)
            self.ctx.disk.warn_if_low(await asyncio.to_thread(self.ctx.disk.look))  # after pruning made room
        await self.duties.on_phase(round, phase)

    async def _on_run(self, run: PhaseRun) -> None:
        overran = run.finished_at > self.ctx.schedule.phase_window(run.round, Phase(run.phase))[1]
        self.ctx.metrics.phase_run(run.round, run.phase, run.duration_s, run.late_s, run.ok, overran,
                                   self.scheduler.skipped)
        log.info("round %d: %s %s in %.1f s%s", run.round, run.phase, "done" if run.ok else "failed", run.duration_s,
                 ", past the end of its phase" if overran else "")
        await self.ctx.storage.record_phase_run(run)
        allocator.trim()  # what the phase freed in its threads' heaps leaves the process
        if run.phase == Phase.MERGE:
            await self.ctx.storage.export_rewards_jsonl(self.ctx.config.rewards_jsonl)

    async def _prune_blobs(self, round: int) -> None:
        keep = await self.ctx.storage.blobs_in_use(round - 1)
        max_age = self.ctx.config.storage.blob_retention_rounds * self.ctx.schedule.round_seconds
        deleted = await asyncio.to_thread(self.ctx.blobs.retain, keep, max_age)
        if deleted:
            log.info("pruned %d blob(s) older than %d rounds", len(deleted), self.ctx.config.storage.blob_retention_rounds)

    # -- StatusSource for the HTTP API --------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        ctx = self.ctx
        now = ctx.clock.now()
        round_, phase = ctx.schedule.phase_at(now) if now >= ctx.schedule.genesis_ts else (None, None)
        stats = ctx.network.stats
        others = other_protocols(stats)
        return {
            "version": RELEASE,
            "protocol": PROTOCOL_VERSION,
            "role": ctx.config.node.role,
            "node_id": ctx.identity.node_id,
            "network_id": ctx.spec.gossip_id,
            "network": ctx.spec.name,
            "time": now,
            "round": round_,
            "phase": None if phase is None else str(phase),
            "peers": len(ctx.network.peers()),
            "listen": ctx.network.listen_addrs,
            "announce": list(ctx.config.p2p.announce),
            "head": await ctx.storage.head(),
            "base": ctx.spec.model.base_hash,
            "learning": learning_settings(ctx.spec),
            "last_run": None if not self.scheduler.runs else _run_dict(self.scheduler.runs[-1]),
            "key_used_elsewhere": self.key_elsewhere,
            "clock_behind": clock_behind(stats, clock_suspects(ctx.spec, ctx.identity.node_id)),
            "disk": ctx.disk.status(await asyncio.to_thread(ctx.disk.look)),
            "other_protocols": others,
            "protocol_alert": " · ".join(other_protocol_line(o["peers"], o["protocol"]) for o in others) or None,
        }

    async def rewards(self, last_rounds: int | None = None, top: int | None = None) -> dict[str, Any]:
        """The rewards ledger: entries of its last `last_rounds` rounds and the `top` best standings (None: all)."""
        return (await self.ctx.storage.rewards(last_rounds, top)).as_dict()

    async def round_report(self, round: int) -> dict[str, Any] | None:
        """A validator's report of one round (None when it has none)."""
        return await self.ctx.storage.round_report(round)

    async def rounds(self) -> list[dict[str, Any]]:
        """The reports of the last rounds, oldest first (empty on a miner)."""
        latest = await self.ctx.storage.latest_round()
        if latest is None:
            return []
        reports = [await self.round_report(r) for r in range(max(0, latest - ROUNDS_LISTED + 1), latest + 1)]
        return [report for report in reports if report is not None]

    def metrics_text(self) -> bytes:
        return self.ctx.metrics.render()

    async def offer_successor(self, data: bytes) -> dict[str, Any]:
        """An operator's successor document, judged by the node's duties: the verdict and its reason."""
        if not isinstance(self.duties, TakesSuccessors):
            return {"verdict": "refuse", "reason": "this node keeps no chain of specs (it runs no role's duties)"}
        record = await self.duties.offer(data)
        return {"verdict": record.verdict, "reason": record.reason, "document": record.document,
                "activation": record.activation, "signed_by": int(record.signed)}


async def spec_in_force(storage: Storage, genesis: NetworkSpec) -> NetworkSpec:
    """The spec this node ran last (node.duties.succession keeps it across restarts), else `genesis`."""
    spec_id = await storage.spec_in_force()
    return genesis if spec_id is None else spec_from_bytes((await storage.specs())[spec_id].body)


def _run_dict(run: PhaseRun) -> dict[str, Any]:
    return {"round": run.round, "phase": run.phase, "ok": run.ok, "error": run.error,
            "duration_s": round(run.duration_s, 3), "late_s": round(run.late_s, 3)}


async def _open_libp2p(config: NodeConfig, spec: NetworkSpec, identity: Identity, blobs: BlobStore,
                       clock: Clock, storage: Storage) -> Network:
    from node.net.p2p import P2PNetwork  # the one package that imports libp2p and trio

    judge = GossipJudge(spec, clock.now, config.p2p, node_id=identity.node_id)
    # A restarted node IGNOREs what it accepted before, as peers re-gossip it (the seen-set is not lost).
    schedule = Schedule.from_spec(spec)
    judge.seed(await storage.accepted_since(schedule.round_at(max(clock.now(), schedule.genesis_ts)) - 1))
    return await P2PNetwork.create(identity, judge, blobs, config.p2p)


def serve(config: NodeConfig, duties: DutiesFactory | None = None) -> int:
    """Run a node in this process until SIGINT/SIGTERM; returns the exit code (0 on a clean stop)."""

    async def main() -> int:
        node = await Node.create(config, duties=duties)
        loop = asyncio.get_running_loop()
        received: set[signal.Signals] = set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, node, received, sig)
        ctx = node.ctx
        log.info("%s: %s %s on network %s (%s), listening on %s%s", describe(), config.node.role,
                 ctx.identity.node_id[:12], ctx.spec.name, ctx.spec.network_id[:12],
                 ", ".join(ctx.network.listen_addrs) or "nothing",
                 f"; peers are told to dial {', '.join(config.p2p.announce)}" if config.p2p.announce else "")
        if (wait := ctx.schedule.genesis_ts - ctx.clock.now()) > 0:
            log.info("genesis (round 0) is at %s UTC, in %s; the node waits for it, and its status page counts down",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ctx.schedule.genesis_ts)), _duration(wait))
        await node.run()
        log.info("stopped cleanly")
        return 0

    return asyncio.run(main())


def _on_signal(node: Node, received: set[signal.Signals], sig: signal.Signals) -> None:
    """The first SIGINT/SIGTERM stops the node cleanly; the same signal again exits at once, which is safe (a node
    killed at any point resumes in the current round) and what an operator who presses Ctrl-C again wants. The
    other signal after the first is not a repeat: a terminal's Ctrl-C reaches every process of its group, and a
    supervisor such as `tessera simulate` then sends SIGTERM, which must let the stop go on cleanly."""
    if sig in received:
        log.warning("%s again: exiting now, without waiting for the phase in progress", sig.name)
        logging.shutdown()
        os._exit(128 + sig)
    if received:
        log.info("%s: already stopping", sig.name)
    else:
        log.info("%s: stopping; the phase in progress is cancelled and the network and storage are closed "
                 "(%s again exits at once)", sig.name, sig.name)
    received.add(sig)
    node.stop()


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60} min" if hours else f"{rest // 60} min {rest % 60} s"
