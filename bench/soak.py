"""Soak benchmark: does a node's memory, open files, threads or disk grow round after round?

It runs `tessera simulate`'s network for R rounds (bench/network.py, which samples every node process
each time the validators have finished a round: resident memory (VmRSS in /proc/<pid>/status), open file
descriptors, threads, and the bytes and blob count of its data directory, with each daemon's own
`process_resident_memory_bytes` as Prometheus scrapes it), or reads an earlier run's (`--reuse`).

Blobs are kept `storage.blob_retention_rounds` rounds and messages `message_retention_rounds`
rounds, and a process's allocator settles in its first rounds, so growth is read after a warm-up:
per node, the least-squares slope of each quantity over the rounds from `--warmup` on (per round),
and its first and last value there. A node that leaks shows a slope that does not shrink as the
run gets longer; a flat node's slope is noise around zero. Linux only (/proc).
Usage: python bench/soak.py [--rounds 30] [--warmup 6] [--validators 2] [--miners 4]
       [--round-seconds 80] [--train-share 0.9] [--dir DIR | --reuse DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import network  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from node.sim import defaults  # noqa: E402
from node.sim.process import SimSettings  # noqa: E402

MIB = 2**20
QUANTITIES = ("rss_mib", "fds", "threads", "data_mib", "blobs")


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
    parser.add_argument("--reuse", type=Path, metavar="DIR",
                        help="skip the simulation: read the --dir of an earlier run of a network benchmark "
                             "(bench/network.py; the options that shape the network are then its own)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        parser.error("the soak benchmark reads /proc; it runs on Linux only")
    if args.dir is not None and args.dir.exists():
        parser.error(f"--dir {args.dir} exists; give a new directory")
    if args.reuse is not None:
        try:
            recorded = network.load(args.reuse.resolve())
        except ValueError as exc:
            parser.error(f"--reuse {exc}")
        rounds = recorded.settings["rounds"]
    else:
        rounds = args.rounds
    if not 0 <= args.warmup < rounds - 1:
        parser.error(f"--warmup must leave at least two rounds to read growth on, got --warmup {args.warmup} "
                     f"with {rounds} rounds")
    if args.reuse is None:
        try:
            settings = SimSettings(validators=args.validators, miners=args.miners, round_seconds=args.round_seconds,
                                   train_share=args.train_share)
        except ValueError as exc:
            parser.error(str(exc))
        recorded = network.run((args.dir or Path(tempfile.mkdtemp(prefix="tessera-soak-"))).resolve(), settings,
                               rounds)
    summary = summarise(recorded.samples, args.warmup)
    worst = {q: max((n[q]["per_round"] for n in summary.values()), default=0.0) for q in QUANTITIES}
    entries = recorded.rounds
    report = {
        "settings": {**recorded.settings, "warmup": args.warmup},
        "failure": recorded.failure,
        "rounds_completed": len(entries),
        "seconds": recorded.seconds,
        "max_rss_growth_mib_per_round": worst["rss_mib"],
        "max_fd_growth_per_round": worst["fds"],
        "max_thread_growth_per_round": worst["threads"],
        "max_data_growth_mib_per_round": worst["data_mib"],
        "nodes": summary,
        "global_loss": [e["global_loss"] for e in entries],
        "one_global_state_every_round": all(len({v["global_hash"] for v in e["validators"]}) == 1 for e in entries),
        "series": recorded.samples,
    }
    emit(report, args.out)
    if args.dir is None and args.reuse is None:
        shutil.rmtree(recorded.directory, ignore_errors=True)
    return 1 if recorded.failure else 0


if __name__ == "__main__":
    raise SystemExit(main())
