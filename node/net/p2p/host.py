"""The libp2p implementation of `node.net.network.Network`.

py-libp2p is trio-only, so the host runs in its own thread under `trio.run`; asyncio calls in with
`trio_token.run_sync_soon` and results come back with `loop.call_soon_threadsafe`, and neither
loop ever blocks on the other. One GossipSub topic per network carries every message kind; its
topic validator is `GossipJudge`, so only ACCEPTed envelopes are delivered and relayed. Publishes
are queued and paced, and closing sends what is queued first. Blobs travel over node.net.p2p.blobs,
a round's history for a restarted node over node.net.p2p.history; peers learn about each other
through node.net.p2p.peers (each told the addresses in `P2PConfig.announce`, else those it listens on),
and a supervisor redials bootstrap and known peers that went away. Peers say their protocol version as
they connect (node.net.p2p.hello; the gossip topic names it too), and one on another version is refused. A
peer the judge penalises is disconnected at once and not redialled until its penalty runs out
(py-libp2p 0.8.1's GossipSub v1.1 scorer only gates gossip and never disconnects). This module
knows nothing about rounds, duties or storage but blobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as new_noise_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.tools.anyio_service import background_trio_service

from node.net.config import P2PConfig
from node.net.judge import GossipJudge
from node.net.network import Delivery, NetworkError, NetworkStats, Subscribers, Subscription
from node.net.p2p.blobs import BLOB_PROTOCOL, BlobStreams
from node.net.p2p.hello import HELLO_PROTOCOL, Hellos
from node.net.p2p.history import HISTORY_PROTOCOL, HistoryStreams
from node.net.p2p.peers import PEX_PROTOCOL, PeerBook, keypair_for, node_id_for, parse_bootstrap, peer_id_for
from node.net.p2p.wire import TunedNoise
from node.store.blobs import BlobStore
from protocol.identity import Identity
from protocol.messages import Envelope
from protocol.version import PROTOCOL_VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

GOSSIP_PROTOCOLS = [TProtocol("/meshsub/1.1.0"), TProtocol("/meshsub/1.0.0")]
CLOSE_FLUSH_S = 5.0  # how long closing waits for queued publishes to go out
REACH_EXCHANGES = 8  # peers asked at once for the addresses of blob providers we cannot reach yet
START_TIMEOUT_S = 30.0  # the host thread must listen within this long
MAX_REDIAL_BACKOFF_S = 5.0  # the longest wait between two dials of a lost peer
FORGET_AFTER_FAILURES = 5  # failed dials after which a discovered (not a bootstrap) peer is no longer redialled


class P2PNetwork:
    """A libp2p host in its own trio thread, behind the asyncio `Network` interface."""

    def __init__(self, identity: Identity, judge: GossipJudge, store: BlobStore, config: P2PConfig,
                 protocol: int = PROTOCOL_VERSION) -> None:
        """`protocol`: the version this host says it speaks (another than this release's only where a test plays a
        node of another release)."""
        self.config = config
        self._identity = identity
        self._judge = judge
        self._store = store
        self._topic = f"tessera/{protocol}/{judge.network_id}"
        self._key_pair = keypair_for(identity)
        self._peer_id = ID.from_pubkey(self._key_pair.public_key)
        self._subscribers = Subscribers(judge.stats)
        self._blobs = BlobStreams(store, judge, config)
        self._history = HistoryStreams(judge, config)
        self._hellos = Hellos(judge, protocol, config.dial_timeout_s)
        self._book = PeerBook({info.peer_id: info for info in map(parse_bootstrap, config.bootstrap)})
        self._disconnecting: set[ID] = set()
        self._peer_snapshot: list[str] = []
        self._failure_snapshot: dict[str, int] = {}
        self._listen_addrs: list[str] = []
        self._announced: list[str] = []  # what peer exchange tells peers to dial
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._outbox: trio.MemorySendChannel[bytes] | None = None
        self._queued = 0  # publishes asked for (asyncio thread) ...
        self._handed = 0  # ... and handed to gossip (trio thread)
        self._thread: threading.Thread | None = None
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self.failure: BaseException | None = None

    @classmethod
    async def create(
        cls, identity: Identity, judge: GossipJudge, store: BlobStore, config: P2PConfig | None = None,
        protocol: int = PROTOCOL_VERSION,
    ) -> P2PNetwork:
        """Start the host thread and return once it listens; NetworkError if it cannot start."""
        net = cls(identity, judge, store, config or P2PConfig(port=0), protocol)
        net._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = net._loop.create_future()
        net._thread = threading.Thread(target=net._thread_main, args=(ready,), name="tessera-p2p", daemon=True)
        net._thread.start()
        try:
            await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
        except TimeoutError as exc:
            await net.close()
            raise NetworkError(f"libp2p host did not start within {START_TIMEOUT_S} s") from exc
        return net

    # ---- the Network interface (asyncio side) ----

    @property
    def node_id(self) -> str:
        return self._identity.node_id

    @property
    def peer_id(self) -> str:
        return self._peer_id.to_base58()

    @property
    def listen_addrs(self) -> list[str]:
        return list(self._listen_addrs)

    @property
    def announced_addrs(self) -> list[str]:
        """The addresses peers are told to dial (`P2PConfig.announce`, else the listen ones), with our peer id."""
        return list(self._announced)

    @property
    def stats(self) -> NetworkStats:
        return self._judge.snapshot()

    def peers(self) -> list[str]:
        return list(self._peer_snapshot)

    @property
    def publish_backlog(self) -> int:
        """Publishes queued and not yet handed to gossip: they go out one per `publish_interval_s`."""
        return self._queued - self._handed

    def dial_failures(self) -> dict[str, int]:
        """Failed dials in a row per known peer that is down (node ids), as of the last supervisor tick."""
        return dict(self._failure_snapshot)

    def reject_counts(self) -> Mapping[str, int]:
        return self._judge.reject_counts()

    def subscribe(self, kinds: Iterable[str] | None = None) -> Subscription:
        return self._subscribers.add(kinds)

    async def publish(self, envelope: Envelope) -> None:
        await self.publish_raw(self._judge.admit_own(envelope))

    async def publish_raw(self, data: bytes) -> None:
        """Gossip bytes without checking them (tests use it to play a misbehaving peer)."""
        assert self._outbox is not None, "publish before create() finished"
        self._to_trio(self._outbox.send_nowait, data)
        self._queued += 1

    def forget(self, envelope: Envelope) -> None:
        self._judge.forget(envelope)

    def serve(self, blob_hash: str) -> None:
        if not self._store.has(blob_hash):
            raise NetworkError(f"cannot serve blob {blob_hash[:12]}: not in the blob store")
        self._blobs.served.add(blob_hash)

    def unserve(self, blob_hash: str) -> None:
        self._blobs.served.discard(blob_hash)

    async def fetch(self, blob_hash: str, providers: Sequence[str], max_bytes: int) -> Path:
        if self._store.has(blob_hash):
            return self._store.path(blob_hash)
        return await self._call_trio(self._fetch, blob_hash, [peer_id_for(p) for p in providers], max_bytes)

    async def _fetch(self, blob_hash: str, providers: list[ID], max_bytes: int) -> Path:
        assert self._host is not None
        await self._reach(providers)
        return await self._blobs.fetch(self._host, blob_hash, providers, max_bytes)

    async def _reach(self, peers: list[ID]) -> None:
        """Connect now to those of `peers` we are not connected to, within one dial timeout: a node just
        started knows little more than its bootstrap peers until the supervisor's peer exchanges and
        dials catch up, seconds it may not have (a restarted miner fetches the head at TRAIN). Our
        peers are asked for the addresses we lack first."""
        assert self._host is not None
        connected = set(self._host.get_connected_peers())
        missing = [p for p in peers if p not in connected and p != self._host.get_id()]
        if not missing:
            return
        book, timeout = self._book, self.config.dial_timeout_s
        with trio.move_on_after(timeout):
            if any(p not in book.bootstrap and p not in book.discovered for p in missing):
                async with trio.open_nursery() as nursery:
                    for peer_id in sorted(connected, key=lambda p: p not in book.bootstrap)[:REACH_EXCHANGES]:
                        book.last_exchange[peer_id] = trio.current_time()
                        nursery.start_soon(book.exchange, self._host, peer_id, self._announced, timeout)
            async with trio.open_nursery() as nursery:
                for peer_id in missing:
                    if (peer_id in book.bootstrap or peer_id in book.discovered) and peer_id not in book.dialing:
                        book.dialing.add(peer_id)
                        nursery.start_soon(self._redial, peer_id)

    async def catch_up(self, round: int, providers: Sequence[str]) -> int:
        return await self._call_trio(self._catch_up, round, [peer_id_for(p) for p in providers])

    async def _catch_up(self, round: int, providers: list[ID]) -> int:
        assert self._host is not None
        deliver = self._subscribers.deliver
        return await self._history.catch_up(self._host, round, providers, lambda d: self._to_asyncio(deliver, d))

    async def connect(self, addr: str) -> None:
        """Dial a peer by multiaddr now (the supervisor would only get to it on its next tick)."""
        await self._call_trio(self._connect, parse_bootstrap(addr))

    async def close(self) -> None:
        """Stop the host, once what was queued to publish has gone out (CLOSE_FLUSH_S at most): a duty
        records its message as sent when it queues it, and would not send it again after a restart."""
        deadline = time.monotonic() + CLOSE_FLUSH_S
        while self.publish_backlog and self.failure is None and time.monotonic() < deadline \
                and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.01)
        if self._token is not None and self._stop is not None:
            try:
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self._subscribers.close_all()

    # ---- bridging ----

    def _to_trio(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a plain function on the trio thread soon; NetworkError when the host has stopped."""
        if self._token is None or self.failure is not None:
            raise NetworkError("the libp2p host is not running")
        try:
            self._token.run_sync_soon(self._guarded, fn, *args)
        except trio.RunFinishedError as exc:
            raise NetworkError("the libp2p host has stopped") from exc

    @staticmethod
    def _guarded(fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("p2p: callback %s failed", getattr(fn, "__name__", fn))

    def _to_asyncio(self, fn: Callable[..., object], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            log.debug("p2p: event loop closed; dropped %s", getattr(fn, "__name__", fn))

    async def _call_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await a trio coroutine function from asyncio; cancelling the caller cancels it."""
        assert self._loop is not None
        future: asyncio.Future[T] = self._loop.create_future()
        scope = trio.CancelScope()

        async def runner() -> None:
            outcome: tuple[bool, Any] = (False, NetworkError("cancelled: the libp2p host is stopping"))
            try:
                with scope:
                    outcome = (True, await fn(*args))
            except Exception as exc:
                outcome = (False, exc)
            finally:
                self._to_asyncio(_settle, future, *outcome)

        def start() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(runner)

        self._pending.add(future)
        try:
            self._to_trio(start)
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(NetworkError):
                self._to_trio(scope.cancel)
            raise
        finally:
            self._pending.discard(future)

    def _fail_pending(self) -> None:
        for future in list(self._pending):
            _settle(future, False, NetworkError("the libp2p host stopped"))
        self._subscribers.close_all()

    # ---- the trio side ----

    def _thread_main(self, ready: asyncio.Future[None]) -> None:
        try:
            trio.run(self._main, ready)
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # trio nests nursery errors
                exc = exc.exceptions[0]
            self.failure = exc
            log.error("p2p: libp2p host stopped with an error: %r", exc)
            error = exc if isinstance(exc, NetworkError) else NetworkError(f"libp2p host failed: {exc!r}")
            self._to_asyncio(_settle, ready, False, error)
        finally:
            self._to_asyncio(self._fail_pending)

    async def _main(self, ready: asyncio.Future[None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        noise = TunedNoise(self._key_pair, noise_privkey=new_noise_key_pair().private_key)
        connections = ConnectionConfig(max_connections_per_peer=1, dial_timeout=self.config.dial_timeout_s)
        announce = [multiaddr.Multiaddr(addr) for addr in self.config.announce]
        host = new_host(key_pair=self._key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX",
                        connection_config=connections, announce_addrs=announce or None)
        # The default 10 msgs/s per topic would drop bursts; IP-diversity grafting means nothing when
        # every peer shares one address (loopback, one docker host). A mesh is pruned only past max_peers
        # (at least 12) links: a node every peer dials (a bootstrap validator) is grafted by all of them, and a
        # prune there could leave it in no peer's mesh and every peer in its backoff, deaf for a minute
        # (docs/architecture.md §10).
        gossipsub = GossipSub(GOSSIP_PROTOCOLS, degree=6, degree_low=4, degree_high=max(12, self.config.max_peers),
                              heartbeat_interval=1, max_messages_per_topic_per_second=1000.0,
                              eclipse_protection_enabled=False)
        pubsub = Pubsub(host, gossipsub, strict_signing=True)
        pubsub.set_topic_validator(self._topic, self._validate, False)
        host.set_stream_handler(BLOB_PROTOCOL, self._blobs.handle)
        host.set_stream_handler(HISTORY_PROTOCOL, self._history.serve)
        host.set_stream_handler(HELLO_PROTOCOL, lambda stream: self._hellos.serve(host, stream))
        host.set_stream_handler(PEX_PROTOCOL, lambda stream: self._book.serve_exchange(host, stream, self.config.dial_timeout_s))
        self._host, self._pubsub = host, pubsub
        outbox, inbox = trio.open_memory_channel[bytes](float("inf"))
        self._outbox = outbox
        listen = multiaddr.Multiaddr(f"/ip4/{self.config.host}/tcp/{self.config.port}")
        async with background_trio_service(pubsub), background_trio_service(gossipsub):
            await pubsub.wait_until_ready()
            # Subscribed before listening, so that every peer learns it from the first message we send it. A
            # peer whose connection py-libp2p was still setting up when we subscribed never hears of it (its
            # hello was built without the topic, and the announcement goes only to peers already set up), and
            # relays us nothing: a validator started on a busy machine, dialled by a dozen peers at once, heard
            # no commit or seed of a whole round.
            subscription = await pubsub.subscribe(self._topic)
            async with host.run([listen]):
                self._listen_addrs = [f"{a}/p2p/{self._peer_id}" for a in host.get_transport_addrs()]
                if not self._listen_addrs:  # py-libp2p logs a failed listen and carries on
                    raise NetworkError(f"cannot listen on {listen}: the port is taken or the address is not local")
                self._announced = [str(a) for a in host.get_addrs()]  # the announced ones, else the listen ones
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._drain, subscription)
                    nursery.start_soon(self._pace, inbox)
                    nursery.start_soon(self._supervise)
                    self._to_asyncio(_settle, ready, True, None)
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()

    async def _pace(self, inbox: trio.MemoryReceiveChannel[bytes]) -> None:
        assert self._pubsub is not None
        async for data in inbox:
            try:
                await self._pubsub.publish(self._topic, data)
            except Exception:
                log.exception("p2p: publish failed")
            self._handed += 1
            await trio.sleep(self.config.publish_interval_s)

    @staticmethod
    async def _drain(subscription: Any) -> None:
        while True:  # deliveries happen in the validator, which knows the forwarding peer
            await subscription.get()

    def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            return self._judge_gossip(forwarder, msg)
        except Exception:  # a bug of ours must not tear down the peer's pubsub stream
            log.exception("p2p: judging a gossip message failed")
            return False

    def _judge_gossip(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        if msg.from_id == self._peer_id.to_bytes():
            return forwarder == self._peer_id
        peer = node_id_for(forwarder)
        result, envelope = self._judge.judge(msg.data, peer)
        if not result.accepted:
            log.debug("p2p: %s from %s: %s %s", result.verdict, peer[:12], result.reason, result.detail)
            if self._judge.is_penalised(peer):
                self._drop(forwarder)
            return False
        assert envelope is not None
        self._to_asyncio(self._subscribers.deliver, Delivery(envelope, result, peer))
        return True

    async def _supervise(self) -> None:
        while True:
            try:
                self._supervise_once()
            except Exception:
                log.exception("p2p: peer supervision failed; retrying")
            await trio.sleep(self.config.supervise_interval_s)

    def _supervise_once(self) -> None:
        """Refresh the peer list, redial lost bootstrap and known peers, and schedule peer exchanges."""
        assert self._host is not None and self._nursery is not None
        connected = set(self._host.get_connected_peers())
        self._peer_snapshot = sorted(node_id_for(p) for p in connected)
        self._failure_snapshot = {node_id_for(p): n for p, n in self._book.failures.items()}
        now = trio.current_time()
        self._hellos.greet(self._host, connected, self._nursery)  # new connections say their protocol version
        for peer_id in connected:
            if self._judge.is_penalised(node_id_for(peer_id)):  # it dialled us again while barred
                self._drop(peer_id)
        for peer_id in self._book.known():
            room = peer_id in self._book.bootstrap or len(connected) < self.config.max_peers
            due = self._book.next_dial.get(peer_id, 0.0) <= now
            barred = self._judge.is_penalised(node_id_for(peer_id)) or self._hellos.is_barred(peer_id)
            if peer_id not in connected and peer_id not in self._book.dialing and room and due and not barred:
                self._book.dialing.add(peer_id)
                self._nursery.start_soon(self._redial, peer_id)
        for peer_id in connected:
            if now - self._book.last_exchange.get(peer_id, -1e9) >= self.config.exchange_interval_s:
                self._book.last_exchange[peer_id] = now
                self._nursery.start_soon(self._book.exchange, self._host, peer_id, self._announced,
                                         self.config.dial_timeout_s)

    async def _redial(self, peer_id: ID) -> None:
        assert self._host is not None
        # The swarm refuses a peer for 60 s after all its addresses failed; a restarted bootstrap
        # node would stay unreachable, so this supervisor keeps its own back-off instead.
        network = self._host.get_network()
        if isinstance(network, Swarm):
            network.unblock_peer(peer_id)
        try:
            await self._connect(self._book.info(peer_id))
            self._book.failures.pop(peer_id, None)
            self._book.next_dial.pop(peer_id, None)
            self._book.last_exchange.pop(peer_id, None)
        except Exception as exc:
            failures = self._book.failures.get(peer_id, 0) + 1
            self._book.failures[peer_id] = failures
            backoff = min(MAX_REDIAL_BACKOFF_S, self.config.supervise_interval_s * 2 ** (failures - 1))
            self._book.next_dial[peer_id] = trio.current_time() + backoff
            log.debug("p2p: dial %s failed (%d): %r", peer_id, failures, exc)
            if peer_id not in self._book.bootstrap and failures >= FORGET_AFTER_FAILURES:
                self._book.forget(peer_id)
        finally:
            self._book.dialing.discard(peer_id)

    async def _connect(self, info: PeerInfo) -> None:
        assert self._host is not None
        with trio.fail_after(self.config.dial_timeout_s):
            await self._host.connect(info)

    def _drop(self, peer_id: ID) -> None:
        """Disconnect a penalised peer (once, however many of its messages are still arriving)."""
        assert self._nursery is not None
        if peer_id not in self._disconnecting:
            self._disconnecting.add(peer_id)
            log.warning("p2p: disconnecting penalised peer %s", node_id_for(peer_id)[:12])
            assert self._host is not None
            self._nursery.start_soon(PeerBook.disconnect, self._host, peer_id, self._disconnecting)


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if not future.done():
        future.set_result(value) if ok else future.set_exception(value)
