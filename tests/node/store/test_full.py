"""node.store.full: a full disk is found in what is raised, behind its causes and inside exception groups, and
nothing else is taken for one."""

from __future__ import annotations

import errno
import sqlite3

from node.store.blobs import BlobStoreFull
from node.store.full import full_disk


def test_a_full_disk_is_found_wherever_it_is_in_the_chain() -> None:
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert full_disk(enospc) is enospc
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert full_disk(quota) is quota
    budget = BlobStoreFull("ab" * 32, 10, 95, 100)
    assert full_disk(budget) is budget
    try:
        try:
            raise enospc
        except OSError as exc:
            raise RuntimeError("cannot note it as sent") from exc
    except RuntimeError as wrapped:
        assert full_disk(wrapped) is enospc
    try:
        try:
            raise enospc
        except OSError:
            raise ValueError("cannot rollback") from None  # raised while handling it: still its context
    except ValueError as handling:
        assert full_disk(handling) is enospc
    assert full_disk(BaseExceptionGroup("nursery", [ValueError("x"), ExceptionGroup("inner", [enospc])])) is enospc


def test_sqlites_full_error_counts_and_other_errors_do_not() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA max_page_count = 2")
    try:
        for _ in range(100):
            conn.execute("INSERT INTO t VALUES (?)", (b"x" * 1000,))
    except sqlite3.OperationalError as exc:
        assert full_disk(exc) is exc
    else:
        raise AssertionError("the capped database took every row")
    try:
        conn.execute("SELECT * FROM missing")
    except sqlite3.OperationalError as exc:
        assert full_disk(exc) is None
    conn.close()
    assert full_disk(OSError(errno.EIO, "Input/output error")) is None
    assert full_disk(ConnectionResetError(errno.ECONNRESET, "reset")) is None
    cycle = RuntimeError("a")
    cycle.__context__ = RuntimeError("b")
    cycle.__context__.__context__ = cycle
    assert full_disk(cycle) is None
