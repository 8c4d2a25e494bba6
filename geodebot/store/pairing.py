"""DM pairing requests and the bindings made at run time: a mixin of both stores (see
rows.py; migration 0017).

A stranger's message becomes at most one pending request per sender and platform, each with
a one-time code, and at most ``max_pending`` of them wait per platform: decided in one
transaction under the platform's lock, with the answer's outbox row, so a redelivered
message, a crash or two replicas taking messages in at once can never give two codes or
lose the one given. Only an operator decides a request (the CLI or the console, over this
store): approving it writes the binding it grants, the welcome and the timeline's record in
one transaction too. Every change of the stored bindings raises one counter (the cursor
``stored_bindings``), which daemons read to know when to read the bindings again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from geodebot.store.chat import ADD_OUTBOX, outbound_params, outbox_from_row
from geodebot.store.records import (
    NewOutbound,
    OutboxRow,
    PairingAnswer,
    PairingAsk,
    PairingRecord,
    PairingStatus,
    StoredBinding,
    StoreError,
)
from geodebot.store.rows import ENSURE_SESSION, INSERT_EVENT, Row, Transactions, Tx, dumps

__all__ = [
    "BINDINGS_CURSOR",
    "BINDINGS_TOPIC",
    "Grant",
    "PairingRefused",
    "PairingStore",
    "Pairings",
]

BINDINGS_CURSOR = "stored_bindings"
# The wake-up topic of a change of the stored bindings (PostgreSQL: NOTIFY).
BINDINGS_TOPIC = "bindings"

_PAIRING_COLS = (
    "id, platform, code, user_id, user_name, channel, thread, is_dm, first_text, event_id, "
    "created_at, expires_at, noticed_at, status, decided_at, decided_by, binding_key"
)
_BINDING_COLS = "binding_key, platform, channel, data, origin, created_at, created_by"
_BUMP = (
    "UPDATE cursors SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT), updated_at = ? "
    "WHERE name = ?"
)

# A request's record -> (the binding's table, the welcome to send, if any).
Grant = Callable[[PairingRecord], tuple[Mapping[str, Any], NewOutbound | None]]


class PairingRefused(StoreError):
    """A decision that cannot be made: no such code, decided already, or expired. Nothing
    was written."""


class PairingStore(Protocol):
    """Pairing requests, and the bindings made at run time."""

    async def pairing_request(self, ask: PairingAsk) -> PairingAnswer:
        """What a message from a sender no binding allows comes to (see
        :class:`~geodebot.store.records.PairingAnswer`); the answer's outbox row, if any,
        is durable when this returns."""

    async def pairings(
        self, *, platform: str | None = None, status: PairingStatus | None = None
    ) -> list[PairingRecord]:
        """Requests, newest first; ``status`` as of now (an expired one is "expired")."""

    async def pairing_approve(
        self, platform: str, code: str, *, grant: Grant, by: str
    ) -> tuple[PairingRecord, StoredBinding, OutboxRow | None]:
        """Approve the pending request ``code`` of ``platform``: its binding (``grant``'s
        table, keyed by the request's chat) is stored, replacing one the chat had, and the
        welcome goes in the outbox. Raises :class:`PairingRefused` unless the request is
        pending and unexpired."""

    async def pairing_deny(self, platform: str, code: str, *, by: str) -> PairingRecord:
        """Deny it: its sender gets nothing, and no new code until it would have expired."""

    async def stored_bindings(self) -> list[StoredBinding]:
        """Every binding made at run time, by key."""

    async def stored_bindings_revision(self) -> int:
        """A number every change of the stored bindings raises."""

    async def binding_remove(self, key: str, *, by: str) -> StoredBinding | None:
        """Remove a stored binding; the one removed, or None if there was none."""


def _pairing(row: Row) -> PairingRecord:
    return PairingRecord(
        id=int(row["id"]),
        platform=row["platform"],
        code=row["code"],
        user=row["user_id"],
        user_name=row["user_name"],
        channel=row["channel"],
        thread=row["thread"],
        is_dm=bool(row["is_dm"]),
        first_text=row["first_text"],
        event_id=row["event_id"],
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        noticed_at=float(row["noticed_at"]),
        status=row["status"],
        decided_at=None if row["decided_at"] is None else float(row["decided_at"]),
        decided_by=row["decided_by"],
        binding_key=row["binding_key"],
    )


def _binding(row: Row) -> StoredBinding:
    return StoredBinding(
        key=row["binding_key"],
        platform=row["platform"],
        channel=row["channel"],
        data=json.loads(row["data"]),
        origin=row["origin"],
        created_at=float(row["created_at"]),
        created_by=row["created_by"],
    )


async def _stored(db: Tx, key: str) -> StoredBinding | None:
    row = await db.one(f"SELECT {_BINDING_COLS} FROM stored_bindings WHERE binding_key = ?", (key,))
    return None if row is None else _binding(row)


async def _add_outbox(db: Tx, reply: NewOutbound, now: float) -> OutboxRow:
    return outbox_from_row(await db.one(ADD_OUTBOX, outbound_params(reply, None, now)))


async def _pending(db: Tx, platform: str, code: str, what: str, now: float) -> PairingRecord:
    row = await db.one(
        f"SELECT {_PAIRING_COLS} FROM pairings WHERE platform = ? AND code = ?",
        (platform, code),
        lock=True,
    )
    if row is None:
        raise PairingRefused(f"{what} failed: no request on {platform} has that code")
    found = _pairing(row)
    state = found.state(now)
    if state == "expired":
        raise PairingRefused(f"{what} failed: the code expired; the person may ask again")
    if state != "pending":
        raise PairingRefused(f"{what} failed: it was {state} already (by {found.decided_by})")
    return found


class Pairings:
    async def pairing_request(self: Transactions, ask: PairingAsk) -> PairingAnswer:
        what = f"recording a pairing request on {ask.platform}"

        async def look(db: Tx) -> PairingAnswer | None:
            return await _decide(db, ask, what, writing=False)

        async def write(db: Tx) -> PairingAnswer:
            answer = await _decide(db, ask, what, writing=True)
            assert answer is not None
            return answer

        # Most of a stranger's messages change nothing (a code is out already): a read
        # answers those, and only the rest take the platform's lock and a durable write.
        answer = await self._read(what, look)
        if answer is not None:
            return answer
        return await self._write(what, write, durable=True)

    async def pairings(
        self: Transactions, *, platform: str | None = None, status: PairingStatus | None = None
    ) -> list[PairingRecord]:
        sql = f"SELECT {_PAIRING_COLS} FROM pairings"
        params: tuple[str, ...] = ()
        if platform is not None:
            sql, params = f"{sql} WHERE platform = ?", (platform,)

        async def body(db: Tx) -> tuple[float, list[Row]]:
            return await db.now(), await db.all(f"{sql} ORDER BY id DESC", params)

        now, rows = await self._read("listing pairing requests", body)
        found = [_pairing(row) for row in rows]
        return [p for p in found if status is None or p.state(now) == status]

    async def pairing_approve(
        self: Transactions, platform: str, code: str, *, grant: Grant, by: str
    ) -> tuple[PairingRecord, StoredBinding, OutboxRow | None]:
        what = f"approving pairing code {code!r} on {platform}"

        async def body(db: Tx) -> tuple[PairingRecord, StoredBinding, OutboxRow | None]:
            now = await db.now()
            found = await _pending(db, platform, code, what, now)
            data, welcome = grant(found)
            key = f"{platform}:{found.channel}"
            origin = f"pairing:{found.code}"
            await db.run(
                f"INSERT INTO stored_bindings ({_BINDING_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (binding_key) DO UPDATE SET data = excluded.data, "
                "origin = excluded.origin, created_at = excluded.created_at, "
                "created_by = excluded.created_by",
                (key, platform, found.channel, dumps(dict(data)), origin, now, by),
            )
            await db.run(_BUMP, (now, BINDINGS_CURSOR))
            row = await db.one(
                "UPDATE pairings SET status = 'approved', decided_at = ?, decided_by = ?, "
                f"binding_key = ? WHERE id = ? RETURNING {_PAIRING_COLS}",
                (now, by, key, found.id),
            )
            session = str(data["session"])
            await db.run(ENSURE_SESSION, (session, "daemon", now, now))
            event = {
                "key": key,
                "user": found.user,
                "code": found.code,
                "by": by,
                "tools": list(data.get("tools", ())),
            }
            await db.run(INSERT_EVENT, (session, None, now, "pairing_approved", dumps(event)))
            sent = None if welcome is None else await _add_outbox(db, welcome, now)
            binding = StoredBinding(key, platform, found.channel, data, origin, now, by)
            return _pairing(row), binding, sent

        return await self._write(what, body, durable=True)

    async def pairing_deny(
        self: Transactions, platform: str, code: str, *, by: str
    ) -> PairingRecord:
        what = f"denying pairing code {code!r} on {platform}"

        async def body(db: Tx) -> PairingRecord:
            now = await db.now()
            found = await _pending(db, platform, code, what, now)
            row = await db.one(
                "UPDATE pairings SET status = 'denied', decided_at = ?, decided_by = ? "
                f"WHERE id = ? RETURNING {_PAIRING_COLS}",
                (now, by, found.id),
            )
            return _pairing(row)

        return await self._write(what, body)

    async def stored_bindings(self: Transactions) -> list[StoredBinding]:
        sql = f"SELECT {_BINDING_COLS} FROM stored_bindings ORDER BY binding_key"
        rows = await self._read("listing stored bindings", lambda db: db.all(sql))
        return [_binding(row) for row in rows]

    async def stored_bindings_revision(self: Transactions) -> int:
        sql = "SELECT value FROM cursors WHERE name = ?"
        row = await self._read(
            "reading the stored bindings' revision", lambda db: db.one(sql, (BINDINGS_CURSOR,))
        )
        return 0 if row is None else int(row[0])

    async def binding_remove(self: Transactions, key: str, *, by: str) -> StoredBinding | None:
        async def body(db: Tx) -> StoredBinding | None:
            found = await _stored(db, key)
            if found is None:
                return None
            now = await db.now()
            await db.run("DELETE FROM stored_bindings WHERE binding_key = ?", (key,))
            await db.run(_BUMP, (now, BINDINGS_CURSOR))
            session = found.data.get("session")
            if isinstance(session, str):
                await db.run(ENSURE_SESSION, (session, "daemon", now, now))
                data = dumps({"key": key, "by": by, "origin": found.origin})
                await db.run(INSERT_EVENT, (session, None, now, "binding_removed", data))
            return found

        return await self._write(f"removing stored binding {key!r}", body)


async def _decide(db: Tx, ask: PairingAsk, what: str, *, writing: bool) -> PairingAnswer | None:
    """The answer; None when reading only and the answer writes something."""
    key = f"{ask.platform}:{ask.channel}"
    if writing:
        await db.exclusive(f"pairing:{ask.platform}")
    stored = await _stored(db, key)
    if stored is not None:
        return PairingAnswer("bound", binding=stored)
    now = await db.now()
    # A denied request keeps its sender quiet until it would have expired.
    row = await db.one(
        f"SELECT {_PAIRING_COLS} FROM pairings WHERE platform = ? AND user_id = ? "
        "AND status IN ('pending', 'denied') AND expires_at > ? ORDER BY id DESC",
        (ask.platform, ask.user, now),
    )
    if row is not None:
        mine = _pairing(row)
        if mine.status != "pending" or mine.event_id == ask.event_id:
            return PairingAnswer("quiet", mine)
        if now - mine.noticed_at < ask.notice_every_s:
            return PairingAnswer("quiet", mine)
        if not writing:
            return None
        await db.run("UPDATE pairings SET noticed_at = ? WHERE id = ?", (now, mine.id))
        text = ask.say_waiting(mine.code, mine.expires_at)
        return PairingAnswer("waiting", mine, await _add_outbox(db, _to(ask, text), now))
    waiting = await db.one(
        "SELECT COUNT(*) FROM pairings WHERE platform = ? AND status = 'pending' "
        "AND expires_at > ?",
        (ask.platform, now),
    )
    if int(waiting[0]) >= ask.max_pending:
        return PairingAnswer("full")
    if not writing:
        return None
    return await _new_request(db, ask, now, what)


async def _new_request(db: Tx, ask: PairingAsk, now: float, what: str) -> PairingAnswer:
    expires = now + ask.ttl_s
    inserted = await db.one(
        "INSERT INTO pairings (platform, code, user_id, user_name, channel, thread, is_dm, "
        "first_text, event_id, created_at, expires_at, noticed_at, status) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending') "
        f"ON CONFLICT (platform, code) DO NOTHING RETURNING {_PAIRING_COLS}",
        (
            ask.platform,
            ask.code,
            ask.user,
            ask.user_name,
            ask.channel,
            ask.thread,
            int(ask.is_dm),
            ask.first_text,
            ask.event_id,
            now,
            expires,
            now,
        ),
    )
    if inserted is None:
        raise StoreError(f"{what} failed: that code was given before; ask again")
    text = ask.say_code(ask.code, expires)
    return PairingAnswer("code", _pairing(inserted), await _add_outbox(db, _to(ask, text), now))


def _to(ask: PairingAsk, text: str) -> NewOutbound:
    """An answer to the asking message, in its chat."""
    return NewOutbound(
        session_id=ask.session_id,
        platform=ask.platform,
        channel=ask.channel,
        thread=ask.thread,
        reply_to=ask.message_id,
        text=text,
        kind="notice",
    )
