"""Real-size benchmark: every operator command on an OLMoE-1B-7B-shaped checkpoint, then one round of real processes.

On the checkpoint of `bench/real_size_fixture.py` (written to `--work` unless `--checkpoint` names one),
each `tessera` command runs as its own subprocess, and its peak RSS (the child's getrusage maxrss, read
by os.wait4 in a small launcher, `LAUNCHER`) and wall seconds are recorded next to its budget, a
multiple of the checkpoint's weight bytes: `spec new` (top-d 2) 1.3, `inspect blob` 0.1, `eval` of the
base and of a blob (the scoring path: the model once in its dtype, the blob's experts swapped in) 1.3, `train --forward
compressed` in `experts` and in `pgrad` format (the pgrad spec is the experts spec with its
`[submission] format` changed) 0.35, and `export` of the trained blob 1.3. Blob bytes of both formats
are recorded. Then, unless `--no-network`, a network of real processes (`node.sim.run.Simulation`
with this spec in place of the tiny one: a bootstrap, one validator, `--miners` compressed miners)
runs round 0 with H = 2 and phase windows sized from the measured commands: blobs move over
libp2p, are checked, scored, merged and adopted on every node. Recorded: the state every node
adopted, each phase's longest handler run (REVEAL's includes the validator's blob transfers;
EVALUATE's, divided by the submissions, is the seconds a submission takes to score), and every
node's peak RSS (VmHWM before it stops); a round in which a node dies is recorded as `failed`, with the
peaks sampled until then. `--layers 2 --hidden-size 64` runs in seconds.
`--miners` is a most: as many run as fit beside the validator in the memory available when the round starts
(`miners_that_fit`); `--network-from REPORT` runs the round alone, on an earlier run's commands and spec.
Usage: python bench/real_size.py --out FILE [--checkpoint DIR] [--layers N] [--hidden-size H] [--work DIR]
                                 [--miners N] [--no-network | --network-from REPORT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit, out_file  # noqa: E402

BUDGETS = {"spec_new": 1.3, "inspect": 0.1, "eval_base": 1.3, "train_experts": 0.35, "train_pgrad": 0.35,
           "eval_blob": 1.3, "export": 1.3}
"""Peak RSS allowed to each command, as a multiple of the checkpoint's weight bytes."""
NODE_BUDGETS = {"validator": 1.3, "miner": 0.35}
"""Peak RSS allowed to a node of the network round, by role: a validator as scoring, a compressed miner as `train`."""
SEQ_LEN = 64
HELDOUT_SEQUENCES = 8
BATCH = 4
INNER_STEPS = 2
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before torch is imported."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=out_file, metavar="FILE", help="JSON report to write")
    parser.add_argument("--checkpoint", type=Path, metavar="DIR",
                        help="a checkpoint bench/real_size_fixture.py wrote (default: write one under --work)")
    parser.add_argument("--layers", type=int, default=16, help="layers of the checkpoint to write (default 16)")
    parser.add_argument("--hidden-size", type=int, default=2048, help="hidden size of the checkpoint to write")
    parser.add_argument("--work", type=Path, metavar="DIR", help="new directory for the run (default: a temporary one)")
    parser.add_argument("--miners", type=int, default=2, help="compressed miners in the network round (default 2)")
    parser.add_argument("--no-network", action="store_true", help="measure the commands only")
    parser.add_argument("--network-from", type=Path, metavar="REPORT",
                        help="run only the network round, on the commands and spec an earlier run of this --work "
                             "measured (its REPORT)")
    args = parser.parse_args(argv)
    if args.network_from is not None and (args.work is None or not (args.work / "network" / "spec.toml").is_file()):
        parser.error("--network-from needs the --work directory of the run that wrote it")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no config.json there; write one with bench/real_size_fixture.py")
    if args.network_from is None and args.work is not None and args.work.exists() and (
            not args.work.is_dir() or any(args.work.iterdir())):
        parser.error(f"--work {args.work}: exists and is not an empty directory")
    if not 1 <= args.miners <= 8:
        parser.error(f"--miners must be 1 to 8, got {args.miners}")
    return args


LAUNCHER = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""
"""Runs a command and writes its peak RSS (kilobytes on Linux) to a file; exits as the command did (killed by the
same signal, where it was). A process's maxrss starts at its
parent's RSS when it is spawned, so the commands are spawned by this small process, not by the benchmark,
which holds GBs once it has written the fixture."""


def measure(name: str, argv: list[str], work: Path, weight_bytes: int) -> dict[str, Any]:
    """Run `tessera argv` in its own process; its seconds, peak RSS and ratio, and the JSON it printed, if any."""
    out, err, peak_file = work / f"{name}.out", work / f"{name}.err", work / f"{name}.maxrss"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        code = subprocess.run([sys.executable, "-c", LAUNCHER, str(peak_file), sys.executable, "-m", "node.cli", *argv],
                              cwd=ROOT, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env).returncode
    seconds = time.perf_counter() - started
    if code not in (0, 1) or (code == 1 and name != "inspect"):
        raise RuntimeError(f"tessera {' '.join(argv[:2])} exited {code}: {err.read_text()[-3000:]}")
    peak = int(peak_file.read_text(encoding="utf-8")) * 1024
    text = out.read_text(encoding="utf-8")
    try:
        printed = json.loads(text[text.index("{"):]) if "{" in text else None
    except json.JSONDecodeError:
        printed = None
    ratio = peak / weight_bytes
    return {"seconds": round(seconds, 2), "peak_rss_bytes": peak, "ratio": round(ratio, 4),
            "budget": BUDGETS[name], "within": ratio <= BUDGETS[name], "printed": printed}


def derived_spec(source: Path, target: Path, changes: dict[str, Any]) -> Path:
    """`source` (a spec file) with `changes` applied (a dict updates that section, anything else replaces the
    field), written to `target` in the same directory, so the spec's relative paths still hold."""
    from node.sim.layout import to_toml

    assert source.parent == target.parent, "a spec's paths are relative to its directory"
    spec = tomllib.loads(source.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if isinstance(value, dict):
            spec.setdefault(key, {}).update(value)
        else:
            spec[key] = value
    target.write_text(to_toml(spec), encoding="utf-8")
    return target


def commands(checkpoint: Path, work: Path, weight_bytes: int) -> tuple[dict[str, Any], Path, Path]:
    """Each operator command measured; the report, the network's spec and the trained miner blob."""
    from node.sim.layout import sim_identity
    from protocol.identity import save_identity

    network = work / "network"
    (network / "keys").mkdir(parents=True)
    validator, miner = sim_identity(SEED, "validator", 0), sim_identity(SEED, "miner", 0)
    save_identity(validator, network / "keys" / "validator-0.key")
    save_identity(miner, work / "miner-0.key")
    data = checkpoint / "data"
    (network / "data").mkdir()
    (network / "data" / "heldout.jsonl").write_bytes((data / "heldout.jsonl").read_bytes())
    spec = network / "spec.toml"
    runs: dict[str, Any] = {}
    runs["spec_new"] = measure("spec_new", [
        "spec", "new", "--checkpoint", str(checkpoint), "--train", str(data / "train.jsonl"),
        "--heldout", str(data / "heldout.jsonl"), "--validator", validator.node_id, "--top-d", "2",
        "--seq-len", str(SEQ_LEN), "--heldout-sequences", str(HELDOUT_SEQUENCES), "--max-sequences", "16",
        "--timing", "sim", "--set", f"training.inner_steps={INNER_STEPS}", "--set", f"training.batch_size={BATCH}",
        "--set", f"data.gate_sequences={HELDOUT_SEQUENCES}",
        "--out", str(spec)], work, weight_bytes)
    pgrad = derived_spec(spec, network / "spec-pgrad.toml", {"submission": {"format": "pgrad"}})
    heldout = str(network / "data" / "heldout.jsonl")
    runs["eval_base"] = measure("eval_base", ["eval", "--spec", str(spec), "--heldout", heldout], work, weight_bytes)
    blobs = {"experts": work / "miner.blob", "pgrad": work / "miner-pgrad.blob"}
    for fmt, spec_file in (("experts", spec), ("pgrad", pgrad)):
        runs[f"train_{fmt}"] = measure(f"train_{fmt}", [
            "train", "--spec", str(spec_file), "--key", str(work / "miner-0.key"), "--round", "0",
            "--steps", str(INNER_STEPS), "--forward", "compressed", "--out", str(blobs[fmt])], work, weight_bytes)
    runs["inspect"] = measure("inspect", ["inspect", "blob", str(blobs["experts"]), "--spec", str(spec)], work,
                              weight_bytes)
    runs["eval_blob"] = measure("eval_blob", ["eval", "--spec", str(spec), "--heldout", heldout, "--blob",
                                              str(blobs["experts"])], work, weight_bytes)
    runs["export"] = measure("export", ["export", "--spec", str(spec), "--blob", str(blobs["experts"]),
                                        "--out", str(work / "exported")], work, weight_bytes)
    report = {"commands": runs, "blob_bytes": {fmt: path.stat().st_size for fmt, path in blobs.items()}}
    return report, spec, blobs["experts"]


def network_round(spec: Path, work: Path, runs: dict[str, Any], miners: int) -> dict[str, Any]:
    """One round of a bootstrap, a validator and `miners` compressed miners on `spec`, windows from `runs`."""
    from datetime import UTC, datetime, timedelta

    from node.sim.layout import SimNetwork, sim_identity, to_toml
    from node.sim.process import SimSettings, SimulationError
    from node.sim.run import Simulation
    from node.sim.warm import warm_up
    from protocol.spec import load_spec

    load_s = max(runs["eval_base"]["seconds"], runs["train_experts"]["seconds"])
    trained = runs["train_experts"]["printed"]
    train_s = trained["tokens"] / trained["tokens_per_s"]
    forward_s = runs["eval_base"]["printed"]["seconds"]
    blob = runs["train_experts"]["printed"]["bytes"]
    # Nodes hash and load side by side on shared cores; transfers are taken at 10 MB/s or better. A miner loads
    # its model in its first TRAIN (the train command's whole time) and trains beside the validator loading its
    # own. MERGE's gate reads three candidates on as many rows as a submission's score (data.gate_sequences),
    # each thrice slack. The start adds the loads to a simulation's start delay (its nodes' fork server has
    # imported the node before the clock starts: warm_up); the floors are a simulation's windows (`spec new
    # --timing sim` after TRAIN); at real size the measured terms decide.
    timing = {"train_s": round(max(15.0, runs["train_experts"]["seconds"] + 3 * train_s), 1), "commit_s": 4.0,
              "reveal_s": round(8 + miners * blob / 10e6, 1), "evaluate_s": round(8 + 3 * (1 + miners) * forward_s, 1),
              "merge_s": round(6 + 4 * blob / 10e6 + 3 * 3 * forward_s, 1), "clock_skew_s": 2.0}
    settings = SimSettings(validators=1, miners=miners, seed=SEED, train_share=0.5,
                           round_seconds=sum(v for k, v in timing.items() if k != "clock_skew_s"))
    warm_up()
    start_s = load_s * (1 + miners) / 2 + settings.delay_s()
    genesis = (datetime.now(UTC) + timedelta(seconds=start_s)).replace(microsecond=0)
    round_spec = derived_spec(spec, spec.parent / "spec-round.toml", {"timing": timing, "genesis": genesis})
    loaded = load_spec(round_spec)
    sim = Simulation(work / "sim", settings)
    (work / "sim").mkdir()
    sim.use_network(SimNetwork(spec.parent, round_spec, loaded.network_id, [sim_identity(SEED, "validator", 0).node_id],
                               [spec.parent / "keys" / "validator-0.key"], dict(loaded.group)))
    for node in (n for n in sim.nodes.values() if n.role == "miner"):
        config = tomllib.loads((node.directory / "config.toml").read_text(encoding="utf-8"))
        config["miner"] = {"forward": "compressed"}
        (node.directory / "config.toml").write_text(to_toml(config), encoding="utf-8")
    peaks: dict[str, int] = {}
    try:
        sim.start()
        try:
            reports = sim.wait_round(0, on_poll=lambda: peaks.update(_peaks(sim)))
        except SimulationError as exc:  # a node died (at real size: the kernel's OOM killer): its figures stand
            return {"timing": timing, "start_delay_s": round(start_s, 1), "failed": str(exc),
                    "one_state_everywhere": False, "peak_rss_bytes": peaks}
        heads = {name: (sim.get(name, "/status") or {}).get("head") for name in sim.nodes if name != "bootstrap"}
        deadline = time.monotonic() + timing["merge_s"] + 60
        while len(set(heads.values())) != 1 and time.monotonic() < deadline:
            time.sleep(2)
            heads = {name: (sim.get(name, "/status") or {}).get("head") for name in sim.nodes if name != "bootstrap"}
        peaks.update(_peaks(sim))
        entry = sim.round_entry(0, reports)
    finally:
        sim.close()
    phases = entry["phase_seconds"]
    return {"timing": timing, "start_delay_s": round(start_s, 1), "round": entry, "heads": heads,
            "one_state_everywhere": len(set(heads.values())) == 1 and None not in heads.values(),
            "gate": next(iter(reports.values()), {}).get("gate"),
            "score_seconds_per_submission": round(phases.get("evaluate", 0.0) / miners, 2),
            "reveal_seconds": phases.get("reveal"), "peak_rss_bytes": peaks}


def _peaks(sim: Any) -> dict[str, int]:
    """Each running node's peak RSS so far (VmHWM)."""
    out: dict[str, int] = {}
    for name, node in sim.nodes.items():
        if node.proc is None or not node.alive:
            continue
        try:
            status = Path(f"/proc/{node.proc.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                out[name] = int(line.split()[1]) * 1024
    return out


def node_budgets(peaks: dict[str, int], weight_bytes: int) -> dict[str, dict[str, Any]]:
    """Each validator's and miner's peak RSS as a multiple of the checkpoint, against its role's budget."""
    out: dict[str, dict[str, Any]] = {}
    for name, peak in sorted(peaks.items()):
        role = name.split("-")[0]
        if role in NODE_BUDGETS:
            ratio = round(peak / weight_bytes, 4)
            out[name] = {"ratio": ratio, "budget": NODE_BUDGETS[role], "within": ratio <= NODE_BUDGETS[role]}
    return out


def miners_that_fit(runs: dict[str, Any], wanted: int) -> int:
    """How many of `wanted` compressed miners fit beside the validator in the memory available now (1 at least):
    the validator takes what `eval` of a blob peaked at, each miner what `train` did, and 1 GiB is left over."""
    meminfo = Path("/proc/meminfo").read_text(encoding="utf-8")
    available = int(next(line for line in meminfo.splitlines() if line.startswith("MemAvailable:")).split()[1]) * 1024
    room = available - int(runs["eval_blob"]["peak_rss_bytes"]) - (1 << 30)
    return max(1, min(wanted, room // int(runs["train_experts"]["peak_rss_bytes"])))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.network_from is not None:
        earlier: dict[str, Any] = json.loads(args.network_from.read_text(encoding="utf-8"))
        miners = miners_that_fit(earlier["commands"], args.miners)
        earlier["network"] = network_round(args.work / "network" / "spec.toml", args.work, earlier["commands"], miners)
        earlier["network"]["nodes_within_budget"] = node_budgets(earlier["network"]["peak_rss_bytes"],
                                                                 earlier["weight_bytes"])
        emit(earlier, args.out)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="tessera-real-size-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from bench.real_size_fixture import write_fixture

        checkpoint = work / "checkpoint"
        write_fixture(checkpoint, args.layers, args.hidden_size)
    checkpoint = checkpoint.resolve()
    from training.checkpoint import stored_tensors

    weight_bytes = sum(s.nbytes for s in stored_tensors(checkpoint).values())
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    report: dict[str, Any] = {"checkpoint": str(checkpoint), "weight_bytes": weight_bytes,
                              "layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
                              "experts": config["num_experts"], "top_d": 2, "seq_len": SEQ_LEN,
                              "inner_steps": INNER_STEPS, "cpus": os.cpu_count()}
    measured, spec, _ = commands(checkpoint, work, weight_bytes)
    report.update(measured)
    report["all_within_budget"] = all(run["within"] for run in measured["commands"].values())
    emit(report, args.out)  # the commands' figures stand even if the network round fails
    if not args.no_network:
        miners = miners_that_fit(measured["commands"], args.miners)
        report["network"] = network_round(spec, work, measured["commands"], miners)
        report["network"]["nodes_within_budget"] = node_budgets(report["network"]["peak_rss_bytes"], weight_bytes)
        emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
