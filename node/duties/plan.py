"""The round plan from what storage holds: round seed, miners that committed and revealed, assignment.

A validator fixes the plan when EVALUATE starts and MERGE reuses it (node.store keeps it), so a
reveal accepted later can no longer change seed or assignment; a miner computes the same plan a
round later to rank the round from the public score reports. Validators that committed a seed and
did not reveal it are named in the plan. This module knows nothing about scoring or merging.
"""

from __future__ import annotations

import logging

from node.store.db import Storage
from node.store.records import RoundPlan
from protocol.assignment import assign
from protocol.seeds import reveal_matches, round_seed
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)


async def make_plan(storage: Storage, spec: NetworkSpec, round: int) -> RoundPlan | None:
    """The plan of `round` as storage has it now; None (logged) when no validator revealed a seed."""
    seeds = await storage.seeds_for(round)
    committed = {s.validator: s.commitment for s in seeds if s.commitment}
    revealed_seeds = {s.validator: s.seed for s in seeds if s.seed}
    try:
        seed = round_seed(committed, revealed_seeds)
    except ValueError as exc:
        log.warning("round %d: %s", round, exc)
        return None
    reveals = {r.miner: r.commitment for r in await storage.reveals_for(round)}
    commits = {c.miner: c.commitment for c in await storage.commits_for(round)}
    revealed = {m: c for m, c in commits.items() if reveals.get(m) == c}
    validators = sorted(spec.validator_weights)
    assignment = assign(seed, revealed, validators, spec.rewards.replication) if revealed else {}
    unrevealed = tuple(sorted(v for v, c in committed.items()
                              if v not in revealed_seeds or not reveal_matches(c, revealed_seeds[v])))
    return RoundPlan(round, seed, revealed, commits, assignment, unrevealed)
