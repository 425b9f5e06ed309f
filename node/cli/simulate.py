"""`tessera simulate`: a whole network on this machine.

`simulate` drives node.sim.run.Simulation: start every process, print a progress line at each
phase, wait for N rounds, write DIR/report.json, print a results table, stop everything. It exits
1 if a node died or fewer rounds completed than asked, 0 otherwise. This module only parses
arguments and formats output.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from tqdm import tqdm

from node.cli.common import add_spec_settings, comma_list
from node.sim import defaults


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = subparsers.add_parser("simulate", help="run bootstrap, validators and miners as local processes")
    sim.add_argument("--validators", type=int, default=defaults.VALIDATORS, metavar="V",
                     help="validator processes, 1 to 64 (default %(default)s)")
    sim.add_argument("--miners", type=int, default=defaults.MINERS, metavar="M", help="miner processes (default %(default)s)")
    sim.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds to run (default 3)")
    sim.add_argument("--dir", required=True, type=Path, metavar="DIR", help="simulation directory (created)")
    sim.add_argument("--force", action="store_true", help="replace DIR if it holds an earlier simulation")
    sim.add_argument("--adversaries", type=comma_list, default=(), metavar="KIND,...",
                     help="make that many of the M miners adversaries: lazy, noise, copier, late, garbage")
    sim.add_argument("--base-port", type=int, default=0, metavar="P",
                     help="first TCP port; each node takes two (default: free ports)")
    sim.add_argument("--round-seconds", type=float, default=defaults.ROUND_SECONDS, metavar="S",
                     help="round length (default %(default)g)")
    sim.add_argument("--train-share", type=float, default=defaults.TRAIN_SHARE, metavar="F",
                     help="TRAIN's share of the round (default %(default)g)")
    sim.add_argument("--start-delay", type=float, default=None, metavar="S",
                     help=f"seconds until genesis (default: {defaults.START_DELAY_S:g} + "
                          f"{defaults.START_DELAY_PER_NODE_S:g} per node)")
    sim.add_argument("--inner-steps", type=int, default=defaults.INNER_STEPS, metavar="H",
                     help="inner AdamW steps each miner takes per round (default %(default)s)")
    sim.add_argument("--seed", type=int, default=defaults.SEED, help="seed of model, data and keys (default %(default)s)")
    sim.add_argument("--format", choices=("experts", "pgrad"), default=defaults.FORMAT,
                     help="what miners submit: full experts, or compressed pseudo-gradients (top-k per chunk, "
                          "2-bit, with error feedback; the spec's default [submission] parameters) (default %(default)s)")
    sim.add_argument("--family", default=defaults.FAMILY, metavar="FAMILY",
                     help="model family of the tiny pretrained base: qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v2 "
                          "or deepseek_v3 (default %(default)s)")
    add_spec_settings(sim, "--round-seconds, --train-share, --inner-steps and --format")
    sim.set_defaults(run=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from node.sim.process import SimSettings, SimulationError
    from node.sim.run import Simulation

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    # SimSettings judges every other flag, before any directory is made or replaced.
    settings = SimSettings(validators=args.validators, miners=args.miners, adversaries=args.adversaries,
                           round_seconds=args.round_seconds, train_share=args.train_share,
                           start_delay_s=args.start_delay, base_port=args.base_port, seed=args.seed,
                           inner_steps=args.inner_steps, submission_format=args.format, family=args.family,
                           spec_settings=tuple(args.spec_settings))
    if args.force and args.dir.exists():
        if any(args.dir.iterdir()) and not (args.dir / "network" / "spec.toml").exists():
            raise ValueError(f"{args.dir}: --force only replaces an earlier simulation directory, and this "
                             "is not one; remove it yourself or choose another --dir")
        shutil.rmtree(args.dir)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    sim = Simulation(args.dir, settings)
    rounds: list[dict[str, Any]] = []
    failure = ""
    try:
        sim.prepare()
        assert sim.schedule is not None  # prepare() sets it
        print(f"simulation in {sim.directory}: {len(sim.nodes)} processes, genesis in "
              f"{sim.schedule.genesis_ts - time.time():.0f} s, rounds of {sim.schedule.round_seconds:.0f} s, "
              f"{dict(settings.spec_settings).get('submission.format', args.format)} submissions")
        sim.start()
        progress = Progress(sim, sys.stdout)
        # A bar over the rounds on a terminal; the phase lines go above it (tqdm.write).
        with tqdm(total=args.rounds, unit="round", disable=not sys.stdout.isatty(), file=sys.stdout) as bar:
            for r in range(args.rounds):
                reports = sim.wait_round(r, on_poll=progress)
                rounds.append(sim.round_entry(r, reports))
                sim.write_report(rounds)
                _say(f"round {r} done: {_loss_line(rounds[-1])}", sys.stdout)
                bar.update(1)
    except SimulationError as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        failure = "interrupted"
    finally:
        try:
            sim.close()
        except KeyboardInterrupt:  # another Ctrl-C while the nodes stopped: close() killed them
            failure = failure or "interrupted"
        signal.signal(signal.SIGTERM, previous)
    if sim.network is not None:
        print(f"report: {sim.write_report(rounds)}")
    print_table(rounds, sys.stdout)
    if failure:
        print(f"tessera simulate: {failure}", file=sys.stderr)
    return 1 if failure or len(rounds) < args.rounds else 0


def _say(line: str, out: TextIO) -> None:
    """One progress line, above the rounds bar when there is one; flushed, so a pipe sees it at once."""
    tqdm.write(line, file=out)
    out.flush()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class Progress:
    """The `on_poll` hook: one line per phase change, with what the nodes report over HTTP."""

    def __init__(self, sim: Any, out: TextIO) -> None:
        self.sim = sim
        self.out = out
        self.shown: tuple[int, str] | None = None
        self.answering = -1
        self.started = time.monotonic()

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.0f} s"

    def __call__(self) -> None:
        at = self.sim.now_round_phase()
        if at is not None and at == self.shown:
            return
        statuses = [self.sim.get(n.name, "/status") for n in self.sim.nodes.values() if n.http_port is not None]
        up = [s for s in statuses if s]
        if at is None:  # before genesis: report nodes as they come up
            if self.answering != len(up):
                self.answering = len(up)
                wait = self.sim.schedule.genesis_ts - time.time()
                _say(f"[{self._elapsed()}] genesis in {wait:3.0f} s  answering {len(up)}/{len(statuses)}",
                     self.out)
            return
        self.shown = at
        peers = [s.get("peers", 0) for s in up]
        heads: dict[str, int] = {}
        for s in up:
            head = (s.get("head") or "base")[:8]
            heads[head] = heads.get(head, 0) + 1
        alive = sum(n.alive for n in self.sim.nodes.values())
        _say(f"[{self._elapsed()}] round {at[0]} {at[1]:<8} processes {alive}/"
             f"{len(self.sim.nodes)}  answering {len(up)}/{len(statuses)}  peers {min(peers, default=0)}-"
             f"{max(peers, default=0)}  heads {', '.join(f'{h}x{n}' for h, n in sorted(heads.items()))}",
             self.out)


def _loss_line(entry: dict[str, Any]) -> str:
    hashes = {v["global_hash"] for v in entry["validators"] if v["global_hash"]}
    return (f"base loss {_num(entry['base_loss'])} -> global loss {_num(entry['global_loss'])}, "
            f"{len(hashes)} distinct global hash(es)")


def print_table(rounds: list[dict[str, Any]], out: TextIO) -> None:
    """The results: one block per round, one row per miner."""
    if not rounds:
        print("no round completed", file=out)
        return
    header = f"{'round':>5}  {'miner':<10} {'kind':<8} {'verdict':<10} {'loss':>8} {'rank':>4} {'reward':>8}  reason"
    print(header, file=out)
    print("-" * len(header), file=out)
    for entry in rounds:
        print(f"{entry['round']:>5}  {'(global)':<10} {'':<8} {'':<10} {_num(entry['global_loss']):>8} "
              f"{'':>4} {'':>8}  base {_num(entry['base_loss'])}", file=out)
        for m in sorted(entry["miners"], key=lambda m: (m["rank"] is None, m["rank"] or 0, m["id"])):
            print(f"{'':>5}  {m['id'][:10]:<10} {m['kind']:<8} {str(m['verdict']):<10} {_num(m['loss']):>8} "
                  f"{'-' if m['rank'] is None else m['rank']:>4} {_num(m['reward']):>8}  {m['reason'] or ''}",
                  file=out)
    print(file=out)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"
