"""A miner whose commit never reached the validators (its clock ran ahead, or no peer could reach it)
learns it once the round settles: the validators assigned to it reported without naming it, and it says
so in its log with what to check. A miner that was scored, or whose validators' reports have not all
arrived, says nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node.duties.results import unheard_by
from node.sim.twins import Twins
from node.store.records import RoundPlan
from protocol.messages import ScoreEntry, ScoreReport, decode_envelope
from protocol.rounds import PHASES, Phase

pytestmark = pytest.mark.timeout(180)


async def test_a_miner_whose_commit_no_validator_took_says_so(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    net = Twins(tmp_path)
    unheard = net.id("miner-1")
    inject = net.hub.inject

    def drop_its_commit(data: bytes, sender: str, to=None) -> None:  # type: ignore[no-untyped-def]
        if sender == unheard and decode_envelope(data, 1 << 20).kind == "commit":
            return  # as peers refuse a commit from a clock that runs ahead: it never reaches them
        inject(data, sender, to)

    net.hub.inject = drop_its_commit  # type: ignore[method-assign]
    try:
        for name in ("validator-0", "validator-1", "miner-0", "miner-1"):
            await net.start(name)
        with caplog.at_level(logging.WARNING, logger="node.duties.miner"):
            for phase in PHASES:
                await net.phase(0, phase)
            await net.phase(1, Phase.TRAIN)
        said = [r.getMessage() for r in caplog.records if r.name == "node.duties.miner"]
        assert len(said) == 1 and said[0].startswith("round 0: the validator(s) assigned to this miner ("), said
        assert "did not reach them within their windows" in said[0] and "NTP" in said[0]
        results = await net.nodes["miner-1"].ctx.storage.round_results(0)
        assert results is not None
        rows = {m["miner"]: m for m in results["miners"]}
        assert rows[unheard]["reason"] == "unscored" and rows[net.id("miner-0")]["reason"] != "unscored"
    finally:
        await net.close()


def report(validator_round: int, miners: list[str]) -> ScoreReport:
    return ScoreReport(round=validator_round, base="ab" * 32, base_loss=2.0,
                       entries=tuple(ScoreEntry(miner=m, commitment="c" * 64, verdict="accept", loss=1.5)
                                     for m in miners))


def test_unheard_only_when_every_assigned_validator_reported_without_the_miner() -> None:
    me, other = "11" * 32, "22" * 32
    v0, v1, v2 = "a0" * 32, "a1" * 32, "a2" * 32
    plan = RoundPlan(round=3, seed="00" * 32, revealed={me: "c" * 64, other: "d" * 64},
                     commits={me: "c" * 64, other: "d" * 64}, assignment={me: (v0, v1), other: (v1, v2)})
    assert unheard_by(plan, {v0: report(3, [other]), v1: report(3, [other])}, me) == (v0, v1)
    assert unheard_by(plan, {v0: report(3, [other]), v1: report(3, [me, other])}, me) == ()  # one named it
    assert unheard_by(plan, {v0: report(3, [other])}, me) == ()  # v1's report has not arrived: says nothing
    assert unheard_by(plan, {v0: report(3, []), v1: report(3, [])}, "33" * 32) == ()  # not in the plan
