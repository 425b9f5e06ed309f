"""Every node keeps each round's leaderboard: a miner ranks the settled round from the public score
reports and gets the validators' ranks and points; per-miner history and adopted-state losses read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.sim.twins import Twins

pytestmark = pytest.mark.timeout(180)


async def test_miners_learn_the_leaderboard_validators_computed(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    try:
        for name, behaviour in (("validator-0", "honest"), ("validator-1", "honest"), ("miner-0", "honest"),
                                ("miner-1", "honest"), ("miner-2", "lazy")):
            await net.start(name, behaviour)
        await net.rounds(0, 1)
        v0, m0 = net.nodes["validator-0"], net.nodes["miner-0"]
        for r in (0, 1):
            exact, learnt = await v0.ctx.storage.round_results(r), await m0.ctx.storage.round_results(r)
            assert exact is not None and learnt is not None
            assert exact.pop("exact") is True and learnt.pop("exact") is False
            assert learnt == exact  # no near-duplicates here, so the miner's ranking is the validators'
            report = await v0.round_report(r)
            assert report is not None
            assert {m["id"]: (m["rank"], m["reward"]) for m in report["miners"]} == {
                m["miner"]: (m["rank"], m["points"]) for m in learnt["miners"]}
        me = net.id("miner-0")
        history = await m0.ctx.storage.miner_history(me)
        assert [h["round"] for h in history] == [0, 1] and all(h["rank"] is not None for h in history)
        assert set(history[0]["scores"]) == {net.id("validator-0"), net.id("validator-1")}
        assert all(s["verdict"] == "accept" for s in history[0]["scores"].values())
        lazy = (await m0.ctx.storage.miner_history(net.id("miner-2")))[0]
        assert (lazy["rank"], lazy["points"], lazy["reason"]) == (None, 0.0, "no utility")
        losses = await v0.ctx.storage.adopted_losses()
        assert list(losses) == [0, 1] and losses[1]["hash"] == await v0.ctx.storage.head()
        assert losses[1]["loss"] < losses[0]["loss"]
        assert await m0.ctx.storage.adopted_losses() == {}  # miners hold no held-out data
    finally:
        await net.close()
