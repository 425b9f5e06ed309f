"""A miner stopped during TRAIN ends its training thread after the current step instead of at the TRAIN
deadline, so the process can exit: asyncio waits for its worker threads before a process ends."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from node.duties.miner import HonestStrategy, Job
from protocol.rounds import Phase
from tests.node.twins import Twins

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
