"""A validator killed in MERGE after it announced its proposed state, and restarted in the same MERGE,
keeps serving and reporting the state it voted for, even when the reports it merges from changed in
between (a late ScoreReport, in its window until MERGE ends, arrived while it was down)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.runtime.daemon import Node
from protocol.rounds import Phase
from tests.node.twins import Twins

pytestmark = pytest.mark.timeout(180)


async def test_a_validator_restarted_after_it_voted_keeps_the_state_it_voted_for(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=3)
    try:
        nodes = [await net.start(n) for n in ("validator-0", "validator-1", "validator-2", "miner-0", "miner-1",
                                              "miner-2")]
        v0: Node = nodes[0]
        others = {net.id("validator-1"), net.id("validator-2")}
        inbox = net.hub.nodes[net.id("validator-0")]
        receive = inbox.receive
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL):
            await net.phase(0, phase)
        inbox.receive = lambda data, peer: None if peer in others else receive(data, peer)  # type: ignore[method-assign]

        async def nothing_from_peers(round: int, missing: object) -> bool:
            return True

        async def die(*args: object) -> None:  # the vote went out, then the process died
            raise OSError("killed")

        object.__setattr__(v0.ctx, "take_in_from_peer", nothing_from_peers)  # the peers had nothing either
        v0.ctx.storage.set_round_report = die  # type: ignore[method-assign,assignment]
        await net.phase(0, Phase.EVALUATE)
        await net.phase(0, Phase.MERGE, after_s=net.spec.timing.merge_s * 0.6)  # it merges on its own report
        voted = [s.hash for s in await v0.ctx.storage.global_states(0) if net.id("validator-0") in s.voters]
        assert len(voted) == 1 and await v0.round_report(0) is None
        inbox.receive = receive  # type: ignore[method-assign]
        v0 = await net.restart("validator-0")  # catches up on the others' reports, merges again
        await net.ran(0, Phase.MERGE)
        proposal = await v0.ctx.storage.proposal(0)
        report = await v0.round_report(0)
        assert proposal is not None and report is not None
        assert (proposal.state, report["proposed_hash"]) == (voted[0], voted[0])
        assert net.hub.nodes[net.id("validator-0")].read_served(voted[0]) is not None
    finally:
        await net.close()
