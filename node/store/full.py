"""Whether a failed write means a full disk: the OS's ENOSPC or EDQUOT, SQLite's SQLITE_FULL, or the blob
store's budget.

The budget's refusal is `BlobStoreFull`, an ENOSPC. The error may be the one raised, behind it (`raise ...
from`, or raised while handling it) or inside an exception group (a trio nursery's). This module knows
nothing about what was being written.
"""

from __future__ import annotations

import errno
import sqlite3

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def full_disk(exc: BaseException) -> OSError | sqlite3.Error | None:
    """The error in `exc`'s chain that says the disk (or the blob store's budget) is full; None when none does."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        at = todo.pop()
        if id(at) in seen:
            continue
        seen.add(id(at))
        if isinstance(at, OSError) and at.errno in _FULL_ERRNOS:
            return at
        if isinstance(at, sqlite3.Error) and getattr(at, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return at
        if isinstance(at, BaseExceptionGroup):
            todo.extend(at.exceptions)
        todo.extend(e for e in (at.__context__, at.__cause__) if e is not None)
    return None
