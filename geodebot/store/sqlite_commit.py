"""Group commit on the event loop's thread: the writes asked for in one pass of the loop share
one transaction and one sync.

A busy daemon makes several small writes per message, from many turns at once. Each write
used to go to the connection's own thread and back: two hand-overs of the GIL and a wake-up
of the event loop per write, and, while the loop ran Python, a write waited for the GIL at
every statement (the sqlite3 module lets go of it around each step). Measured on a message's
turn, that was most of the store's cost and a tenth of the reply's latency, and the busy
loop made the thread's writes slower still. The statements themselves take microseconds.

So writes run here, on the loop's thread, on a connection of their own: a write is queued,
and at the end of the loop's current pass every write queued by then is committed together,
one ``BEGIN IMMEDIATE`` ... ``COMMIT``, each write inside its own savepoint, so a write that
fails rolls back only itself, exactly as if it had had a transaction of its own. Reads stay
on the store's aiosqlite thread (a long history must not stop the loop), and see what these
commits wrote as soon as they return (WAL).

What the loop must never do is wait. Another process holding the write lock (an operator's
``geodebot`` command) would stop the daemon for the whole busy timeout, so this connection
does not wait for locks: a busy database is tried again after a pause, up to
``busy_timeout_s``, while the loop goes on. And it does not checkpoint the log itself (a
checkpoint copies pages and syncs the database file): every ``checkpoint_every`` commits,
``on_checkpoint`` is called to have it done off the loop. The log only starts again from its
beginning when a write finds it wholly copied, which under steady traffic a checkpoint beside
the writes never leaves it (they add to it while it runs), so the log would grow for as long
as the traffic lasts, and every sync of a growing file costs the journal's too:
:meth:`GroupCommit.between_writes` lets the store copy the last few pages while no write is
being made.

Nor does it sync the log to disk: with a :class:`LogSync`, every commit is made at NORMAL and
a durable write's caller is told of its commit once the log has been synced after it, on the
sync's own thread (see .sqlite_sync). Without one (the store's level is NORMAL or OFF, or the
database is not in WAL mode) every commit is made at the store's level.

What each caller sees: its write happens whole or not at all, it returns once its write is
committed (and, if durable, synced to disk), writes commit in the order they were asked for,
and a caller cancelled meanwhile changes nothing: its write still runs to its commit or
rollback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from geodebot.store.records import StoreError
from geodebot.store.sqlite_sync import LogSync

__all__ = ["GroupCommit"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

BUSY_FIRST_PAUSE_S = 0.005
BUSY_MAX_PAUSE_S = 0.1


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


class _Busy(Exception):
    """Another connection holds the write lock; nothing of the batch ran."""


class GroupCommit:
    """The store's writes, committed in groups on ``conn``, which only this object uses;
    durable ones synced by ``log_sync`` if there is one (see the module's docstring)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        log_sync: LogSync | None,
        busy_timeout_s: float,
        on_checkpoint: Callable[[], None],
        checkpoint_every: int = 100,
    ) -> None:
        self._conn = conn
        self._log = log_sync
        self._busy_timeout_s = busy_timeout_s
        self._on_checkpoint = on_checkpoint
        self._checkpoint_every = checkpoint_every
        self._commits = 0
        self._pending: list[_Write] = []
        # Set while a pass is due (a scheduled drain, or a pause on a busy database).
        self._due: asyncio.Future[None] | None = None
        # Set while between_writes has the connection: writes wait in _pending meanwhile.
        self._lent: asyncio.Future[Any] | None = None
        # Its own thread (started on first use): in a shared pool the connection could wait
        # for a free thread, and every write with it.
        self._lender = concurrent.futures.ThreadPoolExecutor(1, "geodebot-store-lent")

    @property
    def connection(self) -> sqlite3.Connection:
        return self._conn

    @property
    def groups(self) -> int:
        """Groups committed (or failed) so far: a change says a write was made meanwhile."""
        return self._commits

    async def write(self, what: str, fn: Callable[[sqlite3.Connection], _T], durable: bool) -> _T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._pending.append(_Write(what, fn, durable, future))
        if self._due is None:
            self._due = loop.create_future()
            loop.call_soon(self._drain)
        return await future

    async def flush(self) -> None:
        """Return once every write asked for so far has committed or failed."""
        while self._due is not None:
            await asyncio.shield(self._due)

    async def sync(self, *, within_s: float = 0.0) -> None:
        """Return once every write committed so far is on disk (what ``synchronous`` says);
        ``within_s`` as in :meth:`LogSync.request`."""
        if self._log is not None:
            await self._log.sync(within_s=within_s)

    async def between_writes(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn(connection)`` on a thread while no write is made: the writes asked for
        meanwhile wait, and are committed together as soon as it returns. For short work only
        (the end of a checkpoint); one at a time."""
        if self._lent is not None:
            raise StoreError(f"{what} failed: the connection is lent already")
        loop = asyncio.get_running_loop()
        # A pass is never under way here: it runs whole in one callback of the loop. The
        # connection comes back when fn has returned, even if this caller is cancelled.
        lent = self._lent = loop.run_in_executor(self._lender, fn, self._conn)
        lent.add_done_callback(self._given_back)
        try:
            return await asyncio.shield(lent)
        except sqlite3.Error as exc:
            raise _lost(what, exc) from exc

    def _given_back(self, lent: asyncio.Future[Any]) -> None:
        self._lent = None
        if self._pending:
            self._due = self._due or asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._drain)

    async def close(self) -> None:
        """Commit what was asked for, sync what needs it, then close the connection."""
        if self._lent is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._lent)  # given back before this goes on
        self._lender.shutdown(wait=False)  # idle now: nothing is lent
        await self.flush()
        if self._log is not None:
            await self._log.close()
        self._conn.close()

    def _drain(self, busy_since: float | None = None) -> None:
        if self._lent is not None:
            return  # between_writes drains when it gives the connection back
        if not self._pending:  # drained already by a pass scheduled twice
            return
        batch, self._pending = self._pending, []
        try:
            outcomes = self._commit(batch)
        except _Busy as busy:
            waited = 0.0 if busy_since is None else time.monotonic() - busy_since
            if waited < self._busy_timeout_s:
                # The batch goes first again; what is asked for meanwhile joins it.
                self._pending = batch + self._pending
                pause = min(BUSY_MAX_PAUSE_S, max(BUSY_FIRST_PAUSE_S, waited / 2))
                started = time.monotonic() if busy_since is None else busy_since
                asyncio.get_running_loop().call_later(pause, self._drain, started)
                return
            outcomes = [_Outcome(error=_lost(w.what, busy.__cause__ or busy)) for w in batch]
        except Exception as exc:  # a bug here must not leave callers waiting for ever
            log.exception("store: a group of %d writes failed unexpectedly", len(batch))
            outcomes = [_Outcome(error=exc) for _ in batch]
        self._settle_all(batch, outcomes)
        self._commits += 1
        if self._commits % self._checkpoint_every == 0:
            try:
                self._on_checkpoint()
            except Exception:  # the next one is tried later
                log.exception("store: cannot start a checkpoint of the log")
        due, self._due = self._due, None
        if self._pending:
            self._due = due or asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._drain)
        elif due is not None and not due.done():
            due.set_result(None)

    def _settle_all(self, batch: list[_Write], outcomes: list[_Outcome]) -> None:
        """Tell the callers; a durable write's caller once the log is synced after it."""
        synced: list[tuple[_Write, _Outcome]] = []
        for write, outcome in zip(batch, outcomes, strict=True):
            if write.durable and outcome.error is None and self._log is not None:
                synced.append((write, outcome))
            else:
                _settle(write.future, outcome)
        if self._log is None:
            return
        self._log.committed()
        if not synced:
            return

        def settle(sync: asyncio.Future[None]) -> None:
            error = sync.exception() if not sync.cancelled() else asyncio.CancelledError()
            for write, outcome in synced:
                if error is not None:
                    outcome = _Outcome(error=_lost(write.what, error))
                _settle(write.future, outcome)

        self._log.request().add_done_callback(settle)

    def _commit(self, batch: list[_Write]) -> list[_Outcome]:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise _Busy() from exc
            return [_Outcome(error=_store_error(w.what, exc)) for w in batch]
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
