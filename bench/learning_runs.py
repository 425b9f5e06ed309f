"""The learning benchmark's runs: the base, its data, each arm's network and the baselines it is read on.

`Bench` loads the pretrained tiny base (`training.pretrain`), generates the target domain's training,
held-out and general-domain sequences, picks the expert group, and runs one `Arm` at a time: the
network in-process with the protocol's own pieces (`training.trainer`, `training.pgrad`, Proof-of-Loss
on a round-seeded held-out subset, `training.outer`), single-node expert tuning (ESFT), full
fine-tuning and synchronous data parallelism (`data_parallel`). The functions below read a run against
the ESFT curve: `esft_equivalent_steps`, `parallel_efficiency`, `network_vs_esft`, forgetting.
This module knows nothing about which arms the benchmark runs or what it targets (bench/learning.py).
"""

from __future__ import annotations

import copy
import hashlib
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from sklearn.isotonic import IsotonicRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.adapters import adapter_for  # noqa: E402
from training.corpus import generate  # noqa: E402
from training.data import batches, heldout_subset, pack, shard  # noqa: E402
from training.evaluate import heldout_loss, loss_with_experts, token_loss_sum  # noqa: E402
from training.experts import extract, insert, parse_name, pseudo_gradient  # noqa: E402
from training.outer import OuterConfig, average_states, near_duplicates, outer_step  # noqa: E402
from training.pgrad import PgradConfig, chunk_draw, compressed_bytes, coverage, decode, encode  # noqa: E402
from training.pretrain import GENERAL_DOMAINS, base_config, load_pretrained  # noqa: E402
from training.selection import select_experts  # noqa: E402
from training.tokenizer import ByteTokenizer  # noqa: E402
from training.trainer import TrainConfig, backtracked, train_experts  # noqa: E402

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Agreement:
    """An outer step that gives every entry its own outer lr, from how the merged update moved it in earlier rounds.

    Rprop's rule applied to rounds: where the mean update keeps its sign from one round to the next the
    miners keep agreeing on a direction they have not settled, and the entry's lr grows by `grow`; where
    it flips they have overshot, and it shrinks by `shrink`; it stays in [`low`, `high`]. Not the
    protocol's outer step (`training.outer`): the benchmark measures it (bench/outer_lr.py)."""

    start: float = 2.0
    grow: float = 1.2
    shrink: float = 0.5
    low: float = 0.25
    high: float = 8.0


def agreement_step(
    global_t: Tensors, mean_t: Tensors, state: Tensors | None, cfg: Agreement
) -> tuple[Tensors, Tensors]:
    """Φ − lr ⊙ G for the plain mean `mean_t` (G = Φ − mean), each entry's lr set by `Agreement`'s rule.

    `state` (None in the first round) holds, per tensor, the previous round's G (`last:` name) and the
    entries' lrs (`lr:` name); returns the new global tensors and the new state.
    """
    new: Tensors = {}
    kept: Tensors = {}
    for name in sorted(global_t):
        phi = global_t[name].float()
        g = phi - mean_t[name].float()
        if state is None:
            lr = torch.full_like(phi, cfg.start)
        else:
            agree = g * state[f"last:{name}"]
            lr = state[f"lr:{name}"]
            lr = torch.where(agree > 0, (lr * cfg.grow).clamp(max=cfg.high), lr)
            lr = torch.where(agree < 0, (lr * cfg.shrink).clamp(min=cfg.low), lr)
        new[name] = phi - lr * g
        kept[f"last:{name}"] = g
        kept[f"lr:{name}"] = lr
    return new, kept


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
    """Adversarial miners besides the honest ones: the even-numbered send the state with noise, the odd-numbered
    copy honest miner 0 (`copier`)."""
    copier: Literal["same_round", "last_round"] = "same_round"
    """What a copying adversary sends. `same_round`: miner 0's update of this round, nudged by 1e-6, so the
    copy and its victim are dropped as near-duplicates. Commit-reveal keeps that from a copier who works
    alone (blobs are served only from REVEAL on, after commits close, and a blob names its miner, round and
    base, `docs/protocol.md` §5), so it stands for the victim handing its blob over, one operator's second
    identity. `last_round`: miner 0's update revealed in the previous round, applied to the current state
    under the copier's own name (the state unchanged in round 0), which is the most a copier on its own
    can send."""
    pgrad: PgradConfig | None = None
    duplicate_cosine: float = 0.9999
    """Cosine at which two pseudo-gradients count as copies (both dropped)."""
    weighting: Literal["uniform", "utility"] = "uniform"
    """How the outer step weights the merged updates: `uniform`, or `utility` (each by its u_i), as the
    spec's `[aggregation] weighting` does."""
    keep_optimizer: bool = False
    """Each miner goes on with its AdamW state from its previous round (as a DiLoCo worker does) instead of
    starting it at zero every round."""
    rewind: bool = False
    """With `keep_optimizer`: after a round that merged nothing, each miner's AdamW state goes back to what it
    was before the round, as a node with `[miner] keep_optimizer` and `rewind_optimizer` (its default) does
    (`node.duties.miner.InnerOptimizer`). The state did not move, so the next round steps from the same point,
    and moments that counted a step nobody took would count the same point's gradient again: on arithmetic with
    half the miners adversarial the miners then stopped passing the gate for good (docs/learning.md, "Rewinding
    the miners' AdamW state after a level round")."""
    backtrack: bool = False
    """With `rewind`: after each round that merges nothing, the miners' inner lr halves, down to 1/64 of the
    settings', and goes back to the settings' once a round merges an update (`training.trainer.backtracked`), as
    a node with `[miner] backtrack_lr` (its default) does. A rewound miner retries from the same point with the
    same moments; where its step still overshoots, only a shorter one can pass the gate (docs/learning.md,
    "Backtracking the miners' lr after a level round")."""
    gate: str = "each"
    """Which submissions may be merged. `each`: the protocol's Proof-of-Loss gate, each must lower the
    round's subset loss alone. Alternatives the sweep measures, not the protocol's: `marginal`, each
    must lower the subset loss of the plain mean of every non-copy (leaving it out raises it), ranked
    by that; `none`: every non-copy."""
    inner_steps: int | None = None
    """H for this arm (None: the settings'). The arm runs as many more or fewer rounds as keep the miner
    steps of every arm equal: settings' H x R / H."""
    experts: Literal["group", "partition"] = "group"
    """What each honest miner trains. `group`: the whole expert group, as the protocol has it;
    `partition` (the sweep, full experts only): its share of the group's experts (`Bench.share`), the
    others frozen, and the outer step takes each expert from the miners that trained it, as it takes a
    compressed chunk from the miners that sent it."""
    agreement: Agreement | None = None
    """Merge by `agreement_step` on the plain mean of the contributors (outer lr and momentum unused)."""
    subset: int | None = None
    """Held-out sequences of the round's Proof-of-Loss subset (the spec's `data.heldout_sequences`; None:
    the settings')."""
    beta1: float | None = None
    """The miners' AdamW first-moment decay (`TrainConfig.beta1`; None: the settings')."""
    lr_per_update: bool = False
    """The round's outer lr is `outer_lr` times the number of updates merged in it, not `outer_lr`: each
    merged update moves the state as far as it moved its miner, however many pass the gate (the spec's
    `aggregation.outer_lr_scale = "merged"`)."""

    delay: int = 0
    """Rounds by which the state the miners train from lags the one their update is merged into: at 1, round
    r's miners train from the state adopted at the start of round r - 1 (rounds that overlap, each TRAIN
    running while the previous round's windows do), and each update, taken as a pseudo-gradient from that
    state, is scored on and merged into the current one."""

    average: float = 0.0
    """Decay of the average of merged states the arm reports: after each round the reported state moves
    (1 - `average`) of the way to the state just merged (`average_states`), while the miners go on training
    from the merged state itself. 0 reports the merged state. The protocol's `aggregation.average_decay`:
    validators fold the same way (`training.outer.average_states`) in every round, merged or not, and the
    network adopts, reports and exports that average."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.average < 1.0:
            raise ValueError(f"average is a decay in [0, 1), got {self.average}")
        if self.rewind and not self.keep_optimizer:
            raise ValueError("rewind goes back to a kept AdamW state: it needs keep_optimizer")
        if self.backtrack and not self.rewind:
            raise ValueError("backtrack shortens a rewound miner's retry: it needs rewind")
        if self.delay < 0:
            raise ValueError(f"delay is a number of rounds, at least 0, got {self.delay}")
        if self.experts == "partition" and self.pgrad is not None:
            raise ValueError("an arm partitions either the experts among miners or the compressed chunks, not both")
        if self.agreement is not None and (self.outer_lr != 1.0 or self.momentum or self.lr_per_update):
            raise ValueError("the agreement step sets every entry's outer lr itself: leave outer_lr, momentum and "
                             "lr_per_update at their defaults")


@dataclass(frozen=True)
class Settings:
    """What every arm shares."""

    domain: str = "arithmetic"
    rounds: int = 5
    inner_steps: int = 20
    batch_size: int = 8
    inner_lr: float = 1e-3
    beta1: float = 0.9
    """AdamW's first-moment decay for ESFT and the miners (`TrainConfig.beta1`; an arm may set its own)."""
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

    def train_cfg(self, steps: int, batch_size: int | None = None, beta1: float | None = None,
                  lr_scale: float = 1.0) -> TrainConfig:
        return TrainConfig(steps=steps, lr=self.s.inner_lr * lr_scale, batch_size=batch_size or self.s.batch_size,
                           beta1=self.s.beta1 if beta1 is None else beta1)

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

    def esft_averaged(self, steps: int, every: int, decay: float) -> tuple[float, float]:
        """ESFT's held-out and general loss after `steps`, read on the average (`average_states`, decay `decay`)
        of its states after every `every` steps: a network's reported average, read against one node that
        averages its own states as often."""
        insert(self.model, self.adapter, self.base)
        stream = batches(self.train, self.s.batch_size, self.stream(1))
        averaged = self.base

        def averaging() -> Iterator[torch.Tensor]:
            nonlocal averaged
            for k in range(steps):
                if k and k % every == 0:  # the model holds step k's weights (`esft_curve`)
                    averaged = average_states(averaged, extract(self.model, self.adapter, self.group), decay)
                yield next(stream)

        train_experts(self.model, self.adapter, self.group, averaging(), self.train_cfg(steps))
        averaged = average_states(averaged, extract(self.model, self.adapter, self.group), decay)
        insert(self.model, self.adapter, self.base)
        return self.loss(averaged), self.loss(averaged, self.general) - self.base_general

    def full_finetune(self, steps: int) -> dict[str, Any]:
        model = copy.deepcopy(self.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.s.inner_lr)
        stream = batches(self.train, self.s.batch_size, self.stream(1))
        for _ in range(steps):
            ids_BL = next(stream)
            loss = token_loss_sum(model, ids_BL, self.tokenizer.pad_id) / int((ids_BL[:, 1:] != 256).sum())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
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

    def share(self, arm: Arm, miner: int) -> dict[int, list[int]]:
        """The experts `miner` trains: the whole group, or (`Arm.experts` "partition") every M-th of the
        group's (layer, expert) pairs in sorted order from the miner's own; with more miners than
        experts, miner i trains pair i mod the group's size alone."""
        if arm.experts == "group":
            return self.group
        pairs = sorted((layer, expert) for layer, experts in self.group.items() for expert in experts)
        share: dict[int, list[int]] = {}
        for layer, expert in pairs[miner % len(pairs) :: arm.miners]:
            share.setdefault(layer, []).append(expert)
        return share

    def network(self, arm: Arm) -> dict[str, Any]:
        global_t = {k: v.clone() for k, v in self.base.items()}
        momentum: Tensors | None = None
        agreed: Tensors | None = None
        errors: dict[int, Tensors | None] = {}
        optimizers: dict[int, dict[str, Any] | None] = {}
        losses, merged = [], []
        shapes = {name: tuple(t.shape) for name, t in self.base.items()}
        honest = arm.miners - arm.adversaries
        steps, rounds = round_shape(self.s, arm)
        started = [global_t]  # the state at the start of each round so far (for `Arm.delay`)
        reported = global_t  # the state the arm reports (`Arm.average`)
        revealed: Tensors | None = None  # honest miner 0's last update, for a `last_round` copier
        lr_scale = 1.0  # of the settings' inner lr (`Arm.backtrack`)
        for r in range(rounds):
            submissions: dict[int, Tensors] = {}
            masks: dict[int, Tensors] = {}
            trained_from = started[max(r - arm.delay, 0)]
            # train_experts updates a kept state in place (torch loads it without copying): keep a copy to rewind to
            before = {i: copy.deepcopy(optimizers.get(i)) for i in range(honest)} if arm.rewind else {}
            for i in range(honest):
                insert(self.model, self.adapter, trained_from)
                rows = self.miner_rows(arm, i, r)
                order = batches(rows, self.s.batch_size, self.stream(r))
                group = self.share(arm, i)
                result = train_experts(self.model, self.adapter, group, order,
                                       self.train_cfg(steps, beta1=arm.beta1, lr_scale=lr_scale), optimizers.get(i))
                submissions[i] = {**global_t, **result.tensors} if arm.delay == 0 else {
                    name: t + result.tensors[name] - trained_from[name] if name in result.tensors else t
                    for name, t in global_t.items()}
                if arm.experts == "partition":
                    owned = {(layer, expert) for layer, experts in group.items() for expert in experts}
                    masks[i] = {name: torch.tensor([float(parse_name(name)[:2] in owned)]) for name in global_t}
                if arm.keep_optimizer:
                    optimizers[i] = result.optimizer_state
            for j, i in enumerate(range(honest, arm.miners)):
                submissions[i] = self.adversary(j, global_t, submissions, r, arm.copier, revealed)
                if arm.experts == "partition":
                    masks[i] = {name: torch.ones(1) for name in global_t}
            if arm.pgrad is not None:
                for i, tensors in list(submissions.items()):
                    draw = chunk_draw(self.tag("learning-bench"), r, f"miner-{i}")
                    blob, errors[i] = encode(pseudo_gradient(global_t, tensors), errors.get(i), arm.pgrad, draw)
                    decoded = decode(blob, shapes, arm.pgrad, draw)
                    submissions[i] = {name: global_t[name] - decoded[name] for name in global_t}
                    masks[i] = coverage(shapes, arm.pgrad, draw)
            if honest:  # what miner 0 reveals this round (decoded, if compressed)
                revealed = pseudo_gradient(global_t, submissions[0])
            partitioned = arm.experts == "partition" or (arm.pgrad is not None and arm.pgrad.partitions > 1)
            ranked = self.score_and_rank(global_t, submissions, r, arm, masks if partitioned else None)
            contributors = ranked[: arm.top_g]
            if contributors:
                utilities = [u for _, u in contributors]
                outer = OuterConfig(lr=arm.outer_lr, momentum=arm.momentum, weighting=arm.weighting,
                                    lr_per_update=arm.lr_per_update)
                merged_t, momentum = outer_step(global_t, [submissions[i] for i, _ in contributors],
                                                utilities, momentum, outer,
                                                [masks[i] for i, _ in contributors] if partitioned else None)
                if arm.agreement is None:
                    global_t = merged_t
                else:
                    global_t, agreed = agreement_step(global_t, merged_t, agreed, arm.agreement)
            else:
                optimizers.update(before)  # empty unless `arm.rewind`
            if arm.backtrack:
                lr_scale = backtracked(lr_scale, merged=bool(contributors))
            insert(self.model, self.adapter, self.base)
            started.append(global_t)
            reported = average_states(reported, global_t, arm.average)
            losses.append(round(self.loss(reported), 4))
            merged.append([i for i, _ in contributors])
        general = self.loss(reported, self.general)
        out: dict[str, Any] = {**asdict(arm), "losses": losses, "merged": merged,
                               "forgetting": round(general - self.base_general, 4)}
        if arm.pgrad is not None:
            out["pgrad"] = {**asdict(arm.pgrad), "payload_bytes": compressed_bytes(shapes, arm.pgrad),
                            "bf16_bytes": sum(2 * math.prod(s) for s in shapes.values())}
        return out

    def adversary(
        self, j: int, global_t: Tensors, honest: dict[int, Tensors], r: int,
        copier: Literal["same_round", "last_round"] = "same_round", revealed: Tensors | None = None,
    ) -> Tensors:
        """Adversary `j`'s submission in round `r`: the state with noise, or a copy of honest miner 0 (`Arm.copier`;
        `revealed` is miner 0's pseudo-gradient of the previous round, None in round 0)."""
        if j % 2 == 0:
            gen = torch.Generator().manual_seed(self.stream(r * 7919 + j))
            return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in global_t.items()}
        if copier == "last_round":
            return {n: t - revealed[n] if revealed is not None else t.clone() for n, t in global_t.items()}
        victim = honest[0]
        return {n: t + 1e-6 * torch.ones_like(t) for n, t in victim.items()}

    def score_and_rank(
        self, global_t: Tensors, submissions: dict[int, Tensors], r: int, arm: Arm,
        coverage: dict[int, Tensors] | None = None,
    ) -> list[tuple[int, float]]:
        """The round's contributors with their utilities, best first, by the arm's gate (`Arm.gate`)."""
        seed_hex = hashlib.sha256(self.tag(f"learning-bench:{r}").encode()).hexdigest()
        subset = heldout_subset(self.pool, seed_hex, self.s.subset if arm.subset is None else arm.subset)
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


@contextmanager
def changed_settings(bench: Bench, **changes: Any) -> Iterator[Settings]:
    """`bench` run with its settings changed for the block and put back after it; yields the shared ones."""
    shared = bench.s
    bench.s = replace(shared, **changes)
    try:
        yield shared
    finally:
        bench.s = shared


def data_parallel(
    bench: Bench, curve: list[tuple[int, float]], miners: int, lr_factor: float = 1.0
) -> dict[str, Any]:
    """ESFT at `miners` times the miners' batch for one miner's steps, at the inner lr times `lr_factor`.

    Every step sees M batches at once, as if the M miners averaged gradients after every step instead
    of after H. At the shared lr (`lr_factor` 1) it is the most a plain average (outer lr 1) of M
    miners' updates can reach. M times the batch also has less gradient noise, so it can take larger
    steps: at `lr_factor` above 1 it is what the network can reach with an outer lr above 1, where
    the data rather than the number of steps limits learning (`docs/learning.md`).
    """
    s = bench.s
    steps = s.inner_steps * s.rounds
    with changed_settings(bench, inner_lr=s.inner_lr * lr_factor):
        wide, _ = bench.esft_curve(steps, s.inner_steps, set(), batch_size=miners * s.batch_size)
    losses = [round(loss, 4) for _, loss in wide[1:]]
    equivalent = [esft_steps(curve, loss) for loss in losses]
    return {"miners": miners, "batch_size": miners * s.batch_size, "inner_lr": s.inner_lr * lr_factor,
            "losses": losses,
            "esft_equivalent_steps": [None if e is None else round(e, 1) for e in equivalent],
            "parallel_efficiency": _efficiency(curve, losses[-1], miners * steps),
            "parallel_efficiency_monotone": _efficiency(monotone(curve), losses[-1], miners * steps),
            "network_vs_esft": round((bench.base_loss - losses[-1]) / (bench.base_loss - curve_at(curve, miners * steps)), 4)}


def at_learning_rate(bench: Bench, factor: float, arms: dict[str, Arm]) -> dict[str, Any]:
    """ESFT for the 4-miner network's tokens and each of `arms`, all with the inner lr scaled by `factor`.

    Whether the shared lr is fair to the baseline: a higher lr can lower ESFT's target loss at the
    price of forgetting, and the networks are then compared against that ESFT curve.
    """
    with changed_settings(bench, inner_lr=bench.s.inner_lr * factor) as shared:
        steps = 4 * shared.inner_steps * shared.rounds
        curve, forgetting = bench.esft_curve(steps, shared.inner_steps, {steps})
        runs = {name: bench.network(arm) for name, arm in arms.items()}
        for run in runs.values():
            summarise(bench, run, curve, forgetting)
    keys = ("losses", "merged", "forgetting", "network_vs_esft", "esft_equivalent_steps", "parallel_efficiency")
    return {"inner_lr": shared.inner_lr * factor, "esft_loss": round(curve[-1][1], 4),
            "esft_forgetting": round(forgetting[steps], 4),
            **{name: {key: run[key] for key in keys} for name, run in runs.items()}}
