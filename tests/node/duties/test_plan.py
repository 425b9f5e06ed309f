"""node.duties.plan on real SQLite: which miners a plan counts as revealed, how many validators each
gets, which validators it excludes (in what order, for exactly two rounds), when a round has no plan,
and when a round's commits and reveals are `unpaired`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest

from node.duties.plan import excluded_validators, make_plan, unpaired, withheld
from node.store.db import Storage
from node.store.records import SeedRecord
from protocol.identity import Identity
from protocol.messages import Commit, Message, Reveal, SeedCommit, SeedReveal, seal
from protocol.seeds import commitment
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import make_identity, make_spec_dict

SPEC = parse_spec(make_spec_dict())  # three validators, replication 2
WIDE = parse_spec(make_spec_dict(6))
VALIDATORS = [make_identity(i) for i in range(6)]
MINERS = [make_identity(100 + i) for i in range(3)]
OUTSIDER = make_identity(99)  # not a validator of either spec


def h(i: int) -> str:
    return f"{i:064x}"


async def accept(store: Storage, spec: NetworkSpec, message: Message, who: Identity) -> None:
    assert await store.record_accepted(seal(message, spec.network_id, who), message, 1.0)


async def seeds(store: Storage, spec: NetworkSpec, r: int, who: Iterable[Identity], reveal: bool = True) -> None:
    for v in who:
        seed = h(1000 * r + int(v.node_id[:8], 16) % 997 + 1)
        await accept(store, spec, SeedCommit(round=r, commitment=commitment(seed)), v)
        if reveal:
            await accept(store, spec, SeedReveal(round=r, seed=seed), v)


@pytest.fixture
async def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    storage = await Storage.open(tmp_path / "node.db")
    yield storage
    await storage.close()


def test_withheld_names_validators_without_a_matching_reveal_sorted() -> None:
    a, b, c, d = sorted(v.node_id for v in VALIDATORS[:4])
    records = [
        SeedRecord(0, b, commitment(h(1)), None),  # committed, never revealed
        SeedRecord(0, a, commitment(h(2)), h(3)),  # revealed a seed that does not match
        SeedRecord(0, c, commitment(h(4)), h(4)),  # honest
        SeedRecord(0, d, None, h(5)),  # a reveal without a commit withholds nothing
    ]
    assert withheld(records) == (a, b)


async def test_a_plain_round_counts_only_matching_reveals(store: Storage, caplog: pytest.LogCaptureFixture) -> None:
    await seeds(store, SPEC, 0, VALIDATORS[:3])
    m0, m1, m2 = MINERS
    await accept(store, SPEC, Commit(round=0, commitment=h(10)), m0)
    await accept(store, SPEC, Reveal(round=0, commitment=h(10), size=5), m0)
    await accept(store, SPEC, Commit(round=0, commitment=h(11)), m1)
    await accept(store, SPEC, Reveal(round=0, commitment=h(12), size=5), m1)  # not what it committed
    await accept(store, SPEC, Commit(round=0, commitment=h(13)), m2)  # never revealed
    with caplog.at_level(logging.INFO, logger="node.duties.plan"):
        plan = await make_plan(store, SPEC, 0)
    assert plan is not None
    assert plan.revealed == {m0.node_id: h(10)}
    assert plan.commits == {m0.node_id: h(10), m1.node_id: h(11), m2.node_id: h(13)}
    assert list(plan.assignment) == [m0.node_id] and len(plan.assignment[m0.node_id]) == 2  # replication
    assert plan.unrevealed_seeds == () and plan.excluded == ()
    assert [r.getMessage() for r in caplog.records if r.name == "node.duties.plan"] == []  # nobody left out, every revealed miner admitted: nothing to say


async def test_a_round_without_a_revealed_seed_has_no_plan(store: Storage, caplog: pytest.LogCaptureFixture) -> None:
    await seeds(store, SPEC, 0, VALIDATORS[:3], reveal=False)
    await accept(store, SPEC, Commit(round=0, commitment=h(10)), MINERS[0])
    with caplog.at_level(logging.WARNING, logger="node.duties.plan"):
        assert await make_plan(store, SPEC, 0) is None
    assert "round 0: no validator revealed a seed matching its commitment" in caplog.text


async def test_a_withheld_seed_excludes_for_rounds_one_and_two_only(store: Storage) -> None:
    v2 = VALIDATORS[2].node_id
    await seeds(store, SPEC, 0, VALIDATORS[:2])
    await seeds(store, SPEC, 0, VALIDATORS[2:3], reveal=False)
    for r in (1, 2, 3):
        await seeds(store, SPEC, r, VALIDATORS[:3])
        await accept(store, SPEC, Commit(round=r, commitment=h(10 + r)), MINERS[0])
        await accept(store, SPEC, Reveal(round=r, commitment=h(10 + r), size=5), MINERS[0])
    expected = {1: (v2,), 2: (v2,), 3: ()}  # SEED_WITHHOLD_ROUNDS = 2 is protocol: every node must agree
    for r, excluded in expected.items():
        plan = await make_plan(store, SPEC, r)
        assert plan is not None and plan.excluded == excluded, r


async def test_exclusions_are_sorted_and_name_only_spec_validators(
    store: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    withholders = VALIDATORS[1:]
    await seeds(store, WIDE, 0, VALIDATORS[:1])
    await seeds(store, WIDE, 0, [*withholders, OUTSIDER], reveal=False)
    await seeds(store, WIDE, 1, VALIDATORS)
    await accept(store, WIDE, Commit(round=1, commitment=h(10)), MINERS[0])
    await accept(store, WIDE, Reveal(round=1, commitment=h(10), size=5), MINERS[0])
    # Five of six excluded: a set's iteration order would come out sorted once in 5! = 120 processes.
    expected = tuple(sorted(v.node_id for v in withholders))
    assert await excluded_validators(store, WIDE, 1) == expected
    with caplog.at_level(logging.INFO, logger="node.duties.plan"):
        plan = await make_plan(store, WIDE, 1)
    assert plan is not None and plan.excluded == expected
    assert plan.assignment == {MINERS[0].node_id: (VALIDATORS[0].node_id,)}
    assert "round 1: validator(s) " in caplog.text and "left out of the assignment" in caplog.text


async def test_unpaired_sees_any_commit_without_its_reveal_or_the_reverse(store: Storage) -> None:
    m0, m1 = MINERS[:2]
    await seeds(store, SPEC, 0, VALIDATORS[:3])
    await accept(store, SPEC, Commit(round=0, commitment=h(10)), m0)
    await accept(store, SPEC, Reveal(round=0, commitment=h(10), size=5), m0)
    assert not await unpaired(store, 0)  # every commit has its reveal
    await accept(store, SPEC, Commit(round=0, commitment=h(11)), m1)
    assert await unpaired(store, 0)

    await seeds(store, SPEC, 1, VALIDATORS[:3])
    await accept(store, SPEC, Reveal(round=1, commitment=h(10), size=5), m0)  # a reveal without its commit
    assert await unpaired(store, 1)

    await seeds(store, SPEC, 2, VALIDATORS[:2])
    await accept(store, SPEC, SeedReveal(round=2, seed=h(5)), VALIDATORS[2])  # a seed reveal without its commit
    assert await unpaired(store, 2)

    await seeds(store, SPEC, 3, VALIDATORS[:2])
    await seeds(store, SPEC, 3, VALIDATORS[2:3], reveal=False)  # a seed commit without its reveal
    assert await unpaired(store, 3)
