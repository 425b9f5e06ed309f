"""The validator's prefetcher: one fetch per blob, at most `limit` a round, and a new round starts afresh."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from node.duties.prefetch import Prefetcher


class CountingTransfer:
    """Stands in for the network's blob transfer: records each fetch, fetches nothing."""

    def __init__(self) -> None:
        self.fetched: list[str] = []

    async def fetch(self, blob_hash: str, providers: Sequence[str], max_bytes: int) -> Path:
        self.fetched.append(blob_hash)
        return Path("/nonexistent")


async def test_at_most_limit_blobs_are_prefetched_a_round() -> None:
    transfer = CountingTransfer()
    prefetch = Prefetcher(transfer, limit=3)  # type: ignore[arg-type]  # only fetch is used
    blobs = [f"{i:02x}" * 32 for i in range(10)]
    for blob in [blobs[0], *blobs]:  # the first one twice
        prefetch.start(blob, "ab" * 32, 100)
    for blob in blobs:
        await prefetch.wait(blob)
    assert transfer.fetched == blobs[:3]
    prefetch.clear()  # the next round
    prefetch.start(blobs[9], "ab" * 32, 100)
    await prefetch.wait(blobs[9])
    await asyncio.sleep(0)
    assert transfer.fetched == [*blobs[:3], blobs[9]]
