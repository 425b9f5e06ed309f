"""Paired statistics for the learning benchmark: two states' losses on the same sequences, a mean and its 95% interval.

Every comparison is a mean with a paired-bootstrap 95% interval, per seed and pooled over seeds.

Every state the benchmark compares is read on the same report sequences, each sequence counted as its share of the
token-weighted mean (`shares`), so the mean of a row-by-row difference is the difference of the two losses. One seed's
interval resamples the sequences (`paired`); the pooled one (`pooled`) resamples the seeds and, within every draw, the
sequences (the same rows for each seed drawn, since every seed reads the same report set), so it holds both the
sequences' and the seeds' spread. Both are percentile intervals over `DRAWS` resamples from a fixed generator, so the
same losses give the same interval.

`TaskRows` holds one setting and seed's states, row by row: for each honest network of M miners and round, the
adopted state (on the report set and on the general-domain report set) and the round's best single submission; for
each M and round, the data-parallel ceiling at its kept lr, ESFT, and on the general-domain report set ESFT at equal
tokens and at the network's in-domain loss. `comparisons` turns the tasks' rows into `COMPARISONS`, each per round,
per seed and pooled (a comparison of one network names its `miners`, one of forgetting its `esft_at`), where a gain
is the fewer miners' loss minus the more miners' and the others the named state's loss minus the other's. This
module knows nothing about models or how the states were trained.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DRAWS = 2000
"""Bootstrap resamples per interval."""
LEVEL = 0.95
"""The intervals' coverage."""

Rows = tuple[float, ...]
"""A state's loss on the report set, sequence by sequence, each its share of the token-weighted mean."""


@dataclass(frozen=True)
class Interval:
    """A mean difference in nats and its paired-bootstrap 95% interval."""

    mean: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        """The interval as the report writes it, rounded to 1e-5 nats."""
        return {"mean": round(self.mean, 5), "ci_low": round(self.low, 5), "ci_high": round(self.high, 5)}


def shares(row_sums: Sequence[float], tokens: int) -> Rows:
    """Each sequence's summed token loss as its share of the token-weighted mean: their mean is the loss."""
    return tuple(row * len(row_sums) / tokens for row in row_sums)


def difference(a: Rows, b: Rows) -> Rows:
    """`a` minus `b`, sequence by sequence."""
    if len(a) != len(b):
        raise ValueError(f"losses over {len(a)} and {len(b)} sequences cannot be paired")
    return tuple(x - y for x, y in zip(a, b, strict=True))


def paired(diffs: Rows, seed: int = 0) -> Interval:
    """The mean of one seed's row-by-row differences and its percentile interval over resampled sequences."""
    return pooled([diffs], seed)


def pooled(diffs: Sequence[Rows], seed: int = 0) -> Interval:
    """The mean over seeds of each seed's mean difference, and its interval: every resample draws the seeds with
    replacement and the sequences with replacement, the same sequences for every seed drawn (they read the same
    report set). With one seed it is `paired`."""
    import torch  # here, so that bench/learning.py judges its arguments before torch loads

    if not diffs or any(len(d) != len(diffs[0]) for d in diffs) or not diffs[0]:
        raise ValueError("pooled differences need one or more seeds, each over the same non-empty set of sequences")
    d_SN = torch.tensor(diffs, dtype=torch.float64)
    seeds, rows = d_SN.shape
    generator = torch.Generator().manual_seed(seed)
    pick_DS = torch.randint(seeds, (DRAWS, seeds), generator=generator) if seeds > 1 else torch.zeros(DRAWS, 1).long()
    pick_DN = torch.randint(rows, (DRAWS, rows), generator=generator)
    per_seed_SD = d_SN[:, pick_DN].mean(dim=2)  # each seed's mean over each draw's sequences
    means_D = per_seed_SD.gather(0, pick_DS.T).mean(dim=0)
    tail = (1 - LEVEL) / 2
    low, high = torch.quantile(means_D, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return Interval(math.fsum(d_SN.mean(dim=1).tolist()) / seeds, low, high)


COMPARISONS = ("ceiling 1->4", "ceiling 4->8", "network 1->4", "network 4->8", "adopted - ceiling",
               "adopted - best_single", "forgetting - esft_forgetting")
"""What `comparisons` compares: the gains of 1 -> 4 and 4 -> 8 miners (ceiling and network), and per network its
adopted state against the ceiling and the round's best single submission, and its forgetting against ESFT's."""
SCALING = {"1->4": (1, 4), "4->8": (4, 8)}


@dataclass
class TaskRows:
    """One setting and seed's states, row by row, by (what, miners, round) (module doc)."""

    states: dict[tuple[str, int, int], Rows] = field(default_factory=dict)

    def put(self, what: str, miners: int, round: int, rows: Rows) -> None:
        self.states[what, miners, round] = rows

    def get(self, what: str, miners: int, round: int) -> Rows:
        return self.states[what, miners, round]

    def diffs(self, what: str, miners: int | None, round: int) -> Rows | None:
        """The row-by-row differences `what` compares for a network of `miners` (None: a gain) in `round`; None where
        this task lacks a state it needs."""
        s = self.states
        if what.endswith(tuple(SCALING)):
            fewer, more = SCALING[what.split()[-1]]
            kind = "ceiling" if what.startswith("ceiling") else "adopted"
            if (kind, fewer, round) not in s or (kind, more, round) not in s:
                return None
            return difference(s[kind, fewer, round], s[kind, more, round])
        other = {"adopted - ceiling": "ceiling", "adopted - best_single": "best single"}[what]
        if miners is None or ("adopted", miners, round) not in s or (other, miners, round) not in s:
            return None
        return difference(s["adopted", miners, round], s[other, miners, round])

    def forgetting(self, miners: int, round: int, at: str) -> Rows | None:
        """The network's general-domain loss minus ESFT's, row by row, at equal tokens (ESFT after `round`) or at a
        matched in-domain loss (`at` "matched loss": ESFT's state whose report loss was nearest the network's)."""
        esft = ("esft general" if at == "equal tokens" else "esft matched general", miners, round)
        if ("adopted general", miners, round) not in self.states or esft not in self.states:
            return None
        return difference(self.states["adopted general", miners, round], self.states[esft])


def mean(rows: Rows) -> float:
    """The loss `rows` are the shares of."""
    return math.fsum(rows) / len(rows)


def comparisons(tasks: Mapping[tuple[str, int], TaskRows]) -> list[dict[str, Any]]:
    """Every comparison the tasks' rows allow, per round, per seed and pooled over the setting's seeds (module doc)."""
    out: list[dict[str, Any]] = []
    for domain in dict.fromkeys(d for d, _ in tasks):
        seeds = sorted(seed for d, seed in tasks if d == domain)
        mine = [tasks[domain, seed] for seed in seeds]
        rounds = 1 + max(r for rows in mine for (_, _, r) in rows.states)
        networks = sorted({m for rows in mine for (what, m, _) in rows.states if what == "adopted"})
        wanted: list[tuple[str, int | None, str | None]] = [(w, None, None) for w in COMPARISONS[:4]]
        wanted += [(w, m, None) for w in COMPARISONS[4:6] for m in networks]
        wanted += [(COMPARISONS[6], m, at) for m in networks for at in ("equal tokens", "matched loss")]
        for what, miners, at in wanted:
            for r in range(rounds):
                per_seed = [rows.diffs(what, miners, r) if at is None else rows.forgetting(miners or 0, r, at)
                            for rows in mine]
                found = [(seed, d) for seed, d in zip(seeds, per_seed, strict=True) if d is not None]
                if not found:
                    continue
                key = {"domain": domain, "what": what, "round": r, "miners": miners, "esft_at": at}
                out += [{**key, "seed": seed, **paired(d).as_dict()} for seed, d in found]
                if len(found) > 1:
                    out.append({**key, "seed": "pooled", **pooled([d for _, d in found]).as_dict()})
    return out
