"""Files and directories written into place whole or not at all: the one atomic write every package uses.

`write_file` writes a synced temporary sibling, then renames it over the target (`replace`) or links it into
place, so an existing file, also one another process wrote meanwhile, is never replaced (FileExistsError).
On a filesystem without hard links (some FUSE, SMB and FAT mounts) the file is instead created at its path
with O_EXCL, written and synced there, and removed again if that fails. The directory is synced after, so
the new name survives a crash. `staged_directory` is the same for a directory: filled under a hidden
sibling, renamed to its path once whole. Only the standard library: protocol/identity.py writes keys with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS})
"""What link(2) answers on a filesystem without hard links, or with no room for another link to the file."""


def write_file(path: str | Path, data: bytes, *, replace: bool = True, mode: int = 0o644) -> None:
    """Write `data` to `path` whole or not at all (module doc); a new file gets `mode` (less the umask)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_synced(tmp, data, os.O_TRUNC, mode)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in NO_HARD_LINKS:
                    raise
                _write_synced(path, data, os.O_EXCL, mode)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    sync_directory(path.parent)


@contextlib.contextmanager
def staged_directory(out: str | Path) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to fill: renamed to `out` (absent, or an empty directory) when the block
    ends without an error, and removed whatever happens."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.rename(staging, out)
        sync_directory(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def sync_directory(path: Path) -> None:
    """fsync a directory, so the names just made in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes, flag: int, mode: int) -> None:
    """Create `path` (`flag` O_EXCL or O_TRUNC) holding `data`, synced to disk; a file this call created is
    removed again when writing it fails, so none is left half-written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flag, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
