"""Learning benchmark: does the network learn as well as one node tuning the same experts, and faster with more miners?

In-process, one run, CPU, on the pretrained tiny base (`training.pretrain`) and a target domain it
never saw: a skill (arithmetic, records: rules learned once, so a step's progress hardly depends on
how much data it sees) or knowledge (facts: many independent facts about people, tuned from a base
that knows the sentence form from other people, `training.pretrain.base_config`; more data per step
learns more facts). `--form-base` tunes a skill from a base that also read its form with random
results, so the base is not confidently wrong on it and tuning learns only the rule. The network
arms run the protocol's own pieces each round: every miner trains the group from the global state
(`training.trainer`, H steps on its shard), submits full experts or a compressed pseudo-gradient
(`training.pgrad`, error feedback kept per miner), validators score each submission by Proof-of-Loss
on a held-out subset the round seed picks, drop near-duplicates, merge the top-G with positive
utility by the outer step (`training.outer`). Ranking is by loss with utility > 0, as
`protocol.ranking` does; rewards are not computed.

Arms: the network with M = 1, 4, 8 miners; single-node expert tuning (ESFT) of the same group for as
many steps as the largest network spends, evaluated every H steps (the ESFT curve; equal tokens for
every M, and one miner's tokens, are points on it); full fine-tuning of all weights with the 4-miner
network's tokens as a reference; the 4-miner network with half its miners adversarial (one adds
noise, one copies an honest miner), and with miners that keep their AdamW state from round to round
(`Arm.keep_optimizer`; alone, and with outer momentum 0.5 on 4 and 8 miners and with half of 4
adversarial); short rounds (`Arm.inner_steps`: H = 5 over four times the rounds, so every arm spends
the same miner steps) with kept AdamW state and outer lr 2 on 4 and 8 miners and with half of 4
adversarial (`SHORT`), sending full experts and compressed pseudo-gradients, and compressed at outer
lr 2.5 (`SHORT_PGRAD`); networks of 1, 4 and 8 miners sending compressed pseudo-gradients, whole
(every miner every chunk) and partitioned (each miner a half or a quarter of the chunks, drawn from
its id and the round, `training.pgrad`); a sweep
of outer-optimizer settings and data shards on the 4-miner network, and on 4 and 8 miners of merge
gates other than Proof-of-Loss on each submission (`Arm.gate`) and of updates weighted by their
utility (`Arm.weighting`), and of kept AdamW state without outer momentum on 8 miners and on 4 with
half adversarial, and of short rounds at other outer lrs, without kept state and without the gate;
and the data-parallel ceiling: ESFT with M times the miners' batch for one miner's steps (as if M
miners averaged gradients after every step), which bounds what a plain average (outer lr 1) of M
miners' updates can reach; and, to show whether the shared inner lr is fair to the baseline, ESFT
for the 4-miner network's tokens and that network again at half and at double the lr; and, to show
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
import copy
import hashlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from sklearn.isotonic import IsotonicRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit  # noqa: E402
from training.adapters import adapter_for  # noqa: E402
from training.corpus import generate  # noqa: E402
from training.data import batches, heldout_subset, pack, shard  # noqa: E402
from training.evaluate import heldout_loss, loss_with_experts, token_loss_sum  # noqa: E402
from training.experts import extract, insert, pseudo_gradient  # noqa: E402
from training.outer import OuterConfig, near_duplicates, outer_step  # noqa: E402
from training.pgrad import PgradConfig, chunk_draw, compressed_bytes, coverage, decode, encode  # noqa: E402
from training.pretrain import GENERAL_DOMAINS, TARGET_DOMAINS, base_config, load_pretrained  # noqa: E402
from training.selection import select_experts  # noqa: E402
from training.tokenizer import ByteTokenizer  # noqa: E402
from training.trainer import TrainConfig, train_experts  # noqa: E402

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Arm:
    """One network run's settings."""

    miners: int = 4
    outer_lr: float = 1.0
    momentum: float = 0.0
    top_g: int = 8
    shards: str = "random"
    """`random`: each miner a miner-seeded 50% subset (training.data.shard); `disjoint`: a partition."""
    adversaries: int = 0
    pgrad: PgradConfig | None = None
    duplicate_cosine: float = 0.9999
    """Cosine at which two pseudo-gradients count as copies (both dropped)."""
    weighting: Literal["uniform", "utility"] = "uniform"
    """How the outer step weights the merged updates: `uniform`, or `utility` (each by its u_i), as the
    spec's `[aggregation] weighting` does."""
    keep_optimizer: bool = False
    """Each miner goes on with its AdamW state from its previous round (as a DiLoCo worker does) instead of
    starting it at zero every round."""
    gate: str = "each"
    """Which submissions may be merged. `each`: the protocol's Proof-of-Loss gate, each must lower the
    round's subset loss alone. Alternatives the sweep measures, not the protocol's: `marginal`, each
    must lower the subset loss of the plain mean of every non-copy (leaving it out raises it), ranked
    by that; `none`: every non-copy."""
    inner_steps: int | None = None
    """H for this arm (None: the settings'). The arm runs as many more or fewer rounds as keep the miner
    steps of every arm equal: settings' H x R / H."""


@dataclass(frozen=True)
class Settings:
    """What every arm shares."""

    domain: str = "arithmetic"
    rounds: int = 5
    inner_steps: int = 20
    batch_size: int = 8
    inner_lr: float = 1e-3
    experts_per_layer: int = 2
    subset: int = 32
    """Held-out sequences the round seed picks for Proof-of-Loss."""
    report_sequences: int = 128
    """Held-out sequences every reported loss is measured on (disjoint from the subset pool)."""
    knows_form: bool | None = None
    """Whether the base also read the domain's form (`training.pretrain.base_config`; None: only facts')."""
    seed: int = 0
    """Draws the miners' shards, every run's batch order, the round seeds and the adversaries' noise;
    the base, the group, the data and the report sets stay. Seed 0 is the main run; the `seeds`
    section repeats the headline arms with others to show how much of a result is the draw."""


class Bench:
    """The base model, the group, the data and the arms' runs."""

    def __init__(self, settings: Settings, cache: Path) -> None:
        self.s = settings
        self.tokenizer = ByteTokenizer()
        self.model = load_pretrained(cache, base_config(settings.domain, settings.knows_form))
        self.adapter = adapter_for("qwen3_moe")
        tok = self.tokenizer
        self.train = pack(generate(settings.domain, 3000, 11), tok, 64)
        held = pack(generate(settings.domain, 600, 12), tok, 64)
        self.report_set = held[: settings.report_sequences]
        self.pool = held[settings.report_sequences :]
        general = [d for dom in GENERAL_DOMAINS for d in generate(dom, 150, 13)]
        self.general = pack(general, tok, 64)[: settings.report_sequences]
        chosen = select_experts(self.model, self.adapter, self.train[:64], "gate-mass", top_d=settings.experts_per_layer)
        self.group = {int(layer): ids for layer, ids in chosen["group"].items()}
        self.base = extract(self.model, self.adapter, self.group)
        self.base_loss = self.loss(self.base)
        self.base_general = self.loss(self.base, self.general)

    def loss(self, tensors: Tensors, sequences: torch.Tensor | None = None) -> float:
        seqs = self.report_set if sequences is None else sequences
        return loss_with_experts(self.model, self.adapter, tensors, seqs, batch_size=32).loss

    def tag(self, text: str) -> str:
        """`text` made specific to the run's seed (unchanged for seed 0)."""
        return text if self.s.seed == 0 else f"{text}/seed-{self.s.seed}"

    def stream(self, number: int) -> int:
        """A batch-order seed made specific to the run's seed (unchanged for seed 0)."""
        return number + 1_000_003 * self.s.seed

    def train_cfg(self, steps: int, batch_size: int | None = None) -> TrainConfig:
        return TrainConfig(steps=steps, lr=self.s.inner_lr, batch_size=batch_size or self.s.batch_size)

    def esft_curve(
        self, steps: int, every: int, general_at: set[int], batch_size: int | None = None
    ) -> tuple[list[tuple[int, float]], dict[int, float]]:
        """ESFT loss every `every` steps of one continuous run (one optimizer), and its general loss at `general_at`.

        `batch_size` (default the miners') sets the sequences per step: M times the miners' batch is
        synchronous data parallelism over M nodes, the most any averaging of M miners' work can reach.
        """
        insert(self.model, self.adapter, self.base)
        curve = [(0, self.base_loss)]
        general: dict[int, float] = {}
        stream = batches(self.train, batch_size or self.s.batch_size, self.stream(1))

        def evaluated() -> Iterator[torch.Tensor]:
            # The trainer writes its copies back after every step, so the model holds step k's weights
            # when batch k + 1 is drawn: evaluating here traces the curve of one uninterrupted run.
            for k in range(steps):
                if k and k % every == 0:
                    curve.append((k, heldout_loss(self.model, self.report_set, batch_size=32).loss))
                if k in general_at:
                    general[k] = heldout_loss(self.model, self.general, batch_size=32).loss - self.base_general
                yield next(stream)

        train_experts(self.model, self.adapter, self.group, evaluated(), self.train_cfg(steps, batch_size))
        curve.append((steps, heldout_loss(self.model, self.report_set, batch_size=32).loss))
        general[steps] = heldout_loss(self.model, self.general, batch_size=32).loss - self.base_general
        insert(self.model, self.adapter, self.base)
        return curve, general

    def full_finetune(self, steps: int) -> dict[str, Any]:
        model = copy.deepcopy(self.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.s.inner_lr)
        stream = batches(self.train, self.s.batch_size, self.stream(1))
        for _ in range(steps):
            ids_BL = next(stream)
            loss = token_loss_sum(model, ids_BL, self.tokenizer.pad_id) / int((ids_BL[:, 1:] != 256).sum())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        final = heldout_loss(model, self.report_set, batch_size=32).loss
        general = heldout_loss(model, self.general, batch_size=32).loss
        return {"steps": steps, "final_loss": round(final, 4), "forgetting": round(general - self.base_general, 4)}

    def miner_rows(self, arm: Arm, miner: int, round: int) -> torch.Tensor:
        if arm.shards == "disjoint":
            part = self.train[miner :: arm.miners]
            generator = torch.Generator().manual_seed(self.stream(round * 1000 + miner))
            order = torch.randperm(part.shape[0], generator=generator)
            return part[order]
        return shard(self.train, self.tag(f"miner-{miner}"), round)

    def network(self, arm: Arm) -> dict[str, Any]:
        outer = OuterConfig(lr=arm.outer_lr, momentum=arm.momentum, weighting=arm.weighting)
        global_t = {k: v.clone() for k, v in self.base.items()}
        momentum: Tensors | None = None
        errors: dict[int, Tensors | None] = {}
        optimizers: dict[int, dict[str, Any]] = {}
        losses, merged = [], []
        shapes = {name: tuple(t.shape) for name, t in self.base.items()}
        honest = arm.miners - arm.adversaries
        steps, rounds = round_shape(self.s, arm)
        for r in range(rounds):
            submissions: dict[int, Tensors] = {}
            for i in range(honest):
                insert(self.model, self.adapter, global_t)
                rows = self.miner_rows(arm, i, r)
                order = batches(rows, self.s.batch_size, self.stream(r))
                result = train_experts(self.model, self.adapter, self.group, order,
                                       self.train_cfg(steps), optimizers.get(i))
                submissions[i] = result.tensors
                if arm.keep_optimizer:
                    optimizers[i] = result.optimizer_state
            for j, i in enumerate(range(honest, arm.miners)):
                submissions[i] = self.adversary(j, global_t, submissions, r)
            masks: dict[int, Tensors] = {}
            if arm.pgrad is not None:
                for i, tensors in list(submissions.items()):
                    draw = chunk_draw(self.tag("learning-bench"), r, f"miner-{i}")
                    blob, errors[i] = encode(pseudo_gradient(global_t, tensors), errors.get(i), arm.pgrad, draw)
                    decoded = decode(blob, shapes, arm.pgrad, draw)
                    submissions[i] = {name: global_t[name] - decoded[name] for name in global_t}
                    masks[i] = coverage(shapes, arm.pgrad, draw)
            partitioned = arm.pgrad is not None and arm.pgrad.partitions > 1
            ranked = self.score_and_rank(global_t, submissions, r, arm, masks if partitioned else None)
            contributors = ranked[: arm.top_g]
            if contributors:
                utilities = [u for _, u in contributors]
                global_t, momentum = outer_step(global_t, [submissions[i] for i, _ in contributors],
                                                utilities, momentum, outer,
                                                [masks[i] for i, _ in contributors] if partitioned else None)
            insert(self.model, self.adapter, self.base)
            losses.append(round(self.loss(global_t), 4))
            merged.append([i for i, _ in contributors])
        general = self.loss(global_t, self.general)
        out: dict[str, Any] = {**asdict(arm), "losses": losses, "merged": merged,
                               "forgetting": round(general - self.base_general, 4)}
        if arm.pgrad is not None:
            out["pgrad"] = {**asdict(arm.pgrad), "payload_bytes": compressed_bytes(shapes, arm.pgrad),
                            "bf16_bytes": sum(2 * math.prod(s) for s in shapes.values())}
        return out

    def adversary(self, j: int, global_t: Tensors, honest: dict[int, Tensors], r: int) -> Tensors:
        if j % 2 == 0:
            gen = torch.Generator().manual_seed(self.stream(r * 7919 + j))
            return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in global_t.items()}
        victim = honest[0]
        return {n: t + 1e-6 * torch.ones_like(t) for n, t in victim.items()}

    def score_and_rank(
        self, global_t: Tensors, submissions: dict[int, Tensors], r: int, arm: Arm,
        coverage: dict[int, Tensors] | None = None,
    ) -> list[tuple[int, float]]:
        """The round's contributors with their utilities, best first, by the arm's gate (`Arm.gate`)."""
        seed_hex = hashlib.sha256(self.tag(f"learning-bench:{r}").encode()).hexdigest()
        subset = heldout_subset(self.pool, seed_hex, self.s.subset)
        base_loss = self.loss(global_t, subset)
        scored = sorted((self.loss(t, subset), i) for i, t in submissions.items())
        gains = {i: base_loss - loss for loss, i in scored if arm.gate != "each" or loss < base_loss}
        grads = {i: pseudo_gradient(global_t, submissions[i]) for i in gains}
        covered = None if coverage is None else {i: coverage[i] for i in grads}
        flagged = near_duplicates(grads, arm.duplicate_cosine, covered) if len(grads) > 1 else set()
        kept = [i for _, i in scored if i in gains and i not in flagged]
        if arm.gate == "marginal":
            return self.marginal(global_t, submissions, kept, subset, base_loss, coverage)
        return [(i, max(gains[i], 0.0)) for i in kept]

    def marginal(
        self, global_t: Tensors, submissions: dict[int, Tensors], kept: list[int], subset: torch.Tensor,
        base_loss: float, coverage: dict[int, Tensors] | None,
    ) -> list[tuple[int, float]]:
        """Each miner's marginal gain: the subset loss of the mean without it minus that of the mean of all."""

        def merged_loss(ids: list[int]) -> float:
            if not ids:
                return base_loss
            masks = None if coverage is None else [coverage[i] for i in ids]
            state, _ = outer_step(global_t, [submissions[i] for i in ids], [1.0] * len(ids), None,
                                  OuterConfig(lr=1.0, momentum=0.0), masks)
            return self.loss(state, subset)

        whole = merged_loss(kept)
        if whole >= base_loss:
            return []
        gains = {i: merged_loss([j for j in kept if j != i]) - whole for i in kept}
        return sorted(((i, g) for i, g in gains.items() if g > 0), key=lambda pair: -pair[1])


def round_shape(settings: Settings, arm: Arm) -> tuple[int, int]:
    """The arm's (H, rounds): its own H, over as many rounds as spend the settings' H x R steps per miner."""
    steps = settings.inner_steps if arm.inner_steps is None else arm.inner_steps
    per_miner = settings.inner_steps * settings.rounds
    if steps <= 0 or per_miner % steps:
        raise ValueError(f"an arm's inner steps must divide the {per_miner} steps each miner spends, got {steps}")
    return steps, per_miner // steps


def esft_steps(curve: list[tuple[int, float]], loss: float) -> float | None:
    """ESFT steps at which the curve first reaches `loss`, linear between points; None if it never does."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= loss:
            return float(s0) if l0 <= loss else s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    return None


def _efficiency(curve: list[tuple[int, float]], loss: float, spent: int) -> float | None:
    """ESFT steps on `curve` that reach `loss`, over the `spent` miner steps; None if it never does."""
    steps = esft_steps(curve, loss)
    return None if steps is None else round(steps / spent, 4)


def monotone(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The non-increasing curve nearest to `curve` (least squares; scikit-learn's isotonic regression).

    ESFT's expected loss does not rise with steps, so where the measured curve rises again it is the
    report set's noise. On a flat stretch that noise decides where `esft_steps` finds its first
    crossing; reading the fitted curve as well shows how much an efficiency owes to it.
    """
    steps = [step for step, _ in curve]
    fitted = IsotonicRegression(increasing=False).fit_transform(steps, [loss for _, loss in curve])
    return [(step, float(loss)) for step, loss in zip(steps, fitted, strict=True)]


def curve_at(curve: list[tuple[int, float]], steps: int) -> float:
    """ESFT loss after `steps` (a curve point)."""
    return dict(curve)[steps]


def efficiency_for_share(curve: list[tuple[int, float]], base_loss: float, spent: int, share: float = 0.95) -> float | None:
    """The least parallel efficiency of any network that keeps `share` of ESFT's loss drop at `spent` steps.

    Both are read on the same curve. Such a network ends at or below the loss ESFT first reaches after
    some s steps, and ESFT cannot reach a lower loss any sooner, so the network's efficiency is at least
    s / `spent`. Where that is above 0.5, the share target asks more of the network than the efficiency
    target does; the more the curve still falls near `spent` steps, the nearer to 1 it is.
    """
    return _efficiency(curve, base_loss - share * (base_loss - curve_at(curve, spent)), spent)


def summarise(bench: Bench, run: dict[str, Any], curve: list[tuple[int, float]], esft_forgetting: dict[int, float]) -> None:
    s = bench.s
    spent = run["miners"] - run["adversaries"]
    equivalent = [esft_steps(curve, loss) for loss in run["losses"]]
    run["esft_equivalent_steps"] = [None if e is None else round(e, 1) for e in equivalent]
    total = spent * s.inner_steps * s.rounds  # every arm spends the same steps per miner (round_shape)
    if total in dict(curve):
        esft_drop = bench.base_loss - curve_at(curve, total)
        run["network_vs_esft"] = round((bench.base_loss - run["losses"][-1]) / esft_drop, 4)
    if total in esft_forgetting:
        run["esft_forgetting_equal_tokens"] = round(esft_forgetting[total], 4)
    run["parallel_efficiency"] = _efficiency(curve, run["losses"][-1], total)
    run["parallel_efficiency_monotone"] = _efficiency(monotone(curve), run["losses"][-1], total)
    before = [round(bench.base_loss, 4), *run["losses"]]  # losses are rounded; compare like with like
    run["rounds_lowered"] = sum(b < a for a, b in zip(before, run["losses"], strict=False))
    run["lowered_every_round"] = run["rounds_lowered"] == len(run["losses"])


def data_parallel(bench: Bench, curve: list[tuple[int, float]], miners: int) -> dict[str, Any]:
    """ESFT at `miners` times the miners' batch for one miner's steps: the most M miners' plain average can reach.

    Every step sees M batches at once, as if the M miners averaged gradients after every step instead
    of after H; a network that averages after H steps at outer lr 1 can at best match it. An outer lr
    above 1 also makes the steps larger, which can pass it where a larger step helps (records from
    the general base, `docs/learning.md`).
    """
    s = bench.s
    steps = s.inner_steps * s.rounds
    wide, _ = bench.esft_curve(steps, s.inner_steps, set(), batch_size=miners * s.batch_size)
    losses = [round(loss, 4) for _, loss in wide[1:]]
    equivalent = [esft_steps(curve, loss) for loss in losses]
    return {"miners": miners, "batch_size": miners * s.batch_size, "losses": losses,
            "esft_equivalent_steps": [None if e is None else round(e, 1) for e in equivalent],
            "parallel_efficiency": _efficiency(curve, losses[-1], miners * steps),
            "parallel_efficiency_monotone": _efficiency(monotone(curve), losses[-1], miners * steps),
            "network_vs_esft": round((bench.base_loss - losses[-1]) / (bench.base_loss - curve_at(curve, miners * steps)), 4)}


def at_learning_rate(bench: Bench, factor: float) -> dict[str, Any]:
    """ESFT for the 4-miner network's tokens and that network, both with the inner lr scaled by `factor`.

    Whether the shared lr is fair to the baseline: a higher lr can lower ESFT's target loss at the
    price of forgetting, and the network is then compared against that ESFT curve.
    """
    shared = bench.s
    bench.s = replace(shared, inner_lr=shared.inner_lr * factor)
    try:
        steps = 4 * shared.inner_steps * shared.rounds
        curve, forgetting = bench.esft_curve(steps, shared.inner_steps, {steps})
        run = bench.network(Arm())
        summarise(bench, run, curve, forgetting)
    finally:
        bench.s = shared
    return {"inner_lr": shared.inner_lr * factor, "esft_loss": round(curve[-1][1], 4),
            "esft_forgetting": round(forgetting[steps], 4),
            "network_4": {key: run[key] for key in ("losses", "merged", "forgetting", "network_vs_esft",
                                                    "esft_equivalent_steps", "parallel_efficiency")}}


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

SHORT_FAMILIES = (SHORT, f"{SHORT}_pgrad_p2", SHORT_PGRAD)
"""The short-round families the targets read: full experts at outer lr 2, compressed at 2 and at 2.5."""

SEED_ARMS = ("network_1", "network_4", "network_8", "adversarial_4", "pgrad_2bit_c256_k40_p2_4",
             "pgrad_2bit_c256_k40_p2_8", "keep_optimizer_4", "keep_optimizer_momentum0.5_4",
             "keep_optimizer_momentum0.5_8", "keep_optimizer_momentum0.5_adversarial_4",
             *(f"{family}_{name}" for family in SHORT_FAMILIES for name in ("4", "8", "adversarial_4")))
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
           for name in ("keep_optimizer_4", "keep_optimizer_momentum0.5_4", *(f"{f}_4" for f in SHORT_FAMILIES))
           for key in ("network_vs_esft", "parallel_efficiency", "parallel_efficiency_monotone")},
        "8_ahead_of_4": eight["losses"][-1] < four["losses"][-1],
        "8_ahead_of_4_pgrad_partitions_2": runs["pgrad_2bit_c256_k40_p2_8"]["losses"][-1]
        < runs["pgrad_2bit_c256_k40_p2_4"]["losses"][-1],
        "8_ahead_of_4_keep_optimizer_momentum0.5": runs["keep_optimizer_momentum0.5_8"]["losses"][-1]
        < runs["keep_optimizer_momentum0.5_4"]["losses"][-1],
        **{f"8_ahead_of_4_{family}": runs[f"{family}_8"]["losses"][-1] < runs[f"{family}_4"]["losses"][-1]
           for family in SHORT_FAMILIES},
        **{f"forgetting_4_no_worse_than_esft_{family}": _forgets_no_more(runs[f"{family}_4"])
           for family in SHORT_FAMILIES},
        "adversarial_lowers_every_round": runs["adversarial_4"]["lowered_every_round"],
        "adversarial_lowers_every_round_keep_optimizer_momentum0.5":
            runs["keep_optimizer_momentum0.5_adversarial_4"]["lowered_every_round"],
        **{f"adversarial_lowers_every_round_{family}": runs[f"{family}_adversarial_4"]["lowered_every_round"]
           for family in SHORT_FAMILIES},
        **{f"adversarial_rounds_lowered_{family}": runs[f"{family}_adversarial_4"]["rounds_lowered"]
           for family in SHORT_FAMILIES},
    }


def other_seeds(bench: Bench, arms: dict[str, Arm], main: dict[str, Any], seeds: tuple[int, ...]) -> dict[str, Any]:
    """The headline arms, their ESFT curve and the 4-miner ceiling again under other seeds (`Settings.seed`).

    `main` is seed 0's `headline`. Returns each seed's headline and, per number, its range over all seeds.
    """
    shared = bench.s
    per_miner = shared.inner_steps * shared.rounds
    by_seed = {"0": main}
    try:
        for seed in seeds:
            bench.s = replace(shared, seed=seed)
            curve, forgetting = bench.esft_curve(8 * per_miner, shared.inner_steps, {m * per_miner for m in (1, 4, 8)})
            runs = {name: bench.network(arms[name]) for name in SEED_ARMS}
            for run in runs.values():
                summarise(bench, run, curve, forgetting)
            by_seed[str(seed)] = headline(runs, data_parallel(bench, curve, 4),
                                          efficiency_for_share(curve, bench.base_loss, 4 * per_miner))
    finally:
        bench.s = shared
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
    }


def short_rounds(runs: dict[str, dict[str, Any]], family: str) -> dict[str, Any]:
    """The targets read on one family of short-round arms (`SHORT`, full or compressed)."""
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


def _family(name: str, arm: Arm) -> dict[str, Arm]:
    """`arm` on 4 miners, on 8, and on 4 with half adversarial, named as `SHORT_FAMILIES` are read."""
    return {f"{name}_4": replace(arm, miners=4), f"{name}_8": replace(arm, miners=8),
            f"{name}_adversarial_4": replace(arm, miners=4, adversaries=2)}


def _forgets_no_more(run: dict[str, Any]) -> bool:
    """Whether `run`'s general-domain loss rose no more than ESFT's at equal tokens."""
    return run["forgetting"] <= run.get("esft_forgetting_equal_tokens", math.inf)


def _ratio(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """Final ESFT-equivalent steps of `run` over `baseline`'s: how many times one network's progress the other makes."""
    a, b = run["esft_equivalent_steps"][-1], baseline["esft_equivalent_steps"][-1]
    return None if a is None or not b else round(a / b, 2)


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
        **_family(SHORT, short),
        **_family(f"{SHORT}_pgrad_p2", short_compressed),
        **_family(SHORT_PGRAD, replace(short_compressed, outer_lr=2.5)),
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
        **{f"h5_keep_optimizer_lr{lr:g}_4": replace(short, outer_lr=lr) for lr in (1.0, 1.5)},
        "h5_lr2_4": replace(short, keep_optimizer=False),
        "h5_keep_optimizer_lr2_gate_none_4": replace(short, gate="none"),
        "h5_keep_optimizer_lr2.83_8": replace(short, miners=8, outer_lr=2.83),
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
    full = bench.full_finetune(4 * settings.inner_steps * settings.rounds)
    learning_rates = {str(factor): at_learning_rate(bench, factor) for factor in (0.5, 2.0)}
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
        "learning_rate_check (ESFT at 4-miner tokens and network_4, inner lr x 0.5 and x 2)": learning_rates,
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
