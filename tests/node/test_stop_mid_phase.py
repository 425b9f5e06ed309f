"""A node stopped while its torch work runs in a worker thread ends that work soon, so the process can
exit (asyncio waits for its worker threads before a process ends): a miner's training after the current
step instead of at the TRAIN deadline, a validator's scoring before its next submission."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from node.duties.miner import HonestStrategy, Job
from protocol.rounds import Phase
from tests.node.twins import Twins
from validator.scoring import Scorer

pytestmark = pytest.mark.timeout(120)


async def test_stopping_a_miner_ends_its_training_at_the_next_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    started, ended = threading.Event(), threading.Event()
    steps: list[int] = []

    def build(self: HonestStrategy, job: Job) -> bytes:
        started.set()
        # the manual clock stands still, so only a stopping node ends this loop (or the 30 s cap)
        while job.keep_going() and len(steps) < 3000:
            steps.append(1)
            ended.wait(0.01)
        ended.set()
        raise ValueError("stopped")

    monkeypatch.setattr(HonestStrategy, "build", build)
    net = Twins(tmp_path, validators=1)
    try:
        await net.start("validator-0")
        await net.start("miner-0")
        net.clock.set(net.schedule.phase_window(0, Phase.TRAIN)[0])
        assert await asyncio.to_thread(started.wait, 30)
        await net.stop("miner-0")
        assert await asyncio.to_thread(ended.wait, 10)
        assert len(steps) < 3000  # it stopped because the node did, not at the cap
    finally:
        ended.set()
        await net.close()


async def test_stopping_a_validator_ends_its_scoring_before_the_next_submission(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started, ended = threading.Event(), threading.Event()
    asked: list[int] = []
    real = Scorer.score_round

    def score_round(self: Scorer, *args: Any, **kwargs: Any) -> Any:
        keep_going = args[-1]
        started.set()
        while keep_going() and len(asked) < 3000:  # a long round of submissions
            asked.append(1)
            ended.wait(0.01)
        ended.set()
        return real(self, *args[:-1], keep_going)

    monkeypatch.setattr(Scorer, "score_round", score_round)
    net = Twins(tmp_path, validators=1)
    try:
        await net.start("validator-0")
        await net.start("miner-0")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        net.clock.set(net.schedule.phase_window(0, Phase.EVALUATE)[0])
        assert await asyncio.to_thread(started.wait, 30)
        await net.stop("validator-0")
        assert await asyncio.to_thread(ended.wait, 10)
        assert len(asked) < 3000  # it stopped because the node did, not at the cap
    finally:
        ended.set()
        await net.close()
