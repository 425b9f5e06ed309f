"""A miner that reaches TRAIN only after its TRAIN deadline says so (one log line), submits nothing
and keeps running; it does not blame the data ("the batch iterator gave no batches")."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node.duties.miner import TRAIN_MARGIN_SHARE
from node.sim.twins import Twins
from protocol.rounds import Phase

pytestmark = pytest.mark.timeout(120)


async def test_a_miner_started_after_its_train_deadline_says_so(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    net = Twins(tmp_path, validators=1)
    try:
        await net.start("validator-0")
        miner = await net.start("miner-0")
        past_deadline_s = (1 - TRAIN_MARGIN_SHARE / 2) * net.schedule.train_s  # in TRAIN, inside the margin
        with caplog.at_level(logging.INFO, logger="node.duties.miner"):
            await net.phase(0, Phase.TRAIN, after_s=past_deadline_s)
        lines = [r.getMessage() for r in caplog.records if r.name == "node.duties.miner"]
        assert lines == ["round 0: no submission: no time left to train: the TRAIN deadline had already passed "
                         "when training would start"], lines
        assert await miner.ctx.storage.submission(0) is None
        assert not net.tasks["miner-0"].done()
    finally:
        await net.close()
