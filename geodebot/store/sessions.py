"""Sessions, their checkpoints, context reads and timeline: a mixin of both stores (see
rows.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from geodebot.store.chat import finishing
from geodebot.store.receipts import SELECT_SWITCH, switch_from_row
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
from geodebot.store.rows import (
    ENSURE_SESSION,
    INSERT_EVENT,
    Body,
    Transactions,
    Tx,
    dumps,
    dumps_list,
    encoding,
    from_row,
    paged,
)

__all__ = ["SessionStore", "SessionsAndHistory"]

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


class SessionStore(Protocol):
    """Sessions, their checkpoints, context and timeline."""

    async def ensure_session(self, session_id: str, mode: str) -> SessionRecord:
        """Return the session, creating it (generation 1, empty state) if it does not exist."""

    async def open_session(self, session_id: str, mode: str, *, switch: str) -> OpenedSession:
        """:meth:`ensure_session`, the operator switch ``switch`` and :meth:`pending_batches`
        in one transaction: one store round trip where a message's turn would need three."""

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def list_sessions(self) -> list[SessionRecord]: ...

    async def reset_session(self, session_id: str) -> SessionRecord:
        """Start a fresh context: bump the generation, clear state and guards.

        History rows stay in place (append-only); they are simply not loaded any more.
        Pending tool batches of the old generation are marked abandoned.
        """

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
        """Atomically append messages, replace state/guards (when given), and record a tool
        batch proposal or completion ``(batch_id, results, status)`` and timeline events
        ``(turn_id, kind, data)``.

        Returns the seqs assigned to ``messages``. Cost is O(len(messages)), independent of
        the history length.
        """

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
        """:meth:`checkpoint` and :meth:`inbox_finish` of ``ending`` in one transaction,
        committed durably: a turn's end and its reply are saved together or not at all, at
        the cost of one commit where they would need two.

        Returns the seqs assigned to ``messages`` and what :meth:`inbox_finish` returns.
        Raises :class:`StoreError` (and writes nothing) if either part fails.
        """

    async def load_context(self, session_id: str) -> list[MessageRecord]:
        """Messages of the current generation that the model should see: the newest summary
        (if any) followed by every message after the range it covers, in seq order."""

    async def load_context_json(self, session_id: str) -> list[ContextRow]:
        """:meth:`load_context`, each message's content as the JSON text stored (see
        :class:`ContextRow`): what the engine reads when a session's context is not cached."""

    async def load_messages(
        self, session_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        """Raw messages (kind ``message`` and ``summary``) of the current generation."""

    async def pending_batches(self, session_id: str) -> list[ToolBatchRecord]:
        """Batches of the current generation still ``proposed`` (crash before completion)."""

    # -- timeline -------------------------------------------------------------------------
    async def append_timeline(
        self,
        session_id: str,
        turn_id: str | None,
        kind: str,
        data: Mapping[str, Any],
        *,
        mode: str | None = None,
    ) -> int:
        """Append an event; ``mode``: the session is made first (in that mode) if it is not
        there yet, in the same transaction (a chat's first turn, before the loop made it)."""

    async def timeline(
        self, session_id: str, *, after_id: int = 0, limit: int | None = None
    ) -> list[TimelineEvent]: ...

    async def timeline_newest(
        self, session_id: str, *, before_id: int | None = None, limit: int = 100
    ) -> list[TimelineEvent]:
        """The session's newest events, newest first: those with an id below ``before_id``
        (every one, if None), at most ``limit``; what a page of a long timeline shows."""


class SessionsAndHistory:
    # -- sessions -------------------------------------------------------------------------
    async def ensure_session(self: Transactions, session_id: str, mode: str) -> SessionRecord:
        """Return the session, creating it if missing; an existing session keeps its mode."""
        now = time.time()
        return await self._write(
            f"ensuring session {session_id!r}",
            lambda db: _ensure_session(db, session_id=session_id, mode=mode, now=now),
        )

    async def open_session(
        self: Transactions, session_id: str, mode: str, *, switch: str
    ) -> OpenedSession:
        now = time.time()

        async def open_(db: Tx) -> OpenedSession:
            record = await _ensure_session(db, session_id=session_id, mode=mode, now=now)
            found = await db.one(f"{SELECT_SWITCH} WHERE name = ?", (switch,))
            pending = await db.all(_PENDING_BATCHES, {"sid": session_id})
            return OpenedSession(
                record,
                None if found is None else switch_from_row(found),
                [from_row(ToolBatchRecord, row) for row in pending],
            )

        return await self._write(f"opening session {session_id!r}", open_)

    async def get_session(self: Transactions, session_id: str) -> SessionRecord | None:
        async def read(db: Tx) -> SessionRecord | None:
            sql = f"SELECT {_SESSION_COLS} FROM sessions WHERE id = ?"
            rows = await db.all(sql, (session_id,))
            return from_row(SessionRecord, rows[0]) if rows else None

        return await self._read(f"reading session {session_id!r}", read)

    async def list_sessions(self: Transactions) -> list[SessionRecord]:
        sql = f"SELECT {_SESSION_COLS} FROM sessions ORDER BY updated_at DESC, id"
        rows = await self._read("listing sessions", lambda db: db.all(sql))
        return [from_row(SessionRecord, row) for row in rows]

    async def reset_session(self: Transactions, session_id: str) -> SessionRecord:
        what = f"reset of session {session_id!r}"
        now = time.time()

        async def reset(db: Tx) -> SessionRecord:
            sql = (
                "UPDATE sessions SET generation = generation + 1, state = '{}', guards = '{}', "
                f"updated_at = ? WHERE id = ? RETURNING {_SESSION_COLS}"
            )
            rows = await db.all(sql, (now, session_id))
            if not rows:
                raise StoreError(f"{what} failed: no such session")
            record = from_row(SessionRecord, rows[0])
            await db.run(
                "UPDATE tool_batches SET status = 'abandoned', finished_at = ? "
                "WHERE session_id = ? AND status = 'proposed' AND generation < ?",
                (now, session_id, record.generation),
            )
            return record

        return await self._write(what, reset, durable=True)

    # -- checkpoints ----------------------------------------------------------------------
    async def checkpoint(
        self: Transactions,
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
        return await self._write(what, write)

    async def checkpoint_ending(
        self: Transactions,
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

        async def write_both(db: Tx) -> tuple[list[int], InboxFinished]:
            return await write(db), await finish(db)

        return await self._write(f"{what} with {also}", write_both, durable=True)

    async def load_context(self: Transactions, session_id: str) -> list[MessageRecord]:
        async def read(db: Tx) -> list[MessageRecord]:
            # Plain tuples in column order, not named rows: a long history is read on every
            # turn whose session is not cached, and naming each row's columns cost more than
            # the query.
            rows = await db.tuples(_LOAD_CONTEXT, {"sid": session_id})
            return [_message(*row) for row in rows]

        return await self._read(f"loading the context of session {session_id!r}", read)

    async def load_context_json(self: Transactions, session_id: str) -> list[ContextRow]:
        async def read(db: Tx) -> list[ContextRow]:
            rows = await db.tuples(_LOAD_CONTEXT_JSON, {"sid": session_id})
            return [ContextRow._make(row) for row in rows]

        return await self._read(f"loading the context of session {session_id!r}", read)

    async def load_messages(
        self: Transactions, session_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        sql, params = paged(_LOAD_MESSAGES, {"sid": session_id, "after": after_seq}, limit)
        rows = await self._read(
            f"loading messages of session {session_id!r}",
            lambda db: db.all(sql, params),
        )
        return [from_row(MessageRecord, row) for row in rows]

    async def pending_batches(self: Transactions, session_id: str) -> list[ToolBatchRecord]:
        rows = await self._read(
            f"loading pending batches of session {session_id!r}",
            lambda db: db.all(_PENDING_BATCHES, {"sid": session_id}),
        )
        return [from_row(ToolBatchRecord, row) for row in rows]

    # -- timeline -------------------------------------------------------------------------
    async def append_timeline(
        self: Transactions,
        session_id: str,
        turn_id: str | None,
        kind: str,
        data: Mapping[str, Any],
        *,
        mode: str | None = None,
    ) -> int:
        what = f"timeline append to session {session_id!r}"
        now = time.time()
        with encoding(what):
            event = (session_id, turn_id, now, kind, dumps(dict(data)))

        async def append(db: Tx) -> int:
            if mode is not None:
                await db.run(ENSURE_SESSION, (session_id, mode, now, now))
            rows = await db.all(f"{INSERT_EVENT} RETURNING id", event)
            return int(rows[0][0])

        return await self._write(what, append)

    async def timeline(
        self: Transactions, session_id: str, *, after_id: int = 0, limit: int | None = None
    ) -> list[TimelineEvent]:
        sql, params = paged(
            "SELECT id, session_id, turn_id, ts, kind, data FROM timeline "
            "WHERE session_id = :sid AND id > :after ORDER BY id",
            {"sid": session_id, "after": after_id},
            limit,
        )
        rows = await self._read(
            f"reading the timeline of session {session_id!r}",
            lambda db: db.all(sql, params),
        )
        return [from_row(TimelineEvent, row) for row in rows]

    async def timeline_newest(
        self: Transactions, session_id: str, *, before_id: int | None = None, limit: int = 100
    ) -> list[TimelineEvent]:
        before = "" if before_id is None else " AND id < :before"
        sql, params = paged(
            "SELECT id, session_id, turn_id, ts, kind, data FROM timeline "
            f"WHERE session_id = :sid{before} ORDER BY id DESC",
            {"sid": session_id, "before": before_id},
            limit,
        )
        rows = await self._read(
            f"reading the newest timeline of session {session_id!r}",
            lambda db: db.all(sql, params),
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
) -> tuple[str, Body[list[int]]]:
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

    async def write(db: Tx) -> list[int]:
        # Reading and bumping the counter in one statement: no look at message history.
        bump = (len(encoded), now, state_json, guards_json, session_id)
        counters = await db.all(_BUMP_SESSION, bump)
        if not counters:
            raise StoreError(f"{what} failed: no such session")
        generation, next_seq = counters[0]
        first = next_seq - len(encoded)
        if encoded:
            rows = [(session_id, seq, generation, *m, now) for seq, m in enumerate(encoded, first)]
            await db.many(_INSERT_MESSAGE, rows)
        if batch is not None:
            head = (batch.id, session_id, generation, batch.turn_id, batch.round)
            tail = (batch.status, calls, batch_results, batch.created_at, batch.finished_at)
            await db.run(_INSERT_BATCH, head + tail)
        if finish_batch is not None:
            batch_id, _, status = finish_batch
            finish = (status, results, now, batch_id, session_id)
            if not await db.all(_FINISH_BATCH, finish):
                raise StoreError(f"{what} failed: no tool batch {batch_id!r} in this session")
        if events:
            await db.many(INSERT_EVENT, [(s, t, now, k, d) for s, t, k, d in events])
        return list(range(first, next_seq))

    return what, write


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


async def _ensure_session(db: Tx, *, session_id: str, mode: str, now: float) -> SessionRecord:
    await db.run(ENSURE_SESSION, (session_id, mode, now, now))
    return await _session(db, session_id)


async def _session(db: Tx, session_id: str) -> SessionRecord:
    sql = f"SELECT {_SESSION_COLS} FROM sessions WHERE id = ?"
    return from_row(SessionRecord, await db.one(sql, (session_id,)))
