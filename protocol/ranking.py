"""Ranking and rewards (DESIGN §6): combine validators' Proof-of-Loss reports into ranks and points.

Rules, identical on every node:
- A validator's verdict on a miner is a loss, a `Refused(reason)`, or None (it had nothing to
  judge: the blob was missing). Only verdicts from the miner's assigned validators count.
- A miner is rejected when at least half of its counted verdicts (losses plus refusals) are
  refusals; a refusal is checkable by anyone (hash, header, finiteness), so safety wins a tie.
  Otherwise its loss is the median of the reported losses; with no loss and no refusal it is
  unscored. Its utility is max(0, median of base_v - loss_v) over the validators v that reported a
  loss, each loss against that validator's own base loss: validators on other hardware or batch
  sizes can measure the same base a few ulps apart, and a miner that sent the head back unchanged
  must not gain by it.
- Near-duplicates and miners with zero utility are not ranked. The others are ranked 1, 2, ... by
  loss ascending, ties broken by commitment hash ascending. Rank k <= K earns
  points(k) = (K - k + 1) / K, so rank 1 earns 1 and rank K earns 1/K.
- Standing is an exponential moving average of points; a miner absent from a round decays.
- Only reports scored against the round's head count (`counted_reports`); `rank_reports` ranks a round from
  them, as every node can (a miner too, from the public reports).
This module knows nothing about how losses are measured or how near-duplicates are detected.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from protocol.messages import ScoreReport


class NoCountedReports(ValueError):
    """No report of the round was scored against the head: the round cannot be ranked."""


@dataclass(frozen=True)
class Refused:
    """A validator refused a miner's submission; `reason` is the validator's logged reason."""

    reason: str


# A validator's verdict on one miner: its loss, a refusal, or None when it had nothing to judge.
Score = float | Refused | None


@dataclass(frozen=True)
class MinerResult:
    """One miner's outcome this round; `reason` is empty exactly when it earned points."""

    miner: str
    commitment: str
    loss: float | None
    utility: float
    rank: int | None
    points: float
    reason: str


@dataclass(frozen=True)
class RoundRanking:
    """Every committed miner's outcome: ranked miners by rank first, then the rest by miner id."""

    base_loss: float
    top_k: int
    results: tuple[MinerResult, ...]

    def ranked(self) -> tuple[str, ...]:
        """Miners with a rank (positive utility, not a near-duplicate), best first."""
        return tuple(r.miner for r in self.results if r.rank is not None)

    def points(self) -> dict[str, float]:
        """Miner -> points earned this round, for miners that earned any."""
        return {r.miner: r.points for r in self.results if r.points > 0}

    def result(self, miner: str) -> MinerResult:
        for r in self.results:
            if r.miner == miner:
                return r
        raise KeyError(miner)


def median(values: Iterable[float]) -> float:
    """The median; the mean of the two middle values for an even count. ValueError when empty."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    middle = (ordered[mid - 1] + ordered[mid]) / 2
    if math.isinf(middle) and math.isfinite(ordered[mid - 1]) and math.isfinite(ordered[mid]):
        return ordered[mid - 1] / 2 + ordered[mid] / 2  # the sum overflowed; halves first (only then)
    return middle


def rank_points(rank: int, top_k: int) -> float:
    """points(rank) = (K - rank + 1) / K for rank 1..K, else 0."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if 1 <= rank <= top_k:
        return (top_k - rank + 1) / top_k
    return 0.0


def scores_from_report(report: ScoreReport, commitments: Mapping[str, str]) -> dict[str, Score]:
    """A report's verdicts by miner; entries whose commitment is not the miner's are dropped."""
    scores: dict[str, Score] = {}
    for entry in report.entries:
        if commitments.get(entry.miner) != entry.commitment:
            continue
        if entry.verdict == "accept" and entry.loss is not None:
            scores[entry.miner] = entry.loss
        elif entry.verdict == "reject":
            scores[entry.miner] = Refused(entry.reason or "unspecified")
        else:
            scores[entry.miner] = None
    return scores


def combine(
    miner: str, assigned: Iterable[str], reports: Mapping[str, Mapping[str, Score]]
) -> float | Refused | None:
    """A miner's combined verdict from its assigned validators' reports (rules in the module doc)."""
    losses: list[float] = []
    refusals: list[Refused] = []
    for validator in sorted(assigned):
        score = reports.get(validator, {}).get(miner)
        if isinstance(score, Refused):
            refusals.append(score)
        elif score is not None:
            if not math.isfinite(score) or score < 0:
                raise ValueError(
                    f"validator {validator[:12]} reported a non-finite or negative loss for {miner[:12]}"
                )
            losses.append(score)
    if refusals and len(refusals) >= len(losses):
        return refusals[0]
    return median(losses) if losses else None


def utility(miner: str, assigned: Iterable[str], reports: Mapping[str, Mapping[str, Score]],
            base_losses: Mapping[str, float]) -> float:
    """max(0, median over the assigned validators that reported a loss of (their base loss - that loss))."""
    gains = [base_losses[v] - score for v in sorted(assigned)
             if not isinstance(score := reports.get(v, {}).get(miner), Refused) and score is not None]
    return max(0.0, median(gains)) if gains else 0.0


def rank_round(
    reports: Mapping[str, Mapping[str, Score]],
    assignment: Mapping[str, Iterable[str]],
    base_losses: Mapping[str, float],
    commitments: Mapping[str, str],
    duplicates: Container[str],
    top_k: int,
) -> RoundRanking:
    """Rank the miners of `assignment` (miner -> assigned validators) from validators' reports and the
    base loss each validator reported (`base_losses`, by validator; one for every validator in `reports`)."""
    for validator, loss in base_losses.items():
        if not (math.isfinite(loss) and loss >= 0):
            raise ValueError(f"validator {validator[:12]}'s base loss must be a finite non-negative number, "
                             f"got {loss}")
    unknown = sorted(set(reports) - set(base_losses))
    if unknown:
        raise ValueError(f"no base loss for validator {unknown[0][:12]}, whose report counts")
    base_loss = median(base_losses.values()) if base_losses else 0.0
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    missing = sorted(set(assignment) - set(commitments))
    if missing:
        raise ValueError(f"no commitment for assigned miner {missing[0]}")

    eligible: list[tuple[float, str, str, float]] = []
    others: list[MinerResult] = []
    for miner in sorted(assignment):
        combined = combine(miner, assignment[miner], reports)
        if isinstance(combined, Refused):
            others.append(_unranked(miner, commitments[miner], None, 0.0, f"rejected: {combined.reason}"))
            continue
        if combined is None:
            others.append(_unranked(miner, commitments[miner], None, 0.0, "unscored"))
            continue
        gain = utility(miner, assignment[miner], reports, base_losses)
        if miner in duplicates:
            others.append(_unranked(miner, commitments[miner], combined, gain, "near-duplicate"))
        elif gain <= 0:
            others.append(_unranked(miner, commitments[miner], combined, gain, "no utility"))
        else:
            eligible.append((combined, commitments[miner], miner, gain))

    ranked = []
    for rank, (loss, commitment, miner, gain) in enumerate(sorted(eligible), start=1):
        points = rank_points(rank, top_k)
        reason = "" if points > 0 else "not ranked in top-K"
        ranked.append(MinerResult(miner, commitment, loss, gain, rank, points, reason))
    return RoundRanking(base_loss=base_loss, top_k=top_k, results=(*ranked, *others))


def update_standing(
    prev: Mapping[str, float], points: Mapping[str, float], alpha: float, floor: float = 1e-9
) -> dict[str, float]:
    """EMA of points: s' = (1 - alpha) * s + alpha * points; absent miners decay, those below `floor` drop."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    standing = {}
    for miner in sorted(set(prev) | set(points)):
        value = (1 - alpha) * prev.get(miner, 0.0) + alpha * points.get(miner, 0.0)
        if value >= floor:
            standing[miner] = value
    return standing


def _unranked(miner: str, commitment: str, loss: float | None, utility: float, reason: str) -> MinerResult:
    return MinerResult(miner, commitment, loss, utility, None, 0.0, reason)


def counted_reports(reports: Mapping[str, ScoreReport], head: str) -> dict[str, ScoreReport]:
    """The reports that count: those scored against the current head, by validator id."""
    return {validator: reports[validator] for validator in sorted(reports) if reports[validator].base == head}


def rank_reports(
    reports: Mapping[str, ScoreReport],
    assignment: Mapping[str, Iterable[str]],
    commitments: Mapping[str, str],
    head: str,
    top_k: int,
    duplicates: Container[str] = (),
) -> RoundRanking:
    """The round's ranking from the reports scored against `head` (every node can compute it; only
    validators holding the blobs know the near-duplicate flags, `duplicates`). NoCountedReports where none is."""
    counted = counted_reports(reports, head)
    if not counted:
        raise NoCountedReports(f"no score report was made against the current head {head[:12]}; keep the state")
    scores = {validator: scores_from_report(report, commitments) for validator, report in counted.items()}
    base_losses = {validator: report.base_loss for validator, report in counted.items()}
    return rank_round(scores, assignment, base_losses, commitments, duplicates, top_k)
