"""The validator's prefetcher: nothing before the assignment is known, then one fetch per blob, assigned blobs
first, at most `limit` blobs and the byte budget a round (counted by declared sizes, each fetched with its
declared size as cap), and a new round starts afresh; `early_assignment` on real SQLite says who is
assigned once every committed seed is revealed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from node.duties.plan import make_plan
from node.duties.prefetch import Prefetcher, early_assignment
from node.store.db import Storage
from protocol.identity import Identity
from protocol.messages import Commit, Message, Reveal, SeedCommit, SeedReveal, seal
from protocol.seeds import commitment
from protocol.spec import parse_spec
from tests.conftest import make_identity, make_spec_dict

MINER = "ab" * 32


class CountingTransfer:
    """Stands in for the network's blob transfer: records each fetch and its cap, fetches nothing."""

    def __init__(self) -> None:
        self.fetched: list[str] = []
        self.caps: list[int] = []

    async def fetch(self, blob_hash: str, providers: Sequence[str], max_bytes: int) -> Path:
        self.fetched.append(blob_hash)
        self.caps.append(max_bytes)
        return Path("/nonexistent")


def blob(i: int) -> str:
    return f"{i:02x}" * 32


def miner(i: int) -> str:
    return f"{i + 100:02x}" * 32


async def settle(prefetch: Prefetcher, blobs: list[str]) -> None:
    for b in blobs:
        await prefetch.wait(b)
    await asyncio.sleep(0)


async def test_at_most_limit_blobs_are_prefetched_a_round() -> None:
    transfer = CountingTransfer()
    prefetch = Prefetcher(transfer, limit=3, budget_bytes=10_000)  # type: ignore[arg-type]  # only fetch is used
    blobs = [blob(i) for i in range(10)]
    prefetch.assign(frozenset())
    for b in [blobs[0], *blobs]:  # the first one twice
        prefetch.offer(b, MINER, 100, 100)
    await settle(prefetch, blobs)
    assert transfer.fetched == blobs[:3]
    prefetch.clear()  # the next round
    prefetch.assign(frozenset())
    prefetch.offer(blobs[9], MINER, 100, 100)
    await settle(prefetch, [blobs[9]])
    assert transfer.fetched == [*blobs[:3], blobs[9]]


async def test_nothing_is_fetched_before_the_assignment_is_known() -> None:
    transfer = CountingTransfer()
    prefetch = Prefetcher(transfer, limit=10, budget_bytes=10_000)  # type: ignore[arg-type]
    prefetch.offer(blob(0), miner(0), 100, 100)
    await asyncio.sleep(0)
    assert transfer.fetched == [] and prefetch.assigned is None
    prefetch.assign(frozenset({miner(0)}))
    await settle(prefetch, [blob(0)])
    assert transfer.fetched == [blob(0)]


async def test_assigned_blobs_go_first_and_the_budget_bounds_the_bytes() -> None:
    """Six miners reveal 100-byte blobs, two of them (offered last) assigned to us; 300 bytes of budget take
    the two assigned blobs and the first unassigned one, each fetched with its declared size as cap."""
    transfer = CountingTransfer()
    prefetch = Prefetcher(transfer, limit=10, budget_bytes=300)  # type: ignore[arg-type]
    blobs = [blob(i) for i in range(6)]
    for i, b in enumerate(blobs):
        prefetch.offer(b, miner(i), 100, 1_000)
    prefetch.assign(frozenset({miner(4), miner(5)}))
    await settle(prefetch, blobs)
    assert transfer.fetched == [blobs[4], blobs[5], blobs[0]]
    assert transfer.caps == [100, 100, 100]
    prefetch.offer(blob(7), miner(7), 100, 1_000)  # a late reveal finds the budget spent
    prefetch.offer(blob(8), miner(8), 2_000, 1_000)  # declared over the cap: never prefetched
    await asyncio.sleep(0)
    assert len(transfer.fetched) == 3
    prefetch.clear()  # a new round: budget and assignment start afresh
    prefetch.offer(blob(7), miner(7), 100, 1_000)
    await asyncio.sleep(0)
    assert len(transfer.fetched) == 3
    prefetch.assign(frozenset())
    await settle(prefetch, [blob(7)])
    assert transfer.fetched[3:] == [blob(7)]


async def test_a_budget_of_zero_prefetches_nothing() -> None:
    transfer = CountingTransfer()
    prefetch = Prefetcher(transfer, limit=10, budget_bytes=0)  # type: ignore[arg-type]
    prefetch.assign(frozenset({miner(0)}))
    prefetch.offer(blob(0), miner(0), 1, 100)
    await asyncio.sleep(0)
    assert transfer.fetched == []


async def test_the_early_assignment_is_the_plans_once_every_committed_seed_is_revealed(tmp_path: Path) -> None:
    spec = parse_spec(make_spec_dict())  # three validators, replication 2
    validators = [make_identity(i) for i in range(3)]
    miners = [make_identity(100 + i) for i in range(6)]
    store = await Storage.open(tmp_path / "node.db")
    try:
        async def accept(message: Message, who: Identity) -> None:
            assert await store.record_accepted(seal(message, spec.network_id, who), message, 1.0)

        for i, v in enumerate(validators):
            await accept(SeedCommit(round=0, commitment=commitment(f"{i + 1:064x}")), v)
        for i, m in enumerate(miners):
            await accept(Commit(round=0, commitment=blob(i)), m)
            await accept(Reveal(round=0, commitment=blob(i), size=10), m)
        me = validators[0].node_id
        assert await early_assignment(store, spec, 0, me) is None  # no seed revealed yet
        for i, v in enumerate(validators[:2]):
            await accept(SeedReveal(round=0, seed=f"{i + 1:064x}"), v)
        assert await early_assignment(store, spec, 0, me) is None  # one committed seed still unrevealed
        await accept(SeedReveal(round=0, seed=f"{3:064x}"), validators[2])
        assigned = await early_assignment(store, spec, 0, me)
        plan = await make_plan(store, spec, 0)
        assert plan is not None
        assert assigned == frozenset(m for m, chosen in plan.assignment.items() if me in chosen)
        assert 0 < len(assigned) < len(miners)  # replication 2 of 3: some miners are not ours
    finally:
        await store.close()
