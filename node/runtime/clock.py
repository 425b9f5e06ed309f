"""Time as an interface: the wall clock for real nodes and a manual clock that tests advance.

Round maths (protocol.rounds) is pure and takes timestamps; everything in node/ that waits for a
moment in time waits on a `Clock`, so tests move time forward instead of sleeping. This module
knows nothing about rounds or phases.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """POSIX time now, and a way to wait until a given POSIX time."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None:
        """Return once the clock reads `t`, or earlier if the clock was stepped back (the caller looks at
        the time again)."""


STEP_BACK_S = 1.0
"""How far the wall clock must go back between two readings of a wait for the wait to end early."""


class SystemClock:
    """The host's wall clock. Waits in slices so a wall-clock step (NTP) is noticed within a slice: a
    step forward ends the wait, and so does a step back, since the caller may then be waiting for a
    moment far in the future (the clock had been stepped ahead and is now corrected)."""

    def __init__(self, max_slice_s: float = 5.0) -> None:
        assert max_slice_s > 0
        self._max_slice_s = max_slice_s

    def now(self) -> float:
        return time.time()

    async def sleep_until(self, t: float) -> None:
        last = time.time()
        while (remaining := t - (now := time.time())) > 0:
            if now < last - STEP_BACK_S:
                return
            last = now
            await asyncio.sleep(min(remaining, self._max_slice_s))


class ManualClock:
    """A clock that only moves when told to; sleepers wake once time reaches their deadline."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep_until(self, t: float) -> None:
        if t <= self._now:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (t, next(self._order), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` and wake every sleeper whose deadline has passed."""
        if seconds < 0:
            raise ValueError(f"a manual clock only moves forward; got {seconds} s")
        self.set(self._now + seconds)

    def set(self, t: float) -> None:
        """Jump to time `t` (not earlier than now) and wake due sleepers."""
        if t < self._now:
            raise ValueError(f"a manual clock only moves forward; {t} is before {self._now}")
        self._now = t
        while self._sleepers and self._sleepers[0][0] <= t:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    @property
    def sleepers(self) -> int:
        """How many tasks are waiting on this clock right now (tests wait for this to settle)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())
