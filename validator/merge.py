"""The MERGE phase's computation: combine score reports, rank and reward, aggregate the best, then gate what is adopted.

`merge_round` is THE one function MERGE calls: a pure function of this round's reports, assignment,
commitments and checked blobs plus the current global state and momentum, computed in a fixed order
in CPU fp32, so every validator given the same inputs returns byte-identical tensors. It returns
the ranking, the rewards and the merge; when blobs of candidates are not at hand it raises
`MissingBlobError` naming exactly those candidates, so the caller fetches them and calls it again.
The steps:
1. Count only reports scored against the current head (`report.base == head`); the round's
   `base_loss` is the median of their base losses.
2. Rank once without near-duplicate flags to find the candidates (a combined loss and u_i > 0);
   their pseudo-gradients G_i = global - Φ_i are compared and any pair with cosine >=
   `rewards.duplicate_cosine` flags both miners. (A pgrad network's blobs arrive rebuilt,
   Φ_i = global − decode(G_i) (validator.scoring), so this compares the decoded pseudo-gradients
   up to fp32 rounding; with partitions, over the chunks both miners drew, so one run's update sent
   by two identities on their own draws is caught.) Lazy miners never reach this step: an unchanged
   blob scores exactly its validator's L_base, so u_i = 0 and their zero update is never compared.
3. Rank again with the flags (`protocol.ranking`), which gives points; the top-G ranked miners are
   merged by `training.outer.outer_step` with the spec's aggregation settings. A lone contributor's
   merged state is its submission, with the momentum as it was: one update has lost nothing to
   averaging, and taking it as sent gives one state, not a second a rounding apart. In a pgrad network
   with partitions, each entry averages over the contributors that drew its chunk
   (`training.pgrad.coverage`; a miner's chunks are drawn from the reports' round and its id).
   A step whose state or momentum would hold an Inf or a NaN (finite updates near fp32's range, in
   experts the held-out subset never routes to, scaled by a large outer lr) is not taken: the round
   is ranked and rewarded, and the state stays.
When no miner qualifies no outer step is taken: the global tensors AND the momentum are returned
as the very same objects, so the state keeps its bytes and its hash (momentum is not decayed either,
since a decayed momentum would give validators that saw different rounds different states).

`gate` then decides what the round adopts. Its candidates are the current state, the merged state (where
a step was taken) and the state holding the best single submission's experts, the first of the ranking
without near-duplicate flags (with the momentum as it was; weighed once where it is the merged state);
each is measured by the caller's `measure` (validator.scoring.gate_measure: held-out rows the round seed
draws apart from the scored ones, row by row, and general-domain rows where the spec pins a file), and a
candidate that raises the general-domain loss by more than `aggregation.forgetting_budget` over the current
state's, or over the caller's `reference` (a successor spec's: its base state's, the value at the switch), is
refused. The rest are taken in the order of `CANDIDATES`, a fixed
preference: a candidate replaces the one held so far only on evidence, when the low end of its paired
gain's 95% interval (row by row over the gate rows) is above `aggregation.gate_margin`. Validators on
unlike hardware measure the same states a little apart; a decision that needs the gain past a margin far
wider than those differences comes out the same on each of them (docs/protocol.md §7 has the figures).
This module knows nothing about networking, storage or how losses were measured.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.messages import ScoreReport
from protocol.ranking import RoundRanking, rank_reports
from protocol.spec import NetworkSpec
from training.experts import PseudoGradient
from training.outer import OuterConfig, near_duplicates, outer_step
from training.pgrad import chunk_draw, coverage, pgrad_config

log = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor]


class MergeInputError(ValueError):
    """The inputs cannot give a merge every honest validator would agree on (and `protocol.ranking.NoCountedReports`
    where no report counts)."""


class MissingBlobError(MergeInputError):
    """Blobs of miners that must be compared or merged are not at hand; fetch them and retry."""

    def __init__(self, miners: list[str]) -> None:
        shown = ", ".join(m[:12] for m in miners)
        super().__init__(f"missing checked blobs for {len(miners)} candidate miner(s): {shown}")
        self.miners = miners


@dataclass(frozen=True)
class MergeResult:
    """The round's ranking and rewards, who was merged, and the next global tensors and momentum."""

    ranking: RoundRanking
    points: dict[str, float]
    contributors: list[str]
    new_global: dict[str, torch.Tensor]
    new_momentum: dict[str, torch.Tensor]
    duplicates: set[str]
    best: str | None
    """The best single submission: the first miner of the ranking without near-duplicate flags (a flag denies
    a copier the reward and the merge, while adopting one of two equal updates gives the same state)."""

    @property
    def changed(self) -> bool:
        """False when no miner qualified: `new_global` and `new_momentum` are the inputs unchanged."""
        return bool(self.contributors)


CANDIDATES = ("current", "merged", "best_single")
"""The states the merge gate weighs, in the order of preference: a later one replaces an earlier one only on
evidence (`Gain.clears`)."""
GATE_Z = 1.96
"""How many standard errors below its mean a gain's interval ends: the two-sided 95% interval's low end."""


@dataclass(frozen=True)
class GateLoss:
    """A candidate state's loss on the round's gate rows, and on the general-domain rows (None: none held)."""

    loss: float
    general: float | None = None
    rows: tuple[float, ...] = ()
    """The gate loss row by row, each row's share of it (its summed token loss x rows / tokens), so `loss` is
    their mean; empty where only the mean is known (a gain then has no spread)."""


@dataclass(frozen=True)
class Gain:
    """How much lower one candidate's gate loss is than another's, in nats: the mean, and the low end of its
    paired 95% interval (row by row: both were measured on the same rows)."""

    mean: float
    low: float

    @classmethod
    def of(cls, challenger: GateLoss, incumbent: GateLoss) -> Gain:
        mean = incumbent.loss - challenger.loss
        if len(challenger.rows) != len(incumbent.rows):
            raise ValueError(f"gate losses over {len(challenger.rows)} and {len(incumbent.rows)} rows cannot be paired")
        if len(challenger.rows) < 2:
            return cls(mean, mean)
        diffs = [a - b for a, b in zip(incumbent.rows, challenger.rows, strict=True)]
        return cls(mean, mean - GATE_Z * statistics.stdev(diffs) / math.sqrt(len(diffs)))

    def clears(self, margin: float) -> bool:
        """The evidence a change needs: the interval lies wholly above `margin`."""
        return self.low > margin


@dataclass(frozen=True)
class Challenge:
    """A candidate weighed against the one the gate held so far (`against`), and its gain over it."""

    against: str
    gain: Gain


@dataclass(frozen=True)
class Adoption:
    """What the merge gate adopted: the candidate, its tensors and momentum, whose updates it holds (the
    merged contributors, the best single submission's miner, or nobody), and every candidate's losses."""

    adopted: str
    contributors: list[str]
    new_global: dict[str, torch.Tensor]
    new_momentum: dict[str, torch.Tensor]
    losses: dict[str, GateLoss]
    refused: tuple[str, ...]
    """Candidates over the forgetting budget, or with a non-finite loss."""
    challenges: dict[str, Challenge] = field(default_factory=dict)
    """Each candidate weighed after the current state: the one it was weighed against, and its gain over it."""
    holders: dict[str, list[str]] = field(default_factory=dict)
    """Whose updates each weighed candidate holds (what a GlobalState for it would name as contributors)."""

    @property
    def changed(self) -> bool:
        """False when the current state stays: `new_global` and `new_momentum` are the inputs unchanged."""
        return self.adopted != "current"

    def report(self) -> dict[str, Any]:
        """The gate as a round report shows it (`losses` and `general_losses` by candidate; empty when
        nothing was merged and there was nothing to weigh)."""
        general = {name: loss.general for name, loss in self.losses.items() if loss.general is not None}
        return {"adopted": self.adopted, "losses": {name: loss.loss for name, loss in self.losses.items()},
                "general_losses": general or None, "refused": list(self.refused), "holders": dict(self.holders),
                "gains": {name: {"against": c.against, "mean": c.gain.mean, "low": c.gain.low}
                          for name, c in self.challenges.items()}}


def outer_config(spec: NetworkSpec) -> OuterConfig:
    """The outer optimizer settings a spec fixes for a step over two or more updates."""
    agg = spec.aggregation
    return OuterConfig(lr=agg.outer_lr, momentum=agg.momentum, clip_to_median=agg.clip_to_median,
                       weighting=agg.weighting)


def as_state(tensors: Tensors) -> dict[str, torch.Tensor]:
    """A submission's experts as global state tensors: fp32 on the CPU, by sorted name."""
    return {name: tensors[name].detach().to("cpu", torch.float32) for name in sorted(tensors)}


def merge_round(
    reports: Mapping[str, ScoreReport],
    assignment: Mapping[str, Iterable[str]],
    commitments: Mapping[str, str],
    blobs: Mapping[str, Tensors],
    global_tensors: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    spec: NetworkSpec,
    head: str,
) -> MergeResult:
    """Rank, reward and aggregate one round (steps in the module doc).

    `reports`: validator -> its ScoreReport for this round; `assignment`: miner -> its assigned
    validators; `commitments`: miner -> commitment; `blobs`: miner -> tensors of its checked blob
    (at least every candidate; see MissingBlobError); `head`: hash of the state `global_tensors` is.
    """
    preliminary = rank_reports(reports, assignment, commitments, head, spec.rewards.top_k)
    needed = sorted(preliminary.ranked())
    missing = [miner for miner in needed if miner not in blobs]
    if missing:
        raise MissingBlobError(missing)

    grads = {miner: PseudoGradient(global_tensors, blobs[miner]) for miner in needed}  # computed name by name
    masks = _coverage(reports, needed, global_tensors, spec)
    duplicates = near_duplicates(grads, spec.rewards.duplicate_cosine, masks)
    ranking = rank_reports(reports, assignment, commitments, head, spec.rewards.top_k, duplicates)
    contributors = list(ranking.ranked()[: spec.aggregation.top_g])
    best = preliminary.ranked()[0] if needed else None
    if not contributors:
        return MergeResult(ranking, ranking.points(), [], global_tensors, momentum, duplicates, best)
    if len(contributors) == 1:  # an outer lr above 1 makes up for what averaging loses; one update lost nothing
        alone = as_state(blobs[contributors[0]])
        return MergeResult(ranking, ranking.points(), contributors, alone, momentum, duplicates, best)

    utilities = [ranking.result(miner).utility for miner in contributors]
    cfg = outer_config(spec)
    new_global, new_momentum = outer_step(
        global_tensors, [blobs[miner] for miner in contributors], utilities, momentum, cfg,
        None if masks is None else [masks[miner] for miner in contributors],
    )
    overflowed = sorted(name for tensors in (new_global, new_momentum) for name, t in tensors.items()
                        if not bool(torch.isfinite(t).all()))
    if overflowed:
        log.warning("the outer step over %s would put non-finite values in %s; the state stays",
                    ", ".join(m[:12] for m in contributors), overflowed[0])
        return MergeResult(ranking, ranking.points(), [], global_tensors, momentum, duplicates, best)
    return MergeResult(ranking, ranking.points(), contributors, new_global, new_momentum, duplicates, best)


def gate(
    merge: MergeResult,
    blobs: Mapping[str, Tensors],
    global_tensors: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    spec: NetworkSpec,
    measure: Callable[[Tensors], GateLoss],
    reference: float | None = None,
) -> Adoption:
    """The state round `merge` adopts (steps in the module doc); `measure` gives a candidate's losses, and the
    forgetting budget counts from `reference`'s general-domain loss where given, else from the current state's.

    Without a best single submission there is nothing to weigh: the current state stays, unmeasured. Without a
    merge (every candidate flagged a near-duplicate, or a step that would overflow) the merged candidate is the
    current state, and where the merge is the best single submission alone it is that candidate: neither is
    weighed twice."""
    if merge.best is None:
        return Adoption("current", [], global_tensors, momentum, {}, ())
    # The submission is measured as it is held (`Scorer.held`: read a tensor at a time) and copied into
    # fp32 state tensors only if it is adopted: the group in fp32 is 0.8 GB at OLMoE-1B-7B's size.
    single = blobs[merge.best]
    states: dict[str, Tensors] = {"current": global_tensors, "merged": merge.new_global, "best_single": single}
    weighed = [name for name in CANDIDATES if (name != "merged" or merge.changed)
               and (name != "best_single" or merge.contributors != [merge.best])]
    losses = {name: measure(states[name]) for name in weighed}
    holders = {name: {"current": [], "merged": list(merge.contributors), "best_single": [merge.best]}[name]
               for name in weighed}
    budget = spec.aggregation.forgetting_budget
    since = losses["current"].general if reference is None else reference
    refused = tuple(name for name in weighed[1:] if not _within_budget(losses[name], since, budget))
    held, challenges = "current", {}
    for name in weighed[1:]:
        if name in refused:
            continue
        challenges[name] = Challenge(held, Gain.of(losses[name], losses[held]))
        if challenges[name].gain.clears(spec.aggregation.gate_margin):
            held = name
    if held == "merged":
        tensors, moment = merge.new_global, merge.new_momentum
    elif held == "best_single":
        tensors, moment = as_state(single), momentum
    else:
        tensors, moment = global_tensors, momentum
    log.info("gate: adopting the %s state (%s)%s", held,
             ", ".join(f"{name} {loss.loss:.4f}" for name, loss in losses.items()),
             f"; refused {', '.join(refused)}" if refused else "")
    return Adoption(held, list(holders[held]), tensors, moment, losses, refused, challenges, holders)


def _within_budget(candidate: GateLoss, since: float | None, budget: float | None) -> bool:
    """A finite gate loss, and no more than `budget` nats of general-domain loss over `since` (where the spec sets
    a budget and both were measured)."""
    if not math.isfinite(candidate.loss):
        return False
    if budget is None or candidate.general is None or since is None:
        return True
    return math.isfinite(candidate.general) and candidate.general - since <= budget


def _coverage(
    reports: Mapping[str, ScoreReport], miners: list[str], global_tensors: Tensors, spec: NetworkSpec
) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each miner's chunk weights in a partitioned pgrad network; None when every blob covers everything."""
    cfg = pgrad_config(spec)
    if cfg is None or cfg.partitions == 1:
        return None
    rounds = {report.round for report in reports.values()}
    if len(rounds) != 1:
        raise MergeInputError(f"score reports of rounds {sorted(rounds)} cannot be merged together")
    (round,) = rounds
    shapes = {name: tuple(t.shape) for name, t in global_tensors.items()}
    return {miner: coverage(shapes, cfg, chunk_draw(spec.network_id, round, miner)) for miner in miners}
