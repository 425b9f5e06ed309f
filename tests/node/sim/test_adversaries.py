"""Simulation adversaries are strategies injected into the miner duty: one round on the twins with an
honest miner, a copier, a late committer and a noisy miner; only the honest miner is rewarded, and
each adversary ends with the verdict its misbehaviour earns."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.duties.miner import HonestStrategy, MinerDuties
from node.sim.adversaries import STRATEGIES, miner_factory
from node.sim.process import ADVERSARY_KINDS
from node.sim.twins import Twins
from protocol.rounds import Phase

pytestmark = pytest.mark.timeout(180)


def test_every_adversary_the_simulator_offers_has_a_strategy_and_unknown_ones_are_refused() -> None:
    assert set(STRATEGIES) == {"honest", *ADVERSARY_KINDS}
    assert STRATEGIES["honest"] is HonestStrategy
    with pytest.raises(ValueError, match="unknown miner behaviour 'sneaky'"):
        miner_factory("sneaky")


async def test_adversaries_misbehave_through_their_strategies(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    kinds = {"miner-0": "honest", "miner-1": "copier", "miner-2": "late", "miner-3": "noise"}
    try:
        await net.start("validator-0")
        await net.start("validator-1")
        for name, kind in kinds.items():
            node = await net.start(name, kind)
            assert isinstance(node.duties, MinerDuties) and node.duties.strategy.name == kind
        await net.phase(0, Phase.TRAIN)
        await net.phase(0, Phase.COMMIT)
        # the late miner sleeps until COMMIT is over (plus the skew) before committing: let that pass
        await net.phase(0, Phase.REVEAL, after_s=net.spec.timing.clock_skew_s + 0.5)
        for phase in (Phase.EVALUATE, Phase.MERGE):
            await net.phase(0, phase)
        report = await net.nodes["validator-0"].round_report(0)
        assert report is not None
        by_kind = {kinds[n]: next(m for m in report["miners"] if m["id"] == net.id(n)) for n in kinds}
        assert by_kind["honest"]["reward"] > 0 and by_kind["honest"]["verdict"] == "accept"
        copier = by_kind["copier"]  # the copied blob names its real miner: refused at the metadata check
        assert copier["verdict"] == "reject" and copier["reward"] == 0.0, copier
        late = by_kind["late"]
        assert (late["verdict"], late["reason"]) == ("missing", "no commit in the COMMIT window"), late
        assert await net.nodes["validator-0"].ctx.storage.submission(0) is None  # validators build nothing
        noise = by_kind["noise"]
        assert noise["reward"] == 0.0 and noise["loss"] > report["base_loss"], noise
        commits = await net.nodes["validator-0"].ctx.storage.commits_for(0)
        assert net.id("miner-2") not in {c.miner for c in commits}  # its own node refused to send it
    finally:
        await net.close()
