"""A validator reveals its round seed only when the seed_reveal window opens, 2 x clock_skew_s into
REVEAL: before that a node whose clock is behind by the skew still takes commits, and a miner that saw
the seed could choose what to commit by it (protocol.check.window). It commits the seed at TRAIN's start, before it
waits for its model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from node.sim.twins import Twins, until
from protocol.check import window
from protocol.rounds import Phase
from validator.model import ValidatorModel


async def test_a_validator_reveals_its_seed_only_once_no_node_takes_a_commit(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=1)
    await net.start("validator-0")
    await net.start("miner-0")
    try:
        for phase in (Phase.TRAIN, Phase.COMMIT):
            await net.phase(0, phase)
        validator = net.nodes["validator-0"]
        reveal_start = net.schedule.phase_window(0, Phase.REVEAL)[0]
        opens = window("seed_reveal", 0, net.schedule)[0]
        assert opens == reveal_start + 2 * net.spec.timing.clock_skew_s
        net.clock.set(reveal_start + 0.5 * (opens - reveal_start))
        await until(
            lambda: validator.scheduler.current == (0, Phase.REVEAL), "the validator to enter REVEAL")
        await asyncio.sleep(1.0)  # what it would publish at once (in milliseconds) has had time to be stored
        assert [s.seed for s in await validator.ctx.storage.seeds_for(0)] == [None]
        await net.phase(0, Phase.REVEAL)  # the window opens
        assert all(s.seed for s in await validator.ctx.storage.seeds_for(0))
    finally:
        await net.close()


async def test_a_validator_still_loading_its_model_commits_its_seed_in_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At real size a validator loads its model at its first phase for about a minute, beside a miner loading its
    own, longer than TRAIN; its seed commit needs no model and goes out at TRAIN all the same (it went out once the
    model was loaded, after the window)."""
    loaded = threading.Event()  # set only when the test ends: until then the model never finishes loading
    load = ValidatorModel.load

    def slow_load(*args: Any) -> ValidatorModel:
        loaded.wait(timeout=60)
        return load(*args)

    monkeypatch.setattr(ValidatorModel, "load", staticmethod(slow_load))
    net = Twins(tmp_path, validators=1)
    await net.start("validator-0")
    try:
        validator = net.nodes["validator-0"]
        net.clock.set(net.schedule.phase_window(0, Phase.TRAIN)[0])
        await until(lambda: validator.scheduler.current == (0, Phase.TRAIN), "the validator to enter TRAIN")
        me = validator.ctx.identity.node_id
        for _ in range(1000):  # the commit is stored as it is published, in milliseconds
            if [s for s in await validator.ctx.storage.seeds_for(0) if s.commitment]:
                break
            await asyncio.sleep(0.005)
        assert [s.validator for s in await validator.ctx.storage.seeds_for(0) if s.commitment] == [me]
    finally:
        loaded.set()
        await net.close()
