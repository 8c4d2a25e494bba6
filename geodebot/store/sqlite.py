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
import functools
import json
import logging
import os
import pathlib
import re
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any, Self, TypeVar

import aiosqlite

from geodebot.store.protocol import Store
from geodebot.store.records import (
    BatchStatus,
    ContextRow,
    InboxEnding,
    InboxFinished,
    MessageKind,
    MessageRecord,
    NewMessage,
    OpenedSession,
    SessionRecord,
    StoreError,
    TimelineEvent,
    ToolBatchRecord,
)
from geodebot.store.sqlite_approvals import Approvals
from geodebot.store.sqlite_chat import ChatInboxOutbox, finishing
from geodebot.store.sqlite_commit import GroupCommit
from geodebot.store.sqlite_deadletters import DeadLetterDecisions
from geodebot.store.sqlite_jobs import JobsAndFires
from geodebot.store.sqlite_receipts import SELECT_SWITCH, ReceiptsAndSwitches, switch_from_row
from geodebot.store.sqlite_relay import Relay
from geodebot.store.sqlite_rows import (
    ENSURE_SESSION,
    INSERT_EVENT,
    dumps,
    dumps_list,
    encoding,
    from_row,
    paged,
)
from geodebot.store.sqlite_spend import Spend

__all__ = ["SQLiteStore", "load_migrations", "split_statements"]

_T = TypeVar("_T")
log = logging.getLogger(__name__)

_SYNCHRONOUS_MODES = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_BUSY_TIMEOUT_MS = 5_000
_MIGRATION_NAME = re.compile(r"^(\d{4})_\w+\.sql$")

_SESSION_COLS = "id, mode, created_at, updated_at, generation, state, guards, next_seq"
_MESSAGE_COLS = (
    "session_id, seq, generation, role, kind, content, turn_id, covers_from, covers_to, created_at"
)
_CURRENT_GENERATION = "generation = (SELECT generation FROM sessions WHERE id = :sid)"


# The newest summary of the current generation, then every plain message after the range it
# covers (a summary without covers_to covers everything before itself). Both halves are range
# scans on messages_by_kind, so the cost follows the size of the answer, not of the history.
# "kind DESC" puts the summary half first: 'summary' > 'message'.
def _context_query(columns: str) -> str:
    return f"""
WITH latest AS (
    SELECT seq, COALESCE(covers_to, seq) AS upto FROM messages
    WHERE session_id = :sid AND kind = 'summary' AND {_CURRENT_GENERATION}
    ORDER BY seq DESC LIMIT 1
)
SELECT {columns} FROM messages
WHERE session_id = :sid AND seq = (SELECT seq FROM latest)
UNION ALL
SELECT {columns} FROM messages
WHERE session_id = :sid AND kind = 'message' AND {_CURRENT_GENERATION}
  AND seq > COALESCE((SELECT upto FROM latest), 0)
ORDER BY kind DESC, seq
"""


_LOAD_CONTEXT = _context_query(_MESSAGE_COLS)
_LOAD_CONTEXT_JSON = _context_query("seq, kind, covers_from, content")

# One ordered range per kind, merged, so paging never walks older generations.
_LOAD_MESSAGES = f"""
SELECT {_MESSAGE_COLS} FROM messages
WHERE session_id = :sid AND kind = 'message' AND seq > :after AND {_CURRENT_GENERATION}
UNION ALL
SELECT {_MESSAGE_COLS} FROM messages
WHERE session_id = :sid AND kind = 'summary' AND seq > :after AND {_CURRENT_GENERATION}
ORDER BY seq
"""

_PENDING_BATCHES = f"""
SELECT id, session_id, turn_id, round, status, calls, results, created_at, finished_at
FROM tool_batches
WHERE session_id = :sid AND status = 'proposed' AND {_CURRENT_GENERATION}
ORDER BY created_at, round, id
"""

_BUMP_SESSION = """
UPDATE sessions SET next_seq = next_seq + ?, updated_at = ?,
    state = COALESCE(?, state), guards = COALESCE(?, guards)
WHERE id = ? RETURNING generation, next_seq
"""

_INSERT_MESSAGE = f"INSERT INTO messages ({_MESSAGE_COLS}) VALUES ({', '.join('?' * 10)})"
_INSERT_BATCH = """
INSERT INTO tool_batches (id, session_id, generation, turn_id, round, status, calls, results,
    created_at, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
_FINISH_BATCH = """
UPDATE tool_batches SET status = ?, results = ?, finished_at = ?
WHERE id = ? AND session_id = ? RETURNING id
"""


def split_statements(script: str) -> list[str]:
    """Split a migration script into statements.

    Statements are cut at line ends where SQLite considers the text complete, which keeps
    trigger bodies (``BEGIN ... END;``) whole. Migrations run statement by statement, not via
    ``executescript``, because that commits the migration's surrounding transaction.
    """
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        # Trailing comments are harmless; a truncated statement makes SQLite report an error.
        statements.append(buffer.strip())
    return statements


def load_migrations(root: Traversable | None = None) -> list[tuple[int, str, str]]:
    """``(version, file name, sql)`` of every ``NNNN_name.sql`` migration, in version order.

    Adding a migration is adding the next-numbered file to ``migrations/``; ``open()`` applies
    it once, in its own transaction. A statement may span lines but must end at a line end.
    """
    directory = root if root is not None else resources.files("geodebot.store") / "migrations"
    found: dict[int, tuple[int, str, str]] = {}
    for entry in directory.iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match is None:
            continue
        version = int(match.group(1))
        if version in found:
            raise StoreError(f"two migrations share version {version}: {entry.name}")
        found[version] = (version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


class SQLiteStore(
    ReceiptsAndSwitches, Approvals, ChatInboxOutbox, DeadLetterDecisions, JobsAndFires, Relay, Spend
):
    """A :class:`Store` in one SQLite file, created with mode 0600 on first open.

    Effect receipts and operator switches live in :class:`ReceiptsAndSwitches`; they run
    through this class's transactions.
    """

    def __init__(self, path: pathlib.Path | str, *, synchronous: str = "FULL") -> None:
        mode = synchronous.upper()
        if mode not in _SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS_MODES)}")
        self.path = pathlib.Path(path)
        self.synchronous = mode
        self._db: aiosqlite.Connection | None = None
        self._commits: GroupCommit | None = None
        self._checkpointing: asyncio.Task[None] | None = None

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
            self._commits = GroupCommit(
                self._writer_connection(),
                self.synchronous,
                busy_timeout_s=_BUSY_TIMEOUT_MS / 1000,
                on_checkpoint=self._checkpoint_soon,
            )
            await self._migrate()
        except BaseException:
            await self.close()
            raise

    def _writer_connection(self) -> sqlite3.Connection:
        """The connection writes use, on the event loop's thread (see .sqlite_commit): it
        never waits for a lock or checkpoints the log, which would stop the loop."""
        try:
            conn = sqlite3.connect(self.path, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"opening store {str(self.path)!r} for writing failed: {exc}") from exc
        try:
            conn.row_factory = sqlite3.Row
            for pragma in (
                "foreign_keys=ON",
                "busy_timeout=0",
                f"synchronous={self.synchronous}",
                "wal_autocheckpoint=0",
            ):
                conn.execute(f"PRAGMA {pragma}")
        except sqlite3.Error as exc:
            conn.close()
            raise StoreError(f"opening store {str(self.path)!r} for writing failed: {exc}") from exc
        return conn

    def _checkpoint_soon(self) -> None:
        """Copy the log into the database on the store's thread, not on the loop; PASSIVE
        takes no lock that writes wait for."""
        if self._db is None or (self._checkpointing and not self._checkpointing.done()):
            return
        self._checkpointing = asyncio.get_running_loop().create_task(self._checkpoint())

    async def _checkpoint(self) -> None:
        try:
            await self._query(
                "checkpointing the log",
                lambda db: db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall(),
            )
        except StoreError as exc:
            log.warning("store: %s", exc)

    async def close(self) -> None:
        if self._db is None:
            return
        # Writes asked for before the close are committed first.
        commits, self._commits = self._commits, None
        if commits is not None:
            await commits.flush()
            commits.close()
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
        current = await self.schema_version()
        for version, name, script in load_migrations():
            if version <= current:
                continue

            def apply(db: sqlite3.Connection, version: int = version, script: str = script) -> None:
                # Another process may have applied it since we looked; now we hold the lock.
                if _version(db) >= version:
                    return
                for statement in split_statements(script):
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

        ``durable`` marks a commit that something outside acts on next (a platform ack, a
        send, a tool's effect, an operator's order): it is synced to disk at the store's
        ``synchronous`` level before it returns. Other commits use at most NORMAL, which in WAL
        mode survives a killed process but not a power cut, until the next durable commit
        syncs the log up to itself. So nothing the outside world saw can be lost, and a turn
        costs two or three syncs instead of ten.
        """
        self._connection(what)
        if self._commits is None:
            raise StoreError(f"{what} failed: the store is not open")
        return await self._commits.write(what, fn, durable)

    # -- sessions -------------------------------------------------------------------------
    async def ensure_session(self, session_id: str, mode: str) -> SessionRecord:
        """Return the session, creating it if missing; an existing session keeps its mode."""
        now = time.time()
        ensure = functools.partial(_ensure_session, session_id=session_id, mode=mode, now=now)
        return await self._transact(f"ensuring session {session_id!r}", ensure)

    async def open_session(self, session_id: str, mode: str, *, switch: str) -> OpenedSession:
        now = time.time()

        def open_(db: sqlite3.Connection) -> OpenedSession:
            record = _ensure_session(db, session_id=session_id, mode=mode, now=now)
            found = db.execute(f"{SELECT_SWITCH} WHERE name = ?", (switch,)).fetchone()
            pending = db.execute(_PENDING_BATCHES, {"sid": session_id}).fetchall()
            return OpenedSession(
                record,
                None if found is None else switch_from_row(found),
                [from_row(ToolBatchRecord, row) for row in pending],
            )

        return await self._transact(f"opening session {session_id!r}", open_)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        def read(db: sqlite3.Connection) -> SessionRecord | None:
            sql = f"SELECT {_SESSION_COLS} FROM sessions WHERE id = ?"
            rows = db.execute(sql, (session_id,)).fetchall()
            return from_row(SessionRecord, rows[0]) if rows else None

        return await self._query(f"reading session {session_id!r}", read)

    async def list_sessions(self) -> list[SessionRecord]:
        sql = f"SELECT {_SESSION_COLS} FROM sessions ORDER BY updated_at DESC, id"
        rows = await self._query("listing sessions", lambda db: db.execute(sql).fetchall())
        return [from_row(SessionRecord, row) for row in rows]

    async def reset_session(self, session_id: str) -> SessionRecord:
        what = f"reset of session {session_id!r}"
        now = time.time()

        def reset(db: sqlite3.Connection) -> SessionRecord:
            sql = (
                "UPDATE sessions SET generation = generation + 1, state = '{}', guards = '{}', "
                f"updated_at = ? WHERE id = ? RETURNING {_SESSION_COLS}"
            )
            rows = db.execute(sql, (now, session_id)).fetchall()
            if not rows:
                raise StoreError(f"{what} failed: no such session")
            record = from_row(SessionRecord, rows[0])
            db.execute(
                "UPDATE tool_batches SET status = 'abandoned', finished_at = ? "
                "WHERE session_id = ? AND status = 'proposed' AND generation < ?",
                (now, session_id, record.generation),
            )
            return record

        return await self._transact(what, reset, durable=True)

    # -- checkpoints ----------------------------------------------------------------------
    async def checkpoint(
        self,
        session_id: str,
        *,
        messages: Sequence[NewMessage] = (),
        state: Mapping[str, Any] | None = None,
        guards: Mapping[str, Any] | None = None,
        propose_batch: ToolBatchRecord | None = None,
        finish_batch: tuple[str, Sequence[Mapping[str, Any]], BatchStatus] | None = None,
        timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]] = (),
    ) -> list[int]:
        what, write = _checkpointing(
            session_id, messages, state, guards, propose_batch, finish_batch, timeline
        )
        return await self._transact(what, write)

    async def checkpoint_ending(
        self,
        session_id: str,
        ending: InboxEnding,
        *,
        messages: Sequence[NewMessage] = (),
        state: Mapping[str, Any] | None = None,
        guards: Mapping[str, Any] | None = None,
        timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]] = (),
    ) -> tuple[list[int], InboxFinished]:
        what, write = _checkpointing(session_id, messages, state, guards, None, None, timeline)
        also, finish = finishing(ending)

        def write_both(db: sqlite3.Connection) -> tuple[list[int], InboxFinished]:
            return write(db), finish(db)

        return await self._transact(f"{what} with {also}", write_both, durable=True)

    async def load_context(self, session_id: str) -> list[MessageRecord]:
        def read(db: sqlite3.Connection) -> list[MessageRecord]:
            # Plain tuples in column order, not named rows: a long history is read on every
            # turn whose session is not cached, and naming each row's columns cost more than
            # the query.
            cursor = db.cursor()
            cursor.row_factory = None
            rows = cursor.execute(_LOAD_CONTEXT, {"sid": session_id}).fetchall()
            return [_message(*row) for row in rows]

        return await self._query(f"loading the context of session {session_id!r}", read)

    async def load_context_json(self, session_id: str) -> list[ContextRow]:
        def read(db: sqlite3.Connection) -> list[ContextRow]:
            cursor = db.cursor()
            cursor.row_factory = _context_row
            rows: list[ContextRow] = cursor.execute(
                _LOAD_CONTEXT_JSON, {"sid": session_id}
            ).fetchall()
            return rows

        return await self._query(f"loading the context of session {session_id!r}", read)

    async def load_messages(
        self, session_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        sql, params = paged(_LOAD_MESSAGES, {"sid": session_id, "after": after_seq}, limit)
        rows = await self._query(
            f"loading messages of session {session_id!r}",
            lambda db: db.execute(sql, params).fetchall(),
        )
        return [from_row(MessageRecord, row) for row in rows]

    async def pending_batches(self, session_id: str) -> list[ToolBatchRecord]:
        rows = await self._query(
            f"loading pending batches of session {session_id!r}",
            lambda db: db.execute(_PENDING_BATCHES, {"sid": session_id}).fetchall(),
        )
        return [from_row(ToolBatchRecord, row) for row in rows]

    # -- timeline -------------------------------------------------------------------------
    async def append_timeline(
        self, session_id: str, turn_id: str | None, kind: str, data: Mapping[str, Any]
    ) -> int:
        what = f"timeline append to session {session_id!r}"
        with encoding(what):
            event = (session_id, turn_id, time.time(), kind, dumps(dict(data)))
        rows = await self._transact(
            what, lambda db: db.execute(f"{INSERT_EVENT} RETURNING id", event).fetchall()
        )
        return int(rows[0][0])

    async def timeline(
        self, session_id: str, *, after_id: int = 0, limit: int | None = None
    ) -> list[TimelineEvent]:
        sql, params = paged(
            "SELECT id, session_id, turn_id, ts, kind, data FROM timeline "
            "WHERE session_id = :sid AND id > :after ORDER BY id",
            {"sid": session_id, "after": after_id},
            limit,
        )
        rows = await self._query(
            f"reading the timeline of session {session_id!r}",
            lambda db: db.execute(sql, params).fetchall(),
        )
        return [from_row(TimelineEvent, row) for row in rows]

    async def timeline_newest(
        self, session_id: str, *, before_id: int | None = None, limit: int = 100
    ) -> list[TimelineEvent]:
        before = "" if before_id is None else " AND id < :before"
        sql, params = paged(
            "SELECT id, session_id, turn_id, ts, kind, data FROM timeline "
            f"WHERE session_id = :sid{before} ORDER BY id DESC",
            {"sid": session_id, "before": before_id},
            limit,
        )
        rows = await self._query(
            f"reading the newest timeline of session {session_id!r}",
            lambda db: db.execute(sql, params).fetchall(),
        )
        return [from_row(TimelineEvent, row) for row in rows]


def _checkpointing(
    session_id: str,
    messages: Sequence[NewMessage],
    state: Mapping[str, Any] | None,
    guards: Mapping[str, Any] | None,
    batch: ToolBatchRecord | None,
    finish_batch: tuple[str, Sequence[Mapping[str, Any]], BatchStatus] | None,
    timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]],
) -> tuple[str, Callable[[sqlite3.Connection], list[int]]]:
    """A checkpoint as a function a transaction runs; everything is encoded now, so bad
    content fails here, before any transaction."""
    what = f"checkpoint of session {session_id!r}"
    if batch is not None and batch.session_id != session_id:
        raise StoreError(f"{what} failed: batch {batch.id!r} is for {batch.session_id!r}")
    with encoding(what):
        encoded = [
            (m.role, m.kind, dumps(dict(m.content)), m.turn_id, m.covers_from, m.covers_to)
            for m in messages
        ]
        state_json = None if state is None else dumps(dict(state))
        guards_json = None if guards is None else dumps(dict(guards))
        calls = "" if batch is None else dumps_list(batch.calls)
        batch_results = "" if batch is None else dumps_list(batch.results)
        results = "" if finish_batch is None else dumps_list(finish_batch[1])
        events = [(session_id, turn, kind, dumps(dict(data))) for turn, kind, data in timeline]
    now = time.time()

    def write(db: sqlite3.Connection) -> list[int]:
        # Reading and bumping the counter in one statement: no look at message history.
        bump = (len(encoded), now, state_json, guards_json, session_id)
        counters = db.execute(_BUMP_SESSION, bump).fetchall()
        if not counters:
            raise StoreError(f"{what} failed: no such session")
        generation, next_seq = counters[0]
        first = next_seq - len(encoded)
        if encoded:
            rows = [(session_id, seq, generation, *m, now) for seq, m in enumerate(encoded, first)]
            db.executemany(_INSERT_MESSAGE, rows)
        if batch is not None:
            head = (batch.id, session_id, generation, batch.turn_id, batch.round)
            tail = (batch.status, calls, batch_results, batch.created_at, batch.finished_at)
            db.execute(_INSERT_BATCH, head + tail)
        if finish_batch is not None:
            batch_id, _, status = finish_batch
            finish = (status, results, now, batch_id, session_id)
            if not db.execute(_FINISH_BATCH, finish).fetchall():
                raise StoreError(f"{what} failed: no tool batch {batch_id!r} in this session")
        if events:
            db.executemany(INSERT_EVENT, [(s, t, now, k, d) for s, t, k, d in events])
        return list(range(first, next_seq))

    return what, write


def _context_row(_: sqlite3.Cursor, row: tuple[Any, ...]) -> ContextRow:
    return ContextRow._make(row)


def _message(
    session_id: str,
    seq: int,
    generation: int,
    role: str,
    kind: MessageKind,
    content: str,
    turn_id: str,
    covers_from: int | None,
    covers_to: int | None,
    created_at: float,
) -> MessageRecord:
    """A row of ``_MESSAGE_COLS``, in that order, as its record."""
    return MessageRecord(
        session_id=session_id,
        seq=seq,
        generation=generation,
        role=role,
        content=json.loads(content),
        turn_id=turn_id,
        kind=kind,
        covers_from=covers_from,
        covers_to=covers_to,
        created_at=created_at,
    )


def _version(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] or 0)


def _ensure_session(
    db: sqlite3.Connection, *, session_id: str, mode: str, now: float
) -> SessionRecord:
    db.execute(ENSURE_SESSION, (session_id, mode, now, now))
    return _session(db, session_id)


def _session(db: sqlite3.Connection, session_id: str) -> SessionRecord:
    sql = f"SELECT {_SESSION_COLS} FROM sessions WHERE id = ?"
    return from_row(SessionRecord, db.execute(sql, (session_id,)).fetchone())


if TYPE_CHECKING:
    _conforms: type[Store] = SQLiteStore
