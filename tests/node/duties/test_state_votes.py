"""Global-state votes on the twins: a validator that is first to announce the honest state's hash with a
parent of its own cannot stop any node from adopting that state, which every validator voted for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from node.runtime.daemon import Node
from node.sim.twins import WAIT_S, Twins, identity
from protocol.messages import GlobalState, Message, seal
from protocol.rounds import Phase

pytestmark = pytest.mark.timeout(300)

JUNK = "ab" * 32


async def stored_vote(nodes: list[Node], voter: str, round: int) -> None:
    """Wait until every node stored `voter`'s GlobalState vote of `round`."""
    deadline = time.monotonic() + WAIT_S

    async def stored(node: Node) -> bool:
        return any(voter in s.voters for s in await node.ctx.storage.global_states(round))

    while not all([await stored(node) for node in nodes]):
        assert time.monotonic() < deadline, f"timed out waiting for {voter[:12]}'s vote of round {round}"
        await asyncio.sleep(0.005)


async def test_a_wrong_parent_announced_first_does_not_block_adoption(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    net = Twins(tmp_path, validators=3)  # validator-2 runs no node: its key votes with a parent of its own
    attacker = identity("validator-2")
    try:
        v0, v1 = await net.start("validator-0"), await net.start("validator-1")
        miner = await net.start("miner-0")
        nodes = [v0, v1, miner]
        voted: list[GlobalState] = []
        attacked = asyncio.Event()

        def after_the_attacker(publish: Callable[[Message], Awaitable[None]]) -> Callable[[Message], Awaitable[None]]:
            async def wrapped(message: Message) -> None:
                if isinstance(message, GlobalState):  # the attacker's copy is stored first, everywhere
                    if not voted:
                        voted.append(message)
                        bogus = message.model_copy(update={"parent": JUNK})
                        net.hub.inject(seal(bogus, net.spec.network_id, attacker).to_bytes(), attacker.node_id)
                        await stored_vote(nodes, attacker.node_id, message.round)
                        attacked.set()
                    await attacked.wait()
                await publish(message)

            return wrapped

        for validator in (v0, v1):
            monkeypatch.setattr(validator.duties, "_publish", after_the_attacker(validator.duties._publish))
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE):
            await net.phase(0, phase)
        await net.phase(0, Phase.MERGE, after_s=net.spec.timing.merge_s / 2)
        assert voted, "no validator proposed a state"
        honest = voted[0]
        assert honest.parent == net.spec.model.base_hash
        for node in nodes:
            [state] = await node.ctx.storage.global_states(0)
            assert (state.hash, state.parent) == (honest.hash, JUNK)  # the attacker's row, stored first
            assert set(state.voters) == set(net.spec.validator_weights)  # all three voted for the hash

        await net.phase(1, Phase.TRAIN)
        for name, node in zip(("validator-0", "validator-1", "miner-0"), nodes, strict=True):
            assert await node.ctx.storage.head() == honest.hash, name
            [state] = await node.ctx.storage.global_states(0)
            assert state.adopted and state.parent == honest.parent, name  # the parent the checked blob names
    finally:
        await net.close()
