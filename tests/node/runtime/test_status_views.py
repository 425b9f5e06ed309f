"""Status views over a real state file: on a node that wrote no round report of its own (a miner), a
round shows the leaderboard the node learnt from the public score reports (node.duties.results)
with each validator's score per miner and the miners that committed without revealing; the adopted
state's loss comes from the next round's reports; standings are computed; a validator's own report
wins when it exists."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node.duties.results import learn_results
from node.runtime.clock import ManualClock
from node.runtime.daemon import Node
from node.runtime.disk import DiskLook
from node.runtime.metrics import NodeMetrics
from node.runtime.status import ROUNDS_SHOWN, STANDINGS_SHOWN, RoundView, StatusViews, learning_settings
from node.store.db import Storage
from node.store.records import RewardRecord, RewardsLedger
from protocol.assignment import assign
from protocol.identity import Identity
from protocol.messages import (
    Commit,
    GlobalState,
    Reveal,
    ScoreEntry,
    ScoreReport,
    SeedCommit,
    SeedReveal,
    seal,
)
from protocol.ranking import rank_points
from protocol.rounds import Schedule
from protocol.seeds import commitment, round_seed
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import make_spec_dict

BASE = "ee" * 32
LOSSES = {0: 2.0, 1: 2.5}  # miners 0 and 1 by index; miner 2 is refused, miner 3 never reveals
SEEDS = ["1" * 64, "2" * 64, "3" * 64]


class RoomyDisk:
    """The data directory's space as `node.runtime.disk.DiskWatch` looks at it: room to spare."""

    def look(self) -> DiskLook:
        return DiskLook(free_bytes=1 << 30, needed_bytes=1 << 20)


class FakeNode:
    def __init__(self, ctx: SimpleNamespace, own_reports: dict[int, dict[str, Any]]) -> None:
        self.ctx = ctx
        self.genesis = ctx.spec
        self.own_reports = own_reports

    async def status(self) -> dict[str, Any]:
        return {"role": self.ctx.config.node.role, "node_id": self.ctx.identity.node_id,
                "head": await self.ctx.storage.head()}

    rewards = Node.rewards  # the node's own: it only reads ctx.storage

    async def round_report(self, round: int) -> dict[str, Any] | None:
        return self.own_reports.get(round)

    def metrics_text(self) -> bytes:
        return self.ctx.metrics.render()


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "node.db")
    yield store
    await store.close()


async def publish(storage: Storage, spec: NetworkSpec, who: Identity, message: Any) -> None:
    assert await storage.record_accepted(seal(message, spec.network_id, who), message, 0.0)


async def play_round_zero(storage: Storage, spec: NetworkSpec, validators: list[Identity],
                          miners: list[Identity]) -> dict[str, tuple[str, ...]]:
    """Seeds, commits, reveals and every validator's report of round 0; returns the assignment."""
    for v, seed in zip(validators, SEEDS, strict=True):
        await publish(storage, spec, v, SeedCommit(round=0, commitment=commitment(seed)))
        await publish(storage, spec, v, SeedReveal(round=0, seed=seed))
    commitments = {m.node_id: f"{i + 1:x}" * 64 for i, m in enumerate(miners)}
    for m in miners:
        await publish(storage, spec, m, Commit(round=0, commitment=commitments[m.node_id]))
    revealed = {m.node_id: commitments[m.node_id] for m in miners[:3]}
    for m in miners[:3]:
        await publish(storage, spec, m, Reveal(round=0, commitment=commitments[m.node_id], size=100))
    seed = round_seed({v.node_id: commitment(s) for v, s in zip(validators, SEEDS, strict=True)},
                      {v.node_id: s for v, s in zip(validators, SEEDS, strict=True)})
    assignment = assign(seed, revealed, [v.node_id for v in validators], spec.rewards.replication)
    for v in validators:
        entries = []
        for i, m in enumerate(miners[:3]):
            if v.node_id not in assignment[m.node_id]:
                continue
            if i in LOSSES:
                entries.append(ScoreEntry(miner=m.node_id, commitment=revealed[m.node_id], loss=LOSSES[i],
                                          verdict="accept"))
            else:
                entries.append(ScoreEntry(miner=m.node_id, commitment=revealed[m.node_id], verdict="reject",
                                          reason="hash mismatch"))
        await publish(storage, spec, v, ScoreReport(round=0, base=BASE, base_loss=3.0, entries=tuple(entries)))
    return assignment


def views_for(storage: Storage, spec: NetworkSpec, me: Identity, role: str,
              own_reports: dict[int, dict[str, Any]] | None = None) -> StatusViews:
    schedule = Schedule.from_spec(spec)
    ctx = SimpleNamespace(storage=storage, spec=spec, identity=me, metrics=NodeMetrics(),
                          config=SimpleNamespace(node=SimpleNamespace(role=role)), schedule=schedule,
                          clock=ManualClock(schedule.round_start(1) + 1.0), disk=RoomyDisk())
    return StatusViews(FakeNode(ctx, own_reports or {}))  # type: ignore[arg-type]


async def test_a_miner_ranks_a_round_from_the_public_reports(storage: Storage, spec: NetworkSpec,
                                                             validator_ids: list[Identity],
                                                             miner_ids: list[Identity]) -> None:
    assignment = await play_round_zero(storage, spec, validator_ids, miner_ids)
    await storage.record_round(0, 0.0)
    views = views_for(storage, spec, miner_ids[0], "miner")
    assert await views.rounds() == []  # nothing learnt before the round settles
    await storage.set_head(BASE)
    await learn_results(storage, spec, 0)
    await publish(storage, spec, validator_ids[0], ScoreReport(round=1, base="ff" * 32, base_loss=2.2, entries=()))

    report = await views.round_report(0)
    assert report is not None and report["source"] == "public"
    assert (report["base"], report["base_loss"], report["global_loss"]) == (BASE, 3.0, 2.2)
    by_id = {m["id"]: m for m in report["miners"]}
    m0, m1, m2, m3 = (by_id[m.node_id] for m in miner_ids)
    top_k = spec.rewards.top_k
    assert (m0["rank"], m0["reward"], m0["loss"], m0["verdict"]) == (1, rank_points(1, top_k), 2.0, "accept")
    assert (m1["rank"], m1["reward"], m1["loss"]) == (2, rank_points(2, top_k), 2.5)
    assert (m2["verdict"], m2["rank"], m2["reward"]) == ("reject", None, 0.0)
    assert m2["reason"] == "rejected: hash mismatch"
    assert (m3["verdict"], m3["reason"]) == ("missing", "no reveal matching its commitment")
    assert set(m0["scores"]) == set(assignment[miner_ids[0].node_id])
    assert all(s == {"verdict": "accept", "loss": 2.0} for s in m0["scores"].values())

    status = await views.rewards()
    assert list(status["standings"]) == [miner_ids[0].node_id, miner_ids[1].node_id]  # best first
    history = await views.miner(miner_ids[0].node_id)
    assert [(h["round"], h["rank"], h["reward"]) for h in history] == [(0, 1, rank_points(1, top_k))]
    assert await views.round_report(5) is None

    text = (await views.metrics_text()).decode()  # each scrape reads the results first
    assert "tessera_miner_rank 1.0" in text and "tessera_adopted_loss 2.2" in text
    assert 'tessera_round_verdicts{reason="rejected",verdict="reject"} 1.0' in text


async def test_a_validators_own_report_wins(storage: Storage, spec: NetworkSpec, validator_ids: list[Identity],
                                            miner_ids: list[Identity]) -> None:
    await play_round_zero(storage, spec, validator_ids, miner_ids)
    await storage.record_round(0, 0.0)
    own = {"round": 0, "base": BASE, "base_loss": 3.0, "global_hash": "ab" * 32, "global_loss": 2.1,
           "miners": [{"id": miner_ids[0].node_id, "verdict": "accept", "loss": 2.0, "rank": 1, "reward": 1.0,
                       "reason": ""}]}
    views = views_for(storage, spec, validator_ids[0], "validator", {0: own})
    [view] = await views.rounds()
    assert view["source"] == "validator" and view["global_hash"] == own["global_hash"]
    assert view["global_loss"] == 2.1
    [entry] = view["miners"]
    assert entry["rank"] == 1 and len(entry["scores"]) == spec.rewards.replication


def test_status_says_how_the_network_learns(spec_dict: dict[str, Any]) -> None:
    spec_dict["submission"] = {"format": "pgrad", "chunk": 128, "topk": 16, "quant": "int8", "partitions": 4}
    spec_dict["training"] = {"inner_steps": 5, "lr": 2e-3, "beta1": 0.656, "batch_size": 4}
    spec_dict["aggregation"] = {"top_g": 8, "outer_lr": 2.5, "momentum": 0.0}
    pgrad = parse_spec(spec_dict)
    assert learning_settings(pgrad) == {
        "format": "pgrad", "pgrad": {"chunk": 128, "topk": 16, "quant": "int8", "partitions": 4},
        "experts": 3,  # the group is {0: [1, 3], 1: [0]}
        "inner_steps": 5, "inner_lr": 2e-3, "inner_beta1": 0.656, "batch_size": 4,
        "top_g": 8, "outer_lr": 2.5, "momentum": 0.0, "weighting": "uniform"}
    experts = learning_settings(parse_spec(make_spec_dict()))
    assert experts["format"] == "experts" and experts["pgrad"] is None


async def test_status_and_a_scrape_read_only_the_last_rounds_global_states(
        storage: Storage, spec: NetworkSpec, validator_ids: list[Identity]) -> None:
    """Global states are kept for good; /status and each scrape must not read every one ever announced."""
    schedule = Schedule.from_spec(spec)
    rounds = 3 * ROUNDS_SHOWN
    for r in range(rounds):
        state = GlobalState(round=r, hash=f"{r + 1:064x}", parent=f"{r:064x}", contributors=())
        for v in validator_ids[:2]:
            await publish(storage, spec, v, state)
    await storage.set_head(f"{rounds:064x}")  # the state of the last round
    read: list[int] = []
    real = storage.global_states

    async def spy(round: int | None = None, since: int | None = None) -> Any:
        states = await real(round, since)
        read.append(len(states))
        return states

    storage.global_states = spy  # type: ignore[method-assign]
    ctx = SimpleNamespace(storage=storage, spec=spec, identity=validator_ids[0], metrics=NodeMetrics(),
                          config=SimpleNamespace(node=SimpleNamespace(role="validator")),
                          clock=ManualClock(schedule.round_start(rounds) + 1.0), schedule=schedule, disk=RoomyDisk())
    views = StatusViews(FakeNode(ctx, {}))  # type: ignore[arg-type]
    status = await views.status()
    assert status["head_round"] == rounds - 1
    assert status["agreement"]["round"] == rounds - 1 and status["agreement"]["share"] == pytest.approx(2 / 3)
    await views.metrics_text()
    assert sum(read) <= 2 * (ROUNDS_SHOWN + 1), f"read {sum(read)} global states for two requests"


async def test_rewards_lists_the_ledger_of_the_last_rounds_only(storage: Storage, spec: NetworkSpec,
                                                                miner_ids: list[Identity]) -> None:
    """The ledger is kept for good (and exported as JSONL); /rewards must not grow with the network's age."""
    rounds = 3 * ROUNDS_SHOWN
    for r in range(rounds):
        entries = [RewardRecord(r, m.node_id, i + 1, 1.0 / (i + 1), 0.0, 0.5) for i, m in enumerate(miner_ids)]
        assert await storage.add_rewards(r, entries, {m.node_id: 0.5 for m in miner_ids})
    views = views_for(storage, spec, miner_ids[0], "validator")
    rewards = await views.rewards()
    assert sorted({e["round"] for e in rewards["entries"]}) == list(range(rounds - ROUNDS_SHOWN, rounds))
    assert len(rewards["entries"]) == ROUNDS_SHOWN * len(miner_ids)
    assert rewards["standings"] == {m.node_id: 0.5 for m in miner_ids}


async def test_rewards_reads_only_the_rounds_and_standings_it_shows(storage: Storage, spec: NetworkSpec,
                                                                    miner_ids: list[Identity]) -> None:
    """The ledger and the standings table keep every round and every miner key ever rewarded; a request
    reads the last ROUNDS_SHOWN rounds and the best STANDINGS_SHOWN standings, whatever the network's age."""
    rounds, keys = 3 * ROUNDS_SHOWN, [f"{i:064x}" for i in range(3 * STANDINGS_SHOWN)]
    for r in range(rounds):
        entries = [RewardRecord(r, m.node_id, i + 1, 1.0 / (i + 1), 0.0, 0.5) for i, m in enumerate(miner_ids)]
        assert await storage.add_rewards(r, entries, {k: (i + 1) / 1000 for i, k in enumerate(keys)})
    real, read = storage.rewards, []

    async def spy(*args: Any) -> RewardsLedger:
        ledger = await real(*args)
        read.append((len(ledger.entries), len(ledger.standings)))
        return ledger

    storage.rewards = spy  # type: ignore[method-assign]
    rewards = await views_for(storage, spec, miner_ids[0], "validator").rewards()
    assert read == [(ROUNDS_SHOWN * len(miner_ids), STANDINGS_SHOWN)]
    assert list(rewards["standings"]) == keys[::-1][:STANDINGS_SHOWN]  # best first
    assert {e["round"] for e in rewards["entries"]} == set(range(rounds - ROUNDS_SHOWN, rounds))
    whole = await storage.rewards()
    assert len(whole.entries) == rounds * len(miner_ids) and len(whole.standings) == len(keys)


async def test_a_miner_left_out_of_the_last_round_reads_no_reward(storage: Storage, spec: NetworkSpec,
                                                                    miner_ids: list[Identity]) -> None:
    """The own-result gauges follow the last round with miners: a miner rewarded once and then not
    scored (it missed a commit, or its blob never came) must not go on showing its old reward, or
    TesseraMinerUnrewarded could never fire for it."""
    me, other = miner_ids[0], miner_ids[1]
    row = {"verdict": "accept", "reason": "", "loss": 2.0, "rank": 1, "reward": 1.0}
    rounds = [RoundView(0, "public", BASE, 3.0, None, None, [{"id": me.node_id, **row}]),
              RoundView(1, "public", BASE, 3.0, None, None, [{"id": other.node_id, **row}])]
    views = views_for(storage, spec, me, "miner")

    async def fake_views() -> list[RoundView]:
        return rounds

    views._views = fake_views  # type: ignore[method-assign]
    await views.refresh_metrics()
    text = views.ctx.metrics.render().decode()
    assert "tessera_miner_reward 0.0" in text and "tessera_miner_rank 0.0" in text
    rounds[1].miners.append({"id": me.node_id, **row, "reward": 0.25, "rank": 2})
    await views.refresh_metrics()
    assert "tessera_miner_reward 0.25" in views.ctx.metrics.render().decode()


async def test_a_miners_loss_follows_the_last_round_like_its_reward(storage: Storage, spec: NetworkSpec,
                                                                    miner_ids: list[Identity]) -> None:
    """A miner scored once, then rejected or left out, shows no loss: its old one would read as current."""
    me, other = miner_ids[0], miner_ids[1]
    row = {"verdict": "accept", "reason": "", "loss": 2.0, "rank": 1, "reward": 1.0}
    rounds = [RoundView(0, "public", BASE, 3.0, None, None, [{"id": me.node_id, **row}])]
    views = views_for(storage, spec, me, "miner")

    async def fake_views() -> list[RoundView]:
        return rounds

    views._views = fake_views  # type: ignore[method-assign]
    await views.refresh_metrics()
    assert "tessera_miner_loss 2.0" in views.ctx.metrics.render().decode()
    for mine in ([], [{"id": me.node_id, **row, "verdict": "reject", "reason": "rejected: hash mismatch",
                       "loss": 9.0, "rank": None, "reward": 0.0}]):
        rounds.append(RoundView(len(rounds), "public", BASE, 3.0, None, None,
                                [{"id": other.node_id, **row}, *mine]))
        await views.refresh_metrics()
        text = views.ctx.metrics.render().decode()
        assert "\ntessera_miner_loss " not in text and "\ntessera_miner_reward 0.0" in text, text


async def test_a_validator_exports_no_miner_result_gauges(storage: Storage, spec: NetworkSpec,
                                                          miner_ids: list[Identity]) -> None:
    row = {"verdict": "accept", "reason": "", "loss": 2.0, "rank": 1, "reward": 1.0}
    views = views_for(storage, spec, miner_ids[0], "validator")

    async def fake_views() -> list[RoundView]:
        return [RoundView(0, "validator", BASE, 3.0, None, None, [{"id": miner_ids[1].node_id, **row}])]

    views._views = fake_views  # type: ignore[method-assign]
    await views.refresh_metrics()
    text = views.ctx.metrics.render().decode()
    assert not [line for line in text.splitlines() if line.startswith("tessera_miner_")], text


async def test_a_validators_status_names_its_latest_outvote(storage: Storage, spec: NetworkSpec,
                                                          validator_ids: list[Identity]) -> None:
    outvote = {"mine": "merged", "majority": "best_single", "state": "ab" * 32, "gain": -4e-9, "margin": 1e-4}
    for r in range(3):
        await storage.record_round(r, float(r))
        gate = {"adopted": "merged", "losses": {"current": 3.0, "merged": 2.5}}
        await storage.set_round_report(r, {"round": r, "gate": {**gate, "outvoted": outvote} if r == 1 else gate})
    validator = views_for(storage, spec, validator_ids[0], "validator")
    assert (await validator.status())["outvoted"] == {"round": 1, **outvote}
    assert (await views_for(storage, spec, validator_ids[0], "miner").status())["outvoted"] is None

    await storage.record_round(1 + ROUNDS_SHOWN, 9.0)  # the outvoted round is no longer among those shown
    assert (await validator.status())["outvoted"] is None
