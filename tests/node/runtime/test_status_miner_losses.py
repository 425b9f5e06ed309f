"""A miner's page shows the adopted state's held-out loss round by round from the public reports: also for a
round it could not rank (it held another head than the reports' base), once the next round's reports say how
that round ended, and not before."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node.duties.results import learn_results
from node.store.db import Storage
from protocol.identity import Identity
from protocol.messages import ScoreReport
from protocol.spec import NetworkSpec
from tests.node.runtime.test_status_views import BASE, play_round_zero, publish, views_for


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "node.db")
    yield store
    await store.close()


async def test_a_round_the_miner_could_not_rank_still_shows_its_adopted_loss(
        storage: Storage, spec: NetworkSpec, validator_ids: list[Identity], miner_ids: list[Identity]) -> None:
    await play_round_zero(storage, spec, validator_ids, miner_ids)
    await storage.record_round(0, 0.0)
    await storage.record_round(1, 1.0)
    await storage.set_head("dd" * 32)  # not the base the reports were made against
    assert await learn_results(storage, spec, 0) is None and await storage.round_results(0) is None
    views = views_for(storage, spec, miner_ids[0], "miner")
    assert await views.rounds() == []  # nothing public says yet how round 0 ended
    await publish(storage, spec, validator_ids[0], ScoreReport(round=1, base="ff" * 32, base_loss=2.2, entries=()))
    await publish(storage, spec, validator_ids[1], ScoreReport(round=1, base="ff" * 32, base_loss=2.4, entries=()))
    [round0] = [r for r in await views.rounds() if r["round"] == 0]
    assert (round0["source"], round0["base"], round0["base_loss"]) == ("public", BASE, 3.0)
    assert round0["global_loss"] == pytest.approx(2.3) and round0["miners"] == []
