"""Successor benchmark: a live network of separate processes moves to its next expert group at a round, no node restarted.

It runs `tessera simulate`'s network (node.sim.run.Simulation: a bootstrap, 2 validators and 3 miners over
loopback libp2p on the pretrained tiny base, its group chosen on the arithmetic domain) and writes a second domain
(records) beside its data. At the start of round A - 2 it moves the network on with the product's own commands,
as operators would: `tessera select-experts --state` measures validator-0's adopted state on the records data
and, `--disjoint`, leaves out the group in force; `tessera spec successor` trains that group on the records data
from round A, with the arithmetic held-out file as the merge gate's general-domain file under a forgetting budget
(`aggregation.forgetting_budget`); `tessera spec sign` with both validators' keys; `tessera spec offer` to
validator-0, which offers it to its peers. One more miner starts, with an empty data directory, once round A + 1
begins (after the switch). Per round it records the group of the state the round adopted, that state's hash as
every node's state file records it, and, afterwards, the state's held-out loss on each domain's whole held-out
file (the model as nodes build it: the base with the states of earlier specs written in, then the round's state).
It reports whether every round ended on one state on every node that ran it, whether any node process was
restarted (its pid changed), whether the new group's loss fell after the switch and whether the first group's
loss stayed within the budget of its value at the switch. It knows nothing about how nodes train, score or
merge; it reads what they stored and runs the commands an operator would.
Usage: python bench/successor.py [--rounds 6] [--activation 3] [--validators 2] [--miners 3] [--round-seconds 80]
       [--train-share 0.9] [--inner-steps 30] [--budget 0.05] [--seed 0] [--dir DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.network import commit  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from node.cli.main import main as tessera  # noqa: E402
from node.sim import defaults  # noqa: E402
from node.sim.layout import to_toml  # noqa: E402
from node.sim.process import SimSettings, SimulationError  # noqa: E402
from node.sim.run import Simulation  # noqa: E402
from node.store.blobs import BlobStore  # noqa: E402
from node.store.db import Storage  # noqa: E402
from protocol.rounds import Phase  # noqa: E402
from protocol.spec import load_spec  # noqa: E402
from training.corpus import generate, write_documents  # noqa: E402
from training.data import load_sequences  # noqa: E402
from training.evaluate import heldout_loss  # noqa: E402
from training.experts import insert  # noqa: E402
from training.model import load_base  # noqa: E402
from training.state import inherited_experts  # noqa: E402
from training.tokenizer import load_tokenizer  # noqa: E402

DOMAIN, TRAIN_DOCS, HELDOUT_DOCS = "records", 2000, 300
STATES = "adopted-states"


def second_domain(data: Path, seed: int) -> tuple[Path, Path]:
    """The records domain's training and held-out files beside the network's data (disjoint, as the layout's)."""
    train = generate(DOMAIN, TRAIN_DOCS, seed + 7)
    seen = set(train)
    heldout = [doc for doc in generate(DOMAIN, HELDOUT_DOCS, seed + 1_000_010) if doc not in seen]
    return write_documents(data / "train2.jsonl", train), write_documents(data / "heldout2.jsonl", heldout)


def give_validators(sim: Simulation, heldout: Path) -> None:
    """Each validator's config names the next domain's held-out file (`[validator] data`)."""
    for node in sim.validators():
        path = node.directory / "config.toml"
        config = tomllib.loads(path.read_text(encoding="utf-8"))
        config.setdefault("validator", {})["data"] = [str(heldout)]
        path.write_text(to_toml(config), encoding="utf-8")


def run_tessera(*argv: object) -> str:
    """Run one `tessera` command in this process; its standard output. SimulationError with its error line."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tessera([str(a) for a in argv])
    if code != 0:
        raise SimulationError(f"tessera {argv[0]} {argv[1]}: {err.getvalue().strip().splitlines()[-1:]}")
    return out.getvalue()


def move_on(sim: Simulation, work: Path, activation: int, budget: float) -> dict[str, Any]:
    """Choose, draft, sign and offer the successor as operators would; what the commands said."""
    assert sim.network is not None
    spec, data = sim.network.spec_path, sim.network.directory / "data"
    validator = sim.validators()[0]
    group = work / "group.json"
    run_tessera("select-experts", "--spec", spec, "--data", data / "train2.jsonl", "--rule", "gate-mass",
                "--top-d", len(next(iter(sim.network.group.values()))), "--state", validator.directory / "data",
                "--disjoint", "--out", group)
    document = work / "successor.toml"
    drafted = json.loads(run_tessera(
        "spec", "successor", "--spec", spec, "--round", activation, "--group", group, "--train", data / "train2.jsonl",
        "--heldout", data / "heldout2.jsonl", "--general", data / "heldout.jsonl",
        "--set", f"aggregation.forgetting_budget={budget}", "--out", document))
    for key in sorted((sim.network.directory / "keys").glob("validator-*.key")):
        run_tessera("spec", "sign", document, "--key", key)
    offered = json.loads(run_tessera("spec", "offer", document, "--url", f"http://127.0.0.1:{validator.http_port}"))
    chosen = json.loads(group.read_text(encoding="utf-8"))
    return {"document": drafted["document"], "group": drafted["group"], "measured_on_state": chosen["state"],
            "offered_in_round": (sim.now_round_phase() or (None,))[0], "signed_by": offered["signed_by"]}


def keep_state(sim: Simulation, state: str, states: Path) -> None:
    """Copy an adopted state's blob from the first validator holding it (before blob retention prunes it)."""
    for node in sim.validators():
        data = BlobStore(node.directory / "data" / "blobs").read_checked(state)
        if data is not None:
            states.mkdir(parents=True, exist_ok=True)
            (states / state).write_bytes(data)
            return


async def node_states(db: Path, rounds: int) -> dict[int, str | None]:
    """The state each round ended on, as a node's state file records it: the state it adopted for the round, else
    (no state won the round's votes) the one before, carried on; None before its first adopted state."""
    storage = await Storage.open(db)
    try:
        records = await storage.global_states()
    finally:
        await storage.close()
    ended: dict[int, str | None] = {}
    held = None
    for r in range(rounds):
        held = next((s.hash for s in records if s.round == r and s.adopted), held)
        ended[r] = held
    return ended


def evaluate(spec_path: Path, adopted: list[str], activation: int, states: Path) -> list[dict[str, float]]:
    """Each adopted state's whole held-out loss on the first (arithmetic) and the next (records) domain."""
    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path)
    tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
    data = spec_path.parent / "data"
    heldout = {name: load_sequences([data / file], tokenizer, spec.data.seq_len)
               for name, file in (("first_group", "heldout.jsonl"), ("next_group", "heldout2.jsonl"))}

    def losses() -> dict[str, float]:
        return {name: round(float(heldout_loss(model, rows, batch_size=32, pad_id=tokenizer.pad_id).loss), 5)
                for name, rows in heldout.items()}

    out = [losses()]  # the base, before round 0
    for r, state in enumerate(adopted):
        if r == activation:  # the successor's base: the first spec's last state, written in for good
            insert(model, adapter, inherited_experts([states / adopted[activation - 1]], spec.limits.max_header_bytes))
        insert(model, adapter, inherited_experts([states / state], spec.limits.max_header_bytes))
        out.append(losses())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds to run (default 6)")
    parser.add_argument("--activation", type=int, default=3, help="the successor's first round (default 3)")
    parser.add_argument("--validators", type=int, default=2, help="validator processes (default 2)")
    parser.add_argument("--miners", type=int, default=3, help="miners from the start; one more joins late (default 3)")
    parser.add_argument("--round-seconds", type=float, default=defaults.ROUND_SECONDS, help="round length (default 80)")
    parser.add_argument("--train-share", type=float, default=defaults.TRAIN_SHARE, help="TRAIN's share (default 0.9)")
    parser.add_argument("--inner-steps", type=int, default=defaults.INNER_STEPS, help="inner steps (default 30)")
    parser.add_argument("--budget", type=float, default=0.05,
                        help="the successor's forgetting budget on the first domain, nats (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of model, data and keys (default 0)")
    parser.add_argument("--dir", type=Path, help="simulation directory, must not exist (default: a temporary one)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.activation < 2 or args.rounds < args.activation + 2:
        parser.error("--activation must be at least 2 and --rounds at least --activation + 2 (a late joiner's round)")
    if args.dir is not None and args.dir.exists():
        parser.error(f"--dir {args.dir} exists; give a new directory")
    torch.set_num_threads(1)
    directory = (args.dir or Path(tempfile.mkdtemp(prefix="tessera-successor-"))).resolve()
    settings = SimSettings(validators=args.validators, miners=args.miners, round_seconds=args.round_seconds,
                           train_share=args.train_share, inner_steps=args.inner_steps, seed=args.seed)
    started = time.perf_counter()
    sim = Simulation(directory, settings)
    failure, moved, late, reported = "", {}, None, []
    try:
        sim.prepare()
        assert sim.network is not None
        _, heldout2 = second_domain(sim.network.directory / "data", args.seed)
        give_validators(sim, heldout2)
        sim.start()
        pids = {name: node.proc.pid for name, node in sim.nodes.items() if node.proc is not None}
        for r in range(args.rounds):
            if r == args.activation - 2:
                sim.wait_phase(r, Phase.TRAIN)
                moved = move_on(sim, directory, args.activation, args.budget)
            if r == args.activation + 1:
                sim.wait_phase(r, Phase.TRAIN)
                late = sim.add_node("honest")
                pids[late.name] = late.proc.pid if late.proc is not None else -1
            sim.wait_phase(r, Phase.EVALUATE)
            status = sim.get(sim.validators()[0].name, "/status") or {}
            reports = sim.wait_round(r)
            entry = sim.round_entry(r, reports) | {"spec": status.get("spec")}
            reported.append(entry)
            for state in {v["global_hash"] for v in entry["validators"] if v["global_hash"]}:
                keep_state(sim, state, directory / STATES)
            print(f"round {r}: validators' global loss {entry['global_loss']}", file=sys.stderr, flush=True)
        if len(last := {v["global_hash"] for v in reported[-1]["validators"] if v["global_hash"]}) == 1:
            # The miners take the last round's state a moment after the validators report it, as they would
            # before the next round's TRAIN: wait for it there before the network stops.
            (head,) = last
            sim.wait_until(lambda: all((sim.get(n.name, "/status") or {}).get("head") == head
                                       for n in sim.nodes.values() if n.role != "bootstrap" and n.alive),
                           settings.round_seconds, "every node to hold the last round's state")
        restarted = sorted(name for name, node in sim.nodes.items()
                           if node.proc is None or node.proc.pid != pids.get(name) or not node.alive)
    except SimulationError as exc:
        failure, restarted = str(exc), []
    finally:
        sim.close()
    simulated = round(time.perf_counter() - started, 1)
    report = build_report(sim, directory, args, reported, moved, late.name if late else None, restarted, failure)
    report["seconds"] = {"simulation": simulated, "evaluation": round(time.perf_counter() - started - simulated, 1)}
    emit(report, args.out)
    if args.dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if not failure and report["checks"]["all"] else 1


def build_report(sim: Simulation, directory: Path, args: argparse.Namespace, reported: list[dict[str, Any]],
                 moved: dict[str, Any], late: str | None, restarted: list[str], failure: str) -> dict[str, Any]:
    """Per round: the group, every node's state and each domain's loss; and the checks (module docstring)."""
    assert sim.network is not None
    rounds = len(reported)
    per_node = {name: asyncio.run(node_states(node.directory / "data" / "node.db", rounds))
                for name, node in sim.nodes.items() if name != "bootstrap" and (node.directory / "data" / "node.db").is_file()}
    adopted = [min(v["global_hash"] for v in e["validators"] if v["global_hash"]) for e in reported
               if any(v["global_hash"] for v in e["validators"])]
    losses = evaluate(sim.network.spec_path, adopted, args.activation, directory / STATES) if adopted else []
    entries = []
    for r, entry in enumerate(reported):
        states = {name: held[r] for name, held in per_node.items()}
        ran = {s for name, s in states.items() if name != late or r >= args.activation + 1}
        spec = entry.get("spec") or {}
        state_round = _round_of(directory / STATES / adopted[r]) if r < len(adopted) else None
        entries.append({"round": r, "group": spec.get("group"), "spec": spec.get("id"), "states": states,
                        "state_adopted_this_round": state_round == r,
                        "one_state": len(ran) == 1 and None not in ran,
                        "heldout_loss": losses[r + 1] if r + 1 < len(losses) else None,
                        "validators_global_loss": entry["global_loss"],
                        "miners_accepted": sum(m["verdict"] == "accept" for m in entry["miners"])})
    switch = losses[args.activation] if len(losses) > args.activation else None  # the state round A starts from
    after = [e["heldout_loss"] for e in entries[args.activation:] if e["heldout_loss"]]
    rise = max((a["first_group"] - switch["first_group"] for a in after), default=None) if switch else None
    checks = {
        "one_state_every_round": bool(entries) and all(e["one_state"] for e in entries),
        "no_node_restarted": not restarted and not failure,
        "groups_disjoint": bool(moved) and all(not set(moved["group"][k]) & set(sim.network.group.get(int(k), []))
                                               for k in moved["group"]),
        "next_group_loss_fell": switch is not None and len(after) == rounds - args.activation
        and after[-1]["next_group"] < switch["next_group"],
        "first_group_within_budget": rise is not None and rise <= args.budget,
        "late_joiner_scored": late is not None and any(
            m["id"] == sim.nodes[late].node_id and m["verdict"] == "accept" for m in reported[-1]["miners"]),
    }
    checks["all"] = all(checks.values())
    checks["next_group_loss_fell_every_round"] = switch is not None and bool(after) and all(
        b["next_group"] < a["next_group"] for a, b in zip([switch, *after], after, strict=False))
    return {"settings": {"rounds": args.rounds, "activation": args.activation, "validators": args.validators,
                         "miners": args.miners + 1, "round_seconds": args.round_seconds, "train_share": args.train_share,
                         "inner_steps": args.inner_steps, "budget": args.budget, "seed": args.seed, "commit": commit()},
            "failure": failure, "successor": moved, "late_joiner": late, "restarted": restarted,
            "base_heldout_loss": losses[0] if losses else None, "heldout_loss_at_switch": switch,
            "first_group_largest_rise_after_switch": None if rise is None else round(rise, 5),
            "rounds": entries, "checks": checks}


def _round_of(path: Path) -> int | None:
    """The round of a state blob's merge (None: no blob, the base)."""
    from training.blob import read_header

    return read_header(path, 1 << 20).meta.round if path.is_file() else None


if __name__ == "__main__":
    raise SystemExit(main())
