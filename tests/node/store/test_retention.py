"""Storage that stays bounded, on real SQLite and a real blob directory: blobs older than the retention window
go, but not the head, its momenta, or what this node serves a re-syncing peer (its recent proposals and
submissions); a blob budget refuses a fetch that would pass it in one line and leaves nothing behind, while
this node's own blobs are always written, and pruning makes room again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.store.blobs import BlobStore, BlobStoreFull
from node.store.db import Proposal, Storage, Submission
from protocol.spec import parse_spec
from tests.conftest import make_identity, make_spec_dict

SPEC = parse_spec(make_spec_dict())
ROUND_S = 100.0
NOW = 1_000_000.0


def age(store: BlobStore, blob_hash: str, seconds: float) -> None:
    os.utime(store.path(blob_hash), (NOW - seconds, NOW - seconds))


async def test_old_blobs_go_but_the_head_its_momenta_and_what_peers_ask_for_stay(tmp_path: Path) -> None:
    storage = await Storage.open(tmp_path / "node.db")
    blobs = BlobStore(tmp_path / "blobs")
    try:
        me, other = make_identity(0).node_id, make_identity(1).node_id
        names = ["head", "momentum", "other_momentum", "proposal_9_state", "proposal_9_momentum",
                 "proposal_7_state", "proposal_7_momentum", "submission_9", "submission_7", "stale_momentum",
                 "submission_of_a_peer", "fresh"]
        hashes = {name: blobs.put_bytes(name.encode() * 100) for name in names}
        for name, blob_hash in hashes.items():
            age(blobs, blob_hash, 10 if name == "fresh" else 10 * ROUND_S)
        await storage.set_head(hashes["head"])
        await storage.set_momentum(hashes["momentum"])
        await storage.set_momentum_of(hashes["head"], me, hashes["momentum"])
        await storage.set_momentum_of(hashes["head"], other, hashes["other_momentum"])
        await storage.set_momentum_of(hashes["proposal_7_state"], other, hashes["stale_momentum"])
        for r in (7, 9):
            await storage.set_proposal(r, Proposal(hashes[f"proposal_{r}_state"], hashes[f"proposal_{r}_momentum"]), me)
            await storage.set_submission(r, Submission(hashes[f"submission_{r}"], 100))

        keep = await storage.blobs_in_use(since_round=9)
        deleted = blobs.retain(keep, max_age_s=3 * ROUND_S, now=NOW)

        gone = {"proposal_7_state", "proposal_7_momentum", "submission_7", "stale_momentum", "submission_of_a_peer"}
        assert sorted(deleted) == sorted(hashes[name] for name in gone)
        assert sorted(blobs.hashes()) == sorted(hashes[name] for name in names if name not in gone)
        await storage.prune(before_round=9)  # the per-round working state goes with the rounds
        assert await storage.proposal(7) is None and await storage.submission(7) is None
        assert await storage.blobs_in_use(since_round=9) == keep
    finally:
        await storage.close()


def test_a_received_blob_past_the_budget_is_refused_and_own_blobs_are_always_written(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, budget_bytes=1_000)
    own = store.put_bytes(b"a" * 800)
    assert store.held_bytes == 800
    data = b"b" * 300
    blob_hash = store.put_bytes(data)  # this node's own: written past the budget
    assert store.held_bytes == 1_100
    store.delete(blob_hash)
    with pytest.raises(BlobStoreFull) as refused:
        store.check_room(blob_hash, 300)
    assert "\n" not in str(refused.value) and "storage.blob_budget_bytes" in str(refused.value)
    with pytest.raises(BlobStoreFull), store.open_writer(blob_hash, 300) as writer:
        writer.write(data[:150])  # fits
        writer.write(data[150:])  # does not
    assert not store.has(blob_hash) and list((tmp_path / "tmp").iterdir()) == []
    assert store.held_bytes == 800
    store.delete(own)
    with store.open_writer(blob_hash, 300) as writer:
        writer.write(data)
    assert store.has(blob_hash) and store.held_bytes == 300
    assert BlobStore(tmp_path, budget_bytes=1_000).held_bytes == 300  # a reopened store counts what it holds


def test_two_writers_in_flight_share_the_budget(tmp_path: Path) -> None:
    store = BlobStore(tmp_path, budget_bytes=500)
    first, second = store.open_writer("11" * 32, 400), store.open_writer("22" * 32, 400)
    first.accept(b"x" * 300)
    with pytest.raises(BlobStoreFull):
        second.accept(b"y" * 300)  # 300 arriving + 300 more would pass 500
    first.abort()
    second.accept(b"y" * 300)  # the aborted writer's bytes are free again
    second.abort()


async def test_a_fetch_the_budget_refuses_fails_with_one_line_and_pruning_makes_room(tmp_path: Path) -> None:
    hub = MemoryHub()
    miner, validator = make_identity(100).node_id, make_identity(0).node_id
    served = BlobStore(tmp_path / "miner")
    net = hub.join(miner, GossipJudge(SPEC, lambda: NOW), served)
    blob = served.put_bytes(b"s" * 600)
    net.serve(blob)
    store = BlobStore(tmp_path / "validator", budget_bytes=1_000)
    old = store.put_bytes(b"o" * 500)
    fetching = hub.join(validator, GossipJudge(SPEC, lambda: NOW), store)

    with pytest.raises(OSError, match="past its budget of 1000 bytes") as refused:
        await fetching.fetch(blob, [miner], 1_000)
    assert isinstance(refused.value, BlobStoreFull)
    assert not store.has(blob) and list((store.root / "tmp").iterdir()) == []

    age(store, old, 10 * ROUND_S)
    assert store.retain(set(), max_age_s=3 * ROUND_S, now=NOW) == [old]
    assert (await fetching.fetch(blob, [miner], 1_000)).read_bytes() == b"s" * 600
