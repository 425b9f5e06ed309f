"""Revealed blobs fetched while REVEAL is still open, so a miner that goes down after revealing is still scored.

A validator starts a background fetch for each accepted Reveal of the current round, from the miner
that revealed it, a few at a time. At EVALUATE `wait` lets the scoring path await the fetch that is
already under way instead of starting a second one; the blob is in the local store by then, and a
miner killed or unreachable during EVALUATE no longer costs it the round. A failed prefetch is only
logged: EVALUATE fetches again. `clear` cancels whatever is left when the next round starts. At most
`limit` blobs are prefetched a round (as many miners as a round takes): identities that reveal for
nothing cannot make a validator download without bound; what is not prefetched is fetched at
EVALUATE if the miner was admitted.
This module knows nothing about scoring; it moves bytes into the blob store ahead of time.
"""

from __future__ import annotations

import asyncio
import logging

from node.net.network import BlobTransfer, NetworkError

log = logging.getLogger(__name__)

CONCURRENT_FETCHES = 4


class Prefetcher:
    """Background fetches of revealed blobs, one per blob hash, at most CONCURRENT_FETCHES at a time."""

    def __init__(self, network: BlobTransfer, limit: int) -> None:
        self._network = network
        self._limit = limit
        self._full = False  # the limit was reached this round (and logged)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(CONCURRENT_FETCHES)

    def start(self, blob_hash: str, miner: str, max_bytes: int) -> None:
        """Begin fetching `blob_hash` from `miner` unless a fetch of it was already started or this round's
        `limit` is reached; a blob over `max_bytes` (the format's cap, validator.checks.submission_cap) is
        refused as it arrives."""
        if blob_hash in self._tasks:
            return
        if len(self._tasks) >= self._limit:
            if not self._full:
                log.info("%d blobs prefetched this round, as many as a round takes; later reveals are fetched "
                         "at EVALUATE if their miners are admitted", self._limit)
                self._full = True
            return
        self._tasks[blob_hash] = asyncio.create_task(self._fetch(blob_hash, miner, max_bytes),
                                                     name=f"prefetch-{blob_hash[:12]}")

    async def wait(self, blob_hash: str) -> None:
        """Return once the prefetch of `blob_hash` (if any was started) has ended, however it ended."""
        task = self._tasks.get(blob_hash)
        if task is not None:
            await asyncio.wait([task])

    def clear(self) -> None:
        """Cancel every unfinished fetch and forget them all (a new round begins)."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._full = False

    async def _fetch(self, blob_hash: str, miner: str, max_bytes: int) -> None:
        async with self._slots:
            try:
                await self._network.fetch(blob_hash, [miner], max_bytes)
            except (NetworkError, OSError) as exc:
                log.info("prefetch of blob %s from miner %s failed (EVALUATE tries again): %s",
                         blob_hash[:12], miner[:12], exc)
