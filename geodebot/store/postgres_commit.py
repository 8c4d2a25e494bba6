"""The PostgreSQL store's transactions: each write alone, or the writes asked for together
committed in groups.

A daemon's turn makes several small writes, and a busy daemon makes them for many turns at
once. Alone, each costs a pool checkout, ``BEGIN``, the fencing check, its statements,
``COMMIT`` and a sync of the server's log, and most of the daemon's CPU for a write goes to
the round trips rather than the statements. So, as on SQLite (.sqlite_commit), the writes
asked for while a group is on its way (or in the same pass of the event loop) share the next
transaction: one ``BEGIN`` with the fencing check, each write inside its own savepoint (a
write that fails rolls back only itself, exactly as if it had had a transaction of its own),
one ``COMMIT`` and one sync. One group at a time: writes commit in the order they were asked
for, and the store's own writes never wait for each other's locks (two groups that locked
rows in different orders would deadlock).

A group whose transaction is lost before its commit (a deadlock with another process, a
serialization failure, a connection gone) runs its writes again, each alone, with the retries
a write alone has; a commit whose outcome is unknown is never run again.

What each caller sees is what a write alone gives: its write happens whole or not at all,
it returns once its write is committed, and a fenced write commits only while each lease it
was asked for under is its holder's. The writes of a group may carry different leases (the
turns of different sessions): the group reads every lease row its writes name, in one
statement ``FOR KEY SHARE`` right after ``BEGIN`` (so a takeover waits for the group to end),
and a write whose lease is lost is refused alone, the others of its group committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from geodebot.store.leases import fence_holds, refusal
from geodebot.store.records import Fenced, Lease, StoreError
from geodebot.store.rows import Body, Tx

__all__ = ["GroupCommit", "reason", "transaction"]

_T = TypeVar("_T")
log = logging.getLogger(__name__)

Pool = AsyncConnectionPool[psycopg.AsyncConnection[Any]]
TxOn = Callable[[psycopg.AsyncConnection[Any]], Tx]

# Two writers that lock rows in different orders: PostgreSQL ends one of them, which is run
# again from the start (its body is a function of what the database holds).
RETRIED: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
)
ATTEMPTS = 3
# Savepoints are subtransactions: past 64 in one transaction the server's snapshots of it
# get slower for every session, so a group stays well below.
MAX_GROUP = 32

_IN_TRANSACTION = psycopg.pq.TransactionStatus.INTRANS
_FAILED = psycopg.pq.TransactionStatus.INERROR
_SAVEPOINT = "SAVEPOINT write"
_NEXT = "RELEASE SAVEPOINT write; SAVEPOINT write"
_UNDO = "ROLLBACK TO SAVEPOINT write"


def reason(exc: psycopg.Error) -> str:
    """The server's own message and detail where there are some (which row, which table),
    without psycopg's context lines; else the driver's message."""
    primary, detail = exc.diag.message_primary, exc.diag.message_detail
    if primary is None:
        return str(exc).strip() or type(exc).__name__
    return f"{primary} ({detail})" if detail else primary


# The lease rows a transaction's writes are fenced by, as its check reads them.
_FENCES = "SELECT name, holder, epoch FROM leases WHERE name IN ({}) FOR KEY SHARE"

Held = Mapping[str, tuple[Any, ...]]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@functools.lru_cache(maxsize=256)
def _begin(names: tuple[str, ...], grouped: bool) -> str:
    """The transaction's start, its fencing check (see leases.py) and, for a group, the first
    write's savepoint, as one simple query: one round trip, where each would cost one of its
    own. The lease rows are read ``FOR KEY SHARE`` (before the savepoint, which must not undo
    it): a takeover (``FOR UPDATE``) waits for this transaction to end, the holder's renewal
    (an UPDATE of a column outside any key) does not (see leases.py). Shared locks do not
    conflict with each other, so a group naming several rows never deadlocks with another."""
    parts = ["BEGIN"]
    if names:
        parts.append(_FENCES.format(", ".join(_literal(name) for name in names)))
    if grouped:
        parts.append(_SAVEPOINT)
    return "; ".join(parts)


def _names(fences: Sequence[Lease]) -> tuple[str, ...]:
    return tuple(sorted({lease.name for lease in fences}))


async def _started(
    conn: psycopg.AsyncConnection[Any], names: tuple[str, ...], grouped: bool
) -> Held:
    """Begin the transaction on ``conn``, reading the lease rows ``names`` for the fencing
    check: each as (holder, epoch) by name; a lease without a row is absent."""
    cursor = conn.cursor(row_factory=tuple_row)
    await cursor.execute(_begin(names, grouped))
    if not names:
        return {}
    cursor.nextset()  # the fencing check's rows, after BEGIN's
    return {row[0]: row[1:] for row in await cursor.fetchall()}


def _refused(fences: Sequence[Lease], held: Held) -> Callable[[], Fenced] | None:
    """Unless each lease of ``fences`` is still its holder's, what refuses the write (each
    caller gets an exception of its own)."""
    for lease in fences:
        row = held.get(lease.name)
        if not fence_holds(lease, row):
            return functools.partial(refusal, lease, row)
    return None


async def _rolled_back(conn: psycopg.AsyncConnection[Any]) -> None:
    if conn.info.transaction_status in (_IN_TRANSACTION, _FAILED):
        with contextlib.suppress(psycopg.Error):
            await conn.execute("ROLLBACK")


def _failed_statement(what: str) -> StoreError:
    # A statement failed and the body went on: COMMIT would only roll back.
    return StoreError(f"{what} failed: a statement failed, and nothing was written")


async def _alone(
    conn: psycopg.AsyncConnection[Any],
    tx: TxOn,
    fences: Sequence[Lease],
    what: str,
    body: Body[_T],
) -> _T:
    """``body`` between ``BEGIN`` and ``COMMIT`` on ``conn`` (in autocommit mode): the
    commit's own round trip, and nothing more around the body's statements."""
    try:
        held = await _started(conn, _names(fences), grouped=False)
        refused = _refused(fences, held)
        if refused is not None:
            raise refused()
        result = await body(tx(conn))
        if conn.info.transaction_status is _FAILED:
            raise _failed_statement(what)
        await conn.execute("COMMIT")
    except BaseException:
        await _rolled_back(conn)
        raise
    return result


async def transaction(
    pool: Pool, tx: TxOn, fences: Sequence[Lease], what: str, body: Body[_T]
) -> _T:
    """``body`` in a transaction of its own, checked against ``fences`` first, tried again
    after a deadlock or a serialization failure; any other database error is a
    :class:`StoreError`."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            async with pool.connection() as conn:
                return await _alone(conn, tx, fences, what, body)
        except RETRIED as exc:
            if attempt == ATTEMPTS:
                raise StoreError(f"{what} failed: {reason(exc)}") from exc
            log.info("store: %s: %s; trying again", what, reason(exc))
        except psycopg.Error as exc:
            raise StoreError(f"{what} failed: {reason(exc)}") from exc
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(slots=True)
class _Write:
    what: str
    body: Body[Any]
    # The leases it was asked for under: checked in its own transaction or savepoint.
    fences: tuple[Lease, ...]
    future: asyncio.Future[Any]


class _Lost(Exception):
    """The group's transaction ended before its commit: nothing of it was written."""


class GroupCommit:
    """The fenced writes of one store, committed in groups on ``pool``'s connections."""

    def __init__(self, pool: Pool, tx: TxOn, *, max_group: int = MAX_GROUP) -> None:
        self._pool = pool
        self._tx = tx
        self._max_group = max_group
        self._pending: list[_Write] = []
        self._running: asyncio.Task[None] | None = None

    def submit(self, what: str, body: Body[_T], fences: tuple[Lease, ...]) -> asyncio.Future[_T]:
        """Queue ``body`` for the next group, to commit only while each of ``fences`` is its
        holder's; its outcome, once committed or failed. Nothing cancels the write: the
        future is settled when it has run."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        future.add_done_callback(_retrieved)
        self._pending.append(_Write(what, body, fences, future))
        if self._running is None:
            self._running = loop.create_task(self._run())
        return future

    async def flush(self) -> None:
        """Return once every write queued so far has committed or failed."""
        while self._running is not None:
            await asyncio.wait([self._running])

    async def _run(self) -> None:
        try:
            while self._pending:
                size = min(self._max_group, len(self._pending))
                batch, self._pending = self._pending[:size], self._pending[size:]
                try:
                    await self._commit(batch)
                except Exception as exc:  # a bug here must not leave callers waiting for ever
                    log.exception("store: a group of %d writes failed unexpectedly", len(batch))
                    for write in batch:
                        _settle(write.future, error=exc)
        finally:
            self._running = None

    async def _commit(self, batch: list[_Write]) -> None:
        if len(batch) == 1:
            await self._one(batch[0])
            return
        try:
            async with self._pool.connection() as conn:
                outcomes = await self._group(conn, batch)
        except _Lost as lost:
            log.info("store: a group of %d writes: %s; each again alone", len(batch), lost)
            for write in batch:
                await self._one(write)
            return
        except psycopg.Error as exc:  # the pool's: no connection
            outcomes = [(None, StoreError(f"{w.what} failed: {reason(exc)}")) for w in batch]
        for write, (value, error) in zip(batch, outcomes, strict=True):
            _settle(write.future, value, error)

    async def _one(self, write: _Write) -> None:
        try:
            value = await transaction(self._pool, self._tx, write.fences, write.what, write.body)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            _settle(write.future, error=exc)
        else:
            _settle(write.future, value)

    async def _group(
        self, conn: psycopg.AsyncConnection[Any], batch: list[_Write]
    ) -> list[tuple[Any, BaseException | None]]:
        """Each write of ``batch`` in its own savepoint of one transaction on ``conn``; the
        outcomes once it committed. A write whose lease is lost is refused without running,
        its savepoint left as it is for the next write."""
        try:
            held = await _started(conn, _names([f for w in batch for f in w.fences]), True)
        except psycopg.Error as exc:
            await _rolled_back(conn)
            raise _Lost(reason(exc)) from exc
        refusals = [_refused(write.fences, held) for write in batch]
        if all(refused is not None for refused in refusals):  # nothing to run
            await _rolled_back(conn)
            return [(None, refused()) for refused in refusals if refused is not None]
        outcomes: list[tuple[Any, BaseException | None]] = []
        try:
            for index, (write, refused) in enumerate(zip(batch, refusals, strict=True)):
                if refused is not None:
                    outcomes.append((None, refused()))
                    continue
                value, error = await self._body(conn, write)
                outcomes.append((value, error))
                status = conn.info.transaction_status
                if status not in (_IN_TRANSACTION, _FAILED):
                    raise _Lost("the connection ended its transaction")
                if error is not None:
                    await conn.execute(_UNDO)  # the savepoint stays, for the next write
                elif index + 1 < len(batch):
                    await conn.execute(_NEXT)
        except BaseException:
            await _rolled_back(conn)
            raise
        try:
            await conn.execute("COMMIT")
        except psycopg.Error as exc:
            # Its outcome may be unknown (a connection lost meanwhile): never run again.
            await _rolled_back(conn)
            lost = reason(exc)
            return [
                (None, error or StoreError(f"{write.what} failed: {lost}"))
                for write, (_, error) in zip(batch, outcomes, strict=True)
            ]
        return outcomes

    async def _body(
        self, conn: psycopg.AsyncConnection[Any], write: _Write
    ) -> tuple[Any, BaseException | None]:
        try:
            value = await write.body(self._tx(conn))
        except RETRIED as exc:
            raise _Lost(reason(exc)) from exc
        except psycopg.OperationalError as exc:
            if conn.broken:
                raise _Lost(reason(exc)) from exc
            return None, StoreError(f"{write.what} failed: {reason(exc)}")
        except psycopg.Error as exc:
            return None, StoreError(f"{write.what} failed: {reason(exc)}")
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            # A StoreError raised to refuse the change, or a bug: the caller gets it as it is.
            return None, exc
        if conn.info.transaction_status is _FAILED:
            return None, _failed_statement(write.what)
        return value, None


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # its caller may be gone: retrieved, so never logged as lost


def _settle(
    future: asyncio.Future[Any], value: Any = None, error: BaseException | None = None
) -> None:
    if future.done():  # the caller's task is gone; its write ran all the same
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
