"""A round takes at most as many miners as one score report can name: with more reveals than that
(here 12 identities that commit and reveal blobs they never serve, next to an honest miner, under a
2048-byte message limit), each validator still publishes its report, the round seed picks the miners
scored, and the rest are told why they were not."""

from __future__ import annotations

import hashlib
from pathlib import Path

from node.sim.twins import Twins
from protocol.identity import Identity
from protocol.messages import Commit, Reveal, report_capacity, seal
from protocol.rounds import Phase

MAX_BYTES = 2048


async def test_a_round_with_more_reveals_than_a_report_can_name_is_still_scored(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=2, extra=f"\n[limits]\nmax_message_bytes = {MAX_BYTES}\n")
    sybils = [Identity.from_seed(hashlib.sha256(f"sybil{i}".encode()).digest()) for i in range(12)]
    blob = {s.node_id: hashlib.sha256(f"blob{i}".encode()).hexdigest() for i, s in enumerate(sybils)}
    capacity = report_capacity(MAX_BYTES)
    assert capacity < len(sybils) + 1
    try:
        v0 = await net.start("validator-0")
        await net.start("validator-1")
        await net.start("miner-0")
        await net.phase(0, Phase.TRAIN)
        await net.phase(0, Phase.COMMIT)
        for s in sybils:
            net.hub.inject(seal(Commit(round=0, commitment=blob[s.node_id]), net.spec.network_id, s).to_bytes(),
                           s.node_id)
        await net.hub.settle()
        await net.phase(0, Phase.REVEAL)
        for s in sybils:
            reveal = Reveal(round=0, commitment=blob[s.node_id], size=100)
            net.hub.inject(seal(reveal, net.spec.network_id, s).to_bytes(), s.node_id)
        await net.hub.settle()
        await net.phase(0, Phase.EVALUATE)
        await net.phase(0, Phase.MERGE, after_s=net.spec.timing.merge_s / 2)
        reports = await v0.ctx.storage.score_reports(0)
        assert sorted(reports) == sorted(net.id(v) for v in ("validator-0", "validator-1"))  # both went out
        plan = await v0.ctx.storage.round_plan(0)
        assert plan is not None and len(plan.revealed) == len(sybils) + 1 and len(plan.assignment) == capacity
        for report in reports.values():
            assert {e.miner for e in report.entries} <= set(plan.assignment)
        round_report = await v0.round_report(0)
        assert round_report is not None
        reasons = {m["id"]: m["reason"] for m in round_report["miners"]}
        left_out = set(plan.revealed) - set(plan.assignment)
        assert len(left_out) == len(sybils) + 1 - capacity
        assert {reasons[m] for m in left_out} == {"not admitted: more miners revealed than a round takes"}
    finally:
        await net.close()
