"""The round scheduler on a ManualClock: phases in order, resume mid-phase, survive failures, skip overruns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from node.runtime.clock import ManualClock, SystemClock
from node.runtime.scheduler import Scheduler
from node.store.records import PhaseRun
from protocol.rounds import Phase, Schedule

GENESIS = 1000.0
SCHEDULE = Schedule(GENESIS, train_s=30, commit_s=5, reveal_s=10, evaluate_s=10, merge_s=5, clock_skew_s=1)


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks run until `condition` holds (no wall-clock sleeping)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


class Recorder:
    def __init__(self, clock: ManualClock, fail: set[Phase] = frozenset(), work_s: dict[Phase, float] | None = None):
        self.clock = clock
        self.fail = fail
        self.work_s = work_s or {}
        self.calls: list[tuple[int, Phase, float]] = []
        self.runs: list[PhaseRun] = []

    async def handler(self, r: int, phase: Phase) -> None:
        self.calls.append((r, phase, self.clock.now()))
        self.clock.advance(self.work_s.get(phase, 0.0))  # a long duty: time passes while it works
        if phase in self.fail:
            raise RuntimeError(f"duty broke in {phase}")

    async def on_run(self, run: PhaseRun) -> None:
        self.runs.append(run)


async def start(clock: ManualClock, recorder: Recorder) -> tuple[Scheduler, asyncio.Task[None]]:
    scheduler = Scheduler(SCHEDULE, clock, recorder.handler, recorder.on_run)
    task = asyncio.create_task(scheduler.run())
    await until(lambda: clock.sleepers == 1)
    return scheduler, task


async def step_to(clock: ManualClock, t: float) -> None:
    clock.set(t)
    await until(lambda: clock.sleepers == 1)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_fires_every_phase_in_order_from_genesis() -> None:
    clock = ManualClock(GENESIS - 10)
    recorder = Recorder(clock)
    scheduler, task = await start(clock, recorder)
    assert recorder.calls == []  # waiting for genesis
    starts = [GENESIS, 1030, 1035, 1045, 1055, 1060, 1090]
    for t in starts:
        await step_to(clock, t)
    await stop(task)
    assert [(r, p) for r, p, _ in recorder.calls] == [
        (0, Phase.TRAIN), (0, Phase.COMMIT), (0, Phase.REVEAL), (0, Phase.EVALUATE), (0, Phase.MERGE),
        (1, Phase.TRAIN), (1, Phase.COMMIT)]
    assert [t for _, _, t in recorder.calls] == starts
    assert all(run.ok and run.late_s == 0 for run in recorder.runs)
    assert scheduler.current == (1, Phase.COMMIT) and scheduler.skipped == 0


async def test_no_phase_fires_twice_between_boundaries() -> None:
    clock = ManualClock(GENESIS + 1)
    recorder = Recorder(clock)
    _, task = await start(clock, recorder)
    for t in (GENESIS + 5, GENESIS + 10, GENESIS + 29.999):
        await step_to(clock, t)
    await stop(task)
    assert [(r, p) for r, p, _ in recorder.calls] == [(0, Phase.TRAIN)]


async def test_started_mid_phase_runs_that_phase_at_once() -> None:
    clock = ManualClock(GENESIS + 60 + 37)  # round 1, two seconds into REVEAL
    recorder = Recorder(clock)
    _, task = await start(clock, recorder)
    assert recorder.calls == [(1, Phase.REVEAL, GENESIS + 97)]
    assert recorder.runs[0].late_s == pytest.approx(2.0)
    await step_to(clock, GENESIS + 105)
    await stop(task)
    assert recorder.calls[-1] == (1, Phase.EVALUATE, GENESIS + 105)


async def test_a_raising_duty_is_recorded_and_the_loop_goes_on() -> None:
    clock = ManualClock(GENESIS)
    recorder = Recorder(clock, fail={Phase.COMMIT})
    scheduler, task = await start(clock, recorder)
    await step_to(clock, GENESIS + 30)
    await step_to(clock, GENESIS + 35)
    await stop(task)
    assert [p for _, p, _ in recorder.calls] == [Phase.TRAIN, Phase.COMMIT, Phase.REVEAL]
    assert [(run.phase, run.ok) for run in recorder.runs] == [("train", True), ("commit", False), ("reveal", True)]
    assert recorder.runs[1].error == "RuntimeError: duty broke in commit"
    assert list(scheduler.runs) == recorder.runs


async def test_an_overrunning_duty_delays_and_skips_but_never_overlaps() -> None:
    clock = ManualClock(GENESIS)
    recorder = Recorder(clock, work_s={Phase.TRAIN: 50.0})  # TRAIN work ends inside EVALUATE
    scheduler, task = await start(clock, recorder)
    await stop(task)
    assert [(r, p) for r, p, _ in recorder.calls] == [(0, Phase.TRAIN), (0, Phase.EVALUATE)]
    assert scheduler.skipped == 2  # COMMIT and REVEAL passed while TRAIN ran
    assert recorder.runs[0].duration_s == 50.0
    assert recorder.runs[1].late_s == pytest.approx(5.0)


async def test_manual_clock_wakes_sleepers_in_deadline_order() -> None:
    clock = ManualClock(0.0)
    woke: list[float] = []

    async def sleeper(t: float) -> None:
        await clock.sleep_until(t)
        woke.append(t)

    tasks = [asyncio.create_task(sleeper(t)) for t in (5.0, 1.0, 3.0)]
    await until(lambda: clock.sleepers == 3)
    clock.advance(3.0)
    await until(lambda: len(woke) == 2)
    assert woke == [1.0, 3.0] and clock.sleepers == 1
    clock.advance(2.0)
    await asyncio.gather(*tasks)
    assert woke == [1.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1.0)


class SteppingClock(ManualClock):
    """A clock that NTP can step backwards."""

    def step_back_to(self, t: float, wake: bool = False) -> None:
        """`wake`: end every wait, as the system clock's waits end when it is stepped back."""
        assert t < self._now
        self._now = t
        if wake:
            for _, _, future in self._sleepers:
                if not future.done():
                    future.set_result(None)
            self._sleepers.clear()


async def test_a_clock_stepping_back_never_refires_a_phase() -> None:
    clock = SteppingClock(GENESIS + 60)  # round 1 TRAIN
    calls: list[tuple[int, Phase]] = []

    async def handler(r: int, phase: Phase) -> None:
        calls.append((r, phase))
        if len(calls) == 1:
            clock.step_back_to(GENESIS + 40)  # round 0 REVEAL, while the TRAIN duty runs

    scheduler = Scheduler(SCHEDULE, clock, handler)
    task = asyncio.create_task(scheduler.run())
    await until(lambda: clock.sleepers == 1)
    await step_to(clock, GENESIS + 89)
    await step_to(clock, GENESIS + 90)  # round 1 COMMIT
    await stop(task)
    assert calls == [(1, Phase.TRAIN), (1, Phase.COMMIT)]


async def test_a_clock_set_rounds_ahead_and_corrected_resumes_at_the_corrected_phase(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = SteppingClock(GENESIS + 31)  # round 0 COMMIT
    calls: list[tuple[int, Phase]] = []

    async def handler(r: int, phase: Phase) -> None:
        calls.append((r, phase))

    scheduler = Scheduler(SCHEDULE, clock, handler)
    task = asyncio.create_task(scheduler.run())
    await until(lambda: clock.sleepers == 1)
    await step_to(clock, GENESIS + 10 * SCHEDULE.round_seconds + 1)  # set 10 rounds ahead: round 10 TRAIN
    clock.step_back_to(GENESIS + 36, wake=True)  # corrected: round 0 REVEAL
    await until(lambda: clock.sleepers == 1)
    await step_to(clock, GENESIS + 45)  # round 0 EVALUATE, as it would without the bogus hour
    await stop(task)
    assert calls == [(0, Phase.COMMIT), (10, Phase.TRAIN), (0, Phase.REVEAL), (0, Phase.EVALUATE)]
    assert "the clock went back from round 10 train to round 0 reveal" in caplog.text


async def test_system_clock_wait_ends_when_the_wall_clock_is_stepped_back(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([5000.0, 5000.0, 4000.0])  # a step of 1000 s back between two readings

    monkeypatch.setattr("node.runtime.clock.time.time", lambda: next(readings, 4000.0))
    await asyncio.wait_for(SystemClock(max_slice_s=0.01).sleep_until(9000.0), 1.0)  # not 5000 s


async def test_system_clock_sleeps_until_a_wall_time() -> None:
    clock = SystemClock(max_slice_s=0.01)
    target = clock.now() + 0.05
    await clock.sleep_until(target)
    assert clock.now() >= target
    before = clock.now()
    await clock.sleep_until(before - 10)  # a time already past returns at once
    assert clock.now() - before < 0.05
