"""Chat inbox, outbox and cursors: a mixin of both stores (see rows.py).

A mixin rather than a second store: the methods run inside the store's own transactions, and
callers keep using the one store class.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, get_args

from geodebot.store.records import (
    AttachedFile,
    InboxEnding,
    InboxFinish,
    InboxFinished,
    InboxRow,
    InboxStatus,
    NewOutbound,
    OutboxFinish,
    OutboxRow,
    OutboxRowFinished,
    OutboxStatus,
    Speech,
    StoredFile,
    StoreError,
)
from geodebot.store.rows import Body, Row, Transactions, Tx, dumps

__all__ = [
    "ADD_OUTBOX",
    "INBOX_COLS",
    "OUTBOX_COLS",
    "ChatInboxOutbox",
    "InboxOutboxStore",
    "finishing",
    "inbox_from_row",
    "outbound_params",
    "outbox_from_row",
]

_INBOX_STATUSES: tuple[str, ...] = get_args(InboxStatus)
_INBOX_FINISHES: frozenset[str] = frozenset(get_args(InboxFinish))
_OUTBOX_STATUSES: tuple[str, ...] = get_args(OutboxStatus)
_OUTBOX_FINISHES: frozenset[str] = frozenset(get_args(OutboxFinish))

INBOX_COLS = (
    "id, platform, event_id, session_id, channel, thread, user_id, text, message_id, "
    "received_at, status, attempts, detail, finished_at, preview, files, attached, relay_id, "
    "relay_intent, pickup"
)
OUTBOX_COLS = (
    "id, inbox_id, session_id, platform, channel, thread, reply_to, text, kind, status, "
    "sent_parts, in_flight, attempts, created_at, updated_at, error, blind_resends, preview, file, "
    "speech, spoken"
)

# DO NOTHING + RETURNING yields a row only when this call inserted it, so "was it mine?" needs
# no second look that another writer could race.
_ADD_INBOX = f"""
INSERT INTO inbox (platform, event_id, session_id, channel, thread, user_id, text, message_id,
    received_at, status, attempts, detail, files, pickup)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', 0, '', ?, ?)
ON CONFLICT (platform, event_id) DO NOTHING
RETURNING {INBOX_COLS}
"""
# A row found running was cut short (crash, restart) and is simply started again.
_START_INBOX = f"""
UPDATE inbox SET status = 'running', attempts = attempts + 1
WHERE id = ? AND status IN ('pending', 'running')
RETURNING {INBOX_COLS}
"""
# The status condition is the guard against a second finish, so a late or repeated finish
# cannot add a second reply.
_FINISH_INBOX = f"""
UPDATE inbox SET status = ?, detail = ?, finished_at = ?
WHERE id = ? AND status IN ('pending', 'running')
RETURNING {INBOX_COLS}
"""
ADD_OUTBOX = f"""
INSERT INTO outbox (inbox_id, session_id, platform, channel, thread, reply_to, text, kind,
    status, sent_parts, in_flight, attempts, created_at, updated_at, error, blind_resends,
    preview, file, speech)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', '{{}}', NULL, 0, ?, ?, '', 0, ?, ?, ?)
RETURNING {OUTBOX_COLS}
"""
_BEGIN_PART = f"""
UPDATE outbox SET in_flight = ?, attempts = attempts + 1, updated_at = ?
WHERE id = ? RETURNING {OUTBOX_COLS}
"""
_PART_SENT = f"""
UPDATE outbox SET sent_parts = ?, in_flight = ?, status = ?, updated_at = ?
WHERE id = ? RETURNING {OUTBOX_COLS}
"""
_PART_UNSENT = f"""
UPDATE outbox SET in_flight = NULL, updated_at = ?
WHERE id = ? RETURNING {OUTBOX_COLS}
"""
_BLIND_RESEND = f"""
UPDATE outbox SET blind_resends = blind_resends + 1, updated_at = ?
WHERE id = ? RETURNING {OUTBOX_COLS}
"""
_SPOKEN = f"""
UPDATE outbox SET spoken = ?, updated_at = ?
WHERE id = ? AND status = 'pending' AND spoken = ''
RETURNING {OUTBOX_COLS}
"""
_FINISH_OUTBOX = f"""
UPDATE outbox SET status = ?, error = ?, updated_at = ?
WHERE id = ? AND status = 'pending'
RETURNING {OUTBOX_COLS}
"""
_SET_CURSOR = """
INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
"""


def inbox_from_row(row: Row) -> InboxRow:
    return InboxRow(
        id=row["id"],
        platform=row["platform"],
        event_id=row["event_id"],
        session_id=row["session_id"],
        channel=row["channel"],
        thread=row["thread"],
        user=row["user_id"],
        text=row["text"],
        message_id=row["message_id"],
        received_at=row["received_at"],
        status=row["status"],
        attempts=row["attempts"],
        detail=row["detail"],
        finished_at=row["finished_at"],
        preview=row["preview"],
        files=tuple(json.loads(row["files"])),
        attached=(
            None
            if row["attached"] is None
            else tuple(AttachedFile.from_json(a) for a in json.loads(row["attached"]))
        ),
        relay_id=row["relay_id"],
        relay_intent=row["relay_intent"],
        pickup=row["pickup"],
    )


def outbox_from_row(row: Row) -> OutboxRow:
    # JSON object keys are strings; part indexes are ints again once read.
    parts = json.loads(row["sent_parts"])
    return OutboxRow(
        id=row["id"],
        inbox_id=row["inbox_id"],
        session_id=row["session_id"],
        platform=row["platform"],
        channel=row["channel"],
        thread=row["thread"],
        reply_to=row["reply_to"],
        text=row["text"],
        kind=row["kind"],
        status=row["status"],
        sent_parts={int(index): str(message_id) for index, message_id in parts.items()},
        in_flight=row["in_flight"],
        attempts=row["attempts"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        error=row["error"],
        blind_resends=row["blind_resends"],
        preview=row["preview"],
        file=StoredFile.from_json(json.loads(row["file"])) if row["file"] else None,
        speech=Speech.from_json(json.loads(row["speech"])) if row["speech"] else None,
        spoken=StoredFile.from_json(json.loads(row["spoken"])) if row["spoken"] else None,
    )


def _encode_parts(parts: Mapping[int, str]) -> str:
    return dumps({str(index): parts[index] for index in sorted(parts)})


def outbound_params(
    reply: NewOutbound, inbox_id: int | None, now: float, preview: str = ""
) -> tuple[Any, ...]:
    head = (inbox_id, reply.session_id, reply.platform, reply.channel, reply.thread)
    file = dumps(reply.file.to_json()) if reply.file is not None else ""
    speech = dumps(reply.speech.to_json()) if reply.speech is not None else ""
    return (*head, reply.reply_to, reply.text, reply.kind, now, now, preview, file, speech)


def _counts(rows: Any, statuses: tuple[str, ...]) -> dict[str, int]:
    counts = dict.fromkeys(statuses, 0)
    counts.update({row[0]: int(row[1]) for row in rows})
    return counts


async def _inbox_row(db: Tx, inbox_id: int) -> InboxRow | None:
    row = await db.one(f"SELECT {INBOX_COLS} FROM inbox WHERE id = ?", (inbox_id,))
    return None if row is None else inbox_from_row(row)


async def _outbox_row(db: Tx, outbox_id: int, *, lock: bool = False) -> OutboxRow | None:
    sql = f"SELECT {OUTBOX_COLS} FROM outbox WHERE id = ?"
    row = await db.one(sql, (outbox_id,), lock=lock)
    return None if row is None else outbox_from_row(row)


async def _why_finished(db: Tx, inbox_id: int) -> str:
    current = await _inbox_row(db, inbox_id)
    if current is None:
        return "no such inbox row"
    return f"it is already {current.status!r}"


async def _pending_outbox_row(db: Tx, outbox_id: int, what: str) -> OutboxRow:
    """The row as the caller's write transaction sees it, locked to it until it ends (the
    sender's next step is decided on it); raises unless it is pending."""
    current = await _outbox_row(db, outbox_id, lock=True)
    if current is None:
        raise StoreError(f"{what} failed: no such outbox row")
    if current.status != "pending":
        raise OutboxRowFinished(f"{what} failed: it is already {current.status!r}", current)
    return current


class InboxOutboxStore(Protocol):
    """The chat inbox and outbox, and the named cursors a poller keeps."""

    async def inbox_add(
        self,
        *,
        platform: str,
        event_id: str,
        session_id: str,
        channel: str,
        thread: str | None,
        user: str,
        text: str,
        message_id: str,
        cursor: tuple[str, str] | None = None,
        files: Sequence[Mapping[str, Any]] = (),
        pickup: str | None = None,
        durable: bool = True,
    ) -> tuple[InboxRow, bool]:
        """Commit an accepted event as ``pending``; ``(stored, True)``. ``files``: what the
        platform said the message carried (JSON objects), kept on the row as they are.
        ``pickup``: with replicas, the one that took the message in (its session may run on
        another). Not ``durable``: the caller calls :meth:`sync` before it acknowledges the
        event (and may start its turn meanwhile).

        A second event with the same ``(platform, event_id)`` writes nothing and returns
        ``(existing, False)``, also when the two race. ``cursor`` ``(name, value)`` is set in
        the same transaction, duplicate or not, so a poller's offset never runs ahead of the
        events it has committed.
        """

    async def inbox_attached(
        self,
        inbox_id: int,
        attached: Sequence[AttachedFile],
        notice: NewOutbound | None = None,
    ) -> tuple[InboxRow, OutboxRow | None]:
        """Record what became of a row's files, and add ``notice`` (a reply saying what was
        refused) to the outbox in the same commit; ``(row, the notice's outbox row)``.

        Only the first record counts: once a row has one, a later call writes nothing (no
        second notice) and returns ``(row as recorded, None)``. Raises StoreError for an
        unknown id.
        """

    async def inbox_start(self, inbox_id: int) -> InboxRow:
        """Mark a ``pending`` or ``running`` row ``running`` and count the attempt.

        Raises :class:`StoreError` for an unknown id or a finished row.
        """

    async def inbox_finish(
        self,
        inbox_id: int,
        status: InboxFinish,
        *,
        detail: str = "",
        reply: NewOutbound | None = None,
        begin_first_part: bool = False,
    ) -> tuple[InboxRow, OutboxRow | None]:
        """Finish a ``pending`` or ``running`` row and, in the same transaction, write its
        reply to the outbox: after a crash either both exist or neither does.

        ``begin_first_part`` also records the reply's part 0 as begun (as
        :meth:`outbox_begin_part` does) and commits durably, for a sender about to send it:
        one commit before the send instead of two. After a crash the part counts as perhaps
        sent, as any begun part does.

        Raises :class:`StoreError` (and writes nothing) for an unknown id or a finished row.
        """

    async def inbox_preview(self, inbox_id: int, message_id: str) -> None:
        """Remember the streamed preview shown for the row's answer (and give it to the
        row's reply if that is written already), durably."""

    async def inbox_unfinished(self, session_id: str | None = None) -> list[InboxRow]:
        """``pending`` and ``running`` rows in arrival order (of one session, if given)."""

    async def get_inbox(self, inbox_id: int) -> InboxRow | None: ...

    async def find_inbox(self, platform: str, event_id: str) -> InboxRow | None: ...

    async def inbox_counts(self) -> dict[str, int]:
        """Rows per status, every status present (zero included)."""

    # -- chat outbox ----------------------------------------------------------------------
    async def outbox_add(self, reply: NewOutbound) -> OutboxRow:
        """Write a ``pending`` message that answers no inbox row (job result, notice)."""

    async def outbox_begin_part(self, outbox_id: int, index: int) -> OutboxRow:
        """Record that part ``index`` is about to be sent (``in_flight``, attempts + 1).

        Called before the request goes out, so a crash during it leaves the evidence that the
        outcome is unknown. Raises :class:`StoreError` unless the row is ``pending``, the part
        is not already sent and no other part's outcome is still unknown.
        """

    async def outbox_part_sent(
        self, outbox_id: int, index: int, message_id: str, *, last: bool = False
    ) -> OutboxRow:
        """Record part ``index`` as sent as ``message_id`` and clear it from ``in_flight``.

        With ``last`` the row is finished as ``sent`` in the same transaction (the caller
        knows every earlier part is sent). Recording the same message id again changes
        nothing else; a different one raises :class:`StoreError`. The row must be ``pending``.
        """

    async def outbox_part_unsent(self, outbox_id: int, index: int) -> OutboxRow:
        """Record that the send of part ``index`` definitely failed (e.g. a rate limit): its
        outcome is known again, so ``in_flight`` is cleared.

        A no-op when no part is in flight. Raises :class:`StoreError` when another part is in
        flight, the part is already sent or the row is not ``pending``.
        """

    async def outbox_note_blind_resend(self, outbox_id: int) -> OutboxRow:
        """Count a resend of the in-flight part whose arrival could not be checked.

        Raises :class:`StoreError` unless the row is ``pending`` with a part in flight.
        """

    async def outbox_spoken(self, outbox_id: int, spoken: StoredFile) -> OutboxRow:
        """Record the audio made for a pending row's speech; the first record stands (a
        later call returns the row as recorded). Raises StoreError unless it is pending."""

    async def outbox_finish(
        self, outbox_id: int, status: OutboxFinish, *, error: str = ""
    ) -> OutboxRow:
        """Finish a ``pending`` row; raises :class:`StoreError` for any other status."""

    async def outbox_pending(self, *, platform: str | None = None) -> list[OutboxRow]:
        """``pending`` rows (of one platform, if given) in id order."""

    async def get_outbox(self, outbox_id: int) -> OutboxRow | None: ...

    async def outbox_counts(self) -> dict[str, int]:
        """Rows per status, every status present (zero included)."""

    # -- cursors --------------------------------------------------------------------------
    async def get_cursor(self, name: str) -> str | None:
        """A named position that survives restarts (a poll offset, a last seen id)."""

    async def set_cursor(self, name: str, value: str) -> None: ...


class ChatInboxOutbox:
    # -- inbox ----------------------------------------------------------------------------
    async def inbox_add(
        self: Transactions,
        *,
        platform: str,
        event_id: str,
        session_id: str,
        channel: str,
        thread: str | None,
        user: str,
        text: str,
        message_id: str,
        cursor: tuple[str, str] | None = None,
        files: Sequence[Mapping[str, Any]] = (),
        pickup: str | None = None,
        durable: bool = True,
    ) -> tuple[InboxRow, bool]:
        what = f"adding event {event_id!r} of {platform!r} to the inbox"
        if not platform or not event_id:
            # An empty id would make every later event of the platform a "duplicate".
            raise StoreError(f"{what} failed: platform and event id must not be empty")
        now = time.time()
        head = (platform, event_id, session_id, channel, thread, user, text, message_id)
        params = (*head, now, dumps(list(files)), pickup)

        async def add(db: Tx) -> tuple[InboxRow, bool]:
            inserted = await db.one(_ADD_INBOX, params)
            if cursor is not None:
                await db.run(_SET_CURSOR, (*cursor, now))
            if inserted is not None:
                return inbox_from_row(inserted), True
            sql = f"SELECT {INBOX_COLS} FROM inbox WHERE platform = ? AND event_id = ?"
            return inbox_from_row(await db.one(sql, (platform, event_id))), False

        # The platform is acknowledged next (after a sync, if not durable here).
        return await self._write(what, add, durable=durable)

    async def inbox_start(self: Transactions, inbox_id: int) -> InboxRow:
        what = f"starting inbox row {inbox_id}"

        async def start(db: Tx) -> InboxRow:
            row = await db.one(_START_INBOX, (inbox_id,))
            if row is None:
                reason = await _why_finished(db, inbox_id)
                raise StoreError(f"{what} failed: {reason}; only an unfinished row can start")
            return inbox_from_row(row)

        return await self._write(what, start)

    async def inbox_finish(
        self: Transactions,
        inbox_id: int,
        status: InboxFinish,
        *,
        detail: str = "",
        reply: NewOutbound | None = None,
        begin_first_part: bool = False,
    ) -> InboxFinished:
        what, finish = finishing(InboxEnding(inbox_id, status, detail, reply, begin_first_part))
        # A begun part is sent next, so the commit that begins it must be on disk first.
        return await self._write(what, finish, durable=begin_first_part and reply is not None)

    async def inbox_preview(self: Transactions, inbox_id: int, message_id: str) -> None:
        async def note(db: Tx) -> None:
            await db.run("UPDATE inbox SET preview = ? WHERE id = ?", (message_id, inbox_id))
            await db.run(
                "UPDATE outbox SET preview = ? WHERE inbox_id = ? AND status = 'pending'",
                (message_id, inbox_id),
            )

        await self._write(f"recording the preview of inbox row {inbox_id}", note, durable=True)

    async def inbox_attached(
        self: Transactions,
        inbox_id: int,
        attached: Sequence[AttachedFile],
        notice: NewOutbound | None = None,
    ) -> tuple[InboxRow, OutboxRow | None]:
        what = f"recording the files of inbox row {inbox_id}"
        encoded = dumps([a.to_json() for a in attached])
        now = time.time()

        async def note(db: Tx) -> tuple[InboxRow, OutboxRow | None]:
            row = await db.one(
                f"UPDATE inbox SET attached = ? WHERE id = ? AND attached IS NULL "
                f"RETURNING {INBOX_COLS}",
                (encoded, inbox_id),
            )
            if row is None:
                current = await _inbox_row(db, inbox_id)
                if current is None:
                    raise StoreError(f"{what} failed: no such inbox row")
                # Recorded before (a turn cut short): that record and its notice stand.
                return current, None
            added = None
            if notice is not None:
                added = outbox_from_row(
                    await db.one(ADD_OUTBOX, outbound_params(notice, None, now))
                )
            return inbox_from_row(row), added

        return await self._write(what, note, durable=notice is not None)

    async def inbox_unfinished(self: Transactions, session_id: str | None = None) -> list[InboxRow]:
        sql = f"SELECT {INBOX_COLS} FROM inbox WHERE status IN ('pending', 'running')"
        params: tuple[str, ...] = ()
        if session_id is not None:
            sql, params = f"{sql} AND session_id = ?", (session_id,)
        rows = await self._read(
            "listing unfinished inbox rows", lambda db: db.all(f"{sql} ORDER BY id", params)
        )
        return [inbox_from_row(row) for row in rows]

    async def get_inbox(self: Transactions, inbox_id: int) -> InboxRow | None:
        return await self._read(
            f"reading inbox row {inbox_id}", lambda db: _inbox_row(db, inbox_id)
        )

    async def find_inbox(self: Transactions, platform: str, event_id: str) -> InboxRow | None:
        sql = f"SELECT {INBOX_COLS} FROM inbox WHERE platform = ? AND event_id = ?"
        row = await self._read(
            f"finding event {event_id!r} of {platform!r}",
            lambda db: db.one(sql, (platform, event_id)),
        )
        return None if row is None else inbox_from_row(row)

    async def inbox_counts(self: Transactions) -> dict[str, int]:
        sql = "SELECT status, COUNT(*) FROM inbox GROUP BY status"
        rows = await self._read("counting inbox rows", lambda db: db.all(sql))
        return _counts(rows, _INBOX_STATUSES)

    # -- outbox ---------------------------------------------------------------------------
    async def outbox_add(self: Transactions, reply: NewOutbound) -> OutboxRow:
        params = outbound_params(reply, None, time.time())
        row = await self._write(
            f"adding a {reply.kind!r} message to the outbox",
            lambda db: db.one(ADD_OUTBOX, params),
        )
        return outbox_from_row(row)

    async def outbox_begin_part(self: Transactions, outbox_id: int, index: int) -> OutboxRow:
        what = f"beginning part {index} of outbox row {outbox_id}"
        if index < 0:
            raise StoreError(f"{what} failed: a part index must not be negative")

        async def begin(db: Tx) -> OutboxRow:
            current = await _pending_outbox_row(db, outbox_id, what)
            if index in current.sent_parts:
                # Sending it again would post the same text twice.
                raise StoreError(f"{what} failed: that part is already sent")
            if current.in_flight is not None and current.in_flight != index:
                # Overwriting in_flight would erase the only trace that part's outcome is open.
                raise StoreError(
                    f"{what} failed: the outcome of part {current.in_flight} is still unknown"
                )
            return outbox_from_row(await db.one(_BEGIN_PART, (index, time.time(), outbox_id)))

        # The part is sent next.
        return await self._write(what, begin, durable=True)

    async def outbox_part_sent(
        self: Transactions, outbox_id: int, index: int, message_id: str, *, last: bool = False
    ) -> OutboxRow:
        what = f"recording part {index} of outbox row {outbox_id} as sent"
        if index < 0:
            raise StoreError(f"{what} failed: a part index must not be negative")

        async def sent(db: Tx) -> OutboxRow:
            current = await _pending_outbox_row(db, outbox_id, what)
            known = current.sent_parts.get(index)
            if known is not None and known != message_id:
                raise StoreError(f"{what} failed: it was already sent as {known!r}")
            if known is not None and not last:
                return current
            parts = _encode_parts({**current.sent_parts, index: message_id})
            in_flight = None if current.in_flight == index else current.in_flight
            status = "sent" if last else "pending"
            params = (parts, in_flight, status, time.time(), outbox_id)
            return outbox_from_row(await db.one(_PART_SENT, params))

        return await self._write(what, sent)

    async def outbox_part_unsent(self: Transactions, outbox_id: int, index: int) -> OutboxRow:
        what = f"recording part {index} of outbox row {outbox_id} as not sent"

        async def unsent(db: Tx) -> OutboxRow:
            current = await _pending_outbox_row(db, outbox_id, what)
            if index in current.sent_parts:
                raise StoreError(f"{what} failed: it is already sent")
            if current.in_flight is None:
                return current
            if current.in_flight != index:
                raise StoreError(f"{what} failed: part {current.in_flight} is in flight")
            return outbox_from_row(await db.one(_PART_UNSENT, (time.time(), outbox_id)))

        return await self._write(what, unsent)

    async def outbox_note_blind_resend(self: Transactions, outbox_id: int) -> OutboxRow:
        what = f"counting a blind resend of outbox row {outbox_id}"

        async def note(db: Tx) -> OutboxRow:
            current = await _pending_outbox_row(db, outbox_id, what)
            if current.in_flight is None:
                raise StoreError(f"{what} failed: no part is in flight")
            return outbox_from_row(await db.one(_BLIND_RESEND, (time.time(), outbox_id)))

        return await self._write(what, note, durable=True)

    async def outbox_spoken(self: Transactions, outbox_id: int, spoken: StoredFile) -> OutboxRow:
        what = f"recording the speech of outbox row {outbox_id}"
        params = (dumps(spoken.to_json()), time.time(), outbox_id)

        async def note(db: Tx) -> OutboxRow:
            row = await db.one(_SPOKEN, params)
            if row is not None:
                return outbox_from_row(row)
            return await _pending_outbox_row(db, outbox_id, what)

        return await self._write(what, note)

    async def outbox_finish(
        self: Transactions, outbox_id: int, status: OutboxFinish, *, error: str = ""
    ) -> OutboxRow:
        what = f"finishing outbox row {outbox_id} as {status!r}"
        if status not in _OUTBOX_FINISHES:
            raise StoreError(f"{what} failed: status must be one of {sorted(_OUTBOX_FINISHES)}")

        async def finish(db: Tx) -> OutboxRow:
            row = await db.one(_FINISH_OUTBOX, (status, error, time.time(), outbox_id))
            if row is None:
                current = await _outbox_row(db, outbox_id)
                reason = "no such outbox row" if current is None else f"it is {current.status!r}"
                raise StoreError(f"{what} failed: {reason}; only a pending row can finish")
            return outbox_from_row(row)

        return await self._write(what, finish)

    async def outbox_pending(self: Transactions, *, platform: str | None = None) -> list[OutboxRow]:
        where, params = "status = 'pending'", []
        if platform is not None:
            where += " AND platform = ?"
            params.append(platform)
        sql = f"SELECT {OUTBOX_COLS} FROM outbox WHERE {where} ORDER BY id"
        rows = await self._read("listing pending outbox rows", lambda db: db.all(sql, params))
        return [outbox_from_row(row) for row in rows]

    async def get_outbox(self: Transactions, outbox_id: int) -> OutboxRow | None:
        return await self._read(
            f"reading outbox row {outbox_id}", lambda db: _outbox_row(db, outbox_id)
        )

    async def outbox_counts(self: Transactions) -> dict[str, int]:
        sql = "SELECT status, COUNT(*) FROM outbox GROUP BY status"
        rows = await self._read("counting outbox rows", lambda db: db.all(sql))
        return _counts(rows, _OUTBOX_STATUSES)

    # -- cursors --------------------------------------------------------------------------
    async def get_cursor(self: Transactions, name: str) -> str | None:
        sql = "SELECT value FROM cursors WHERE name = ?"
        row = await self._read(f"reading cursor {name!r}", lambda db: db.one(sql, (name,)))
        return None if row is None else str(row[0])

    async def set_cursor(self: Transactions, name: str, value: str) -> None:
        params = (name, value, time.time())
        await self._write(f"setting cursor {name!r}", lambda db: db.run(_SET_CURSOR, params))


def finishing(ending: InboxEnding) -> tuple[str, Body[InboxFinished]]:
    """What :meth:`ChatInboxOutbox.inbox_finish` writes, as a function a transaction runs;
    ``checkpoint_ending`` runs it in a checkpoint's transaction."""
    inbox_id, status = ending.inbox_id, ending.status
    what = f"finishing inbox row {inbox_id} as {status!r}"
    if status not in _INBOX_FINISHES:
        raise StoreError(f"{what} failed: status must be one of {sorted(_INBOX_FINISHES)}")
    now = time.time()

    async def finish(db: Tx) -> InboxFinished:
        row = await db.one(_FINISH_INBOX, (status, ending.detail, now, inbox_id))
        if row is None:
            reason = await _why_finished(db, inbox_id)
            raise StoreError(f"{what} failed: {reason}; only an unfinished row can finish")
        outbound = None
        if ending.reply is None and _dead_without_reply(status, row["relay_intent"]):
            # A dead letter from now on (chat/deadletters.py); marked for its partial index.
            await db.run("UPDATE inbox SET no_reply = 1 WHERE id = ?", (inbox_id,))
        if ending.reply is not None:
            # The answer replaces its streamed preview, if the turn showed one.
            params = outbound_params(ending.reply, inbox_id, now, row["preview"])
            added = await db.one(ADD_OUTBOX, params)
            if ending.begin_first_part:
                added = await db.one(_BEGIN_PART, (0, now, added["id"]))
            outbound = outbox_from_row(added)
        return inbox_from_row(row), outbound

    return what, finish


def _dead_without_reply(status: str, relay_intent: str | None) -> bool:
    """Whether a row finished as ``status`` without a reply row is left unanswered: not when
    dropped on purpose, nor a relayed "notify" message, recorded to be answered by nobody."""
    return status in ("done", "failed") and not (status == "done" and relay_intent == "notify")
