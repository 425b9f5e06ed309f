"""Round and phase arithmetic: which round and phase a POSIX timestamp falls in, and when each starts.

Round r starts at genesis + r * round_seconds and runs TRAIN, COMMIT, REVEAL, EVALUATE, MERGE in
that order. Every window is half-open, [start, end), and the end of MERGE is exactly the start of
the next round, so phases tile time without gaps. Time is always passed in as a float; this module
never reads the clock and knows nothing about messages or what happens in a phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from protocol.spec import MIN_PHASE_S, NetworkSpec


class Phase(StrEnum):
    """The five phases of a round, in order."""

    TRAIN = "train"
    COMMIT = "commit"
    REVEAL = "reveal"
    EVALUATE = "evaluate"
    MERGE = "merge"


PHASES: tuple[Phase, ...] = tuple(Phase)


@dataclass(frozen=True)
class Schedule:
    """The timing of one network: genesis, phase lengths (seconds) and clock-skew tolerance."""

    genesis_ts: float
    train_s: float
    commit_s: float
    reveal_s: float
    evaluate_s: float
    merge_s: float
    clock_skew_s: float = 2.0

    def __post_init__(self) -> None:
        for phase, length in zip(PHASES, self.lengths, strict=True):
            if not (math.isfinite(length) and length >= MIN_PHASE_S):
                raise ValueError(f"{phase} phase length must be at least {MIN_PHASE_S} seconds, got {length}")
        if not (math.isfinite(self.clock_skew_s) and self.clock_skew_s >= 0):
            raise ValueError(f"clock skew must be >= 0 seconds, got {self.clock_skew_s}")
        if not math.isfinite(self.genesis_ts):
            raise ValueError(f"genesis must be a finite timestamp, got {self.genesis_ts}")

    @classmethod
    def from_spec(cls, spec: NetworkSpec) -> Schedule:
        t = spec.timing
        return cls(
            genesis_ts=spec.genesis_ts,
            train_s=t.train_s,
            commit_s=t.commit_s,
            reveal_s=t.reveal_s,
            evaluate_s=t.evaluate_s,
            merge_s=t.merge_s,
            clock_skew_s=t.clock_skew_s,
        )

    @property
    def lengths(self) -> tuple[float, ...]:
        """Phase lengths in PHASES order."""
        return (self.train_s, self.commit_s, self.reveal_s, self.evaluate_s, self.merge_s)

    @property
    def round_seconds(self) -> float:
        return sum(self.lengths)

    def round_start(self, r: int) -> float:
        """When round `r` (>= 0) starts."""
        if r < 0:
            raise ValueError(f"round must be >= 0, got {r}")
        return self.genesis_ts + r * self.round_seconds

    def round_at(self, t: float) -> int:
        """The round in progress at time `t`; ValueError before genesis."""
        if t < self.genesis_ts:
            raise ValueError(f"time {t} is before genesis ({self.genesis_ts}); no round has started")
        r = int((t - self.genesis_ts) // self.round_seconds)
        # Float division can land one round off right at a boundary; round_start is the authority.
        if self.round_start(r) > t:
            r -= 1
        elif self.round_start(r + 1) <= t:
            r += 1
        return r

    def phase_window(self, r: int, phase: Phase) -> tuple[float, float]:
        """The half-open window [start, end) of `phase` in round `r`."""
        index = PHASES.index(phase)
        start = self.round_start(r) + sum(self.lengths[:index])
        # Ends are computed exactly like the next phase's start, so windows tile without float gaps.
        end = (
            self.round_start(r + 1)
            if phase is Phase.MERGE
            else self.round_start(r) + sum(self.lengths[: index + 1])
        )
        return start, end

    def phase_at(self, t: float) -> tuple[int, Phase]:
        """The round and phase in progress at time `t`; ValueError before genesis."""
        r = self.round_at(t)
        for phase in PHASES:
            if t < self.phase_window(r, phase)[1]:
                return r, phase
        raise AssertionError(f"time {t} falls past MERGE of round {r}")

    def next_phase_start(self, t: float) -> tuple[int, Phase, float]:
        """The first phase that starts strictly after `t`: (round, phase, start).

        Before genesis this is round 0's TRAIN.
        """
        if t < self.genesis_ts:
            return 0, Phase.TRAIN, self.genesis_ts
        r, phase = self.phase_at(t)
        if phase is Phase.MERGE:
            return r + 1, Phase.TRAIN, self.round_start(r + 1)
        following = PHASES[PHASES.index(phase) + 1]
        return r, following, self.phase_window(r, following)[0]
