"""The content-addressed blob store: layout, verified atomic writes, cleanup and retention."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from node.store.blobs import BlobError, BlobStore, BlobTooLarge, HashMismatch


def tmp_files(store: BlobStore) -> list[Path]:
    return list((store.root / "tmp").iterdir())


def test_put_bytes_stores_by_sha256_in_a_two_level_layout(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"tessera" * 100
    blob_hash = store.put_bytes(data)
    assert blob_hash == hashlib.sha256(data).hexdigest()
    assert store.path(blob_hash) == tmp_path / blob_hash[:2] / blob_hash
    assert store.has(blob_hash) and store.size(blob_hash) == len(data)
    assert store.path(blob_hash).read_bytes() == data
    assert store.put_bytes(data) == blob_hash
    assert store.hashes() == [blob_hash]
    assert tmp_files(store) == []


def test_put_parts_stores_a_blob_given_in_pieces_and_refuses_pieces_of_another(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    parts = [b"head", memoryview(b"tensor one"), b"tensor two"]
    blob_hash = hashlib.sha256(b"".join(parts)).hexdigest()
    assert store.put_parts(blob_hash, parts) == blob_hash
    assert store.path(blob_hash).read_bytes() == b"".join(parts)
    other = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(HashMismatch):
        store.put_parts(other, parts)
    assert not store.has(other) and tmp_files(store) == []


def test_verified_gives_the_path_of_an_intact_blob_and_deletes_a_corrupt_one(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = os.urandom(9 << 20)  # more than one 8 MB read
    blob_hash = store.put_bytes(data)
    assert store.verified(blob_hash) == store.path(blob_hash)
    store.path(blob_hash).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert store.verified(blob_hash) is None and not store.has(blob_hash)
    assert store.verified(blob_hash) is None  # missing


def test_put_file_copies_a_file_in(tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(3 << 20))
    store = BlobStore(tmp_path / "store")
    blob_hash = store.put_file(source)
    assert store.path(blob_hash).read_bytes() == source.read_bytes()


def test_a_writer_commits_only_bytes_that_hash_to_the_address(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"x" * 1000
    good = hashlib.sha256(data).hexdigest()
    writer = store.open_writer(good, 1000)
    writer.write(data[:400])
    assert not store.has(good)  # nothing visible until commit
    writer.write(data[400:])
    assert writer.commit() == store.path(good)

    wrong = "00" * 32
    with pytest.raises(HashMismatch, match="hash to"), store.open_writer(wrong, 1000) as w:
        w.write(data)
    assert not store.has(wrong)
    assert tmp_files(store) == []


def test_a_writer_refuses_more_than_its_cap_and_leaves_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"y" * 101
    blob_hash = hashlib.sha256(data).hexdigest()
    writer = store.open_writer(blob_hash, 100)
    writer.write(data[:100])
    with pytest.raises(BlobTooLarge):
        writer.write(data[100:])
    assert not store.has(blob_hash)
    assert tmp_files(store) == []


def test_bytes_accepted_in_one_thread_and_stored_in_another_commit_as_one_blob(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    chunks = [os.urandom(1000) for _ in range(5)]
    blob_hash = hashlib.sha256(b"".join(chunks)).hexdigest()
    with store.open_writer(blob_hash, 5000) as writer:
        for chunk in chunks:
            writer.accept(chunk)
        worker = threading.Thread(target=lambda: [writer.store(chunk) for chunk in chunks])
        worker.start()
        worker.join()
    assert store.path(blob_hash).read_bytes() == b"".join(chunks)
    with pytest.raises(BlobTooLarge), store.open_writer(blob_hash, 999) as writer:
        writer.accept(chunks[0])
    assert tmp_files(store) == []


def test_an_exception_inside_the_writer_context_aborts(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    blob_hash = hashlib.sha256(b"z").hexdigest()
    with pytest.raises(RuntimeError), store.open_writer(blob_hash, 10) as w:
        w.write(b"z")
        raise RuntimeError("peer went away")
    assert not store.has(blob_hash)
    assert tmp_files(store) == []


def test_the_owner_sweeps_stale_temp_files_and_a_reader_leaves_writes_in_flight_alone(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    writer = store.open_writer("ab" * 32, 100)
    writer.write(b"partial")
    assert len(tmp_files(store)) == 1  # a crash here would leave this behind
    data = b"a blob written while another process opened the store"
    with store.open_writer(hashlib.sha256(data).hexdigest(), 100) as second:
        second.write(data)
        BlobStore(tmp_path)  # a reader, e.g. a benchmark counting a running node's blobs
        second.commit()  # its temp file is still there to rename
    assert store.has(hashlib.sha256(data).hexdigest())
    assert BlobStore(tmp_path).sweep_temporary() == 1  # the owner, on a restart after the crash
    assert tmp_files(store) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names synced descriptors through Linux's /proc")
def test_a_commit_fsyncs_the_directory_it_renames_into_and_the_root_when_that_directory_is_new(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage records a blob (a submission, an error-feedback buffer) once the commit returns, so the
    rename must survive a power cut, and so must a shard directory made for it."""
    store = BlobStore(tmp_path)
    synced: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    first = store.put_bytes(b"first")
    root = tmp_path.resolve()
    assert synced[0].parent == root / "tmp" and synced[1:] == [root / first[:2], root]
    second = hashlib.sha256(b"second").hexdigest()
    store.path(second).parent.mkdir(exist_ok=True)
    synced.clear()
    store.put_bytes(b"second")
    assert synced[0].parent == root / "tmp" and synced[1:] == [root / second[:2]]


def test_addresses_are_checked(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    for bad in ("../etc/passwd", "AB" * 32, "ab" * 31):
        with pytest.raises(BlobError, match="not a blob address"):
            store.path(bad)


def test_retain_deletes_old_blobs_outside_the_keep_set(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    old_kept, old_dropped, fresh = (store.put_bytes(bytes([i]) * 10) for i in range(3))
    now = 1_000_000.0
    for blob_hash, age in ((old_kept, 7200), (old_dropped, 7200), (fresh, 10)):
        os.utime(store.path(blob_hash), (now - age, now - age))
    deleted = store.retain({old_kept}, max_age_s=3600, now=now)
    assert deleted == [old_dropped]
    assert store.has(old_kept) and store.has(fresh) and not store.has(old_dropped)
    store.delete(fresh)
    assert store.hashes() == [old_kept]


def test_read_checked_gives_intact_blobs_and_drops_missing_or_corrupt_ones(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    good = store.put_bytes(b"a global state")
    assert store.read_checked(good) == b"a global state"
    assert store.read_checked("ab" * 32) is None  # never stored
    store.path(good).write_bytes(b"flipped bits")
    assert store.read_checked(good) is None and not store.has(good)  # corrupt: deleted, to be fetched again
