"""Content-addressed blob storage on disk: a blob lives at `root/ab/abcdef...` named by its SHA-256.

Every write goes to a temp file under `root/tmp/`, is hashed while it is written, and is renamed
into place (os.replace) only once its hash and size are verified, and the rename is made durable
(fsync of the directory, and of the root when that directory is new); a failed or aborted write
deletes its temp file (also when the disk refuses writes: the OSError reaches the caller and no
partial blob stays). Temp files left by a crash are removed by `sweep_temporary`, which only the
store's owner calls, when it opens the store (a node, once it holds its data directory's lock):
anyone else may open the same directory to read it without touching writes in flight. This
module knows nothing about the network, messages or what a blob contains.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
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

    def __init__(self, store: BlobStore, expected_hash: str, max_bytes: int) -> None:
        self._store = store
        self.expected_hash = expected_hash
        self.max_bytes = max_bytes
        self.size = 0
        self._stored = 0
        self._hasher = hashlib.sha256()
        self.tmp_path = store.root / TMP_DIR / f"{expected_hash}.{os.getpid()}.{time.monotonic_ns()}"
        self._file = open(self.tmp_path, "xb")  # noqa: SIM115 - closed by commit/abort
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        """Hash and store `data`; BlobTooLarge (and the temp file deleted) past the cap."""
        try:
            self.accept(data)
        except BlobTooLarge:
            self.abort()
            raise
        self.store(data)

    def accept(self, data: bytes | memoryview) -> None:
        """Count and hash `data`; BlobTooLarge past the cap. `store` must follow with the same bytes.

        Hashing is fastest on bytes still in this CPU's cache, so a receiver accepts a chunk where it
        arrived and may store it from another thread.
        """
        assert not self._done, "write after commit/abort"
        if self.size + len(data) > self.max_bytes:
            raise BlobTooLarge(f"blob {self.expected_hash[:12]}: more than {self.max_bytes} bytes")
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
            os.replace(self.tmp_path, final)
            _fsync_directory(final.parent)
            if new_directory:
                _fsync_directory(final.parent.parent)
        except OSError:  # a full or failing disk: nothing half-written stays behind
            self.abort()
            raise
        self._done = True
        return final

    def abort(self) -> None:
        """Delete the temp file; safe to call on a disk that refuses writes (the close may fail again)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # the close flushes what is buffered; the file closes regardless
            self._file.close()
        self.tmp_path.unlink(missing_ok=True)

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
    """Blobs by SHA-256 under one directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / TMP_DIR).mkdir(parents=True, exist_ok=True)

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

    def put_bytes(self, data: bytes) -> str:
        """Store `data`; returns its address (a no-op when it is already stored)."""
        blob_hash = hashlib.sha256(data).hexdigest()
        if not self.has(blob_hash):
            with self.open_writer(blob_hash, len(data)) as writer:
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
            with self.open_writer(blob_hash, source.stat().st_size) as writer, open(source, "rb") as f:
                while chunk := f.read(1 << 20):
                    writer.write(chunk)
        return blob_hash

    def open_writer(self, expected_hash: str, max_bytes: int) -> BlobWriter:
        """A writer for a blob expected to hash to `expected_hash`, refusing more than `max_bytes`."""
        _check_hash(expected_hash)
        if max_bytes < 0:
            raise BlobError(f"max_bytes must be >= 0, got {max_bytes}")
        return BlobWriter(self, expected_hash, max_bytes)

    def delete(self, blob_hash: str) -> None:
        self.path(blob_hash).unlink(missing_ok=True)

    def hashes(self) -> list[str]:
        """Addresses of every stored blob, sorted."""
        return sorted(
            p.name for d in self.root.iterdir() if d.is_dir() and d.name != TMP_DIR for p in d.iterdir()
            if p.is_file() and is_hex_digest(p.name)
        )

    def retain(self, keep: set[str], max_age_s: float, now: float | None = None) -> list[str]:
        """Delete blobs not in `keep` whose files are older than `max_age_s`; returns what was deleted."""
        now = time.time() if now is None else now
        deleted = []
        for blob_hash in self.hashes():
            if blob_hash in keep:
                continue
            path = self.path(blob_hash)
            if now - path.stat().st_mtime > max_age_s:
                path.unlink(missing_ok=True)
                deleted.append(blob_hash)
        return deleted
