"""Benchmark the libp2p layer on loopback: blob throughput against raw TCP, and gossip latency.

    python bench/transfer.py --out FILE [--size-mb 64] [--messages 40]

Blob throughput: one `node.sim.peer` process serves a blob, another fetches it over /tessera/blob/1
(Noise + yamux, sha256 verified, written to a temp file, fsynced, renamed); the same bytes are
then copied over a plain TCP socket between two processes into a blob store through the same
`BlobWriter` a fetch uses (sha256, write, fsync, rename), and once more with the receiver only
counting bytes. Each is run `--repeats` times
and the best run counts (the box is shared and noisy). `throughput_ratio` is the libp2p fetch over
the raw copy with the same receive path. Gossip latency: five processes
(a bootstrap node and four peers) in a full mesh; each message's latency is the time from the
publish command on its sender to its delivery on each of the four others (one host, one clock).
The messages are heartbeats, and a node sends at most one a round (node.net.judge), so the
benchmark's network has rounds of `ROUND_S` and each process publishes once a round.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from node.sim.peer import PeerProcess  # noqa: E402
from node.store.blobs import BlobStore  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.rounds import Schedule  # noqa: E402
from protocol.spec import load_spec  # noqa: E402

ROUND_S = 2.0
"""Seconds in one round of the benchmark's network: a sender publishes its next heartbeat a round later."""

SENDER = """
import socket, sys
path, port = sys.argv[1], int(sys.argv[2])
with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
    while chunk := f.read(1 << 20):
        s.sendall(chunk)
"""


def write_spec(directory: Path) -> Path:
    """A network whose rounds last `ROUND_S`; the blob transfers do not depend on rounds."""
    genesis = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    validator = Identity.from_seed(b"\x07" * 32).node_id
    phase = ROUND_S / 5
    path = directory / "spec.toml"
    path.write_text(
        f'name = "bench"\ngenesis = {genesis}\ngroup = {{ 0 = [0] }}\nvalidators = [{{ key = "{validator}" }}]\n'
        f"[timing]\ntrain_s = {phase}\ncommit_s = {phase}\nreveal_s = {phase}\nevaluate_s = {phase}\nmerge_s = {phase}\n"
        f'[model]\nfamily = "qwen3_moe"\nconfig = "model.json"\nbase_hash = "{"ab" * 32}"\n'
        f'[data]\ntrain = ["train.jsonl"]\nheldout_sha256 = "{"cd" * 32}"\n'
    )
    return path


def start_peer(root: Path, spec: Path, name: str, seed: int, bootstrap: list[str]) -> PeerProcess:
    directory = root / name
    directory.mkdir()
    args = [arg for addr in bootstrap for arg in ("--bootstrap", addr)]
    return PeerProcess(directory, spec, Identity.from_seed(seed.to_bytes(32, "big")), 0, *args)


def start_peers(root: Path, spec: Path, seeds: dict[str, int], bootstrap: list[str]) -> list[PeerProcess]:
    """Start peers side by side (each spends seconds importing libp2p); none is left running if one fails."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(start_peer, root, spec, name, seed, bootstrap) for name, seed in seeds.items()]
    errors = [error for future in futures if (error := future.exception()) is not None]
    if errors:
        stop_peers([future.result() for future in futures if future.exception() is None])
        raise errors[0]
    return [future.result() for future in futures]


def stop_peers(peers: list[PeerProcess]) -> None:
    """Ask every peer to stop before waiting for any: each takes a while to close its host."""
    for peer in peers:
        if peer.alive:
            peer.proc.terminate()
    for peer in peers:
        peer.stop()


def wait_until(predicate: Callable[..., object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def raw_tcp_copy(path: Path, blob_hash: str, store: BlobStore | None) -> float:
    """Seconds to copy `path` to another process's socket, into `store` the way a fetch stores a blob
    (hashed, written, fsynced, renamed), or with no store only counting the bytes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", SENDER, str(path), str(port)])
        conn, _ = server.accept()
        started = time.perf_counter()
        with conn:
            if store is None:
                while conn.recv(1 << 20):
                    pass
            else:
                with store.open_writer(blob_hash, path.stat().st_size) as writer:  # commits on exit
                    while chunk := conn.recv(1 << 20):
                        writer.write(chunk)
        seconds = time.perf_counter() - started
        sender.wait(30)
    if store is not None:
        store.delete(blob_hash)
    return seconds


def blob_throughput(root: Path, spec: Path, size: int, repeats: int) -> dict[str, object]:
    """Best of `repeats` for each path (a fresh blob per libp2p fetch, so nothing is already stored)."""
    provider = start_peer(root, spec, "provider", 1, [])
    fetcher = start_peer(root, spec, "fetcher", 2, [provider.addr])
    raw_store = BlobStore(root / "raw")
    p2p_runs, raw_runs, bare_runs = [], [], []
    try:
        wait_until(lambda: provider.node_id in fetcher.call("peers")["peers"], 30, "the fetcher connecting")
        for seed in range(repeats):
            blob = provider.call("put_blob", size=size, seed=seed, timeout=120)
            got = fetcher.call("fetch", hash=blob["hash"], providers=[provider.node_id], max_bytes=size, timeout=300)
            p2p_runs.append(got["seconds"])
            raw_runs.append(raw_tcp_copy(Path(blob["path"]), blob["hash"], raw_store))
            bare_runs.append(raw_tcp_copy(Path(blob["path"]), blob["hash"], None))
    finally:
        stop_peers([provider, fetcher])
    mb = size / 1e6
    p2p_s, raw_s, bare_s = min(p2p_runs), min(raw_runs), min(bare_runs)
    return {
        "blob_bytes": size,
        "repeats": repeats,
        "libp2p_seconds_runs": p2p_runs,
        "raw_tcp_seconds_runs": raw_runs,
        "raw_tcp_bare_seconds_runs": bare_runs,
        "libp2p_mb_s": mb / p2p_s,
        "raw_tcp_mb_s": mb / raw_s,
        "raw_tcp_bare_mb_s": mb / bare_s,
        "throughput_ratio": raw_s / p2p_s,
        "throughput_ratio_vs_bare_socket": bare_s / p2p_s,
    }


def gossip_latency(root: Path, spec: Path, messages: int) -> dict[str, float]:
    boot = start_peer(root, spec, "boot", 10, [])
    try:
        peers = [boot, *start_peers(root, spec, {f"n{i}": 11 + i for i in range(4)}, [boot.addr])]
    except BaseException:
        stop_peers([boot])
        raise
    try:
        for peer in peers:
            wait_until(lambda p=peer: len(p.call("peers")["peers"]) == 4, 60, "a full mesh of five")
        time.sleep(3)  # GossipSub grafts its mesh on 1 s heartbeats
        schedule = Schedule.from_spec(load_spec(spec))
        sent: dict[str, tuple[float, int]] = {}
        for i in range(messages):
            index = i % len(peers)
            if index == 0:  # every process has published in this round: on to the next
                time.sleep(schedule.round_start(schedule.round_at(time.time()) + 1) - time.time() + 0.05)
            head = hashlib.sha256(f"bench-{i}".encode()).hexdigest()
            answer = peers[index].call("publish", head=head)
            sent[answer["message_id"]] = (answer["sent_at"], index)
            time.sleep(0.05)
        latencies: list[float] = []

        def all_delivered() -> bool:
            latencies.clear()
            for j, peer in enumerate(peers):
                got = {m["message_id"]: m["at"] for m in peer.call("received")["received"]}
                for message_id, (sent_at, index) in sent.items():
                    if index != j:
                        if message_id not in got:
                            return False
                        latencies.append((got[message_id] - sent_at) * 1000)
            return True

        wait_until(all_delivered, 60, "every message delivered to every other process")
    finally:
        stop_peers(peers)
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "gossip_processes": len(peers),
        "gossip_messages": messages,
        "gossip_deliveries": len(latencies),
        "gossip_p50_ms": statistics.median(latencies),
        "gossip_p95_ms": quantiles[94],
        "gossip_max_ms": max(latencies),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=out_file)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5, help="blob transfers per path; the best counts")
    args = parser.parse_args(argv)
    if min(args.size_mb, args.messages, args.repeats) < 1:
        parser.error("--size-mb, --messages and --repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = write_spec(root)
        result = {**blob_throughput(root, spec, args.size_mb * 1_000_000, args.repeats), **gossip_latency(root, spec, args.messages)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
