"""One running node per data directory and per key: advisory locks a node holds for its whole life.

Two daemons started on one config (a service manager and a shell, say) would sign different commits
for one round with one key, which peers REJECT as equivocation, and would write one database from
two processes. So a node takes `flock` locks on `<data_dir>/node.lock` (which names the holder's pid)
and on its key file before it opens anything else, and a second node on either refuses to start.
The kernel drops a process's locks when it exits, however it exits (SIGKILL included), so a crashed
node restarts with nothing to clean up. A filesystem that cannot lock (some network mounts) gets a
warning instead of a refusal. This module knows nothing of what the node stores.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "node.lock"
_HELD = (errno.EAGAIN, errno.EACCES)  # flock's "someone else holds it" (EWOULDBLOCK is EAGAIN on Linux)


class AlreadyRunning(ValueError):
    """Another running node holds this node's data directory or key."""


class NodeLock:
    """The locks of one running node; `release()` (or process exit) frees them."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    @classmethod
    def acquire(cls, data_dir: Path, key: Path) -> NodeLock:
        """Lock `data_dir` (created if missing), then `key`; raises AlreadyRunning naming the one held."""
        data_dir.mkdir(parents=True, exist_ok=True)
        lock_path = data_dir / LOCK_NAME
        fds: list[int] = []
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fds.append(fd)
            if not _try_lock(fd, lock_path):
                raise AlreadyRunning(f"{data_dir}: another node is running on this data directory "
                                     f"({_holder(lock_path)}); stop it first, or give this node its own "
                                     f"node.data_dir")
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            fd = os.open(key, os.O_RDONLY)
            fds.append(fd)
            if not _try_lock(fd, key):
                raise AlreadyRunning(f"{key}: another running node uses this key; two nodes signing with one "
                                     f"key send conflicting messages, which peers reject as equivocation: give "
                                     f"each node its own key (tessera keygen)")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds)

    def release(self) -> None:
        """Drop the locks (closing a file's only descriptor drops its flock); a second call does nothing."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _try_lock(fd: int, path: Path) -> bool:
    """False if another open file holds `path`'s lock; True once locked, or where locks do not work."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _HELD:
            return False
        log.warning("%s: cannot lock (%s); make sure no other node uses it", path, exc.strerror or exc)
    return True


def _holder(lock_path: Path) -> str:
    try:
        pid = lock_path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "its pid unknown"
