"""Group commit: writes queued at the same moment share one transaction and one sync.

A busy daemon makes several small writes per message, from many turns at once. On its own,
each write costs a trip to the connection's thread and back (two hand-overs of the GIL and a
wake-up of the event loop) and, when durable, a sync of the log; at saturation that was about
a third of the daemon's time. Writes that queue up while one transaction runs are taken
together instead: one ``BEGIN IMMEDIATE`` ... ``COMMIT``, each write inside its own savepoint,
so a write that fails rolls back only itself, exactly as if it had had a transaction of its
own. A lone write runs as before, without savepoints.

What each caller sees is unchanged: its write happens whole or not at all, it returns once
its write is committed (synced to disk first if it, or any write committed with it, is
durable), writes commit in the order they were asked for, and a caller cancelled meanwhile
changes nothing: its write still runs to its commit or rollback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from geodebot.store.protocol import StoreError

__all__ = ["GroupCommit"]

_T = TypeVar("_T")

# Runs a function on the connection's thread, in the order of the connection's queue.
Runner = Callable[[Callable[[sqlite3.Connection], Any]], Awaitable[Any]]


@dataclass(slots=True)
class _Write:
    what: str
    fn: Callable[[sqlite3.Connection], Any]
    durable: bool
    future: asyncio.Future[Any]


@dataclass(slots=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None


class GroupCommit:
    """The store's writes, committed in groups; one per connection.

    ``synchronous`` is the store's level for durable commits; the others use at most NORMAL
    (see :meth:`SQLiteStore._transact`).
    """

    def __init__(self, run: Runner, synchronous: str) -> None:
        self._run = run
        self._durable_level = synchronous
        self._relaxed_level = "NORMAL" if synchronous in ("FULL", "EXTRA") else synchronous
        self._level = synchronous  # touched only on the connection's thread
        self._pending: list[_Write] = []
        self._drainer: asyncio.Task[None] | None = None
        # Set while a write that found nothing in flight is on the connection (see write).
        self._direct: asyncio.Future[None] | None = None

    async def write(self, what: str, fn: Callable[[sqlite3.Connection], _T], durable: bool) -> _T:
        loop = asyncio.get_running_loop()
        if self._drainer is None and self._direct is None:
            value: _T = await self._write_now(loop, _Write(what, fn, durable, loop.create_future()))
            return value
        future: asyncio.Future[_T] = loop.create_future()
        self._pending.append(_Write(what, fn, durable, future))
        if self._drainer is None and self._direct is None:
            self._drainer = loop.create_task(self._drain(), name="store-group-commit")
        return await future

    async def _write_now(self, loop: asyncio.AbstractEventLoop, write: _Write) -> Any:
        """Nothing is in flight: the write goes to the connection at once, alone, without
        waiting a turn of the loop for company (what a lone message's turn would pay at
        every write). Writes asked for meanwhile queue up and follow it as one group."""
        self._direct = done = loop.create_future()
        try:
            try:
                (outcome,) = await self._run(functools.partial(self._commit, [write]))
            except Exception as exc:  # noqa: BLE001 - the connection is closed or gone
                outcome = _Outcome(error=_store_error(write.what, exc))
        finally:
            # Also when the caller is cancelled: its write still runs, and the queued ones
            # go to the connection after it, so the order is kept.
            self._direct = None
            done.set_result(None)
            if self._pending and self._drainer is None:
                self._drainer = loop.create_task(self._drain(), name="store-group-commit")
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    async def flush(self) -> None:
        """Return once every write asked for so far has committed or failed."""
        while self._drainer is not None or self._direct is not None:
            await asyncio.shield(self._drainer or self._direct)  # type: ignore[arg-type]

    async def _drain(self) -> None:
        batch: list[_Write] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    outcomes = await self._run(functools.partial(self._commit, batch))
                except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                    # The connection is closed or gone: nothing of the batch ran.
                    outcomes = [_Outcome(error=_store_error(w.what, exc)) for w in batch]
                for write, outcome in zip(batch, outcomes, strict=True):
                    _settle(write.future, outcome)
                batch = []
        except asyncio.CancelledError:
            # Only when the loop itself is torn down; nobody is left to tell.
            for write in (*batch, *self._pending):
                write.future.cancel()
            self._pending = []
            raise
        finally:
            self._drainer = None

    # -- on the connection's thread --------------------------------------------------------
    def _commit(self, batch: list[_Write], conn: sqlite3.Connection) -> list[_Outcome]:
        level = self._durable_level if any(w.durable for w in batch) else self._relaxed_level
        try:
            if level != self._level:
                conn.execute(f"PRAGMA synchronous={level}")
                self._level = level
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return [_Outcome(error=_store_error(w.what, exc)) for w in batch]
        if len(batch) == 1:
            outcomes = [_call(batch[0], conn)]
            if outcomes[0].error is not None:
                _rollback(conn)
                return outcomes
        else:
            try:
                outcomes = self._each_in_savepoint(batch, conn)
            except sqlite3.Error as exc:  # a savepoint statement itself failed
                _rollback(conn)
                return [_Outcome(error=_store_error(w.what, exc)) for w in batch]
            if not conn.in_transaction:
                return outcomes  # a failure took the whole transaction with it
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            _rollback(conn)
            return [_Outcome(error=_store_error(w.what, exc)) for w in batch]
        return outcomes

    def _each_in_savepoint(self, batch: list[_Write], conn: sqlite3.Connection) -> list[_Outcome]:
        outcomes: list[_Outcome] = []
        for index, write in enumerate(batch):
            conn.execute("SAVEPOINT write")
            outcome = _call(write, conn)
            outcomes.append(outcome)
            if outcome.error is None:
                conn.execute("RELEASE write")
            elif conn.in_transaction:
                conn.execute("ROLLBACK TO write")
                conn.execute("RELEASE write")
            else:
                # SQLite rolled the whole transaction back by itself (a full disk, an I/O
                # error): the writes before this one are undone, the ones after never ran.
                cause = outcome.error.__cause__ or outcome.error
                return [
                    outcome if i == index else _Outcome(error=_lost(w.what, cause))
                    for i, w in enumerate(batch)
                ]
        return outcomes


def _call(write: _Write, conn: sqlite3.Connection) -> _Outcome:
    try:
        return _Outcome(value=write.fn(conn))
    except sqlite3.Error as exc:
        return _Outcome(error=_store_error(write.what, exc))
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        # A StoreError raised to refuse the change, or a bug: the caller gets it as it is.
        return _Outcome(error=exc)


def _rollback(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back by itself (e.g. on SQLITE_FULL).
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")


def _store_error(what: str, exc: BaseException) -> BaseException:
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, sqlite3.Error):
        return _lost(what, exc)
    return exc


def _lost(what: str, cause: BaseException) -> StoreError:
    error = StoreError(f"{what} failed: {cause}")
    error.__cause__ = cause
    return error


def _settle(future: asyncio.Future[Any], outcome: _Outcome) -> None:
    if future.done():  # the caller was cancelled; its write ran all the same
        return
    if outcome.error is not None:
        future.set_exception(outcome.error)
    else:
        future.set_result(outcome.value)
