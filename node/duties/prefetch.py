"""Revealed blobs fetched while REVEAL is still open, so a miner that goes down after revealing is still scored.

A validator offers each accepted Reveal of the current round (`offer`) and, once every validator that
committed a seed has revealed it, the miners the round plan will assign to it (`assign`, from
`early_assignment`): from then on offered blobs are fetched in the background from the miners that
revealed them, a few at a time, those assigned to this validator first, within a byte budget a round
(`[validator] prefetch_bytes`, counted by the sizes the reveals declare; a blob is fetched with that
size as its cap) and at most `limit` blobs (as many miners as a round takes). So a validator's
downloads do not grow with all miners: what does not fit, and everything when a validator withholds
its seed, is fetched at EVALUATE if this validator is assigned to it (or at MERGE if it is a merge
candidate). An unassigned blob takes what budget the assigned ones offered so far left; reveals come
at the start of REVEAL, before the seeds, so nearly all are offered before the assignment is known.
At EVALUATE `wait` lets the scoring path await a fetch already under way instead of starting a
second one. A failed prefetch is only logged (one a full disk refused, by `quiet`, once a round): EVALUATE
fetches again. `clear` cancels whatever is left when the next round starts.
This module knows nothing about scoring; it moves bytes into the blob store ahead of time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from node.duties.plan import make_plan, withheld
from node.net.network import BlobTransfer, NetworkError
from node.store.db import Storage
from protocol.spec import NetworkSpec

log = logging.getLogger(__name__)

CONCURRENT_FETCHES = 4


@dataclass(frozen=True)
class _Offer:
    blob_hash: str
    miner: str
    size: int
    """The size the miner's Reveal declares: what the budget counts, and the fetch's cap."""


async def early_assignment(storage: Storage, spec: NetworkSpec, round: int, me: str) -> frozenset[str] | None:
    """The miners the plan of `round` will assign to validator `me`, once every validator that committed a
    seed has revealed a matching one (the round seed is final then); None before."""
    seeds = await storage.seeds_for(round)
    if not any(s.commitment for s in seeds) or withheld(seeds):
        return None
    plan = await make_plan(storage, spec, round)
    if plan is None:
        return None
    return frozenset(miner for miner, chosen in plan.assignment.items() if me in chosen)


class Prefetcher:
    """Background fetches of revealed blobs, one per blob hash, at most CONCURRENT_FETCHES at a time, at most
    `limit` blobs and `budget_bytes` declared bytes a round."""

    def __init__(self, network: BlobTransfer, limit: int, budget_bytes: int,
                 quiet: Callable[[BaseException], bool] | None = None) -> None:
        self._network = network
        self._quiet = quiet
        """Says a failure itself (a full disk: node.runtime.disk.DiskWatch.quiet) when it returns True."""
        self._limit = limit
        self._budget = budget_bytes
        self._spent = 0
        self._offers: dict[str, _Offer] = {}  # by blob hash, in the order offered; not yet started
        self._assigned: frozenset[str] | None = None
        self._full = False  # a blob was left for lack of budget or count this round (and logged)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(CONCURRENT_FETCHES)

    @property
    def assigned(self) -> frozenset[str] | None:
        """The miners assigned to this validator this round, once `assign` said; None before."""
        return self._assigned

    def offer(self, blob_hash: str, miner: str, size: int, max_bytes: int) -> None:
        """A blob `miner` revealed with `size` bytes; fetched once the assignment is known and it fits. A blob
        declared over `max_bytes` (the format's cap, validator.checks.submission_cap) is not prefetched."""
        if blob_hash in self._tasks or blob_hash in self._offers or size > max_bytes:
            return
        self._offers[blob_hash] = _Offer(blob_hash, miner, size)
        self._start_what_fits()

    def assign(self, miners: frozenset[str]) -> None:
        """The miners the round plan assigns to this validator: start their blobs first, then the others."""
        self._assigned = miners
        self._start_what_fits()

    async def wait(self, blob_hash: str) -> None:
        """Return once the prefetch of `blob_hash` (if any was started) has ended, however it ended."""
        task = self._tasks.get(blob_hash)
        if task is not None:
            await asyncio.wait([task])

    def clear(self) -> None:
        """Cancel every unfinished fetch and forget them all, and the offers and assignment (a new round begins)."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._offers.clear()
        self._assigned = None
        self._spent = 0
        self._full = False

    def _start_what_fits(self) -> None:
        assigned = self._assigned
        if assigned is None:
            return
        for offer in sorted(self._offers.values(), key=lambda o: o.miner not in assigned):  # stable: offer order
            if len(self._tasks) >= self._limit or self._spent + offer.size > self._budget:
                self._say_full(offer, offer.miner in assigned)
                continue
            del self._offers[offer.blob_hash]
            self._spent += offer.size
            self._tasks[offer.blob_hash] = asyncio.create_task(self._fetch(offer), name=f"prefetch-{offer.blob_hash[:12]}")

    def _say_full(self, offer: _Offer, assigned: bool) -> None:
        if self._full:
            return
        self._full = True
        log.info("prefetch: %d blob(s) and %d of %d bytes taken this round; blob %s of %s miner %s (%d bytes) and "
                 "any later ones that do not fit are fetched at EVALUATE if this validator scores them",
                 len(self._tasks), self._spent, self._budget, offer.blob_hash[:12],
                 "assigned" if assigned else "unassigned", offer.miner[:12], offer.size)

    async def _fetch(self, offer: _Offer) -> None:
        async with self._slots:
            try:
                await self._network.fetch(offer.blob_hash, [offer.miner], offer.size)
            except (NetworkError, OSError) as exc:
                if self._quiet is None or not self._quiet(exc):
                    log.info("prefetch of blob %s from miner %s failed (EVALUATE tries again): %s",
                             offer.blob_hash[:12], offer.miner[:12], exc)
