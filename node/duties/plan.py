"""The round plan from what storage holds: round seed, miners that committed and revealed, assignment.

A validator fixes the plan when EVALUATE starts and MERGE reuses it (node.store keeps it), so a
reveal accepted later can no longer change seed or assignment; a miner computes the same plan a
round later to rank the round from the public score reports. A round takes at most as many miners as
one score report can name (`protocol.messages.report_capacity`): beyond that, the round seed picks
which (`protocol.assignment.admit`), and the others are in the plan's reveals but not its
assignment. Validators that committed a seed and did not reveal it are named in the plan, and lose
reward-set standing: for the next SEED_WITHHOLD_ROUNDS rounds they are left out of the assignment
(they score no miners, so their reports count for nobody). Every node computes that exclusion from the seed commits and reveals it
stored for those rounds. Before a validator fixes its plan, a commit it holds without the reveal (or
the reverse, `unpaired`) sends it to a peer for the round's envelopes (node.duties.validator): gossip
can miss a node, and a validator planning without a reveal the others have would vote alone. This
module knows nothing about scoring or merging.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from node.store.db import Storage
from node.store.records import RoundPlan, SeedRecord
from protocol.assignment import admit, assign
from protocol.messages import report_capacity
from protocol.seeds import reveal_matches, round_seed
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)

SEED_WITHHOLD_ROUNDS = 2
"""K, a protocol constant: a validator that commits a seed in round r and does not reveal a matching
seed is left out of the assignment of rounds r+1 .. r+K."""


def withheld(seeds: Iterable[SeedRecord]) -> tuple[str, ...]:
    """The validators, sorted, that committed a seed and did not reveal one matching the commitment."""
    return tuple(sorted(s.validator for s in seeds
                        if s.commitment and not (s.seed and reveal_matches(s.commitment, s.seed))))


async def excluded_validators(storage: Storage, spec: NetworkSpec, round: int) -> tuple[str, ...]:
    """Spec validators that withheld a seed in one of the SEED_WITHHOLD_ROUNDS rounds before `round`."""
    validators = set(spec.validator_weights)
    excluded: set[str] = set()
    for earlier in range(max(0, round - SEED_WITHHOLD_ROUNDS), round):
        excluded.update(v for v in withheld(await storage.seeds_for(earlier)) if v in validators)
    return tuple(sorted(excluded))


async def unpaired(storage: Storage, round: int) -> bool:
    """Whether storage holds a commit of `round` (a validator's seed, a miner's checkpoint) with no
    matching reveal, or a reveal with no commit."""
    seeds = await storage.seeds_for(round)
    if withheld(seeds) or any(s.seed and not s.commitment for s in seeds):
        return True
    commits = {c.miner: c.commitment for c in await storage.commits_for(round)}
    reveals = {r.miner: r.commitment for r in await storage.reveals_for(round)}
    return commits != reveals


async def make_plan(storage: Storage, spec: NetworkSpec, round: int) -> RoundPlan | None:
    """The plan of `round` as storage has it now; None (logged) when no validator revealed a seed.

    The assignment leaves out the validators `excluded_validators` names; when that would leave no
    validator at all, every validator is assigned (a round never goes without validators) and the
    plan names nobody as excluded.
    """
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
    excluded = await excluded_validators(storage, spec, round)
    validators = sorted(set(spec.validator_weights) - set(excluded))
    if not validators:
        log.warning("round %d: every validator withheld a seed in the last %d round(s); assigning all of them",
                    round, SEED_WITHHOLD_ROUNDS)
        validators, excluded = sorted(spec.validator_weights), ()
    elif excluded:
        log.info("round %d: validator(s) %s left out of the assignment: they withheld a seed in the last %d "
                 "round(s)", round, ", ".join(v[:12] for v in excluded), SEED_WITHHOLD_ROUNDS)
    admitted = admit(seed, revealed, report_capacity(spec.limits.max_message_bytes)) if revealed else ()
    if len(admitted) < len(revealed):
        log.warning("round %d: %d miners revealed, and a round takes %d (as many as one score report of at most "
                    "limits.max_message_bytes = %d bytes can name); the rest are not scored this round", round,
                    len(revealed), len(admitted), spec.limits.max_message_bytes)
    assignment = assign(seed, admitted, validators, spec.rewards.replication) if admitted else {}
    return RoundPlan(round, seed, revealed, commits, assignment, withheld(seeds), excluded)
