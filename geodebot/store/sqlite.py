"""SQLite implementation of :class:`~geodebot.store.protocol.Store`.

Two connections to one file in WAL mode. Reads run on an aiosqlite connection's thread, each
operation one function (one hop, not one per statement), so a long history never stops the
event loop. Writes run on the event loop's own thread, on a second connection, committed in
groups (:mod:`.sqlite_commit`): a transaction is a handful of statements that take
microseconds, and a hop to a thread cost more than the work. Writes are explicit
``BEGIN IMMEDIATE`` transactions; only the commits something outside acts on are synced to
disk at the configured level (see :meth:`SQLiteStore._transact`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

import aiosqlite

from geodebot.store.leases import Fences, check_fence
from geodebot.store.methods import StoreMethods
from geodebot.store.protocol import Store
from geodebot.store.records import Lease, StoreError
from geodebot.store.rows import Body, Params, Row, Tx, drive, dumps
from geodebot.store.schema import (
    for_backend,
    load_migrations,
    refuse_newer,
    split_statements,
)
from geodebot.store.sqlite_commit import GroupCommit
from geodebot.store.sqlite_sync import LogSync
from geodebot.store.wakeups import Wakeups

# load_migrations and split_statements are named here too: tests and tools import them from
# the SQLite store, as before there were two stores.
__all__ = ["SQLiteStore", "dumps", "load_migrations", "split_statements"]

_T = TypeVar("_T")
log = logging.getLogger(__name__)

_SYNCHRONOUS_MODES = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_BUSY_TIMEOUT_MS = 5_000
_LOG_SIZE_LIMIT = 32 * 1024 * 1024


class SQLiteStore(StoreMethods):
    """A :class:`Store` in one SQLite file, created with mode 0600 on first open.

    The methods are the mixins' (shared with the PostgreSQL store); they run through this
    class's :meth:`_read` and :meth:`_write`.
    """

    dialect = "sqlite"

    def __init__(self, path: pathlib.Path | str, *, synchronous: str = "FULL") -> None:
        mode = synchronous.upper()
        if mode not in _SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS_MODES)}")
        self.path = pathlib.Path(path)
        self.synchronous = mode
        self._db: aiosqlite.Connection | None = None
        self._commits: GroupCommit | None = None
        self._checkpointing: asyncio.Task[None] | None = None
        self._fences = Fences()
        self._on_broken: list[Callable[[StoreError], None]] = []
        self._broken_by: StoreError | None = None
        self.version_found = 0

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> None:
        if self._db is not None:
            return
        what = f"opening store {str(self.path)!r}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            # O_CREAT leaves an existing file's mode alone; SQLite copies it to -wal and -shm.
            os.chmod(self.path, 0o600)
        except OSError as exc:
            raise StoreError(f"{what} failed: {exc}") from exc
        db = aiosqlite.connect(self.path, isolation_level=None)
        try:
            await db
            db.row_factory = sqlite3.Row
            await db.executescript(
                "PRAGMA journal_mode=WAL; PRAGMA foreign_keys=ON; "
                f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}; PRAGMA synchronous={self.synchronous}; "
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL);"
            )
        except BaseException as exc:
            await db.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"{what} failed: {exc}") from exc
            raise
        self._db = db
        try:
            conn, log_sync = self._writer_connection()
            self._commits = GroupCommit(
                conn,
                log_sync=log_sync,
                busy_timeout_s=_BUSY_TIMEOUT_MS / 1000,
                on_checkpoint=self._checkpoint_soon,
            )
            await self._migrate()
        except BaseException:
            await self.close()
            raise

    def _writer_connection(self) -> tuple[sqlite3.Connection, LogSync | None]:
        """The connection writes use, on the event loop's thread (see .sqlite_commit): it
        never waits for a lock or checkpoints the log, which would stop the loop; nor syncs
        the log, in WAL mode at FULL or EXTRA, where a :class:`LogSync` does that off the
        loop for the durable commits. Otherwise every commit is made at the store's level."""
        try:
            # Used by one thread at a time: the loop's, or the one between_writes lends it to.
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"opening store {str(self.path)!r} for writing failed: {exc}") from exc
        try:
            conn.row_factory = sqlite3.Row
            wal = conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
            log_sync = wal and self.synchronous in ("FULL", "EXTRA")
            for pragma in (
                "foreign_keys=ON",
                "busy_timeout=0",
                f"synchronous={'NORMAL' if log_sync else self.synchronous}",
                "wal_autocheckpoint=0",
                # When the log starts again from its beginning, a file a burst left larger
                # than a few checkpoints' worth is cut back to this.
                f"journal_size_limit={_LOG_SIZE_LIMIT}",
            ):
                conn.execute(f"PRAGMA {pragma}")
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"opening store {str(self.path)!r} for writing failed: {exc}") from exc
        return conn, LogSync(self.path, on_failed=self._broken) if log_sync else None

    def on_broken(self, callback: Callable[[StoreError], None]) -> None:
        self._on_broken.append(callback)
        if self._broken_by is not None:  # broke before anyone asked: told at once
            callback(self._broken_by)

    def _broken(self, exc: StoreError) -> None:
        self._broken_by = exc
        for callback in self._on_broken:
            callback(exc)

    def _checkpoint_soon(self) -> None:
        """Copy the log into the database off the loop: most of it on the store's thread
        beside the writes (PASSIVE takes no lock that writes wait for), then what they added
        meanwhile between two writes, so that the next write starts the log again from its
        beginning (see .sqlite_commit) instead of making it longer."""
        if self._db is None or (self._checkpointing and not self._checkpointing.done()):
            return
        self._checkpointing = asyncio.get_running_loop().create_task(self._checkpoint())

    async def _checkpoint(self) -> None:
        commits = self._commits
        if commits is None:
            return
        groups = commits.groups
        try:
            await self._query("checkpointing the log", _checkpoint_passive)
            # Nothing written meanwhile: the log is wholly copied already, no write waits.
            # (Closed meanwhile: nothing to finish.)
            if self._commits is commits and commits.groups != groups:
                await commits.between_writes(
                    "finishing the checkpoint of the log", _checkpoint_passive
                )
        except StoreError as exc:
            log.warning("store: %s", exc)

    async def close(self) -> None:
        if self._db is None:
            return
        # Writes asked for before the close are committed first.
        commits, self._commits = self._commits, None
        if commits is not None:
            await commits.close()
        if self._checkpointing is not None:
            await asyncio.gather(self._checkpointing, return_exceptions=True)
        db, self._db = self._db, None
        if db is None:  # closed by another caller meanwhile
            return  # type: ignore[unreachable]  # mypy cannot see the other closer
        try:
            await db.close()
        except sqlite3.Error as exc:
            raise StoreError(f"closing store {str(self.path)!r} failed: {exc}") from exc

    async def schema_version(self) -> int:
        return await self._query("reading the schema version", _version)

    async def _migrate(self) -> None:
        migrations = load_migrations()
        current = self.version_found = await self.schema_version()
        refuse_newer(current, migrations, repr(str(self.path)))
        for version, name, script in migrations:
            if version <= current:
                continue

            def apply(db: sqlite3.Connection, version: int = version, script: str = script) -> None:
                # Another process may have applied it since we looked; now we hold the lock.
                if _version(db) >= version:
                    return
                for statement in split_statements(for_backend(script, "sqlite")):
                    db.execute(statement)
                db.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, time.time()),
                )

            await self._transact(f"applying migration {name}", apply, durable=True)

    # -- transaction plumbing -------------------------------------------------------------
    def _connection(self, what: str) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreError(f"{what} failed: the store is not open")
        return self._db

    async def _in_thread(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` on the connection's own thread in one hop.

        A whole transaction is one function, so it costs one wake-up of the event loop rather
        than one per statement.
        """
        self._connection(what)
        try:
            result: _T = await self._on_thread(fn)
        except sqlite3.Error as exc:
            raise StoreError(f"{what} failed: {exc}") from exc
        return result

    async def _on_thread(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        # aiosqlite has no public call for this; ``_execute`` is the queue its own methods go
        # through, so ordering with them is kept.
        db = self._connection("using the store")
        result: _T = await db._execute(fn, db._conn)  # type: ignore[no-untyped-call]  # private, untyped
        return result

    async def _query(self, what: str, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """A read: ``fn`` runs outside any explicit transaction (WAL readers never block)."""
        return await self._in_thread(what, fn)

    async def _transact(
        self, what: str, fn: Callable[[sqlite3.Connection], _T], *, durable: bool = False
    ) -> _T:
        """A write: ``fn`` runs inside ``BEGIN IMMEDIATE`` ... ``COMMIT`` on the event loop's
        thread, together with the other writes asked for in the same pass of the loop
        (:mod:`.sqlite_commit`).

        It happens whole or not at all: any exception (a StoreError raised by ``fn`` to refuse
        the change included) rolls it back. The caller being cancelled meanwhile changes
        nothing: the function still runs to its commit or rollback.

        ``durable`` marks a commit that something outside acts on next (a send, a tool's
        effect, an operator's order): at FULL or EXTRA it returns once the log is synced to
        disk after it (off the loop, shared with the durable commits asked for meanwhile).
        Other commits are made at NORMAL, which in WAL mode survives a killed process but not
        a power cut, until the next sync of the log, which covers everything before it. So
        nothing the outside world saw can be lost, and a turn costs two or three syncs, none
        of them on the loop.
        """
        self._connection(what)
        if self._commits is None:
            raise StoreError(f"{what} failed: the store is not open")
        return await self._commits.write(what, fn, durable)

    async def sync(self, *, within_s: float = 0.0) -> None:
        """Return once every commit so far is on disk as the store's level says."""
        if self._commits is not None:
            await self._commits.sync(within_s=within_s)

    async def _read(self, what: str, body: Body[_T]) -> _T:
        return await self._query(what, lambda conn: drive(body(_SQLiteTx(conn))))

    async def _write(
        self, what: str, body: Body[_T], *, durable: bool = False, fenced: bool = True
    ) -> _T:
        # The leases are read here, in the caller's context: the group commit runs the body
        # later, in a callback of its own (see leases.py).
        fences = self._fences.current() if fenced else ()
        if not fences:
            return await self._transact(
                what, lambda conn: drive(body(_SQLiteTx(conn))), durable=durable
            )

        async def checked(db: Tx) -> _T:
            for lease in fences:
                await check_fence(db, lease)
            return await body(db)

        return await self._transact(
            what, lambda conn: drive(checked(_SQLiteTx(conn))), durable=durable
        )

    def fence(self, lease: Lease | None) -> None:
        """Write only while ``lease`` is its holder's (see leases.py); None: write freely."""
        self._fences.fence(lease)

    def fenced(self, lease: Lease) -> contextlib.AbstractContextManager[None]:
        """Inside, this context's writes are made under ``lease`` too (see leases.py)."""
        return self._fences.fenced(lease)

    async def wake(self, topic: str, about: str = "") -> None:
        """Nothing: one process uses a SQLite store at a time."""

    @contextlib.asynccontextmanager
    async def wakeups(self, topic: str) -> AsyncIterator[Wakeups]:
        """An event nothing sets: no other process writes here."""
        yield Wakeups()


class _SQLiteTx:
    """:class:`Tx` on a sqlite3 connection: nothing in it waits, so :func:`drive` runs a body
    to its end in one step."""

    __slots__ = ("_conn",)

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    async def one(
        self, sql: str, params: Params = (), *, lock: bool = False, share: bool = False
    ) -> Any:
        # A write transaction (BEGIN IMMEDIATE) holds the whole database: no row lock needed.
        return self._conn.execute(sql, params).fetchone()

    async def all(
        self, sql: str, params: Params = (), *, lock: bool = False, skip_locked: bool = False
    ) -> list[Row]:
        rows: list[Row] = self._conn.execute(sql, params).fetchall()
        return rows

    async def tuples(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        cursor = self._conn.cursor()
        cursor.row_factory = None
        return cursor.execute(sql, params).fetchall()

    async def run(self, sql: str, params: Params = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    async def exclusive(self, key: str) -> None:
        return  # a write transaction holds the whole database already

    async def now(self) -> float:
        return time.time()  # one machine: its clock is the database's


def _checkpoint_passive(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _version(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] or 0)


if TYPE_CHECKING:
    _conforms: type[Store] = SQLiteStore
