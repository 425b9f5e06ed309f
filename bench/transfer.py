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
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from node.sim.peer import PeerProcess  # noqa: E402
from node.store.blobs import BlobStore  # noqa: E402
from protocol.identity import Identity  # noqa: E402

SENDER = """
import socket, sys
path, port = sys.argv[1], int(sys.argv[2])
with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
    while chunk := f.read(1 << 20):
        s.sendall(chunk)
"""


def write_spec(directory: Path) -> Path:
    genesis = (datetime.now(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    validator = Identity.from_seed(b"\x07" * 32).node_id
    path = directory / "spec.toml"
    path.write_text(
        f'name = "bench"\ngenesis = {genesis}\ngroup = {{ 0 = [0] }}\nvalidators = [{{ key = "{validator}" }}]\n'
        "[timing]\ntrain_s = 3000.0\ncommit_s = 200.0\nreveal_s = 200.0\nevaluate_s = 100.0\nmerge_s = 100.0\n"
        f'[model]\nfamily = "qwen3_moe"\nconfig = "model.json"\nbase_hash = "{"ab" * 32}"\n'
        f'[data]\ntrain = ["train.jsonl"]\nheldout_sha256 = "{"cd" * 32}"\n'
    )
    return path


def start_peer(root: Path, spec: Path, name: str, seed: int, bootstrap: list[str]) -> PeerProcess:
    directory = root / name
    directory.mkdir()
    args = [arg for addr in bootstrap for arg in ("--bootstrap", addr)]
    return PeerProcess(directory, spec, Identity.from_seed(seed.to_bytes(32, "big")), 0, *args)


def wait_until(predicate: Callable[..., object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark set-up timed out")
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
        wait_until(lambda: provider.node_id in fetcher.call("peers")["peers"], 30)
        for seed in range(repeats):
            blob = provider.call("put_blob", size=size, seed=seed, timeout=120)
            got = fetcher.call("fetch", hash=blob["hash"], providers=[provider.node_id], max_bytes=size, timeout=300)
            p2p_runs.append(got["seconds"])
            raw_runs.append(raw_tcp_copy(Path(blob["path"]), blob["hash"], raw_store))
            bare_runs.append(raw_tcp_copy(Path(blob["path"]), blob["hash"], None))
    finally:
        provider.stop()
        fetcher.stop()
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
    peers = [boot] + [start_peer(root, spec, f"n{i}", 11 + i, [boot.addr]) for i in range(4)]
    try:
        for peer in peers:
            wait_until(lambda p=peer: len(p.call("peers")["peers"]) == 4, 60)
        time.sleep(3)  # GossipSub grafts its mesh on 1 s heartbeats
        sent: dict[str, tuple[float, int]] = {}
        for i in range(messages):
            index = i % len(peers)
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

        wait_until(all_delivered, 60)
    finally:
        for peer in peers:
            peer.stop()
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "gossip_processes": len(peers),
        "gossip_messages": messages,
        "gossip_deliveries": len(latencies),
        "gossip_p50_ms": statistics.median(latencies),
        "gossip_p95_ms": quantiles[94],
        "gossip_max_ms": max(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=out_file)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--messages", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5, help="blob transfers per path; the best counts")
    args = parser.parse_args()
    if min(args.size_mb, args.messages, args.repeats) < 1:
        parser.error("--size-mb, --messages and --repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = write_spec(root)
        result = {**blob_throughput(root, spec, args.size_mb * 1_000_000, args.repeats), **gossip_latency(root, spec, args.messages)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
