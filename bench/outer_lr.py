"""Outer lrs that adapt (per entry, by agreement; per round, by the updates merged), beta1, and overlapping rounds.

The learning benchmark (bench/learning.py) found that miners merged after every step at an outer lr
equal to their number (`h1_keep_optimizer_lrM`) meet both headline targets on records and facts but
forget more than ESFT and do not fall in every round with half the miners adversarial, and that at
H = 5 or more the same outer lr overshoots. This benchmark measures two outer lrs that adapt, against
the fixed ones of the learning benchmark, in the same run:

- per entry (`bench.learning_runs.Agreement`): every entry of the expert group has its own outer lr,
  which grows while the merged update keeps its sign from round to round (the miners keep agreeing on a
  direction they have not settled) and shrinks where the sign flips (Rprop's rule applied to rounds):
  at H = 5, 10 and 20, against the learning benchmark's short rounds (`h5_keep_optimizer_lr2_4`: H = 5,
  kept AdamW state, outer lr 2);
- per round (`Arm.lr_per_update`): merged after every step, the outer lr is the number of updates merged
  that round, so each merged miner step moves the state one step, however many pass the gate (at a
  fixed outer lr M, a round where one update passes moves it M of that miner's steps); on 4 miners,
  8, and 4 with half adversarial, against `h1_keep_optimizer_lrM`; and again with Proof-of-Loss on 128
  held-out sequences a round instead of 32 (`Arm.subset`, the spec's `data.heldout_sequences`), which
  lets through more of the one-step updates whose gain is near the subset's noise;
- the every-step family with the miners' AdamW beta1 at 0.9^M (`MOMENT`): each miner step moves the
  state M steps, so AdamW's default horizon of about ten steps, counted in the miner's steps, spans
  about 10·M of the state's; 0.9^M puts it back to ten of the state's. Each of these arms is read
  again on ESFT at the same beta1, so that a baseline that would gain from it too is not left behind.
- rounds that overlap (`OVERLAP`, `Arm.delay`): the miners of round r train from the state of round
  r - 1, as they would if each TRAIN ran while the previous round's windows did, and their updates are
  merged into the current state; on the every-step families, whose rounds are mostly windows, and at
  half the outer lr (asynchronous SGD's rule: a step one round stale at lr / (1 + delay));
- the per-round outer lr with the miners' beta1 at 0.9^M for M miners (`PER_UPDATE_MOMENT`): whether the
  two, each of which brought forgetting nearer to ESFT's, do so together, and what beta1 does to the
  rounds that fall with half the miners adversarial when the outer lr follows the updates merged; and the
  same gated on 128 held-out sequences a round (`SUBSET`);
- a copier on its own (`LAST_ROUND_COPIER`, `Arm.copier`): under commit-reveal a copier sees another
  miner's blob only after commits close, so the most it can send is that miner's previous update on the
  current state; the `_adversarial_4` arms' copier sends the same round's, which needs the victim's help;
- the same family reporting the average of its merged states (`AVERAGE`, `Arm.average` 0.9), the miners
  training from the merged state as before; read also against ESFT averaged the same way every 4 steps.
  Its 8 miners also run with the 4-miner network's own spec (`SAME_SPEC`: beta1 0.9^4, not 0.9^8): more
  miners joining one network, rather than a network specified for 8. Each of these arms runs again with the
  miners rewinding their AdamW state after a round that merges nothing (`REWIND`, `Arm.rewind`), and with
  them also halving their inner lr after each such round (`BACKTRACK`, `Arm.backtrack`).

Every (setting, seed) also reads ESFT after every one of the 4-miner network's steps and counts the
stretches of 1 and of 4 steps that end lower (`esft_lowered`): how often one node's own loss falls over
what a one-step round of 4 miners spends, the yardstick for a network that should fall every round.

Each of the learning benchmark's five settings (three domains from the general base, two skills from the
base that read their forms) runs under seeds 0, 1 and 2: ESFT for the 8-miner network's tokens and every
arm, all with the same miner steps, shards, batches and round seeds, each read on its own seed's ESFT
curve as the learning benchmark reads its arms (`summarise`). The (setting, seed) runs are independent
and run `--jobs` at a time.

Usage: python bench/outer_lr.py [--arms NAME,...] [--setting NAME]... [--seeds 0,1,2] [--jobs N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learning import EVERY_STEP, SHORT, family  # noqa: E402
from bench.learning_runs import Agreement, Arm, Bench, Settings, changed_settings, summarise  # noqa: E402
from bench.report import emit, out_file  # noqa: E402

SETTINGS = {
    "arithmetic": ("arithmetic", None),
    "records": ("records", None),
    "facts": ("facts", None),
    "arithmetic, form base": ("arithmetic", True),
    "records, form base": ("records", True),
}
"""The learning benchmark's five settings: (domain, `Settings.knows_form`)."""

PER_UPDATE = "h1_keep_optimizer_lr_per_update"
"""Merged after every step at an outer lr equal to the number of updates merged in the round."""

MOMENT = f"{EVERY_STEP}_beta1M"
"""`EVERY_STEP` with the miners' AdamW beta1 at 0.9^M for outer lr M: each miner step moves the state M steps,
and 0.9^M keeps the first moment's horizon at AdamW's default counted in the state's steps."""

PER_UPDATE_MOMENT = f"{PER_UPDATE}_beta1M"
"""`PER_UPDATE` with the miners' AdamW beta1 at 0.9^M for M miners: the outer lr reaches M when every update
passes the gate, and a miner cannot know how many will (adversaries count: the spec sets beta1, not who turns up)."""

SUBSET = "_subset128"
"""Suffix of an arm gated by Proof-of-Loss on 128 held-out sequences a round instead of 32 (`Arm.subset`, the
spec's `data.heldout_sequences`)."""

LAST_ROUND_COPIER = "_adversarial_last_round_4"
"""Suffix of a half-adversarial arm whose copier sends honest miner 0's update of the previous round on the
current state under its own name (`Arm.copier` "last_round"): under commit-reveal that is the most a copier
working alone can send; the `_adversarial_4` arms copy the same round's update, which takes the victim's help."""

AVERAGE = "_average0.9"
"""Suffix of an arm that reports the average of its merged states at decay 0.9 (`Arm.average`) instead of the
merged state: what a network whose spec sets `aggregation.average_decay = 0.9` adopts and exports."""

SAME_SPEC = "_8_beta1_of_4"
"""Suffix of an 8-miner arm that keeps the 4-miner arm's beta1 (0.9^4): the same network spec with twice the miners,
where the `_8` arms set beta1 to 0.9^8 for the 8 miners they were specified for."""

REWIND = "_rewind"
"""Inserted after `AVERAGE` in an arm whose miners rewind their AdamW state after a round that merges nothing
(`Arm.rewind`, what `[miner] rewind_optimizer` does in the node)."""

BACKTRACK = "_backtrack"
"""Inserted after `REWIND` in an arm whose rewound miners also halve their inner lr after each round that merges
nothing, back to the spec's once one merges (`Arm.backtrack`, what `[miner] backtrack_lr` does in the node)."""

OVERLAP = "_delay1"
"""Suffix of an arm whose miners train from the state one round older than the one their update is merged into
(`Arm.delay`): what rounds that overlap, TRAIN of round r running while round r - 1's windows do, cost in
learning."""

_short = Arm(inner_steps=5, keep_optimizer=True, outer_lr=2.0)
_every = family(EVERY_STEP, Arm(inner_steps=1, keep_optimizer=True), outer_lr_is_miners=True)
_per_update = family(PER_UPDATE, Arm(inner_steps=1, keep_optimizer=True, lr_per_update=True))
_per_update_moment = {name.replace(PER_UPDATE, PER_UPDATE_MOMENT): replace(arm, beta1=round(0.9**arm.miners, 6))
                      for name, arm in _per_update.items()}
_per_update_moment_subset = {name.replace(PER_UPDATE_MOMENT, PER_UPDATE_MOMENT + SUBSET): replace(arm, subset=128)
                             for name, arm in _per_update_moment.items()}
ARMS = {
    f"{SHORT}_4": _short,
    **{f"h{h}_agreement_4": replace(_short, inner_steps=h, outer_lr=1.0, agreement=Agreement()) for h in (5, 10, 20)},
    **_every,
    **{name.replace(EVERY_STEP, MOMENT): replace(arm, beta1=round(0.9**arm.outer_lr, 6)) for name, arm in _every.items()},
    **_per_update,
    **_per_update_moment,
    **{name.replace(EVERY_STEP, EVERY_STEP + OVERLAP): replace(arm, delay=1) for name, arm in _every.items()},
    **{name.replace(PER_UPDATE_MOMENT, PER_UPDATE_MOMENT + OVERLAP): replace(arm, delay=1)
       for name, arm in _per_update_moment.items()},
    f"{PER_UPDATE_MOMENT}{OVERLAP}_half_lr_4": replace(_per_update_moment[f"{PER_UPDATE_MOMENT}_4"], delay=1,
                                                       outer_lr=0.5),
    **family(f"{PER_UPDATE}{SUBSET}", Arm(inner_steps=1, keep_optimizer=True, lr_per_update=True, subset=128)),
    **_per_update_moment_subset,
    **{name.replace("_adversarial_4", LAST_ROUND_COPIER): replace(arm, copier="last_round")
       for name, arm in {**_per_update_moment, **_per_update_moment_subset}.items() if name.endswith("_adversarial_4")},
    **{name.replace(SUBSET, SUBSET + AVERAGE): replace(arm, average=0.9) for name, arm in _per_update_moment_subset.items()},
    f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}{LAST_ROUND_COPIER}":
        replace(_per_update_moment_subset[f"{PER_UPDATE_MOMENT}{SUBSET}_adversarial_4"], copier="last_round", average=0.9),
    f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}{SAME_SPEC}":
        replace(_per_update_moment_subset[f"{PER_UPDATE_MOMENT}{SUBSET}_8"], average=0.9,
                beta1=_per_update_moment_subset[f"{PER_UPDATE_MOMENT}{SUBSET}_4"].beta1),
}
ARMS.update({name.replace(AVERAGE, AVERAGE + REWIND): replace(arm, rewind=True)
             for name, arm in list(ARMS.items()) if AVERAGE in name})
ARMS.update({name.replace(REWIND, REWIND + BACKTRACK): replace(arm, backtrack=True)
             for name, arm in list(ARMS.items()) if REWIND in name})
COMPARED = {"agreement": (f"{SHORT}_4", ("h5_agreement_4", "h10_agreement_4", "h20_agreement_4")),
            "per update": (f"{EVERY_STEP}_4", (f"{PER_UPDATE}_4", f"{PER_UPDATE}_subset128_4")),
            "beta1 per merged step": (f"{EVERY_STEP}_4", (f"{MOMENT}_4",)),
            "beta1 with the outer lr per update": (f"{PER_UPDATE}_4", (f"{PER_UPDATE_MOMENT}_4",)),
            "overlapping rounds": (f"{PER_UPDATE_MOMENT}_4", (f"{PER_UPDATE_MOMENT}{OVERLAP}_4",)),
            "gated on 128 sequences": (f"{PER_UPDATE_MOMENT}_4", (f"{PER_UPDATE_MOMENT}{SUBSET}_4",)),
            "a copier on its own": (f"{PER_UPDATE_MOMENT}_adversarial_4", (f"{PER_UPDATE_MOMENT}{LAST_ROUND_COPIER}",
                                                                          f"{PER_UPDATE_MOMENT}{SUBSET}{LAST_ROUND_COPIER}")),
            "the average of merged states": (f"{PER_UPDATE_MOMENT}{SUBSET}_4", (f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}_4",)),
            "rewinding after a level round": (f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}_4",
                                              (f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}{REWIND}_4",)),
            "backtracking the inner lr after a level round": (
                f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}{REWIND}_4", (f"{PER_UPDATE_MOMENT}{SUBSET}{AVERAGE}{REWIND}{BACKTRACK}_4",))}
"""Each adaptive rule's arms and the fixed-lr arm they are set against."""
READ = ("parallel_efficiency", "network_vs_esft", "forgetting", "esft_forgetting_equal_tokens", "rounds_lowered",
        "parallel_efficiency_monotone", "losses")


def run_one(setting: str, seed: int, cache: Path, names: list[str]) -> dict[str, Any]:
    """The arms `names` in one setting under one seed, each read on that seed's ESFT curve; an arm with its own
    beta1 is read again on ESFT at that beta1 (whether the baseline gains from it too)."""
    domain, knows_form = SETTINGS[setting]
    started = time.perf_counter()
    torch.set_num_threads(1)  # a tiny model on a shared CPU runs faster without intra-op threads
    bench = Bench(Settings(domain=domain, knows_form=knows_form, seed=seed), cache)
    per_miner = bench.s.inner_steps * bench.s.rounds
    curve, forgetting = bench.esft_curve(8 * per_miner, bench.s.inner_steps, {m * per_miner for m in (2, 4, 8)})
    at_beta1 = {}
    for beta1 in sorted({beta1 for name in names if (beta1 := ARMS[name].beta1) is not None}):
        with changed_settings(bench, beta1=beta1):
            at_beta1[beta1] = bench.esft_curve(4 * per_miner, bench.s.inner_steps, {m * per_miner for m in (2, 4)})
    fine, _ = bench.esft_curve(4 * per_miner, 1, set())
    averaged = {}  # ESFT read on the average of its own states, for each decay an arm reports
    for decay in sorted({ARMS[name].average for name in names} - {0.0}):
        loss, general = bench.esft_averaged(4 * per_miner, 4, decay)
        averaged[f"esft averaged at decay {decay:g} every 4 steps, 4 miners' tokens"] = {
            "loss": round(loss, 4), "forgetting": round(general, 4)}
    runs = {}
    for name in names:
        run = bench.network(ARMS[name])
        summarise(bench, run, curve, forgetting)
        runs[name] = {**{key: run[key] for key in READ}, "merged_per_round": [len(ids) for ids in run["merged"]]}
        beta1 = ARMS[name].beta1
        if beta1 is not None and ARMS[name].miners <= 4:  # ESFT at beta1 runs for 4 miners' tokens
            summarise(bench, run, *at_beta1[beta1])
            runs[name]["read on ESFT at the same beta1"] = {key: run[key] for key in READ[:4]}
    print(f"{setting}, seed {seed} ({time.perf_counter() - started:.0f} s): "
          + ", ".join(f"{n} {r['parallel_efficiency']}" for n, r in runs.items()), file=sys.stderr, flush=True)
    return {"base_loss": round(bench.base_loss, 4), "esft_loss_4_miner_tokens": round(dict(curve)[4 * per_miner], 4),
            **{f"esft_loss_4_miner_tokens at beta1 {beta1:g}": round(dict(c)[4 * per_miner], 4)
               for beta1, (c, _) in at_beta1.items()},
            "esft_lowered (4 miners' tokens, read after every step and every 4)":
                {f"every {every}": esft_lowered(fine, every) for every in (1, 4)},
            **averaged,
            "arms": runs}


def esft_lowered(curve: list[tuple[int, float]], every: int) -> str:
    """How many of ESFT's stretches of `every` steps along `curve` (read after every step) end lower than they
    start, at the 4 decimals the arms' losses are rounded to: a one-step round's yardstick for falling every
    round (with 4 miners merged every step, a round spends 4 miners' steps)."""
    points = [round(loss, 4) for step, loss in curve if step % every == 0]
    return f"{sum(b < a for a, b in zip(points, points[1:], strict=False))} of {len(points) - 1}"


def summary(by_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per arm, each number's [min, max] over the seeds, and over how many seeds each target holds."""
    out: dict[str, Any] = {}
    names = list(next(iter(by_seed.values()))["arms"])  # every seed's run holds the same arms
    for name in names:
        runs = [seed["arms"][name] for seed in by_seed.values()]
        out[name] = {key: [min(values), max(values)] for key in READ[:5]
                     if None not in (values := [run[key] for run in runs])}
        out[name]["seeds where it forgets no more than ESFT"] = sum(
            run["forgetting"] <= run["esft_forgetting_equal_tokens"] for run in runs)
        out[name]["seeds where it falls every round"] = sum(
            run["rounds_lowered"] == len(run["losses"]) for run in runs)
        if name.endswith("_8"):
            four = name.removesuffix("_8") + "_4"
            if four not in names:
                continue
            out[name]["seeds where it ends ahead of 4 miners"] = sum(
                seed["arms"][name]["losses"][-1] < seed["arms"][four]["losses"][-1] for seed in by_seed.values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--arms", help="comma-separated arm names to run (default: every arm)")
    parser.add_argument("--setting", action="append", dest="settings", metavar="NAME",
                        help=f"a setting to run, repeatable (default: every one of {'; '.join(SETTINGS)})")
    parser.add_argument("--jobs", type=int, default=1, help="(setting, seed) runs at a time, one core each (default 1)")
    parser.add_argument("--cache", type=Path, default=Path(".bench/cache"), help="pretrained-base cache directory")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args()
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if args.jobs < 1:
        parser.error(f"--jobs: expected at least 1, got {args.jobs}")
    names = list(ARMS) if args.arms is None else args.arms.split(",")
    unknown = [name for name in names if name not in ARMS]
    if unknown:
        parser.error(f"--arms: no arm named {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    settings_run = list(SETTINGS) if args.settings is None else args.settings
    unknown = [setting for setting in settings_run if setting not in SETTINGS]
    if unknown:
        parser.error(f"--setting: no setting named {'; '.join(unknown)}; the settings are {'; '.join(SETTINGS)}")
    started = time.perf_counter()
    tasks = [(setting, seed) for setting in settings_run for seed in seeds]
    # spawn: each run builds its own model in a fresh interpreter, whatever this one has loaded
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {task: pool.submit(run_one, *task, args.cache, names) for task in tasks}
        done = {task: future.result() for task, future in futures.items()}
    settings = {}
    for setting in settings_run:
        by_seed = {str(seed): done[setting, seed] for seed in seeds}
        settings[setting] = {"by_seed": by_seed, "summary": summary(by_seed)}
    emit({"agreement": asdict(Agreement()), "compared": COMPARED,
          "arms": {name: asdict(ARMS[name]) for name in names}, "settings": settings,
          "seconds": round(time.perf_counter() - started, 1)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
