"""Learning benchmark: does the network learn as well as one node tuning the same experts, and faster with more miners?

In-process, one run, CPU, on the pretrained tiny base (`training.pretrain`) and a target domain it
never saw: a skill (arithmetic, records: rules learned once, so a step's progress hardly depends on
how much data it sees) or knowledge (facts: many independent facts about people, tuned from a base
that knows the sentence form from other people, `training.pretrain.base_config`; more data per step
learns more facts). `--form-base` tunes a skill from a base that also read its form with random
results, so the base is not confidently wrong on it and tuning learns only the rule. The network
arms (`bench/learning_runs.py` runs every arm) use the protocol's own pieces each round: every miner
trains the group from the global state (`training.trainer`, H steps on its shard), submits full
experts or a compressed pseudo-gradient (`training.pgrad`, error feedback kept per miner), validators
score each submission by Proof-of-Loss on a held-out subset the round seed picks, drop
near-duplicates, merge the top-G with positive utility by the outer step (`training.outer`). Ranking
is by loss with utility > 0, as `protocol.ranking` does; rewards are not computed.

Arms: the network with M = 1, 4, 8 miners; single-node expert tuning (ESFT) of the same group for as
many steps as the largest network spends, evaluated every H steps (the ESFT curve; equal tokens for
every M, and one miner's tokens, are points on it); full fine-tuning of all weights with the 4-miner
network's tokens as a reference; the 4-miner network with half its miners adversarial (one adds
noise, one copies an honest miner), and with miners that keep their AdamW state from round to round
(`Arm.keep_optimizer`; alone, and with outer momentum 0.5 on 4 and 8 miners and with half of 4
adversarial); short rounds (`Arm.inner_steps`: H = 5 over four times the rounds, so every arm spends
the same miner steps) with kept AdamW state and outer lr 2 on 4 and 8 miners and with half of 4
adversarial (`SHORT`), sending full experts and compressed pseudo-gradients, and compressed at outer
lr 2.5 (`SHORT_PGRAD`); miners that merge after every step at an outer lr equal to their number
(`EVERY_STEP`), on 4 and 8 miners and with half of 4 adversarial; networks of 1, 4 and 8 miners
sending compressed pseudo-gradients, whole (every miner every chunk) and partitioned (each miner a
half or a quarter of the chunks, drawn from its id and the round, `training.pgrad`); a sweep of
outer-optimizer settings and data shards on the 4-miner network, and on 4 and 8 miners of merge
gates other than Proof-of-Loss on each submission (`Arm.gate`) and of updates weighted by their
utility (`Arm.weighting`), and of kept AdamW state without outer momentum on 8 miners and on 4 with
half adversarial, and of short rounds at other outer lrs, without kept state and without the gate,
and of miners that each train only their share of the group's experts (`Arm.experts`), at H = 20
and in short rounds, and a grid of the steps between merges and the outer lr (`sync_grid`);
and the data-parallel ceiling: ESFT with M times the miners' batch for one miner's steps (as if M
miners averaged gradients after every step), which bounds what a plain average (outer lr 1) of M
miners' updates can reach, and for 4 miners again at 2 and 4 times the inner lr (a step on 4 times
the batch has half the gradient noise and can be larger: what an outer lr above 1 can reach); and,
to show whether the shared inner lr is fair to the baseline, ESFT for the 4-miner network's tokens,
that network and the 4-miner `EVERY_STEP` network again at half and at double the lr; and, to show
how much of a result is the draw, the headline arms (1, 4 and 8 miners, full and partitioned
compressed), the ESFT curve and the ceiling again under two other seeds for the shards, batch orders
and round seeds (`Settings.seed`), with the adversarial, optimizer-keeping and short-round arms.
Reported per arm: held-out loss after every round, general-domain loss change (forgetting),
`network_vs_esft` (loss drop / ESFT's drop at equal total tokens), `esft_equivalent_steps` after
each round (ESFT steps that reach the same loss, linear between curve points), `parallel_efficiency`
(those steps / miner steps spent; honest miners' steps for the adversarial arm) and
`parallel_efficiency_monotone`, the same read on the non-increasing fit of the ESFT curve
(`monotone`): where the curve is flat, its noise moves the first read, and the two disagree. The
tuned arms merge every useful submission (top-G 8) by plain averaging (outer lr 1, no momentum) with
a copy threshold of cosine 0.9999: honest miners starting from one state agree to about 0.995 after
20 steps, so the old 0.99 dropped them all (the sweep's `old_defaults_dup0.99`).
`targets` sets the issue's targets next to what was measured, and next to the efficiency that keeping
0.95 of ESFT's drop alone takes (`efficiency_for_share`).
Usage: python bench/learning.py [--domain D] [--form-base] [--rounds R] [--inner-steps H] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learning_runs import (  # noqa: E402
    Arm,
    Bench,
    Settings,
    at_learning_rate,
    changed_settings,
    data_parallel,
    efficiency_for_share,
    round_shape,
    summarise,
)
from bench.report import emit  # noqa: E402
from training.pgrad import PgradConfig  # noqa: E402
from training.pretrain import TARGET_DOMAINS, base_config  # noqa: E402

SHORT = "h5_keep_optimizer_lr2"
"""The short-round arms: H = 5 over 4 times the rounds, miners keeping their AdamW state, outer lr 2 (about
the square root of the 4 miners merged: each miner's AdamW step is normalised by its own batch's gradient
noise, so the mean of M such steps moves about as far as one, where one step on M times the batch moves
about sqrt(M) times as far)."""

SHORT_PGRAD = "h5_keep_optimizer_lr2.5_pgrad_p2"
"""The short-round arms sending compressed pseudo-gradients (`pgrad_2bit_c256_k40_p2`) at outer lr 2.5. Each
round applies only the top entries of half the chunks per miner and the error buffers hold the rest back,
so the same outer lr moves the compressed network less far than the full one; the outer lr was picked from
2, 2.5 and 3 on records from the form-aware base (`docs/learning.md`)."""

EVERY_STEP = "h1_keep_optimizer_lrM"
"""Miners that merge after every step (H = 1, a hundred rounds), keeping their AdamW state, at an outer lr equal
to the number of miners M the network is run with (4, and 8 on 8 miners). Where gradient noise rather than
the number of steps limits learning, the mean of M miners' steps is one step on M times the data with 1/M of
the noise, and sequential ESFT's M steps move about M times as far as one; an outer lr of M takes that
distance. Merged after more steps, each miner's update has already gone as far as the sharp directions
allow, and M times it overshoots (the sweep's `h{H}_keep_optimizer_lr{a}_4`)."""

SHORT_FAMILIES = (SHORT, f"{SHORT}_pgrad_p2", SHORT_PGRAD)
"""The short-round families: full experts at outer lr 2, compressed at 2 and at 2.5."""

AVERAGED = "h1_keep_optimizer_lr_per_update_beta1M_subset128_average0.9"
"""Miners that merge after every step, keeping their AdamW state at beta1 0.9^M for M miners, at an outer lr equal
to the number of updates merged, gated by Proof-of-Loss on 128 held-out sequences, in a network that offers the
average of its merged states at decay 0.9 (`aggregation.average_decay`): `bench/outer_lr.py`'s pick, the one
family that holds every target on records (docs/learning.md, "Reporting the average of the merged states")."""

REWOUND = "h1_keep_optimizer_rewind_lr_per_update_beta1_0.6561_subset128_average0.9"
"""`AVERAGED` with two changes. After a round that merges nothing, the miners' AdamW state goes back to what it was
before the round (`Arm.rewind`, what `[miner] rewind_optimizer` does in the node): on arithmetic, with half the
miners adversarial, `AVERAGED`'s miners stopped passing the gate for good once the state stood still. And one
spec for 4 miners and 8: beta1 0.9^4 = 0.6561, the 4-miner network's, so its 8-miner arm is more miners joining
that network, not a network specified for 8 (`bench/outer_lr.py`'s `_rewind` arms; docs/learning.md)."""

BACKTRACKED = "h1_keep_optimizer_rewind_backtrack_lr_per_update_beta1_0.6561_subset128_average0.9"
"""`REWOUND` whose miners also halve their inner lr after each round that merges nothing, down to 1/64, and go
back to the spec's lr once a round merges an update (`Arm.backtrack`, what `[miner] backtrack_lr` does in the
node): rewound, `REWOUND`'s one honest miner left with half the miners adversarial still stalled under seed 2,
retrying the same overshooting step (`bench/outer_lr.py`'s `_backtrack` arms; docs/learning.md)."""

FAMILIES = (*SHORT_FAMILIES, EVERY_STEP, AVERAGED, REWOUND, BACKTRACKED)
"""The families of 4 miners, 8 miners and 4 with half adversarial that the targets read."""

CEILING_LR_FACTORS = (2.0, 4.0)
"""The 4-miner data-parallel ceiling is also run at the inner lr times these (about sqrt(M) and M): a step on
M times the batch has less noise and can be larger."""

SEED_ARMS = ("network_1", "network_4", "network_8", "adversarial_4", "pgrad_2bit_c256_k40_p2_4",
             "pgrad_2bit_c256_k40_p2_8", "keep_optimizer_4", "keep_optimizer_momentum0.5_4",
             "keep_optimizer_momentum0.5_8", "keep_optimizer_momentum0.5_adversarial_4",
             *(f"{family}_{name}" for family in FAMILIES for name in ("4", "8", "adversarial_4")))
"""The arms the `seeds` section repeats: the ones the headline targets read."""


def headline(runs: dict[str, dict[str, Any]], ceiling: dict[str, Any], share_needs: float | None) -> dict[str, Any]:
    """The numbers of one seed's run that the targets read; `share_needs` is `efficiency_for_share` at 4 miners."""
    four, eight = runs["network_4"], runs["network_8"]
    return {
        "final_loss": {name: runs[name]["losses"][-1] for name in SEED_ARMS},
        "merged_per_round": {name: [len(m) for m in runs[name]["merged"]] for name in SEED_ARMS},
        "network_vs_esft_4": four.get("network_vs_esft"),
        "parallel_efficiency_4": four["parallel_efficiency"],
        "parallel_efficiency_4_monotone": four["parallel_efficiency_monotone"],
        "parallel_efficiency_4_ceiling": ceiling["parallel_efficiency"],
        "parallel_efficiency_4_share_needs": share_needs,
        "progress_4_over_1": _ratio(four, runs["network_1"]),
        **{f"{key}_{name}": runs[name].get(key)
           for name in ("keep_optimizer_4", "keep_optimizer_momentum0.5_4", *(f"{f}_4" for f in FAMILIES))
           for key in ("network_vs_esft", "parallel_efficiency", "parallel_efficiency_monotone")},
        "8_ahead_of_4": eight["losses"][-1] < four["losses"][-1],
        "8_ahead_of_4_pgrad_partitions_2": runs["pgrad_2bit_c256_k40_p2_8"]["losses"][-1]
        < runs["pgrad_2bit_c256_k40_p2_4"]["losses"][-1],
        "8_ahead_of_4_keep_optimizer_momentum0.5": runs["keep_optimizer_momentum0.5_8"]["losses"][-1]
        < runs["keep_optimizer_momentum0.5_4"]["losses"][-1],
        **{f"8_ahead_of_4_{family}": runs[f"{family}_8"]["losses"][-1] < runs[f"{family}_4"]["losses"][-1]
           for family in FAMILIES},
        **{f"forgetting_4_no_worse_than_esft_{family}": _forgets_no_more(runs[f"{family}_4"])
           for family in FAMILIES},
        "adversarial_lowers_every_round": runs["adversarial_4"]["lowered_every_round"],
        "adversarial_lowers_every_round_keep_optimizer_momentum0.5":
            runs["keep_optimizer_momentum0.5_adversarial_4"]["lowered_every_round"],
        **{f"adversarial_lowers_every_round_{family}": runs[f"{family}_adversarial_4"]["lowered_every_round"]
           for family in FAMILIES},
        **{f"adversarial_rounds_lowered_{family}": runs[f"{family}_adversarial_4"]["rounds_lowered"]
           for family in FAMILIES},
    }


def other_seeds(bench: Bench, arms: dict[str, Arm], main: dict[str, Any], seeds: tuple[int, ...]) -> dict[str, Any]:
    """The headline arms, their ESFT curve and the 4-miner ceiling again under other seeds (`Settings.seed`).

    `main` is seed 0's `headline`. Returns each seed's headline and, per number, its range over all seeds.
    """
    shared = bench.s
    per_miner = shared.inner_steps * shared.rounds
    by_seed = {"0": main}
    for seed in seeds:
        with changed_settings(bench, seed=seed):
            curve, forgetting = bench.esft_curve(8 * per_miner, shared.inner_steps, {m * per_miner for m in (1, 4, 8)})
            runs = {name: bench.network(arms[name]) for name in SEED_ARMS}
            for run in runs.values():
                summarise(bench, run, curve, forgetting)
            by_seed[str(seed)] = headline(runs, data_parallel(bench, curve, 4),
                                          efficiency_for_share(curve, bench.base_loss, 4 * per_miner))
    ranges = {key: [min(h[key] for h in by_seed.values()), max(h[key] for h in by_seed.values())]
              for key in main if not isinstance(main[key], (dict, bool))
              if all(h[key] is not None for h in by_seed.values())}
    held = {key: sum(h[key] for h in by_seed.values()) for key in main if isinstance(main[key], bool)}
    return {"by_seed": by_seed, "range": ranges, f"seeds where it holds (of {len(by_seed)})": held}


def targets(runs: dict[str, dict[str, Any]], ceilings: dict[str, dict[str, Any]], share_needs: float | None) -> dict[str, Any]:
    """The issue's targets next to what this run measured, the data-parallel ceiling they are bounded by,
    and the efficiency the share target alone asks for (`efficiency_for_share`)."""
    four, eight = runs["network_4"], runs["network_8"]
    pgrad = {name: {"network_vs_esft": run.get("network_vs_esft"),
                    "payload_vs_bf16": round(run["pgrad"]["bf16_bytes"] / run["pgrad"]["payload_bytes"], 1)}
             for name, run in runs.items() if name.startswith("pgrad_")}
    return {
        "network_vs_esft_4 (>= 0.95)": four.get("network_vs_esft"),
        "network_vs_esft_8 (>= 0.95)": eight.get("network_vs_esft"),
        "parallel_efficiency_4 (>= 0.5)": four["parallel_efficiency"],
        "parallel_efficiency_4 read on the monotone fit of the ESFT curve": four["parallel_efficiency_monotone"],
        "progress_4_over_1 (ESFT-equivalent steps of 4 miners / of 1)": _ratio(four, runs["network_1"]),
        "parallel_efficiency_4_ceiling (synchronous data parallel)": ceilings["4"]["parallel_efficiency"],
        "network_vs_esft_4_ceiling (synchronous data parallel)": ceilings["4"]["network_vs_esft"],
        **{f"{key}_4_ceiling at inner lr x{factor:g}": ceilings[f"4_lr{factor:g}x"][key]
           for key in ("parallel_efficiency", "network_vs_esft") for factor in CEILING_LR_FACTORS},
        "parallel_efficiency_4 that keeping 0.95 of ESFT's drop takes (both targets: the larger of it and 0.5)":
            share_needs,
        "8_ahead_of_4": eight["losses"][-1] < four["losses"][-1],
        "8_ahead_of_4_pgrad_partitions_2": runs["pgrad_2bit_c256_k40_p2_8"]["losses"][-1]
        < runs["pgrad_2bit_c256_k40_p2_4"]["losses"][-1],
        "forgetting_4_no_worse_than_esft": _forgets_no_more(four),
        "adversarial_lowers_every_round": runs["adversarial_4"]["lowered_every_round"],
        "pgrad (payload >= 16x, network_vs_esft >= 0.9)": pgrad,
        f"{SHORT} (H = 5 over 4x the rounds, kept AdamW state, outer lr 2)": short_rounds(runs, SHORT),
        f"{SHORT}_pgrad_p2 (the same, compressed as pgrad_2bit_c256_k40_p2)": short_rounds(runs, f"{SHORT}_pgrad_p2"),
        f"{SHORT_PGRAD} (the same compressed, at outer lr 2.5)": short_rounds(runs, SHORT_PGRAD),
        f"{EVERY_STEP} (H = 1 over 20x the rounds, kept AdamW state, outer lr = M)": short_rounds(runs, EVERY_STEP),
        f"{AVERAGED} (the same at an outer lr per update merged and beta1 0.9^M, gated on 128 sequences, "
        "offering the average of the merged states at decay 0.9)": short_rounds(runs, AVERAGED),
        f"{REWOUND} (the same with the miners' AdamW state rewound after a round that merges nothing, "
        "and the 4-miner spec's beta1 for 8 miners)": short_rounds(runs, REWOUND),
        f"{BACKTRACKED} (the same with the miners' inner lr halved after each round that merges nothing, "
        "back to the spec's once one merges)": short_rounds(runs, BACKTRACKED),
    }


def short_rounds(runs: dict[str, dict[str, Any]], family: str) -> dict[str, Any]:
    """The targets read on one family of short-round arms (`FAMILIES`)."""
    four, eight, adversarial = (runs[f"{family}_{name}"] for name in ("4", "8", "adversarial_4"))
    return {
        "network_vs_esft_4 (>= 0.95)": four.get("network_vs_esft"),
        "parallel_efficiency_4 (>= 0.5)": four["parallel_efficiency"],
        "parallel_efficiency_4 read on the monotone fit of the ESFT curve": four["parallel_efficiency_monotone"],
        "8_ahead_of_4": eight["losses"][-1] < four["losses"][-1],
        "forgetting_4_no_worse_than_esft": _forgets_no_more(four),
        "adversarial_lowers_every_round": adversarial["lowered_every_round"],
        "adversarial_rounds_lowered": f"{adversarial['rounds_lowered']} of {len(adversarial['losses'])}",
    }


def averaged_family() -> dict[str, Arm]:
    """`AVERAGED` on 4 miners, on 8, and on 4 with half adversarial, each miner's beta1 0.9^M for M miners (a
    spec sets beta1 for the miners a network is run with, not for who turns up)."""
    arm = Arm(inner_steps=1, keep_optimizer=True, lr_per_update=True, subset=128, average=0.9)
    return {name: replace(each, beta1=round(0.9**each.miners, 6)) for name, each in family(AVERAGED, arm).items()}


def rewound_family() -> dict[str, Arm]:
    """`REWOUND` on 4 miners, on 8, and on 4 with half adversarial, all under one spec (beta1 0.9^4)."""
    return family(REWOUND, Arm(inner_steps=1, keep_optimizer=True, rewind=True, lr_per_update=True, subset=128,
                               average=0.9, beta1=round(0.9**4, 6)))


def backtracked_family() -> dict[str, Arm]:
    """`BACKTRACKED`: `rewound_family` with the miners' inner lr backtracking after level rounds."""
    return {name.replace(REWOUND, BACKTRACKED): replace(arm, backtrack=True) for name, arm in rewound_family().items()}


def family(name: str, arm: Arm, outer_lr_is_miners: bool = False) -> dict[str, Arm]:
    """`arm` on 4 miners, on 8, and on 4 with half adversarial, named as `FAMILIES` are read; with
    `outer_lr_is_miners` each at an outer lr equal to its number of miners (adversaries included: a
    network's outer lr is set in its spec, not by who turns up)."""

    def on(miners: int, adversaries: int = 0) -> Arm:
        lr = float(miners) if outer_lr_is_miners else arm.outer_lr
        return replace(arm, miners=miners, adversaries=adversaries, outer_lr=lr)

    return {f"{name}_4": on(4), f"{name}_8": on(8), f"{name}_adversarial_4": on(4, adversaries=2)}


def _forgets_no_more(run: dict[str, Any]) -> bool:
    """Whether `run`'s general-domain loss rose no more than ESFT's at equal tokens."""
    forgetting: float = run["forgetting"]
    esft_forgetting: float = run.get("esft_forgetting_equal_tokens", math.inf)
    return forgetting <= esft_forgetting


def _ratio(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """Final ESFT-equivalent steps of `run` over `baseline`'s: how many times one network's progress the other makes."""
    a, b = run["esft_equivalent_steps"][-1], baseline["esft_equivalent_steps"][-1]
    return None if a is None or not b else round(a / b, 2)


def sync_grid(short: Arm) -> dict[str, Arm]:
    """4 miners keeping their AdamW state, merged every H steps at outer lr a (H in 1, 2, 5, 10; a in 1, 2, 4):
    how the efficiency an outer lr above 1 buys falls with the steps between merges."""
    return {f"h{h}_keep_optimizer_lr{lr:g}_4": replace(short, inner_steps=h, outer_lr=lr)
            for h in (1, 2, 5, 10) for lr in (1.0, 2.0, 4.0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", choices=TARGET_DOMAINS, default="arithmetic", help="target domain (default arithmetic)")
    parser.add_argument("--form-base", action="store_true",
                        help="tune a skill from a base that also read its form, with random results "
                        "(facts' base always does)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per network run (default 5)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument("--cache", type=Path, default=Path(".bench/cache"), help="pretrained-base cache directory")
    parser.add_argument("--no-sweep", action="store_true", help="skip the outer-optimizer sweep")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model on a shared CPU runs faster without intra-op threads
    started = time.perf_counter()
    settings = Settings(domain=args.domain, rounds=args.rounds, inner_steps=args.inner_steps,
                        knows_form=True if args.form_base else None)
    bench = Bench(settings, args.cache)
    tuned = Arm()
    short = Arm(inner_steps=5, keep_optimizer=True, outer_lr=2.0)
    short_compressed = replace(short, pgrad=PgradConfig(chunk=256, topk=40, partitions=2))
    max_miners = 8
    per_miner = settings.inner_steps * settings.rounds
    arms: dict[str, Arm] = {
        "network_1": replace(tuned, miners=1),
        "network_4": tuned,
        "network_8": replace(tuned, miners=8),
        "adversarial_4": replace(tuned, adversaries=2),
        "keep_optimizer_4": replace(tuned, keep_optimizer=True),
        **{f"keep_optimizer_momentum0.5_{m}": replace(tuned, miners=m, keep_optimizer=True, momentum=0.5)
           for m in (4, 8)},
        "keep_optimizer_momentum0.5_adversarial_4": replace(tuned, adversaries=2, keep_optimizer=True, momentum=0.5),
        **family(SHORT, short),
        **family(f"{SHORT}_pgrad_p2", short_compressed),
        **family(SHORT_PGRAD, replace(short_compressed, outer_lr=2.5)),
        **family(EVERY_STEP, Arm(inner_steps=1, keep_optimizer=True), outer_lr_is_miners=True),
        **averaged_family(),
        **rewound_family(),
        **backtracked_family(),
        "pgrad_2bit_k32_4": replace(tuned, pgrad=PgradConfig(chunk=1024, topk=32, quant="2bit")),
        "pgrad_2bit_k48_4": replace(tuned, pgrad=PgradConfig(chunk=1024, topk=48, quant="2bit")),
        "pgrad_int8_k32_4": replace(tuned, pgrad=PgradConfig(chunk=1024, topk=32, quant="int8")),
        "pgrad_2bit_c256_k16_4": replace(tuned, pgrad=PgradConfig(chunk=256, topk=16, quant="2bit")),
        "pgrad_2bit_c256_k32_p2_4": replace(tuned, pgrad=PgradConfig(chunk=256, topk=32, partitions=2)),
        **{f"pgrad_2bit_c256_k40_p2_{m}": replace(tuned, miners=m, pgrad=PgradConfig(chunk=256, topk=40, partitions=2))
           for m in (1, 4, 8)},
        **{f"pgrad_2bit_c256_k64_p4_{m}": replace(tuned, miners=m, pgrad=PgradConfig(chunk=256, topk=64, partitions=4))
           for m in (4, 8)},
    }
    sweep = {
        "old_defaults_dup0.99": Arm(outer_lr=0.7, momentum=0.9, top_g=3, duplicate_cosine=0.99),
        "design_0.7_0.9": Arm(outer_lr=0.7, momentum=0.9, top_g=3),
        "sim_0.5_0.5": Arm(outer_lr=0.5, momentum=0.5, top_g=3),
        "top3_1.0_0": Arm(outer_lr=1.0, momentum=0.0, top_g=3),
        "average_1.0_0": Arm(outer_lr=1.0, momentum=0.0),
        "lr2_0": Arm(outer_lr=2.0, momentum=0.0),
        "lr3_0": Arm(outer_lr=3.0, momentum=0.0),
        "lr1_0.5": Arm(outer_lr=1.0, momentum=0.5),
        "lr2_0.5": Arm(outer_lr=2.0, momentum=0.5),
        "disjoint_lr2_0": Arm(outer_lr=2.0, momentum=0.0, shards="disjoint"),
        **{f"gate_{gate}_{m}": Arm(miners=m, gate=gate) for gate in ("none", "marginal") for m in (4, 8)},
        **{f"utility_weighting_{m}": Arm(miners=m, weighting="utility") for m in (4, 8)},
        "keep_optimizer_8": Arm(miners=8, keep_optimizer=True),
        "keep_optimizer_adversarial_4": Arm(adversaries=2, keep_optimizer=True),
        "h5_keep_optimizer_lr1.5_4": replace(short, outer_lr=1.5),
        "h5_lr2_4": replace(short, keep_optimizer=False),
        "h5_keep_optimizer_lr2_gate_none_4": replace(short, gate="none"),
        "h5_keep_optimizer_lr2.83_8": replace(short, miners=8, outer_lr=2.83),
        **{f"partition_experts_{m}": Arm(miners=m, experts="partition") for m in (4, 8)},
        **{f"h5_keep_optimizer_lr{lr:g}_partition_experts_4": replace(short, outer_lr=lr, experts="partition")
           for lr in (1.0, 2.0)},
        **{name: arm for name, arm in sync_grid(short).items() if arm not in arms.values()},  # not twice
    }
    try:  # an H that does not divide the miners' steps fails here, not an hour in
        for arm in [*sweep.values(), *arms.values()]:
            round_shape(settings, arm)
    except ValueError as exc:
        parser.error(f"--inner-steps {settings.inner_steps} --rounds {settings.rounds}: {exc}")
    curve, esft_forgetting = bench.esft_curve(max_miners * per_miner, settings.inner_steps, {m * per_miner for m in (1, 2, 4)})
    runs: dict[str, dict[str, Any]] = {}
    for name, arm in [*({} if args.no_sweep else sweep).items(), *arms.items()]:
        runs[name] = bench.network(arm)
        summarise(bench, runs[name], curve, esft_forgetting)
        print(f"{name}: {runs[name]['losses']} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    ceilings = {str(m): data_parallel(bench, curve, m) for m in (4, 8)}
    ceilings.update({f"4_lr{factor:g}x": data_parallel(bench, curve, 4, factor) for factor in CEILING_LR_FACTORS})
    full = bench.full_finetune(4 * settings.inner_steps * settings.rounds)
    checked = {"network_4": arms["network_4"], f"{EVERY_STEP}_4": arms[f"{EVERY_STEP}_4"]}
    learning_rates = {str(factor): at_learning_rate(bench, factor, checked) for factor in (0.5, 2.0)}
    share_needs = efficiency_for_share(curve, bench.base_loss, 4 * per_miner)
    seeds = other_seeds(bench, arms, headline(runs, ceilings["4"], share_needs), (1, 2))
    report = {
        "settings": {**asdict(settings), "group": bench.group,
                     "base": asdict(base_config(settings.domain, settings.knows_form))},
        "base_loss": round(bench.base_loss, 4),
        "base_general_loss": round(bench.base_general, 4),
        "esft": {"curve": [(s, round(loss, 4)) for s, loss in curve],
                 "forgetting_at_steps": {s: round(f, 4) for s, f in sorted(esft_forgetting.items())}},
        "full_finetune_4_miner_tokens": full,
        "data_parallel_ceiling": ceilings,
        f"learning_rate_check (ESFT at 4-miner tokens, network_4 and {EVERY_STEP}_4, inner lr x 0.5 and x 2)":
            learning_rates,
        "targets": targets(runs, ceilings, share_needs),
        "seeds (the headline arms under other draws of shards, batches and round seeds)": seeds,
        "arms": {name: runs[name] for name in arms},
        "sweep": {name: runs[name] for name in sweep if name in runs},
        "seconds": round(time.perf_counter() - started, 1),
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
