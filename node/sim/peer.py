"""A minimal standalone peer: a libp2p host with a line-based JSON control channel on stdin/stdout.

    python -m node.sim.peer --key K --network-spec SPEC --data-dir DIR [--host IP] [--port P]
                        [--bootstrap ADDR ...] [--serve-rate B/S] [--penalty-threshold N]
                        [--supervise-interval S] [--protocol N]

A test harness (integration tests, benchmarks), not a production node (that relay is `tessera
bootstrap`, node.cli.bootstrap): it reads one JSON command per line on stdin and answers one JSON
line `{"id": ..., "ok": true, ...}` per command; commands run concurrently, so a slow fetch does
not hold up the others:
    info | peers (and failed dials in a row) | stats (and peers refused for their protocol) | received | rejects
    publish {forge: null|"bad_signature"|"wrong_network", head}    a Heartbeat, optionally spoiled
    put_blob {size, seed, serve}    store (and serve) deterministic random bytes
    fetch {hash, providers, max_bytes} | has_blob {hash} | tmp_files | quit
    connect {addr}    dial a multiaddr now | catch_up {round, providers}
`PeerProcess` starts such a process and drives it (integration tests and bench/transfer.py).
This module knows nothing about rounds or duties; it only exercises node.net.p2p.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from node.net.config import P2PConfig
from node.net.judge import GossipJudge, other_protocols
from node.net.network import Delivery, NetworkError
from node.net.p2p import P2PNetwork
from node.runtime.clock import SystemClock
from node.sim.warm import WarmProcess
from node.store.blobs import TMP_DIR, BlobStore
from protocol.check import CheckContext
from protocol.identity import Identity, load_or_create_identity, save_identity
from protocol.messages import Envelope, Heartbeat, seal
from protocol.rounds import Schedule
from protocol.spec import NetworkSpec, load_spec
from protocol.version import PROTOCOL_VERSION
from training.allocator import set_policy


class Peer:
    """One peer process: the network, what it received, and the control commands."""

    def __init__(self, net: P2PNetwork, identity: Identity, spec: NetworkSpec, store: BlobStore) -> None:
        self.net = net
        self.identity = identity
        self.spec = spec
        self.store = store
        self.schedule = Schedule.from_spec(spec)
        self.received: list[dict[str, Any]] = []

    async def collect(self) -> None:
        async for delivery in self.net.subscribe():
            self.received.append(_describe(delivery))

    def heartbeat(self, forge: str | None, head: str | None = None) -> Envelope:
        now = time.time()
        ctx = CheckContext(self.spec.network_id, {}, self.schedule, now)
        message = Heartbeat(round=ctx.current_round, role="bootstrap", head=head or self.spec.model.base_hash)
        network = "00" * 32 if forge == "wrong_network" else self.spec.network_id
        envelope = seal(message, network, self.identity)
        if forge == "bad_signature":
            flipped = format(int(envelope.signature[0], 16) ^ 1, "x") + envelope.signature[1:]
            envelope = envelope.model_copy(update={"signature": flipped})
        return envelope

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        cmd = command.get("cmd")
        if cmd == "info":
            return {"node_id": self.net.node_id, "peer_id": self.net.peer_id, "addrs": self.net.listen_addrs}
        if cmd == "peers":
            return {"peers": self.net.peers(), "dial_failures": self.net.dial_failures()}
        if cmd == "received":
            return {"received": self.received}
        if cmd == "rejects":
            return {"rejects": dict(self.net.reject_counts())}
        if cmd == "stats":
            stats = self.net.stats
            return {
                "messages": {f"{k}/{v}": n for (k, v), n in stats.messages.items()},
                "blob_bytes_in": stats.blob_bytes_in,
                "blob_bytes_out": stats.blob_bytes_out,
                "other_protocols": other_protocols(stats),
            }
        if cmd == "publish":
            forge = command.get("forge")
            envelope = self.heartbeat(forge, command.get("head"))
            sent_at = time.time()
            if forge is None:
                await self.net.publish(envelope)
            else:
                await self.net.publish_raw(envelope.to_bytes())
            return {"message_id": envelope.message_id, "sent_at": sent_at}
        if cmd == "put_blob":
            data = random.Random(command["seed"]).randbytes(int(command["size"]))
            blob_hash = await asyncio.to_thread(self.store.put_bytes, data)
            if command.get("serve", True):
                self.net.serve(blob_hash)
            return {"hash": blob_hash, "path": str(self.store.path(blob_hash))}
        if cmd == "fetch":
            started = time.perf_counter()
            path = await self.net.fetch(command["hash"], command["providers"], int(command["max_bytes"]))
            return {"path": str(path), "seconds": time.perf_counter() - started}
        if cmd == "connect":
            await self.net.connect(command["addr"])
            return {}
        if cmd == "catch_up":
            return {"delivered": await self.net.catch_up(int(command["round"]), command["providers"])}
        if cmd == "has_blob":
            return {"has": self.store.has(command["hash"])}
        if cmd == "tmp_files":
            return {"files": sorted(p.name for p in (self.store.root / TMP_DIR).iterdir())}
        raise ValueError(f"unknown command {cmd!r}")


def _describe(delivery: Delivery) -> dict[str, Any]:
    envelope = delivery.envelope
    return {
        "message_id": envelope.message_id,
        "kind": envelope.kind,
        "sender": envelope.sender,
        "peer": delivery.peer,
        "at": time.time(),
    }


async def _control(peer: Peer, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()

    def reply(payload: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    async def run(command: dict[str, Any]) -> None:
        try:
            reply({"id": command.get("id"), "ok": True, **await peer.handle(command)})
        except (NetworkError, ValueError, KeyError) as exc:
            reply({"id": command.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    while not stop.is_set():
        line = await reader.readline()
        if not line:
            break
        try:
            command = json.loads(line)
        except json.JSONDecodeError:
            reply({"id": None, "ok": False, "error": "not JSON"})
            continue
        if command.get("cmd") == "quit":
            break
        task = asyncio.create_task(run(command))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    stop.set()


async def run_peer(args: argparse.Namespace) -> None:
    spec = load_spec(args.network_spec)
    identity = load_or_create_identity(args.key)
    store = BlobStore(Path(args.data_dir) / "blobs")
    store.sweep_temporary()
    config = P2PConfig(host=args.host, port=args.port, bootstrap=tuple(args.bootstrap),
                       serve_rate_bytes_s=args.serve_rate, penalty_threshold=args.penalty_threshold,
                       supervise_interval_s=args.supervise_interval)
    judge = GossipJudge(spec, SystemClock().now, config)
    net = await P2PNetwork.create(identity, judge, store, config, args.protocol)
    peer = Peer(net, identity, spec, store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with asyncio.TaskGroup() as group:
        group.create_task(peer.collect())
        control = group.create_task(_control(peer, stop))
        await stop.wait()
        control.cancel()
        await net.close()


class PeerProcess:
    """A `python -m node.sim.peer` child process and its control channel.

    The process forks from the simulator's warm fork server (node.sim.warm), which has imported libp2p
    already; its stdin and stdout are sockets, its stderr `stderr.log` in `directory`. A reader thread files
    each answer under its request id, so callers wait with a timeout.
    """

    def __init__(self, directory: Path, spec: Path, identity: Identity, port: int, *args: str) -> None:
        self.directory = directory
        self.port = port
        self.node_id = identity.node_id
        key = directory / "node.key"
        if not key.exists():
            save_identity(identity, key)
        argv = ["--key", str(key), "--network-spec", str(spec), "--data-dir", str(directory), "--port", str(port),
                *args]
        commands, their_stdin = socket.socketpair()
        answers, their_stdout = socket.socketpair()
        with their_stdin, their_stdout:
            self.proc = WarmProcess(argv, str(directory / "stderr.log"), dict(os.environ),
                                    str(Path(__file__).resolve().parents[1]), program="node.sim.peer",
                                    stdin=their_stdin, stdout=their_stdout)
        self._commands = commands.makefile("wb")
        self._answers_in = answers.makefile("rb")
        commands.close()  # the files keep the sockets open
        answers.close()
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.call("info", timeout=60)
        self.addr: str = self.info["addrs"][0]

    def _box(self, request_id: int) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._answers.setdefault(request_id, queue.Queue())

    def _read(self) -> None:
        for line in self._answers_in:
            answer = json.loads(line)
            self._box(answer["id"]).put(answer)

    def send(self, cmd: str, **args: Any) -> int:
        """Send a command without waiting; returns its request id for `answer`."""
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
        self._box(request_id)
        self._commands.write((json.dumps({"id": request_id, "cmd": cmd, **args}) + "\n").encode())
        self._commands.flush()
        return request_id

    def answer(self, request_id: int, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._box(request_id).get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer on port {self.port} did not answer request {request_id} in {timeout} s") from None

    def call(self, cmd: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        """Send a command and wait for a successful answer; RuntimeError if the peer reports a failure."""
        answer = self.answer(self.send(cmd, **args), timeout)
        if not answer["ok"]:
            raise RuntimeError(f"{cmd} failed on port {self.port}: {answer.get('error')}")
        return answer

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._commands.close()


def main(argv: list[str] | None = None) -> None:
    set_policy()  # as `tessera` does: training.allocator
    parser = argparse.ArgumentParser(prog="python -m node.sim.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True, help="Ed25519 key file (created on first start)")
    parser.add_argument("--network-spec", required=True, help="the network spec TOML")
    parser.add_argument("--data-dir", required=True, help="where blobs are stored")
    parser.add_argument("--host", default="127.0.0.1", help="listen IP")
    parser.add_argument("--port", type=int, default=0, help="listen TCP port (0 picks one)")
    parser.add_argument("--bootstrap", action="append", default=[], help="bootstrap multiaddr (repeatable)")
    parser.add_argument("--serve-rate", type=float, default=0.0, help="blob upload cap in bytes/s (0: none)")
    parser.add_argument("--penalty-threshold", type=int, default=P2PConfig().penalty_threshold,
                        help="REJECTs per round before a peer is disconnected")
    parser.add_argument("--supervise-interval", type=float, default=P2PConfig().supervise_interval_s,
                        help="seconds between two rounds of redials and peer exchanges")
    parser.add_argument("--protocol", type=int, default=PROTOCOL_VERSION,
                        help="the protocol version it says it speaks: another plays a node of another release")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(run_peer(args))


if __name__ == "__main__":
    main()
