"""The round scheduler: runs the node's phase handler at the start of every phase, on an injected Clock.

A plain loop over `Schedule.phase_at` / `next_phase_start` rather than APScheduler: the phase
boundaries are pure functions of the spec, so the loop needs no job store or trigger objects, and
with a `ManualClock` a test drives it through rounds deterministically without sleeping.

Semantics:
- a node started mid-phase runs that phase's handler at once (it resumes in the current round);
- handlers run one at a time: one that overruns its phase delays the next, never overlaps it, and
  phases whose window passed meanwhile are skipped (logged) in favour of the one now in progress;
- a handler that raises is logged with its traceback and recorded as a failed run, and the loop goes on; a
  run that cannot be recorded is logged the same way; `quiet(exc)`, when given, may say either error itself
  instead (a full disk: one line, no traceback, node.runtime.disk);
- a clock stepped back waits for the phase that ran to end (no phase runs twice), unless it went
  back more than a round before that phase began: then it is a clock that had been set ahead being
  corrected, and the loop resumes at the phase of the corrected time (logged as an error; duties
  check storage for what they already did).
Each run is kept as a `PhaseRun` (node.store.records, the record storage persists). This module knows
nothing about what a phase's duty does, messages, storage or networking.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

from node.runtime.clock import Clock
from node.store.records import PhaseRun
from protocol.rounds import PHASES, Phase, Schedule

log = logging.getLogger(__name__)

PhaseHandler = Callable[[int, Phase], Awaitable[None]]


class Scheduler:
    """Fires `handler(round, phase)` at each phase start; `await run()` until cancelled."""

    def __init__(self, schedule: Schedule, clock: Clock, handler: PhaseHandler,
                 on_run: Callable[[PhaseRun], Awaitable[None]] | None = None, history: int = 64,
                 quiet: Callable[[BaseException], bool] | None = None) -> None:
        self.schedule = schedule
        self.clock = clock
        self._handler = handler
        self._on_run = on_run
        self._quiet = quiet
        self.current: tuple[int, Phase] | None = None
        self.runs: deque[PhaseRun] = deque(maxlen=history)
        self.skipped = 0

    async def run(self) -> None:
        last: tuple[int, Phase] | None = None
        while True:
            now = self.clock.now()
            if now < self.schedule.genesis_ts:
                log.info("waiting %.1f s for genesis", self.schedule.genesis_ts - now)
                await self.clock.sleep_until(self.schedule.genesis_ts)
                continue
            due = self.schedule.phase_at(now)
            if last is not None and now < self.schedule.phase_window(*last)[0] - self.schedule.round_seconds:
                log.error("the clock went back from round %d %s to round %d %s: resuming there (was it set "
                          "ahead? the duties check what they already did)", last[0], last[1], due[0], due[1])
            elif last is not None and _index(due) <= _index(last):
                if due != last:
                    log.warning("the clock went back to round %d %s; waiting for round %d %s to end",
                                due[0], due[1], last[0], last[1])
                await self.clock.sleep_until(self.schedule.phase_window(*last)[1])
                continue
            if last is not None and _index(due) > _index(last) + 1:
                missed = _index(due) - _index(last) - 1
                self.skipped += missed
                log.warning("round %d %s overran: skipping %d phase(s), now at round %d %s",
                            last[0], last[1], missed, due[0], due[1])
            last = due
            await self._fire(*due)

    async def _fire(self, r: int, phase: Phase) -> None:
        self.current = (r, phase)
        phase_start = self.schedule.phase_window(r, phase)[0]
        started = self.clock.now()
        error = ""
        try:
            await self._handler(r, phase)
        except Exception as exc:  # a failing duty must not stop the node; the run records it
            error = f"{type(exc).__name__}: {exc}"
            if not self._told(exc):
                log.exception("round %d %s: phase handler failed", r, phase)
        run = PhaseRun(r, str(phase), started, self.clock.now(), not error, error, phase_start)
        self.runs.append(run)
        if self._on_run is not None:
            try:
                await self._on_run(run)
            except Exception as exc:
                if not self._told(exc):
                    log.exception("round %d %s: recording the phase run failed", r, phase)

    def _told(self, exc: Exception) -> bool:
        return self._quiet is not None and self._quiet(exc)


def _index(at: tuple[int, Phase]) -> int:
    """Phases counted from genesis, so order and gaps are plain integer arithmetic."""
    return at[0] * len(PHASES) + PHASES.index(at[1])
