"""Approval requests, a mixin of both stores (see rows.py): asked once, decided once.

A mixin like the receipts': the methods run inside the store's own transactions. Each write
appends its timeline event to the request's session in the same transaction, so the history
of who asked for what, and who decided, cannot disagree with the rows.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from geodebot.store.records import ApprovalRecord, StoreError
from geodebot.store.rows import INSERT_EVENT, Transactions, Tx, dumps, encoding, from_row

__all__ = ["ApprovalStore", "Approvals"]

_COLS = (
    "id, session_id, turn_id, call_id, tool, safety, call_sha256, summary, origin, approvers, "
    "status, created_at, expires_at, decided_by, decided_via, decided_at, card"
)
_SELECT = f"SELECT {_COLS} FROM approval_requests"
# DO NOTHING + RETURNING yields a row only when this call inserted it.
_OPEN = f"""
INSERT INTO approval_requests (id, session_id, turn_id, call_id, tool, safety, call_sha256,
    summary, origin, approvers, status, created_at, expires_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)
ON CONFLICT (session_id, turn_id, call_id) DO NOTHING
RETURNING {_COLS}
"""
# The status and expiry conditions are the guard: of two presses, or a press and the expiry
# sweep, exactly one matches the row.
_DECIDE = f"""
UPDATE approval_requests SET status = ?, decided_by = ?, decided_via = ?, decided_at = ?
WHERE id = ? AND status = 'pending' AND expires_at > ?
RETURNING {_COLS}
"""
_EXPIRE = f"""
UPDATE approval_requests SET status = 'expired', decided_at = ?
WHERE id = ? AND status = 'pending'
RETURNING {_COLS}
"""
VIAS = frozenset({"chat", "console"})


def _event(request: ApprovalRecord, kind: str, now: float) -> tuple[Any, ...]:
    data: dict[str, Any] = {
        "approval": request.id,
        "call": request.call_id,
        "tool": request.tool,
        "call_sha256": request.call_sha256,
        "status": request.status,
    }
    if request.decided_by is not None:
        data.update(by=request.decided_by, via=request.decided_via)
    return (request.session_id, request.turn_id, now, kind, dumps(data))


class ApprovalStore(Protocol):
    """Approval requests and their decisions."""

    async def approval_open(self, request: ApprovalRecord) -> tuple[ApprovalRecord, bool]:
        """Record a fresh ``pending`` request (with an ``approval_requested`` timeline event).

        If the session's turn already asked about the same call, nothing is written and
        ``(existing, False)`` is returned, whatever its status: a resumed turn finds its
        request (and its decision) instead of asking twice. Otherwise ``(stored, True)``.
        """

    async def approval_decide(
        self,
        request_id: str,
        approved: bool,
        *,
        by: str,
        via: str,
        now: float | None = None,
    ) -> tuple[ApprovalRecord | None, bool]:
        """Decide a pending, unexpired request, once: ``(decided, True)`` for the call that
        decided it (with an ``approval_decided`` event). Any other press changes nothing and
        gets ``(current, False)``; one after the expiry first marks the request ``expired``;
        an unknown id gets ``(None, False)``. ``via``: ``chat`` or ``console``."""

    async def approval_expire(
        self, request_id: str, *, now: float | None = None
    ) -> ApprovalRecord | None:
        """Expire a request still pending (its asker stopped waiting), with an
        ``approval_expired`` event; a decided one is returned as it is, an unknown id as None.
        """

    async def approval_card(self, request_id: str, card: dict[str, Any]) -> ApprovalRecord | None:
        """Record where the request's card is (``{"state": "posting"}`` before it is sent, the
        message's address after), whatever the request's status; None for an unknown id."""

    async def get_approval(self, request_id: str) -> ApprovalRecord | None: ...

    async def approvals_pending(self, *, session_id: str | None = None) -> list[ApprovalRecord]:
        """Pending requests (of one session, or all), oldest first."""


class Approvals:
    async def approval_open(
        self: Transactions, request: ApprovalRecord
    ) -> tuple[ApprovalRecord, bool]:
        what = f"opening approval request {request.id!r} for {request.tool}"
        if request.status != "pending" or request.decided_at is not None:
            raise StoreError(f"{what} failed: a new request must be pending and undecided")
        if not request.approvers:
            raise StoreError(f"{what} failed: nobody could decide it (no approvers)")
        with encoding(what):
            approvers = dumps(list(request.approvers))
        params = (
            request.id,
            request.session_id,
            request.turn_id,
            request.call_id,
            request.tool,
            request.safety,
            request.call_sha256,
            request.summary,
            request.origin,
            approvers,
            request.created_at,
            request.expires_at,
        )

        async def open_(db: Tx) -> tuple[ApprovalRecord, bool]:
            row = await db.one(_OPEN, params)
            if row is None:
                existing = await db.one(
                    f"{_SELECT} WHERE session_id = ? AND turn_id = ? AND call_id = ?",
                    (request.session_id, request.turn_id, request.call_id),
                )
                return from_row(ApprovalRecord, existing), False
            opened = from_row(ApprovalRecord, row)
            await db.run(INSERT_EVENT, _event(opened, "approval_requested", opened.created_at))
            return opened, True

        return await self._write(what, open_, durable=True)

    async def approval_decide(
        self: Transactions,
        request_id: str,
        approved: bool,
        *,
        by: str,
        via: str,
        now: float | None = None,
    ) -> tuple[ApprovalRecord | None, bool]:
        what = f"deciding approval request {request_id!r}"
        if not by:
            raise StoreError(f"{what} failed: whoever decides must be named")
        if via not in VIAS:
            raise StoreError(f"{what} failed: via must be one of {sorted(VIAS)}")
        at = time.time() if now is None else now
        status = "approved" if approved else "denied"

        async def decide(db: Tx) -> tuple[ApprovalRecord | None, bool]:
            row = await db.one(_DECIDE, (status, by, via, at, request_id, at))
            if row is not None:
                decided = from_row(ApprovalRecord, row)
                await db.run(INSERT_EVENT, _event(decided, "approval_decided", at))
                return decided, True
            # Decided already, unknown, or still pending only because nobody swept it since
            # its expiry: a late press expires it now.
            current = await _current(db, request_id, lock=True)
            if current is not None and current.status == "pending":
                return await _expire(db, request_id, at), False
            return current, False

        return await self._write(what, decide, durable=True)

    async def approval_expire(
        self: Transactions, request_id: str, *, now: float | None = None
    ) -> ApprovalRecord | None:
        at = time.time() if now is None else now

        async def expire(db: Tx) -> ApprovalRecord | None:
            current = await _current(db, request_id, lock=True)
            if current is None or current.status != "pending":
                return current
            return await _expire(db, request_id, at)

        return await self._write(f"expiring approval request {request_id!r}", expire, durable=True)

    async def approval_card(
        self: Transactions, request_id: str, card: dict[str, Any]
    ) -> ApprovalRecord | None:
        async def place(db: Tx) -> ApprovalRecord | None:
            await db.run(
                "UPDATE approval_requests SET card = ? WHERE id = ?", (dumps(card), request_id)
            )
            return await _current(db, request_id)

        return await self._write(
            f"recording the card of approval request {request_id!r}", place, durable=True
        )

    async def get_approval(self: Transactions, request_id: str) -> ApprovalRecord | None:
        return await self._read(
            f"reading approval request {request_id!r}", lambda db: _current(db, request_id)
        )

    async def approvals_pending(
        self: Transactions, *, session_id: str | None = None
    ) -> list[ApprovalRecord]:
        sql = f"{_SELECT} WHERE status = 'pending'"
        params: tuple[Any, ...] = ()
        if session_id is not None:
            sql, params = f"{sql} AND session_id = ?", (session_id,)

        async def pending(db: Tx) -> list[ApprovalRecord]:
            rows = await db.all(f"{sql} ORDER BY created_at, id", params)
            return [from_row(ApprovalRecord, row) for row in rows]

        return await self._read("listing pending approval requests", pending)


async def _current(db: Tx, request_id: str, *, lock: bool = False) -> ApprovalRecord | None:
    row = await db.one(f"{_SELECT} WHERE id = ?", (request_id,), lock=lock)
    return None if row is None else from_row(ApprovalRecord, row)


async def _expire(db: Tx, request_id: str, at: float) -> ApprovalRecord:
    row = await db.one(_EXPIRE, (at, request_id))
    expired = from_row(ApprovalRecord, row)
    await db.run(INSERT_EVENT, _event(expired, "approval_expired", at))
    return expired
