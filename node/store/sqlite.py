"""One SQLite connection on its own worker thread, and the decorators that run methods on it.

`@read` methods run on the worker; `@write` methods run there inside one BEGIN IMMEDIATE ...
COMMIT transaction (rolled back on any exception). node.store.db builds the typed storage on this.
This module knows nothing about the schema or what the rows mean.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from node.store.schema import connect

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound="SqliteWorker")
_Fn = Callable[Concatenate[S, sqlite3.Connection, P], T]
_Async = Callable[Concatenate[S, P], Coroutine[Any, Any, T]]


def read(fn: _Fn[S, P, T]) -> _Async[S, P, T]:
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._submit(lambda conn: fn(self, conn, *args, **kwargs))

    functools.update_wrapper(run, fn)
    return run


def write(fn: _Fn[S, P, T]) -> _Async[S, P, T]:
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        def transaction(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self, conn, *args, **kwargs)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

        return await self._submit(transaction)

    functools.update_wrapper(run, fn)
    return run


class SqliteWorker:
    """One SQLite connection owned by one worker thread. Make it with `await X.open(path)`; `await close()`."""

    def __init__(self, path: Path, executor: ThreadPoolExecutor, conn: sqlite3.Connection) -> None:
        self.path = path
        self._executor = executor
        self._conn: sqlite3.Connection | None = conn

    @classmethod
    async def open(cls, path: str | Path) -> Self:
        path = Path(path)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-storage")
        loop = asyncio.get_running_loop()
        try:
            conn = await loop.run_in_executor(executor, connect, path)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(path, executor, conn)

    async def close(self) -> None:
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        await asyncio.get_running_loop().run_in_executor(self._executor, conn.close)
        self._executor.shutdown(wait=True)

    async def _submit(self, job: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._conn
        assert conn is not None, "storage used after close()"
        return await asyncio.get_running_loop().run_in_executor(self._executor, job, conn)

