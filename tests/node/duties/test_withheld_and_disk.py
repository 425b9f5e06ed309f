"""Issue 11: a validator that commits a seed and does not reveal it loses its place in the assignment
for the next SEED_WITHHOLD_ROUNDS rounds (named in the stored plan, /rounds/{r} and /metrics,
computed the same by every node, miners too); a disk that refuses writes (ENOSPC from the blob store)
leaves no partial blob or row, is said once in the round (naming the data directory, its free bytes and what
to do), and the node takes part normally the next round."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import node.store.blobs as blobs_module
from node.duties.plan import SEED_WITHHOLD_ROUNDS, make_plan
from node.runtime.daemon import Node
from node.runtime.metrics import peer_label
from node.runtime.status import StatusViews
from node.sim.twins import Twins
from node.store.blobs import TMP_DIR, BlobStore
from node.store.db import Storage
from node.store.records import RoundPlan
from protocol.messages import Commit, Message, Reveal, SeedCommit, SeedReveal, seal
from protocol.rounds import PHASES
from protocol.seeds import commitment
from protocol.spec import parse_spec
from tests.conftest import make_identity, make_spec_dict

pytestmark = pytest.mark.timeout(180)

SPEC = parse_spec(make_spec_dict())  # three validators, replication 2
VALIDATORS = [make_identity(i) for i in range(3)]
MINERS = [make_identity(100 + i) for i in range(6)]


def h(i: int) -> str:
    return f"{i:064x}"


# -- the exclusion rule, on real SQLite ----------------------------------------------------------

async def accept(store: Storage, message: Message, who: Any) -> None:
    assert await store.record_accepted(seal(message, SPEC.network_id, who), message, 1.0)


async def play_round(store: Storage, r: int, withholders: set[int] = frozenset(), wrong: set[int] = frozenset()) -> None:
    """Every validator commits a seed; withholders never reveal, `wrong` reveal a seed that does not match."""
    for i, v in enumerate(VALIDATORS):
        seed = h(1000 * r + i + 1)
        await accept(store, SeedCommit(round=r, commitment=commitment(seed)), v)
        if i not in withholders:
            await accept(store, SeedReveal(round=r, seed=h(7) if i in wrong else seed), v)
    for j, m in enumerate(MINERS):
        await accept(store, Commit(round=r, commitment=h(500 + j)), m)
        await accept(store, Reveal(round=r, commitment=h(500 + j), size=10), m)


def assigned(plan: Any) -> set[str]:
    return {v for chosen in plan.assignment.values() for v in chosen}


async def test_a_withheld_seed_excludes_its_validator_for_the_next_k_rounds(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        v2 = VALIDATORS[2].node_id
        await play_round(store, 0, withholders={2})
        for r in range(1, SEED_WITHHOLD_ROUNDS + 2):
            await play_round(store, r)
        plan = await make_plan(store, SPEC, 0)
        assert plan is not None and plan.unrevealed_seeds == (v2,) and plan.excluded == ()
        for r in range(1, SEED_WITHHOLD_ROUNDS + 1):
            plan = await make_plan(store, SPEC, r)
            assert plan is not None and plan.unrevealed_seeds == () and plan.excluded == (v2,), r
            assert assigned(plan) == {VALIDATORS[0].node_id, VALIDATORS[1].node_id}, r
            assert all(len(chosen) == 2 for chosen in plan.assignment.values())  # R still met by the others
        back = await make_plan(store, SPEC, SEED_WITHHOLD_ROUNDS + 1)
        assert back is not None and back.excluded == () and v2 in assigned(back)
    finally:
        await store.close()


async def test_a_reveal_that_does_not_match_counts_as_withheld(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        await play_round(store, 0, wrong={1})
        await play_round(store, 1)
        plan = await make_plan(store, SPEC, 1)
        assert plan is not None and plan.excluded == (VALIDATORS[1].node_id,)
    finally:
        await store.close()


async def test_when_every_validator_is_excluded_all_are_assigned(tmp_path: Path) -> None:
    store = await Storage.open(tmp_path / "node.db")
    try:
        await play_round(store, 0, withholders={0})
        await play_round(store, 1, withholders={1, 2})
        await play_round(store, 2)
        plan = await make_plan(store, SPEC, 2)
        assert plan is not None and plan.excluded == ()
        assert assigned(plan) == {v.node_id for v in VALIDATORS}
    finally:
        await store.close()


def test_a_plan_stored_before_exclusions_existed_reads_back_with_none_excluded() -> None:
    plan = RoundPlan(round=1, seed=h(1), revealed={}, commits={}, assignment={}, unrevealed_seeds=(h(2),),
                     excluded=(h(3),))
    assert RoundPlan.from_json(plan.to_json()) == plan
    stored = json.loads(plan.to_json())
    del stored["excluded"]
    assert RoundPlan.from_json(json.dumps(stored)).excluded == ()


# -- a withholding validator on the twins --------------------------------------------------------

def metric(node: Node, name: str, labels: str = "") -> float | None:
    line = f"{name}{{{labels}}} " if labels else f"{name} "
    return next((float(x.split()[-1]) for x in node.metrics_text().decode().splitlines() if x.startswith(line)), None)


async def test_a_validator_that_withholds_its_seed_is_named_and_left_out_of_the_next_rounds(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        v0 = await net.start("validator-0")
        v1 = await net.start("validator-1")
        v2 = await net.start("validator-2")
        miners = [await net.start(f"miner-{i}") for i in range(3)]
        seeds = v2.duties.seeds  # type: ignore[attr-defined]
        reveal = seeds.reveal

        async def withhold(round: int) -> None:  # the injected behaviour: commit in TRAIN, never reveal
            return None

        seeds.reveal = withhold
        await net.rounds(0, 0)
        seeds.reveal = reveal
        await net.rounds(1, 1)
        me = net.id("validator-2")
        assert any(s.validator == me and s.commitment and not s.seed for s in await v0.ctx.storage.seeds_for(0))

        for node in (v0, v1):  # the round report as /rounds/{r} serves it, and /metrics
            view = await StatusViews(node).round_report(0)
            assert view is not None and view["seeds"] == {"withheld": [me], "excluded": []}
            assert metric(node, "tessera_seed_withheld_total", f'validator="{peer_label(me)}"') == 1.0
            view = await StatusViews(node).round_report(1)
            assert view is not None and view["seeds"] == {"withheld": [], "excluded": [me]}
            assert metric(node, "tessera_validators_excluded") == 1.0
            report = await node.round_report(1)
            assert report is not None and report["proposed_hash"] is not None

        plans = [await node.ctx.storage.round_plan(1) for node in (v0, v1, v2)]
        assert plans[0] is not None and plans[0] == plans[1] == plans[2]  # the withholder agrees it is out
        assert plans[0].excluded == (me,) and me not in assigned(plans[0])
        assert len(plans[0].assignment) == len(miners)
        reports = await v0.ctx.storage.score_reports(1)
        assert reports[me].entries == ()  # it scored nobody
        assert len(reports[net.id("validator-0")].entries) == len(miners)
        [state] = await v0.ctx.storage.global_states(1)
        assert set(state.voters) == {net.id(f"validator-{i}") for i in range(3)} and state.adopted

        ranking = {m["miner"]: m["rank"] for m in (await v0.ctx.storage.round_results(1))["miners"]}
        for miner in miners:  # miners recompute the plan a round later, with the same exclusion
            public = await miner.ctx.storage.round_results(1)
            assert public is not None and {m["miner"]: m["rank"] for m in public["miners"]} == ranking
    finally:
        await net.close()


# -- a disk that refuses writes ------------------------------------------------------------------

class FullDisk(io.FileIO):
    """A file on a disk with no space left: every write fails with ENOSPC."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_disk_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    if "r" in mode:
        return open(file, mode, *args, **kwargs)
    return io.BufferedWriter(FullDisk(file, mode.replace("b", "")))


@pytest.mark.parametrize("size", [100, 1 << 20])  # stays in the write buffer (fails at the flush) / fails at once
def test_a_full_disk_leaves_no_partial_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    store = BlobStore(tmp_path / "blobs")
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(size))
    monkeypatch.setattr(blobs_module, "open", full_disk_open, raising=False)
    with pytest.raises(OSError, match="No space left"):
        store.put_bytes(os.urandom(size))
    with pytest.raises(OSError, match="No space left"):
        store.put_file(source)
    assert store.hashes() == [] and list((tmp_path / "blobs" / TMP_DIR).iterdir()) == []
    monkeypatch.undo()
    assert store.has(store.put_file(source))  # the same store works once the disk has room


def refuse_writes(node: Node) -> None:
    """The node's blob store refuses every put (what a full disk leaves of it is the test above)."""
    def refuse(*args: object) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    node.ctx.blobs.put_bytes = refuse  # type: ignore[method-assign]
    node.ctx.blobs.put_parts = refuse  # type: ignore[method-assign]


async def test_a_disk_that_refuses_writes_for_a_round_costs_that_round_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        v0 = await net.start("validator-0")
        v1 = await net.start("validator-1")
        await net.start("validator-2")
        m0 = await net.start("miner-0")
        await net.start("miner-1")
        for node in (v0, m0):
            refuse_writes(node)
        with caplog.at_level(logging.ERROR):
            for phase in PHASES:
                await net.phase(0, phase)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        for node in (v0, m0):  # the refused submission or proposal, said once with the room it has and needs
            [said] = [e for e in errors if str(node.ctx.config.node.data_dir) in e]
            assert said.startswith("round 0: the disk is full: writing") and "No space left" in said, said
            assert " free, and the rounds ahead need about " in said and "free space there" in said, said
        assert sum("No space left" in e for e in errors) == 2, errors
        assert await m0.ctx.storage.submission(0) is None
        assert all(c.miner != net.id("miner-0") for c in await v1.ctx.storage.commits_for(0))
        assert await v0.ctx.storage.proposal(0) is None
        report = await v0.round_report(0)
        assert report is not None and report["proposed_hash"] is None
        for node in (v0, m0):
            del node.ctx.blobs.put_bytes, node.ctx.blobs.put_parts  # the disk has room again

        await net.rounds(1, 1)
        [state] = await v1.ctx.storage.global_states(0)
        assert net.id("validator-0") not in state.voters and state.adopted
        assert (await v0.ctx.storage.global_states(0))[0].adopted  # it adopted the others' state
        assert (await m0.ctx.storage.submission(1)) is not None
        report = await v1.round_report(1)
        assert report is not None
        [mine] = [m for m in report["miners"] if m["id"] == net.id("miner-0")]
        assert mine["verdict"] == "accept", mine
        [state] = await v1.ctx.storage.global_states(1)
        assert set(state.voters) == {net.id(f"validator-{i}") for i in range(3)} and state.adopted
        assert all(run.ok for node in (v0, m0) for run in node.scheduler.runs)  # no phase handler raised
    finally:
        await net.close()
