"""Round benchmark: where the wall time of a simulated round goes, and how much of it miners train.

Runs `tessera simulate`'s network (bench/network.py; default: 2 validators, 4 honest miners, and the default
simulation timing: 80 s rounds with TRAIN 90 % of them) for --rounds rounds, or reads an earlier run's
(`--reuse`), then reads
- each miner's training wall time per round from its log ("round R: trained N steps at lr X in S s"),
- every node's recorded phase-handler runs (start and end wall time, from its state file).
Reported:
- `train_share`: mean over miners and rounds of training wall time / round length, a miner-round with
  no training run counting as 0; target >= 0.8;
- `train_window_share`: the same over the TRAIN window only;
- `phase_seconds`: per phase, the mean over rounds of the longest handler run of any node;
- `rounds`: the per-round report the simulation wrote (losses, verdicts, hashes).
Usage: python bench/round.py [--rounds N] [--validators V] [--miners M] [--round-seconds S] [--train-share F]
       [--dir DIR | --reuse DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import network  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from node.sim import defaults  # noqa: E402
from node.sim.process import SimSettings  # noqa: E402
from protocol.rounds import PHASES  # noqa: E402

TRAINED = re.compile(r"round (?P<round>\d+): trained (?P<steps>\d+) steps [^\n]*?in (?P<seconds>[\d.]+) s")


def training_runs(logs: list[str], miners: int, rounds: int) -> tuple[list[float], list[int]]:
    """From the miners' logs: training seconds per miner-round, one for each of the `miners` × `rounds` (a
    miner-round with no training run, late or failed, counts as 0 s, not as absent), and the steps of the
    runs there were."""
    # one run per miner and round: a miner restarted in TRAIN logs the run it finished last
    runs = [m for log in logs for m in {int(m["round"]): m for m in TRAINED.finditer(log)
                                         if int(m["round"]) < rounds}.values()]
    if not runs:
        raise SystemExit("no miner logged a training run; see the node logs")
    return [float(m["seconds"]) for m in runs] + [0.0] * (miners * rounds - len(runs)), [int(m["steps"]) for m in runs]


def measure(recorded: network.Run) -> dict[str, Any]:
    """Where the rounds of a recorded network run went (module doc)."""
    settings, rounds = recorded.sim_settings(), recorded.settings["rounds"]
    entries = recorded.rounds
    round_s, train_s = settings.round_seconds, settings.timing()["train_s"]
    logs = [(path / "log.txt").read_text(errors="replace") for path in sorted((recorded.directory / "nodes").iterdir())
            if path.name.startswith("miner-")]
    training, steps = training_runs(logs, settings.miners, rounds)
    phase_seconds = {str(p): round(statistics.mean(e["phase_seconds"].get(str(p), 0.0) for e in entries), 3)
                     for p in PHASES}
    mean_train = statistics.mean(training)
    return {
        "round_seconds": round_s,
        "timing": settings.timing(),
        "miners": settings.miners,
        "validators": settings.validators,
        "rounds_measured": rounds,
        "miner_train_seconds": {"mean": round(mean_train, 3), "min": round(min(training), 3),
                                "max": round(max(training), 3), "runs": len(steps),
                                "runs_expected": settings.miners * rounds},
        "miner_inner_steps": {"mean": round(statistics.mean(steps), 1), "min": min(steps), "max": max(steps)},
        "train_share": round(mean_train / round_s, 3),
        "train_window_share": round(mean_train / train_s, 3),
        "phase_seconds": phase_seconds,
        "rounds": entries,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds to measure (default 2)")
    parser.add_argument("--validators", type=int, default=2, help="validator processes (default 2)")
    parser.add_argument("--miners", type=int, default=4, help="miner processes (default 4)")
    parser.add_argument("--round-seconds", type=float, default=defaults.ROUND_SECONDS,
                        help="round length (default %(default)g, as simulate)")
    parser.add_argument("--train-share", type=float, default=defaults.TRAIN_SHARE,
                        help="TRAIN's share of a round (default %(default)g)")
    parser.add_argument("--dir", type=Path, help="simulation directory, must not exist (default: a new temporary one)")
    parser.add_argument("--reuse", type=Path, metavar="DIR",
                        help="skip the simulation: read the --dir of an earlier run of a network benchmark "
                             "(bench/network.py; the options that shape the network are then its own)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.miners < 1:
        parser.error(f"--miners must be at least 1: the benchmark reads miners' training, got {args.miners}")
    if args.dir is not None and args.dir.exists():
        parser.error(f"--dir {args.dir} exists; give a new directory")
    if args.reuse is not None:
        try:
            recorded = network.load(args.reuse.resolve())
        except ValueError as exc:
            parser.error(f"--reuse {exc}")
    else:
        try:
            settings = SimSettings(validators=args.validators, miners=args.miners, round_seconds=args.round_seconds,
                                   train_share=args.train_share)
        except ValueError as exc:
            parser.error(str(exc))
        recorded = network.run((args.dir or Path(tempfile.mkdtemp(prefix="tessera-bench-round-"))).resolve(),
                               settings, args.rounds)
    if recorded.failure or not recorded.rounds:
        print(f"bench/round.py: the network failed: {recorded.failure}", file=sys.stderr)
        return 1
    result = measure(recorded)
    emit(result, args.out)
    if args.dir is None and args.reuse is None:
        shutil.rmtree(recorded.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
