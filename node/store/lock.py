"""One running node per data directory and per key: advisory locks a node holds for its whole life.

Two daemons started on one config (a service manager and a shell, say) would sign different commits
for one round with one key, which peers REJECT as equivocation, and would write one database from
two processes. So a node takes `flock` locks on `<data_dir>/node.lock` (which names the holder's pid)
and on its key file before it opens anything else, and a second node on either refuses to start.
The kernel drops a process's locks when it exits, however it exits (SIGKILL included), so a crashed
node restarts with nothing to clean up. A filesystem that cannot lock (some network mounts) gets a
warning instead of a refusal.

Once locked, a data directory is also claimed for one node: `<data_dir>/owner.json` names the network,
role and key it was first run with (written atomically on first start), and a node of another network,
role or key refuses it: a miner's state is not a validator's, and a state of another network is not one
this network's blobs fit. This module knows nothing else of what the node stores.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from protocol.files import write_file

log = logging.getLogger(__name__)

LOCK_NAME = "node.lock"
OWNER_NAME = "owner.json"
_HELD = (errno.EAGAIN, errno.EACCES)  # flock's "someone else holds it" (EWOULDBLOCK is EAGAIN on Linux)


class AlreadyRunning(ValueError):
    """Another running node holds this node's data directory or key."""


@dataclass(frozen=True)
class Owner:
    """Whose a data directory is: the network id, the role and the node id (the key) it runs with."""

    network: str
    role: str
    node: str

    def describe(self) -> str:
        return f"a {self.role} of network {self.network[:12]} with key {self.node[:12]}"


class NodeLock:
    """The locks of one running node; `release()` (or process exit) frees them."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    @classmethod
    def acquire(cls, data_dir: Path, key: Path, owner: Owner | None = None) -> NodeLock:
        """Lock `data_dir` (created if missing), then `key`; raises AlreadyRunning naming the one held. With
        `owner`, then claim the directory for it (`claim`)."""
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
            if owner is not None:
                claim(data_dir, owner)
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


def claim(data_dir: Path, owner: Owner) -> None:
    """Record `owner` in `data_dir` on first use; ValueError when the directory already belongs to another."""
    path = data_dir / OWNER_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    if text is None:
        write_file(path, (json.dumps(asdict(owner), indent=2) + "\n").encode("utf-8"))
        return
    try:
        found = Owner(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not an owner record ({exc}); if this data directory is this node's, remove the "
                         f"file and start again") from None
    if found != owner:
        raise ValueError(f"{data_dir}: this data directory belongs to {found.describe()}, and this node is "
                         f"{owner.describe()}; give it its own node.data_dir (a new directory)")


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
