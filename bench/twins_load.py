"""Load benchmark on the in-memory twins: many miners, a few validators, whole rounds in one process.

3 validators and 200 miners of the tiny qwen3_moe network fixed in node/sim/twins.py (4 inner steps per
round) run --rounds rounds on one MemoryHub and one ManualClock, moved phase by phase by
`node.sim.twins.Twins`. Nothing is mocked: every node runs its
real duties, storage and blob store, and every message goes through the same judge as libp2p.
It checks, and fails loudly otherwise, that
- every miner is scored in every round (each validator's round report has a loss for it), and
- the validators agree (one state per round, voted by every validator; every node ends on it).
Reported:
- `peak_rss_mib` (the process's peak RSS, all nodes together), `rss_before_mib` (after imports) and
  `peak_rss_growth_per_node_mib` (the difference over the number of nodes);
- `evaluate_s_per_miner`: seconds a validator's `Scorer.score_round` takes per miner it scores
  (all calls pooled), and `evaluate_phase_wall_s`: wall time of each round's EVALUATE phase (every
  validator fetching, checking and scoring its assigned miners, concurrently);
- wall time per phase per round, and the per-round scores summary.
The machine's CPUs are shared by every node here (and whatever else runs), so times are upper bounds.
Usage: python bench/twins_load.py [--validators 3] [--miners 200] [--rounds 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import node.sim.twins as twins  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from protocol.rounds import PHASES, Phase  # noqa: E402
from validator.scoring import Scorer  # noqa: E402

WAIT_S = 1800.0  # one phase of 200 miners on two shared cores takes minutes, not the tests' 2


class ScoreTimer:
    """Records (miners scored, seconds) of every `Scorer.score_round` call while installed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._original: Callable[..., Any] = Scorer.score_round

    def __enter__(self) -> ScoreTimer:
        original, calls, lock = self._original, self.calls, self._lock

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = original(*args, **kwargs)
            with lock:
                calls.append((len(result.entries), time.perf_counter() - started))
            return result

        Scorer.score_round = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Scorer.score_round = self._original  # type: ignore[method-assign]


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def run_load(root: Path, validators: int, miners: int, rounds: int) -> dict[str, Any]:
    """Run the rounds, check every miner was scored and the validators agree; return the figures."""
    net = twins.Twins(root, validators, wait_s=WAIT_S)
    names = [f"validator-{i}" for i in range(validators)] + [f"miner-{i}" for i in range(miners)]
    started = time.perf_counter()
    for name in names:
        await net.start(name)
    phase_s: list[dict[str, float]] = []
    try:
        with ScoreTimer() as timer:
            for r in range(rounds):
                walls: dict[str, float] = {}
                for phase in PHASES:
                    t0 = time.perf_counter()
                    await net.phase(r, phase)
                    walls[str(phase)] = round(time.perf_counter() - t0, 3)
                    print(f"round {r} {phase}: {walls[str(phase)]:.1f} s", file=sys.stderr, flush=True)
                phase_s.append(walls)
            await net.phase(rounds, Phase.TRAIN)  # settles the last round
        observed = await _observe(net, names, rounds)
    finally:
        await net.close()
    scored = sum(n for n, _ in timer.calls)
    return {
        "validators": validators,
        "miners": miners,
        "rounds": rounds,
        "inner_steps": net.spec.training.inner_steps,
        "replication": net.spec.rewards.replication,
        "cpus": os.cpu_count(),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "evaluate_s_per_miner": round(sum(s for _, s in timer.calls) / scored, 4),
        "evaluations": scored,
        "evaluate_phase_wall_s": [w["evaluate"] for w in phase_s],
        "phase_wall_s": phase_s,
        **observed,
    }


async def _observe(net: twins.Twins, names: list[str], rounds: int) -> dict[str, Any]:
    miners = {net.id(n) for n in names if n.startswith("miner")}
    voters = {net.id(n) for n in names if n.startswith("validator")}
    storage = net.nodes["validator-0"].ctx.storage
    summary = []
    for r in range(rounds):
        states = await storage.global_states(r)
        agreed = [s.hash for s in states if set(s.voters) == voters]
        if len(states) != 1 or not agreed:
            raise AssertionError(f"round {r}: validators did not agree: {[(s.hash[:12], len(s.voters)) for s in states]}")
        accepted = 0
        for name in names:
            if not name.startswith("validator"):
                continue
            reported = await net.nodes[name].round_report(r)
            assert reported is not None, f"round {r}: {name} wrote no round report"
            report = reported
            losses = {m["id"]: m["loss"] for m in report["miners"]}
            unscored = miners - {m for m, loss in losses.items() if loss is not None}
            if unscored:
                raise AssertionError(f"round {r}: {name} has no loss for {len(unscored)} miner(s)")
            accepted = len(losses)
        summary.append({"round": r, "state": agreed[0], "miners_scored": accepted,
                        "base_loss": report["base_loss"], "global_loss": report["global_loss"]})
    heads = {await n.ctx.storage.head() for n in net.nodes.values()}
    if len(heads) != 1:
        raise AssertionError(f"nodes end on {len(heads)} different heads")
    return {"every_miner_scored": True, "validators_agree": True, "per_round": summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--validators", type=int, default=3)
    parser.add_argument("--miners", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=out_file, default=None)
    args = parser.parse_args(argv)
    if min(args.validators, args.miners, args.rounds) < 1:
        parser.error("--validators, --miners and --rounds must be at least 1")
    logging.basicConfig(level=logging.ERROR)
    before = rss_mib()
    with tempfile.TemporaryDirectory(prefix="tessera-twins-load-") as tmp:
        report = asyncio.run(run_load(Path(tmp), args.validators, args.miners, args.rounds))
    # The kernel sums RSS from per-CPU counters, so its high-water mark can read a few pages below an RSS read
    # earlier; the peak is at least every RSS seen.
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, before, rss_mib())
    report["rss_before_mib"] = round(before, 1)
    report["peak_rss_mib"] = round(peak, 1)
    report["peak_rss_growth_per_node_mib"] = round((peak - before) / (args.validators + args.miners), 2)
    emit(report, args.out)


if __name__ == "__main__":
    main()
