"""Content-addressed blob storage on disk: a blob lives at `root/ab/abcdef...` named by its SHA-256.

Every write goes to a temp file under `root/tmp/`, is hashed while it is written, and is renamed
into place (os.replace) only once its hash and size are verified, and the rename is made durable
(fsync of the directory, and of the root when that directory is new); a failed or aborted write
deletes its temp file (also when the disk refuses writes: the OSError reaches the caller and no
partial blob stays). Temp files left by a crash are removed by `sweep_temporary`, which only the
store's owner calls, when it opens the store (a node, once it holds its data directory's lock):
anyone else may open the same directory to read it without touching writes in flight.
A store may have a byte budget: a blob received through `open_writer` (a fetch) that would take the
blobs held, and those arriving, past it is refused with BlobStoreFull, an OSError as a full disk is, before
its bytes are stored (a fetcher that knows the size asks `check_room` first); this node's own blobs
(`put_bytes`, `put_file`) count towards the budget but are never refused by it. `retain` prunes by age.
This module knows nothing about the network, messages or what a blob contains.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from protocol.encoding import is_hex_digest

TMP_DIR = "tmp"


class BlobError(ValueError):
    """Root of blob store errors."""


class HashMismatch(BlobError):
    """The bytes written do not hash to the expected address."""


class BlobTooLarge(BlobError):
    """More bytes arrived than the caller's cap allows."""


class BlobStoreFull(OSError):
    """A received blob would take the store past its byte budget: refused as a full disk would refuse it."""

    def __init__(self, blob_hash: str, incoming: int, held: int, budget: int) -> None:
        super().__init__(errno.ENOSPC, f"blob {blob_hash[:12]}: {incoming} more bytes would take the blob store past "
                         f"its budget of {budget} bytes ({held} held or arriving); the fetch is refused (raise "
                         "storage.blob_budget_bytes, or keep fewer rounds with storage.blob_retention_rounds)")


def _check_hash(blob_hash: str) -> None:
    if not is_hex_digest(blob_hash):
        raise BlobError(f"not a blob address (64 lower-case hex characters): {blob_hash!r}")


def _fsync_directory(path: Path) -> None:
    """Make the entries just renamed or made in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobWriter:
    """Streams bytes into a temp file; `commit()` verifies and moves it into place, `abort()` deletes it.

    As a context manager it commits on a clean exit (unless committed already) and aborts on an exception.
    """

    def __init__(self, store: BlobStore, expected_hash: str, max_bytes: int, budgeted: bool) -> None:
        self._store = store
        self.expected_hash = expected_hash
        self.max_bytes = max_bytes
        self.budgeted = budgeted
        self.size = 0
        self._stored = 0
        self._hasher = hashlib.sha256()
        self.tmp_path = store.root / TMP_DIR / f"{expected_hash}.{os.getpid()}.{time.monotonic_ns()}"
        self._file = open(self.tmp_path, "xb")  # noqa: SIM115 - closed by commit/abort
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        """Hash and store `data`; BlobTooLarge past the cap, BlobStoreFull past the store's budget (and the temp
        file deleted)."""
        try:
            self.accept(data)
        except (BlobTooLarge, BlobStoreFull):
            self.abort()
            raise
        self.store(data)

    def accept(self, data: bytes | memoryview) -> None:
        """Count and hash `data`; BlobTooLarge past the cap, BlobStoreFull past the store's budget (a budgeted
        writer). `store` must follow with the same bytes.

        Hashing is fastest on bytes still in this CPU's cache, so a receiver accepts a chunk where it
        arrived and may store it from another thread.
        """
        assert not self._done, "write after commit/abort"
        if self.size + len(data) > self.max_bytes:
            raise BlobTooLarge(f"blob {self.expected_hash[:12]}: more than {self.max_bytes} bytes")
        if self.budgeted:
            self._store._reserve(self.expected_hash, len(data))
        self.size += len(data)
        self._hasher.update(data)

    def store(self, data: bytes | memoryview) -> None:
        """Append accepted bytes to the temp file, in the order they were accepted."""
        assert not self._done, "write after commit/abort"
        self._stored += len(data)
        self._file.write(data)

    def commit(self) -> Path:
        """Verify the hash, fsync, rename into place and fsync the directory it lands in (and the root when
        that directory is new), so the blob survives a power cut; raises HashMismatch (and deletes) otherwise."""
        assert not self._done, "commit after commit/abort"
        assert self._stored == self.size, f"{self._stored} bytes stored but {self.size} accepted"
        actual = self._hasher.hexdigest()
        if actual != self.expected_hash:
            self.abort()
            raise HashMismatch(f"blob {self.expected_hash[:12]}: received bytes hash to {actual[:12]}")
        final = self._store.path(self.expected_hash)
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            try:
                final.parent.mkdir()
                new_directory = True
            except FileExistsError:
                new_directory = False
            replaced = final.exists()
            os.replace(self.tmp_path, final)
            _fsync_directory(final.parent)
            if new_directory:
                _fsync_directory(final.parent.parent)
        except OSError:  # a full or failing disk: nothing half-written stays behind
            self.abort()
            raise
        self._done = True
        self._store._landed(self.size if self.budgeted else 0, 0 if replaced else self.size)
        return final

    def abort(self) -> None:
        """Delete the temp file; safe to call on a disk that refuses writes (the close may fail again)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # the close flushes what is buffered; the file closes regardless
            self._file.close()
        self.tmp_path.unlink(missing_ok=True)
        self._store._landed(self.size if self.budgeted else 0, 0)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class BlobStore:
    """Blobs by SHA-256 under one directory; `budget_bytes` (None: no budget) bounds what fetches may add."""

    def __init__(self, root: str | Path, budget_bytes: int | None = None) -> None:
        self.root = Path(root)
        (self.root / TMP_DIR).mkdir(parents=True, exist_ok=True)
        if budget_bytes is not None and budget_bytes < 0:
            raise BlobError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()  # writers commit from worker threads
        self._held = sum(self.size(h) for h in self.hashes()) if budget_bytes is not None else 0
        self._arriving = 0  # bytes budgeted writers accepted and have not committed or aborted yet

    @property
    def held_bytes(self) -> int:
        """Bytes of the blobs stored (counted only in a store with a budget; 0 otherwise)."""
        return self._held

    def check_room(self, blob_hash: str, incoming: int) -> None:
        """BlobStoreFull when `incoming` more bytes of a received blob would take the store past its budget."""
        with self._lock:
            self._check_room(blob_hash, incoming)

    def _check_room(self, blob_hash: str, incoming: int) -> None:
        budget = self.budget_bytes
        if budget is not None and self._held + self._arriving + incoming > budget:
            raise BlobStoreFull(blob_hash, incoming, self._held + self._arriving, budget)

    def _reserve(self, blob_hash: str, incoming: int) -> None:
        with self._lock:
            self._check_room(blob_hash, incoming)
            self._arriving += incoming

    def _landed(self, reserved: int, stored: int) -> None:
        """A writer ended: `reserved` budgeted bytes no longer arriving, `stored` new bytes held."""
        if self.budget_bytes is None:
            return
        with self._lock:
            self._arriving -= reserved
            self._held += stored

    def sweep_temporary(self) -> int:
        """Delete the temp files of writes that never finished (a crash); returns how many. Only for the
        store's owner, before it writes: another process's writes in flight would be deleted too."""
        stale = list((self.root / TMP_DIR).iterdir())
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def path(self, blob_hash: str) -> Path:
        _check_hash(blob_hash)
        return self.root / blob_hash[:2] / blob_hash

    def has(self, blob_hash: str) -> bool:
        return self.path(blob_hash).is_file()

    def size(self, blob_hash: str) -> int:
        return self.path(blob_hash).stat().st_size

    def read_checked(self, blob_hash: str) -> bytes | None:
        """The blob's bytes when it is stored intact; None when it is missing, or corrupt (then deleted)."""
        try:
            data = self.path(blob_hash).read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != blob_hash:
            self.delete(blob_hash)
            return None
        return data

    def verified(self, blob_hash: str) -> Path | None:
        """`read_checked` without the bytes in memory: the blob's path when its file hashes to its name (read in
        8 MB pieces); None when it is missing, or corrupt (then deleted)."""
        hasher = hashlib.sha256()
        try:
            with open(self.path(blob_hash), "rb") as fh:
                while chunk := fh.read(8 << 20):
                    hasher.update(chunk)
        except FileNotFoundError:
            return None
        if hasher.hexdigest() != blob_hash:
            self.delete(blob_hash)
            return None
        return self.path(blob_hash)

    def put_parts(self, blob_hash: str, parts: Iterable[bytes | memoryview]) -> str:
        """Store a blob of this node's own, given its hash and its bytes in pieces (a state of GBs written a
        tensor at a time, never whole in memory); HashMismatch if the pieces are not that blob."""
        if not self.has(blob_hash):
            with self._writer(blob_hash, 1 << 62, budgeted=False) as writer:
                for part in parts:
                    writer.write(part)
        return blob_hash

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; returns its address (a no-op when it is already stored)."""
        blob_hash = hashlib.sha256(data).hexdigest()
        if not self.has(blob_hash):
            with self._writer(blob_hash, len(data), budgeted=False) as writer:
                writer.write(data)
        return blob_hash

    def put_file(self, source: str | Path) -> str:
        """Copy a file into the store; returns its address."""
        source = Path(source)
        hasher = hashlib.sha256()
        with open(source, "rb") as f:
            while chunk := f.read(1 << 20):
                hasher.update(chunk)
        blob_hash = hasher.hexdigest()
        if not self.has(blob_hash):
            with self._writer(blob_hash, source.stat().st_size, budgeted=False) as writer, open(source, "rb") as f:
                while chunk := f.read(1 << 20):
                    writer.write(chunk)
        return blob_hash

    def open_writer(self, expected_hash: str, max_bytes: int) -> BlobWriter:
        """A writer for a received blob expected to hash to `expected_hash`, refusing more than `max_bytes`
        and anything past the store's budget."""
        return self._writer(expected_hash, max_bytes, budgeted=True)

    def _writer(self, expected_hash: str, max_bytes: int, budgeted: bool) -> BlobWriter:
        _check_hash(expected_hash)
        if max_bytes < 0:
            raise BlobError(f"max_bytes must be >= 0, got {max_bytes}")
        return BlobWriter(self, expected_hash, max_bytes, budgeted)

    def delete(self, blob_hash: str) -> None:
        self._unlink(self.path(blob_hash))

    def _unlink(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        self._landed(0, -size)

    def hashes(self) -> list[str]:
        """Addresses of every stored blob, sorted."""
        return sorted(
            p.name for d in self.root.iterdir() if d.is_dir() and d.name != TMP_DIR for p in d.iterdir()
            if p.is_file() and is_hex_digest(p.name)
        )

    def stored_bytes(self) -> int:
        """Bytes of every blob stored now, counted from the files (in a store with or without a budget)."""
        total = 0
        for blob_hash in self.hashes():
            with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                total += self.size(blob_hash)
        return total

    def retain(self, keep: set[str], max_age_s: float, now: float | None = None) -> list[str]:
        """Delete blobs not in `keep` whose files are older than `max_age_s`; returns what was deleted."""
        now = time.time() if now is None else now
        deleted = []
        for blob_hash in self.hashes():
            if blob_hash in keep:
                continue
            path = self.path(blob_hash)
            if now - path.stat().st_mtime > max_age_s:
                self._unlink(path)
                deleted.append(blob_hash)
        return deleted
