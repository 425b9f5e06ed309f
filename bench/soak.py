"""Soak benchmark: does a node's memory, open files, threads or disk grow round after round?

It runs `tessera simulate`'s network (node.sim.run.Simulation: a bootstrap, V validators and M
miners as separate processes over loopback libp2p, on the pretrained tiny base) for R rounds and,
each time the validators have finished a round, samples every node process: resident memory
(VmRSS in /proc/<pid>/status), open file descriptors (/proc/<pid>/fd), threads, and the bytes and
blob count of its data directory (SQLite database with its WAL, blob store). Each daemon's own
`process_resident_memory_bytes` (its /metrics, as Prometheus scrapes it) is recorded next to the
/proc reading.

Blobs are kept `storage.blob_retention_rounds` rounds and messages `message_retention_rounds`
rounds, and a process's allocator settles in its first rounds, so growth is read after a warm-up:
per node, the least-squares slope of each quantity over the rounds from `--warmup` on (per round),
and its first and last value there. A node that leaks shows a slope that does not shrink as the
run gets longer; a flat node's slope is noise around zero. Linux only (/proc).
Usage: python bench/soak.py [--rounds 30] [--warmup 6] [--validators 2] [--miners 4]
       [--round-seconds 80] [--train-share 0.9] [--dir DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from bench.simulation import _commit, run_rounds  # noqa: E402
from node.sim import defaults  # noqa: E402
from node.sim.process import SimNode, SimSettings  # noqa: E402
from node.sim.run import Simulation  # noqa: E402
from node.store.blobs import BlobStore  # noqa: E402

MIB = 2**20
QUANTITIES = ("rss_mib", "fds", "threads", "data_mib", "blobs")


def sample(node: SimNode) -> dict[str, float] | None:
    """One reading of a running node process and its data directory; None if it is not running."""
    if node.proc is None or not node.alive:
        return None
    proc = Path(f"/proc/{node.proc.pid}")
    try:
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        fds = len(list((proc / "fd").iterdir()))
    except (OSError, ValueError):
        return None  # exited between the check and the read
    data = node.directory / "data"
    files = [p for p in data.rglob("*") if p.is_file()] if data.exists() else []
    blobs = data / "blobs"
    reading = {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024,
        "fds": fds,
        "threads": int(status["Threads"]),
        "data_mib": sum(p.stat().st_size for p in files) / MIB,
        "blobs": len(BlobStore(blobs).hashes()) if blobs.is_dir() else 0,
    }
    metric = _metric(node, "process_resident_memory_bytes")
    if metric is not None:
        reading["metrics_rss_mib"] = metric / MIB
    return reading


def _metric(node: SimNode, name: str) -> float | None:
    """One unlabelled sample from the node's /metrics; None for the bootstrap or if it does not answer."""
    if node.http_port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def growth(rounds: list[int], values: list[float]) -> float:
    """Least-squares slope of `values` against `rounds` (per round); 0.0 with fewer than two points."""
    if len(rounds) < 2:
        return 0.0
    slope, _ = np.polyfit(np.asarray(rounds, dtype=float), np.asarray(values, dtype=float), 1)
    return float(slope)


def summarise(series: dict[str, list[dict[str, Any]]], warmup: int) -> dict[str, dict[str, Any]]:
    """Per node and quantity: slope per round from `warmup` on, value at the warm-up and at the end, maximum."""
    summary: dict[str, dict[str, Any]] = {}
    for name, readings in series.items():
        settled = [r for r in readings if r["round"] >= warmup]
        node: dict[str, Any] = {}
        for q in QUANTITIES:
            node[q] = {"per_round": round(growth([r["round"] for r in settled], [r[q] for r in settled]), 4),
                       "at_warmup": round(settled[0][q], 2) if settled else None,
                       "at_end": round(settled[-1][q], 2) if settled else None,
                       "max": round(max(r[q] for r in readings), 2) if readings else None}
        node["peak_rss_mib"] = round(max((r["peak_rss_mib"] for r in readings), default=0.0), 1)
        summary[name] = node
    return summary


def run(directory: Path, settings: SimSettings, rounds: int) -> tuple[dict[str, list[dict[str, Any]]],
                                                                         list[dict[str, Any]], str]:
    """Run the network for `rounds` rounds, sampling every node after each; returns series, rounds, failure."""
    series: dict[str, list[dict[str, Any]]] = {}

    def sample_all(sim: Simulation, r: int, entry: dict[str, Any]) -> str:
        for name, node in sim.nodes.items():
            reading = sample(node)
            if reading is not None:
                series.setdefault(name, []).append({"round": r, **{k: round(v, 3) for k, v in reading.items()}})
        largest = max(readings[-1]["rss_mib"] for readings in series.values())
        return f"global {entry['global_loss']}, largest RSS {largest:.0f} MiB"

    entries, failure = run_rounds(directory, settings, rounds, sample_all)
    return series, entries, failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds to run (default 30)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="rounds before growth is read (default 6: blob and message retention are 3)")
    parser.add_argument("--validators", type=int, default=2, help="validator processes (default 2)")
    parser.add_argument("--miners", type=int, default=4, help="miner processes (default 4)")
    parser.add_argument("--round-seconds", type=float, default=defaults.ROUND_SECONDS,
                        help="round length (default %(default)g, as simulate)")
    parser.add_argument("--train-share", type=float, default=defaults.TRAIN_SHARE,
                        help="TRAIN's share of the round (default %(default)g, as simulate)")
    parser.add_argument("--dir", type=Path, help="simulation directory, must not exist (default: a new temporary one)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        parser.error("the soak benchmark reads /proc; it runs on Linux only")
    if not 0 <= args.warmup < args.rounds - 1:
        parser.error(f"--warmup must leave at least two rounds to read growth on, got --warmup {args.warmup} "
                     f"with --rounds {args.rounds}")
    if args.dir is not None and args.dir.exists():
        parser.error(f"--dir {args.dir} exists; give a new directory")
    try:
        settings = SimSettings(validators=args.validators, miners=args.miners, round_seconds=args.round_seconds,
                               train_share=args.train_share)
    except ValueError as exc:
        parser.error(str(exc))
    directory = (args.dir or Path(tempfile.mkdtemp(prefix="tessera-soak-"))).resolve()
    started = time.perf_counter()
    series, entries, failure = run(directory, settings, args.rounds)
    summary = summarise(series, args.warmup)
    worst = {q: max((n[q]["per_round"] for n in summary.values()), default=0.0) for q in QUANTITIES}
    report = {
        "settings": {**asdict(settings), "rounds": args.rounds, "warmup": args.warmup, "commit": _commit()},
        "failure": failure,
        "rounds_completed": len(entries),
        "seconds": round(time.perf_counter() - started, 1),
        "max_rss_growth_mib_per_round": worst["rss_mib"],
        "max_fd_growth_per_round": worst["fds"],
        "max_thread_growth_per_round": worst["threads"],
        "max_data_growth_mib_per_round": worst["data_mib"],
        "nodes": summary,
        "global_loss": [e["global_loss"] for e in entries],
        "one_global_state_every_round": all(len({v["global_hash"] for v in e["validators"]}) == 1 for e in entries),
        "series": series,
    }
    emit(report, args.out)
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        (directory / "soak.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if failure else 0


if __name__ == "__main__":
    raise SystemExit(main())
