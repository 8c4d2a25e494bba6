"""Thread Relay's rows, a mixin of both stores (see rows.py): deliveries with their receipts,
what each session last read of another thread, and the relay's reads of the inbox.

A mixin like the approvals': its writes run in the store's transactions. A delivery writes its
receipt, the target's inbox row and the attributed post, and both sessions' timeline events in
one transaction, after counting the source's deliveries in flight in that same transaction,
which holds the source's relay lock: after a crash either all of it exists or none, and two
concurrent sends cannot both take the last place.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

from geodebot.store.chat import (
    ADD_OUTBOX,
    INBOX_COLS,
    inbox_from_row,
    outbound_params,
    outbox_from_row,
)
from geodebot.store.records import (
    InboxRow,
    NewOutbound,
    OutboxRow,
    RelayDelivery,
    RelayedMessage,
    RelayInFlight,
    RelayRead,
    StoreError,
)
from geodebot.store.rows import (
    ENSURE_SESSION,
    INSERT_EVENT,
    Row,
    Transactions,
    Tx,
    dumps,
    encoding,
    from_row,
)

__all__ = [
    "Relay",
    "RelayStore",
]

_COLS = (
    "id, source_session, target_session, project, user_id AS user, source_turn, idem_key, "
    "intent, mode, state, reason, content_sha256, receipt, created_at, inbox_id, outbox_id, "
    "envelope"
)
_SELECT = f"SELECT {_COLS} FROM relay_deliveries"
_INSERT = """
INSERT INTO relay_deliveries (id, source_session, target_session, project, user_id,
    source_turn, idem_key, intent, mode, state, reason, content_sha256, receipt, inbox_id,
    outbox_id, created_at, envelope)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
# In flight: delivered, and the target has not yet taken it (recorded or answered it, and
# posted it).
_IN_FLIGHT = """
SELECT COUNT(*) FROM relay_deliveries AS d
LEFT JOIN inbox AS i ON i.id = d.inbox_id
LEFT JOIN outbox AS o ON o.id = d.outbox_id
WHERE d.source_session = ? AND d.state = 'delivered'
    AND (i.status IN ('pending', 'running') OR o.status = 'pending')
"""
_ADD_RELAYED = f"""
INSERT INTO inbox (platform, event_id, session_id, channel, thread, user_id, text, message_id,
    received_at, status, attempts, detail, files, relay_id, relay_intent)
VALUES (?, ?, ?, ?, ?, ?, ?, '', ?, 'pending', 0, '', '[]', ?, ?)
RETURNING {INBOX_COLS}
"""
# What changed in a target since a revision, leaving out the messages recorded from the
# source's own notifies (a relayed notify's turn is named after its inbox row).
_FOREIGN_CHANGES = """
SELECT COUNT(*) FROM messages
WHERE session_id = ? AND seq > ? AND turn_id NOT IN (
    SELECT 't-inbox-' || inbox_id FROM relay_deliveries
    WHERE source_session = ? AND target_session = ? AND intent = 'notify'
        AND state = 'delivered'
)
"""
_MARK_READ = """
INSERT INTO relay_reads (source_session, target_session, revision, capability, active_turn,
    adapter, read_at)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (source_session, target_session) DO UPDATE SET revision = excluded.revision,
    capability = excluded.capability, active_turn = excluded.active_turn,
    adapter = excluded.adapter, read_at = excluded.read_at
"""


def _delivery(row: Row) -> RelayDelivery:
    # By hand: from_row would read "state" as the JSON column of sessions.
    return RelayDelivery(
        id=row["id"],
        source_session=row["source_session"],
        target_session=row["target_session"],
        project=row["project"],
        user=row["user"],
        source_turn=row["source_turn"],
        idem_key=row["idem_key"],
        intent=row["intent"],
        mode=row["mode"],
        state=row["state"],
        reason=row["reason"],
        content_sha256=row["content_sha256"],
        receipt=json.loads(row["receipt"]),
        created_at=row["created_at"],
        inbox_id=row["inbox_id"],
        outbox_id=row["outbox_id"],
        envelope=json.loads(row["envelope"]),
    )


def _params(d: RelayDelivery) -> tuple[Any, ...]:
    return (
        d.id,
        d.source_session,
        d.target_session,
        d.project,
        d.user,
        d.source_turn,
        d.idem_key,
        d.intent,
        d.mode,
        d.state,
        d.reason,
        d.content_sha256,
        dumps(dict(d.receipt)),
        d.inbox_id,
        d.outbox_id,
        d.created_at,
        dumps(dict(d.envelope)),
    )


def _event(d: RelayDelivery, counterpart: str) -> dict[str, Any]:
    return {
        "delivery": d.id,
        "thread": counterpart,
        "intent": d.intent,
        "mode": d.mode,
        "state": d.state,
        "reason": d.reason,
        "content_sha256": d.content_sha256,
        "user": d.user,
    }


class RelayStore(Protocol):
    """Thread Relay: deliveries between sessions and what a session read of another."""

    async def relay_deliver(
        self,
        delivery: RelayDelivery,
        post: NewOutbound,
        message: RelayedMessage,
        *,
        max_in_flight: int,
    ) -> tuple[RelayDelivery, bool, OutboxRow | None, InboxRow | None]:
        """Deliver into the target, in one transaction: the receipt (``delivery``, state
        ``delivered``, with its idempotency key), ``message`` as a ``pending`` row of the
        target session's inbox (event id ``relay:<id>``, with the delivery's id and intent),
        ``post`` (the attributed message) in the outbox, and ``relay_sent`` /
        ``relay_received`` events on both sessions' timelines.
        ``(stored, True, post's row, message's row)``, the stored receipt naming both rows.

        A delivery with the same source session and key exists: nothing is written,
        ``(first, False, None, None)``. The source has ``max_in_flight`` deliveries whose
        target has not taken them yet (inbox row unfinished or post unsent): nothing is
        written and :class:`RelayInFlight` is raised.
        """

    async def relay_record(
        self, delivery: RelayDelivery, *, on_target: bool = False
    ) -> RelayDelivery:
        """Record an attempt that was not delivered (keyless), with a ``relay_refused`` event
        on the source session's timeline and, ``on_target``, on the target's too (a thread
        the caller may address; never one it named wrongly or of another project)."""

    async def relay_get(self, delivery_id: str) -> RelayDelivery | None: ...

    async def relay_find(self, source_session: str, idem_key: str) -> RelayDelivery | None: ...

    async def relay_list(
        self, *, session_id: str | None = None, limit: int = 50
    ) -> list[RelayDelivery]:
        """Newest first; with ``session_id``, the ones from or into that session."""

    async def relay_in_flight(self, source_session: str) -> int:
        """The source's deliveries the target has not taken yet (see :meth:`relay_deliver`)."""

    async def relay_mark_read(self, read: RelayRead) -> None:
        """Remember what a session read of another thread (replacing the earlier read)."""

    async def relay_last_read(
        self, source_session: str, target_session: str
    ) -> RelayRead | None: ...

    async def relay_foreign_changes(
        self, source_session: str, target_session: str, since_revision: int
    ) -> int:
        """How many messages ``target_session`` got after ``since_revision`` that are not
        the records of ``source_session``'s own notifies: what its read did not see."""

    async def inbox_authored(self, session_id: str, user: str, text: str) -> InboxRow | None:
        """The newest platform message of ``session_id`` that ``user`` wrote with exactly
        ``text`` (relayed messages are not theirs)."""

    async def inbox_activity(self, session_id: str) -> tuple[InboxRow | None, int]:
        """The session's running row (its active turn), if any, and how many wait."""


class Relay:
    async def relay_deliver(
        self: Transactions,
        delivery: RelayDelivery,
        post: NewOutbound,
        message: RelayedMessage,
        *,
        max_in_flight: int,
    ) -> tuple[RelayDelivery, bool, OutboxRow | None, InboxRow | None]:
        what = f"delivering {delivery.id!r} into {delivery.target_session!r}"
        if delivery.idem_key is None or delivery.state != "delivered":
            raise StoreError(f"{what} failed: a delivery needs its idempotency key")
        with encoding(what):
            _params(delivery)
        now = delivery.created_at

        async def deliver(
            db: Tx,
        ) -> tuple[RelayDelivery, bool, OutboxRow | None, InboxRow | None]:
            await db.exclusive(f"relay:{delivery.source_session}")
            first = await db.one(
                f"{_SELECT} WHERE source_session = ? AND idem_key = ?",
                (delivery.source_session, delivery.idem_key),
            )
            if first is not None:
                return _delivery(first), False, None, None
            in_flight = int((await db.one(_IN_FLIGHT, (delivery.source_session,)))[0])
            if in_flight >= max_in_flight:
                raise RelayInFlight(in_flight)
            inbox = inbox_from_row(
                await db.one(
                    _ADD_RELAYED,
                    (
                        message.platform,
                        f"relay:{delivery.id}",
                        delivery.target_session,
                        message.channel,
                        message.thread,
                        message.user,
                        message.text,
                        now,
                        delivery.id,
                        delivery.intent,
                    ),
                )
            )
            outbox = outbox_from_row(await db.one(ADD_OUTBOX, outbound_params(post, None, now)))
            references = {
                **delivery.receipt.get("references", {}),
                "target_inbox": inbox.id,
                "target_outbox": outbox.id,
            }
            stored = dataclasses.replace(
                delivery,
                inbox_id=inbox.id,
                outbox_id=outbox.id,
                receipt={**delivery.receipt, "references": references},
            )
            await db.run(_INSERT, _params(stored))
            turn = delivery.source_turn
            # The target may never have had a message: its session starts with this one.
            await db.run(ENSURE_SESSION, (delivery.target_session, "daemon", now, now))
            await db.run(
                INSERT_EVENT,
                (
                    delivery.source_session,
                    turn,
                    now,
                    "relay_sent",
                    dumps(_event(stored, delivery.target_session)),
                ),
            )
            await db.run(
                INSERT_EVENT,
                (
                    delivery.target_session,
                    None,
                    now,
                    "relay_received",
                    dumps({**_event(stored, delivery.source_session), "inbox": inbox.id}),
                ),
            )
            return stored, True, outbox, inbox

        return await self._write(what, deliver, durable=True)

    async def relay_record(
        self: Transactions, delivery: RelayDelivery, *, on_target: bool = False
    ) -> RelayDelivery:
        what = f"recording relay attempt {delivery.id!r}"
        if delivery.state == "delivered" or delivery.idem_key is not None:
            raise StoreError(f"{what} failed: only an attempt that was not delivered, keyless")
        with encoding(what):
            params = _params(delivery)

        async def record(db: Tx) -> RelayDelivery:
            await db.run(_INSERT, params)
            at = delivery.created_at
            await db.run(ENSURE_SESSION, (delivery.source_session, "daemon", at, at))
            await db.run(
                INSERT_EVENT,
                (
                    delivery.source_session,
                    delivery.source_turn,
                    at,
                    "relay_refused",
                    dumps(_event(delivery, delivery.target_session)),
                ),
            )
            if on_target:
                await db.run(ENSURE_SESSION, (delivery.target_session, "daemon", at, at))
                await db.run(
                    INSERT_EVENT,
                    (
                        delivery.target_session,
                        None,
                        at,
                        "relay_refused",
                        dumps(_event(delivery, delivery.source_session)),
                    ),
                )
            return delivery

        return await self._write(what, record)

    async def relay_get(self: Transactions, delivery_id: str) -> RelayDelivery | None:
        async def read(db: Tx) -> RelayDelivery | None:
            row = await db.one(f"{_SELECT} WHERE id = ?", (delivery_id,))
            return None if row is None else _delivery(row)

        return await self._read(f"reading relay delivery {delivery_id!r}", read)

    async def relay_find(
        self: Transactions, source_session: str, idem_key: str
    ) -> RelayDelivery | None:
        async def read(db: Tx) -> RelayDelivery | None:
            row = await db.one(
                f"{_SELECT} WHERE source_session = ? AND idem_key = ?",
                (source_session, idem_key),
            )
            return None if row is None else _delivery(row)

        return await self._read("finding a relay delivery by its key", read)

    async def relay_list(
        self: Transactions, *, session_id: str | None = None, limit: int = 50
    ) -> list[RelayDelivery]:
        if session_id is None:
            sql, params = f"{_SELECT} ORDER BY created_at DESC, id DESC LIMIT ?", (limit,)
        else:
            sql = (
                f"{_SELECT} WHERE source_session = ? OR target_session = ? "
                "ORDER BY created_at DESC, id DESC LIMIT ?"
            )
            params = (session_id, session_id, limit)  # type: ignore[assignment]

        async def read(db: Tx) -> list[RelayDelivery]:
            return [_delivery(row) for row in await db.all(sql, params)]

        return await self._read("listing relay deliveries", read)

    async def relay_in_flight(self: Transactions, source_session: str) -> int:
        row = await self._read(
            "counting relay deliveries in flight", lambda db: db.one(_IN_FLIGHT, (source_session,))
        )
        return int(row[0])

    async def relay_mark_read(self: Transactions, read: RelayRead) -> None:
        params = (
            read.source_session,
            read.target_session,
            read.revision,
            read.capability,
            read.active_turn,
            read.adapter,
            read.read_at,
        )
        await self._write("recording a relay read", lambda db: db.run(_MARK_READ, params))

    async def relay_last_read(
        self: Transactions, source_session: str, target_session: str
    ) -> RelayRead | None:
        async def read(db: Tx) -> RelayRead | None:
            row = await db.one(
                "SELECT source_session, target_session, revision, capability, active_turn, "
                "adapter, read_at FROM relay_reads WHERE source_session = ? "
                "AND target_session = ?",
                (source_session, target_session),
            )
            return None if row is None else from_row(RelayRead, row)

        return await self._read("reading a relay read", read)

    async def relay_foreign_changes(
        self: Transactions, source_session: str, target_session: str, since_revision: int
    ) -> int:
        params = (target_session, since_revision, source_session, target_session)
        row = await self._read(
            "counting a thread's changes since a read", lambda db: db.one(_FOREIGN_CHANGES, params)
        )
        return int(row[0])

    async def inbox_authored(
        self: Transactions, session_id: str, user: str, text: str
    ) -> InboxRow | None:
        async def read(db: Tx) -> InboxRow | None:
            row = await db.one(
                f"SELECT {INBOX_COLS} FROM inbox WHERE session_id = ? AND user_id = ? "
                "AND text = ? AND relay_id IS NULL ORDER BY id DESC LIMIT 1",
                (session_id, user, text),
            )
            return None if row is None else inbox_from_row(row)

        return await self._read("finding a message a user wrote", read)

    async def inbox_activity(self: Transactions, session_id: str) -> tuple[InboxRow | None, int]:
        async def read(db: Tx) -> tuple[InboxRow | None, int]:
            running = await db.one(
                f"SELECT {INBOX_COLS} FROM inbox WHERE session_id = ? AND status = 'running' "
                "ORDER BY id LIMIT 1",
                (session_id,),
            )
            queued = (
                await db.one(
                    "SELECT COUNT(*) FROM inbox WHERE session_id = ? AND status = 'pending'",
                    (session_id,),
                )
            )[0]
            return (None if running is None else inbox_from_row(running)), int(queued)

        return await self._read("reading a session's activity", read)
