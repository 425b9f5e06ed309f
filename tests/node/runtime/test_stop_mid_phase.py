"""A node stopped while its torch work runs in a worker thread ends that work soon, so the process can
exit (asyncio waits for its worker threads before a process ends): a miner's training after the current
step instead of at the TRAIN deadline, a validator's scoring before its next submission."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from node.duties.miner import HonestStrategy, Job
from node.sim.twins import Twins
from protocol.rounds import Phase
from validator.scoring import Scorer

pytestmark = pytest.mark.timeout(120)


CAP = 3000  # steps of 10 ms: a loop that only a stopping node ends, capped so a failure cannot hang


class LongWork:
    """Stands in for torch work in a worker thread: runs until its `keep_going` says stop, or the cap.
    The twins' manual clock stands still, so no deadline ends it."""

    def __init__(self) -> None:
        self.started, self.ended = threading.Event(), threading.Event()
        self.steps = 0

    def run(self, keep_going: Callable[[], bool]) -> None:
        self.started.set()
        while keep_going() and self.steps < CAP:
            self.steps += 1
            self.ended.wait(0.01)
        self.ended.set()

    async def ends_when(self, stop: Callable[[], Awaitable[None]]) -> None:
        assert await asyncio.to_thread(self.started.wait, 30)
        await stop()
        assert await asyncio.to_thread(self.ended.wait, 10)
        assert self.steps < CAP  # it stopped because the node did, not at the cap


async def test_stopping_a_miner_ends_its_training_at_the_next_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    work = LongWork()

    def build(self: HonestStrategy, job: Job) -> bytes:
        work.run(job.keep_going)
        raise ValueError("stopped")

    monkeypatch.setattr(HonestStrategy, "build", build)
    net = Twins(tmp_path, validators=1)
    try:
        await net.start("validator-0")
        await net.start("miner-0")
        net.clock.set(net.schedule.phase_window(0, Phase.TRAIN)[0])
        await work.ends_when(lambda: net.stop("miner-0"))
    finally:
        work.ended.set()
        await net.close()


async def test_stopping_a_validator_ends_its_scoring_before_the_next_submission(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = LongWork()
    real = Scorer.score_round

    def score_round(self: Scorer, *args: Any) -> Any:
        keep_going = args[-1]
        work.run(keep_going)  # a long round of submissions
        return real(self, *args[:-1], keep_going)

    monkeypatch.setattr(Scorer, "score_round", score_round)
    net = Twins(tmp_path, validators=1)
    try:
        await net.start("validator-0")
        await net.start("miner-0")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        net.clock.set(net.schedule.phase_window(0, Phase.EVALUATE)[0])
        await work.ends_when(lambda: net.stop("validator-0"))
    finally:
        work.ended.set()
        await net.close()
