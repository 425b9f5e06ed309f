"""Simulation learning benchmark: does a real process simulation lower the held-out loss by more than noise?

It runs `tessera simulate`'s network for R rounds (bench/network.py, which keeps each round's ADOPTED
global state, the hash the validators report for the round), or reads an earlier run's (`--reuse`).
Afterwards, with the validators' model and adapter (`training.model.load_base`
on the simulation's spec), it scores the base (the state round 0 starts from) and every adopted
state on every sequence of the simulation's WHOLE held-out file, and reports per round the
whole-held-out loss and its drop from the previous adopted state.

Noise. Validators score a state on a subset of the held-out file (`data.heldout_sequences` rows
chosen by the round seed, `training.data.heldout_subset`), so their reported loss moves from round
to round even when the state does not, because each round draws another subset. With per-sequence
token losses of every state, the loss of any subset is exact and cheap, so the benchmark draws N
subsets the validators' way (heldout_subset with N fixed seeds) and reports for each state:
`subset_std`, the std of its loss across subsets; and `round_to_round_std`, the std of the
difference between its losses on two independently drawn subsets (subset i against subset N/2+i),
which is what the same state's reported loss moves by between round r and round r+1 (about
sqrt(2) x subset_std). A round beats the noise when its whole-held-out drop exceeds 2 x the larger
round_to_round_std of the two states compared (`beats_noise`); the looser reading, drop > 2 x
subset_std, is `beats_2_subset_std`. Per round it also reports the paired drop
loss(previous, S) - loss(adopted, S) over the same subsets (mean, std, min), the validators' own
base_loss/global_loss next to this benchmark's recomputation on the round's actual subset (from the
stored round seed; they match, which shows the per-sequence losses are the validators' numbers),
and, in `noise_by_subset_size`, which rounds would beat the noise at other subset sizes.
This script knows nothing about how the nodes train, score or merge; it reads what they stored.
Usage: python bench/simulation.py [--rounds 6] [--dir DIR] [--subsets 200] [--out FILE.json]
       [--inner-steps H] [--format pgrad] [--set SECTION.FIELD=VALUE ...]
       [--adversaries KIND,...]
       python bench/simulation.py --reuse DIR [--out FILE.json]   (evaluate the network an earlier run left)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import network  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from node.cli.common import comma_list, spec_setting  # noqa: E402
from node.sim import defaults  # noqa: E402
from node.sim.process import SimSettings  # noqa: E402
from node.store.db import Storage  # noqa: E402
from protocol.spec import load_spec  # noqa: E402
from training.data import heldout_subset, load_sequences, not_padding  # noqa: E402
from training.evaluate import heldout_loss, token_loss_sum  # noqa: E402
from training.experts import extract, insert  # noqa: E402
from training.model import load_base  # noqa: E402
from training.state import decode_state_blob  # noqa: E402
from training.tokenizer import load_tokenizer  # noqa: E402

NOISE_SIGMAS = 2.0


# -- statistics (pure) --------------------------------------------------------------------------


def noise_seeds(n: int) -> list[str]:
    """`n` fixed 64-hex seeds, the shape of a round seed."""
    return [hashlib.sha256(f"tessera-bench-noise:{i}".encode()).hexdigest() for i in range(n)]


def subset_rows(total: int, size: int, seeds: list[str]) -> torch.Tensor:
    """[len(seeds), size] row indices: the held-out subset each seed picks, exactly as validators pick it."""
    index_N1 = torch.arange(total).unsqueeze(1)
    return torch.stack([heldout_subset(index_N1, seed, size).squeeze(1) for seed in seeds])


def subset_losses(sums_N: torch.Tensor, tokens_N: torch.Tensor, rows_SK: torch.Tensor) -> torch.Tensor:
    """[S] mean token loss of each subset: its summed token losses over its token count (float64)."""
    return sums_N.double()[rows_SK].sum(1) / tokens_N.double()[rows_SK].sum(1)


def state_noise(losses_S: torch.Tensor) -> dict[str, float]:
    """A state's subset noise: std across subsets, and std of the difference of two independent subsets.

    The subsets are paired first half against second half; each pair is two independent draws.
    """
    if losses_S.numel() < 4:
        raise ValueError(f"need at least 4 subsets to measure noise, got {losses_S.numel()}")
    half = losses_S.numel() // 2
    return {"subset_mean": float(losses_S.mean()), "subset_std": float(losses_S.std()),
            "round_to_round_std": float((losses_S[:half] - losses_S[half:2 * half]).std())}


def round_verdict(whole_prev: float, whole_now: float, noise_prev: dict[str, float],
                  noise_now: dict[str, float], paired_drop_S: torch.Tensor) -> dict[str, Any]:
    """One round's comparison of its whole-held-out drop with the subset noise of the two states."""
    drop = whole_prev - whole_now
    rr = max(noise_prev["round_to_round_std"], noise_now["round_to_round_std"])
    sd = max(noise_prev["subset_std"], noise_now["subset_std"])
    return {"drop": drop, "round_to_round_std": rr, "noise_2sigma": NOISE_SIGMAS * rr,
            "beats_noise": drop > NOISE_SIGMAS * rr, "subset_std": sd,
            "beats_2_subset_std": drop > NOISE_SIGMAS * sd,
            "paired_drop_mean": float(paired_drop_S.mean()), "paired_drop_std": float(paired_drop_S.std()),
            "paired_drop_min": float(paired_drop_S.min())}


# -- the run -----------------------------------------------------------------------------------


def round_seeds(directory: Path, rounds: int) -> dict[int, str]:
    """Each round's seed from validator-0's stored round plans."""
    async def read() -> dict[int, str]:
        storage = await Storage.open(directory / "nodes" / "validator-0" / "data" / "node.db")
        try:
            plans = {r: await storage.round_plan(r) for r in range(rounds)}
        finally:
            await storage.close()
        return {r: p.seed for r, p in plans.items() if p is not None}

    return asyncio.run(read())


# -- evaluation ---------------------------------------------------------------------------------


@torch.no_grad()
def sequence_losses(model: torch.nn.Module, sequences_NL: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: summed next-token loss (float64) and scored-token count, by `training.evaluate`'s own sum."""
    model.eval()
    sums = [float(token_loss_sum(model, ids_1L, pad_id)) for ids_1L in torch.split(sequences_NL, 1)]
    counts = not_padding(sequences_NL, pad_id)[:, 1:].sum(1)
    return torch.tensor(sums, dtype=torch.float64), counts


def evaluate_states(directory: Path, hashes: list[str], states: Path) -> dict[str, Any]:
    """Per-sequence losses of the base and of each state in `hashes` on the whole held-out file."""
    spec_path = directory / "network" / "spec.toml"
    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path)
    tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
    heldout = load_sequences([spec_path.parent / "data" / "heldout.jsonl"], tokenizer, spec.data.seq_len)
    base = extract(model, adapter, spec.group)
    shapes = {name: tuple(t.shape) for name, t in base.items()}
    per_state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    whole_check = 0.0
    for h in [spec.model.base_hash, *hashes]:
        if h in per_state:
            continue
        tensors = base if h == spec.model.base_hash else decode_state_blob((states / h).read_bytes(), spec, shapes)[1]
        insert(model, adapter, tensors)
        per_state[h] = sequence_losses(model, heldout, tokenizer.pad_id)
        reference = heldout_loss(model, heldout, pad_id=tokenizer.pad_id).loss
        whole_check = max(whole_check, abs(float(per_state[h][0].sum() / per_state[h][1].sum()) - reference))
    return {"spec": spec, "heldout_rows": heldout.shape[0], "per_state": per_state,
            "whole_check_abs_diff": whole_check}


# -- the report ---------------------------------------------------------------------------------


def whole_loss(sums_N: torch.Tensor, tokens_N: torch.Tensor) -> float:
    """Mean token loss over every sequence."""
    return float(sums_N.sum() / tokens_N.sum())


def build_report(entries: list[dict[str, Any]], evaluated: dict[str, Any], seeds: dict[int, str],
                 n_subsets: int) -> dict[str, Any]:
    """The per-round table, judged against the noise of the spec's subset size, and the size sweep."""
    spec = evaluated["spec"]
    per_state: dict[str, tuple[torch.Tensor, torch.Tensor]] = evaluated["per_state"]
    total, size = evaluated["heldout_rows"], spec.data.heldout_sequences
    rows_SK = subset_rows(total, size, noise_seeds(n_subsets))
    whole = {h: whole_loss(*losses) for h, losses in per_state.items()}
    subset = {h: subset_losses(*per_state[h], rows_SK) for h in per_state}
    noise = {h: state_noise(losses) for h, losses in subset.items()}
    chain = [spec.model.base_hash, *(adopted_hash(e) for e in entries)]
    rounds = []
    for entry, previous, adopted in zip(entries, chain, chain[1:], strict=False):
        verdict = round_verdict(whole[previous], whole[adopted], noise[previous], noise[adopted],
                                subset[previous] - subset[adopted])
        seed = seeds.get(entry["round"])
        rounds.append({
            "round": entry["round"], "adopted_hash": adopted,
            "validators_agree": len({v["global_hash"] for v in entry["validators"] if v["global_hash"]}) == 1,
            "previous_hash": previous, "whole_heldout_loss": round(whole[adopted], 5),
            **{k: round(v, 5) if isinstance(v, float) else v for k, v in verdict.items()},
            "adopted_noise": {k: round(v, 5) for k, v in noise[adopted].items()},
            "validators_report": {"base_loss": entry["base_loss"], "global_loss": entry["global_loss"]},
            "recomputed_on_round_subset": None if seed is None else {
                "base_loss": round(float(subset_losses(*per_state[previous], subset_rows(total, size, [seed]))[0]), 5),
                "global_loss": round(float(subset_losses(*per_state[adopted], subset_rows(total, size, [seed]))[0]), 5)},
            "miners_accepted": sum(m["verdict"] == "accept" for m in entry["miners"]),
            "miners_with_utility": sum(m["rank"] is not None for m in entry["miners"]),
            "adversaries": [{k: m[k] for k in ("kind", "verdict", "rank", "reason")}
                            for m in entry["miners"] if m["kind"] != "honest"],
        })
    return {
        "base_whole_heldout_loss": round(whole[spec.model.base_hash], 5),
        "base_noise": {k: round(v, 5) for k, v in noise[spec.model.base_hash].items()},
        "rounds": rounds,
        "lowered_every_round_above_noise": bool(rounds) and all(r["beats_noise"] for r in rounds),
        "lowered_every_round_above_2_subset_std": bool(rounds) and all(r["beats_2_subset_std"] for r in rounds),
        "heldout": {"rows": total, "subset_rows": size, "subsets_drawn": n_subsets,
                    "per_sequence_vs_evaluate_abs_diff": evaluated["whole_check_abs_diff"]},
        "noise_by_subset_size": size_sweep(per_state, whole, chain, total, noise_seeds(n_subsets)),
    }


def size_sweep(per_state: dict[str, tuple[torch.Tensor, torch.Tensor]], whole: dict[str, float],
               chain: list[str], total: int, seeds: list[str]) -> dict[str, dict[str, Any]]:
    """At other subset sizes: the largest round-to-round std of an adopted state (the base's is larger, its loss
    being far higher), and which rounds' drops beat 2x the larger std of their two states."""
    out: dict[str, dict[str, Any]] = {}
    for n in (16, 32, 64, 128, 256):
        if n > total:
            continue
        rows_SK = subset_rows(total, n, seeds)
        rr = {h: state_noise(subset_losses(*per_state[h], rows_SK))["round_to_round_std"] for h in set(chain)}
        beating = [r for r, (prev, now) in enumerate(zip(chain, chain[1:], strict=False))
                   if whole[prev] - whole[now] > NOISE_SIGMAS * max(rr[prev], rr[now])]
        out[str(n)] = {"adopted_max_round_to_round_std": round(max(rr[h] for h in chain[1:]), 5),
                       "rounds_beating_noise": beating}
    return out


def adopted_hash(entry: dict[str, Any]) -> str:
    """The state a round ended on, as its validators report it (the smallest hash if they disagree)."""
    adopted: str = min(v["global_hash"] for v in entry["validators"] if v["global_hash"])
    return adopted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds to run (default 6)")
    parser.add_argument("--validators", type=int, default=2, help="validator processes (default 2)")
    parser.add_argument("--miners", type=int, default=4, help="miner processes (default 4)")
    parser.add_argument("--round-seconds", type=float, default=defaults.ROUND_SECONDS,
                        help="round length (default %(default)g, as simulate)")
    parser.add_argument("--train-share", type=float, default=defaults.TRAIN_SHARE,
                        help="TRAIN's share of the round (default %(default)g, as simulate)")
    parser.add_argument("--inner-steps", type=int, default=defaults.INNER_STEPS,
                        help="miners' inner steps per round (default %(default)s, as simulate)")
    parser.add_argument("--subsets", type=int, default=200, help="held-out subsets drawn to measure noise (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of model, data and keys (default 0)")
    parser.add_argument("--format", choices=("experts", "pgrad"), default="experts",
                        help="what miners submit, as simulate's --format (default experts)")
    parser.add_argument("--set", action="append", default=[], type=spec_setting, metavar="SECTION.FIELD=VALUE",
                        dest="spec_settings", help="a spec value, as simulate's --set (repeatable)")
    parser.add_argument("--adversaries", type=comma_list, default=(), metavar="KIND,...",
                        help="make that many of the miners adversaries, as simulate's --adversaries")
    parser.add_argument("--dir", type=Path, help="simulation directory, must not exist (default: a new temporary one)")
    parser.add_argument("--reuse", type=Path, metavar="DIR",
                        help="skip the simulation: read the --dir of an earlier run of a network benchmark "
                             "(bench/network.py; the options that shape the network are then its own)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.subsets < 4:
        parser.error(f"--rounds must be >= 1 and --subsets >= 4, got {args.rounds} and {args.subsets}")
    if args.dir is not None and args.dir.exists():
        parser.error(f"--dir {args.dir} exists; give a new directory")
    torch.set_num_threads(1)
    if args.reuse is not None:
        try:
            recorded = network.load(args.reuse.resolve())
        except ValueError as exc:
            parser.error(f"--reuse {exc}")
    else:
        try:  # before any directory is made
            settings = SimSettings(validators=args.validators, miners=args.miners, adversaries=args.adversaries,
                                   round_seconds=args.round_seconds,
                                   train_share=args.train_share, inner_steps=args.inner_steps, seed=args.seed,
                                   submission_format=args.format, spec_settings=tuple(args.spec_settings))
        except ValueError as exc:
            parser.error(str(exc))
        recorded = network.run((args.dir or Path(tempfile.mkdtemp(prefix="tessera-simlearn-"))).resolve(),
                               settings, args.rounds)
    entries = recorded.rounds
    if not entries:
        print(f"bench/simulation.py: no round completed: {recorded.failure}", file=sys.stderr)
        return 1
    evaluating = time.perf_counter()
    evaluated = evaluate_states(recorded.directory, [adopted_hash(e) for e in entries], recorded.states)
    report = build_report(entries, evaluated, round_seeds(recorded.directory, len(entries)), args.subsets)
    spec = evaluated["spec"]
    report["settings"] = {**recorded.settings, "training": spec.training.model_dump(),
                          "aggregation": spec.aggregation.model_dump(), "submission": spec.submission.model_dump(),
                          "rewards": spec.rewards.model_dump()}
    report["failure"] = recorded.failure
    report["seconds"] = {"simulation": recorded.seconds, "evaluation": round(time.perf_counter() - evaluating, 1)}
    emit(report, args.out)
    if args.dir is None and args.reuse is None:
        shutil.rmtree(recorded.directory, ignore_errors=True)
    return 1 if recorded.failure else 0


if __name__ == "__main__":
    raise SystemExit(main())
