"""A validator's round seed: committed at TRAIN, revealed once the seed-reveal window opens.

The seed is persisted before its commit is published, so a restart reuses it. It is revealed 2 x clock_skew_s
into REVEAL: until then some node whose clock is behind ours may still take a commit, and a miner that saw the
seed could choose its commit by it. This module knows nothing about scoring, merging or how the round seed is combined (node.duties.plan).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from node.runtime.context import NodeContext
from protocol.check import window
from protocol.messages import Message, SeedCommit, SeedReveal
from protocol.seeds import commitment, new_seed


class Seeds:
    """One validator's seed commits and reveals; `publish` sends a message as its duty does."""

    def __init__(self, ctx: NodeContext, publish: Callable[[Message], Awaitable[None]]) -> None:
        self.ctx = ctx
        self.publish = publish
        self.me = ctx.identity.node_id

    async def commit(self, round: int) -> None:
        seed = await self.ctx.storage.own_seed(round)
        if seed is None:
            seed = new_seed()
            await self.ctx.storage.set_own_seed(round, seed)
        if not any(s.validator == self.me and s.commitment for s in await self.ctx.storage.seeds_for(round)):
            await self.publish(SeedCommit(round=round, commitment=commitment(seed)))

    async def reveal(self, round: int) -> None:
        """Reveal our seed of `round` once its window opens (module doc), unless it is out already."""
        opens = window("seed_reveal", round, self.ctx.schedule)[0]
        while self.ctx.clock.now() < opens:
            await self.ctx.clock.sleep_until(opens)
        seed = await self.ctx.storage.own_seed(round)
        mine = [s for s in await self.ctx.storage.seeds_for(round) if s.validator == self.me]
        if seed is not None and mine and mine[0].commitment and not mine[0].seed:
            await self.publish(SeedReveal(round=round, seed=seed))
