"""Effect receipts and operator switches: a mixin of both stores (see rows.py).

A mixin rather than a second store: the methods run inside the store's own transactions, and
callers keep using the one store class.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol, get_args

from geodebot.store.records import (
    EffectReceipt,
    FinishStatus,
    OperatorSwitch,
    ReceiptStatus,
    Resolution,
    StoreError,
)
from geodebot.store.rows import (
    INSERT_EVENT,
    Row,
    Transactions,
    Tx,
    dumps,
    encoding,
    from_row,
    paged,
)

__all__ = ["ReceiptStore", "ReceiptsAndSwitches"]

_FINISH_STATUSES: frozenset[str] = frozenset(get_args(FinishStatus))
_RESOLUTIONS: frozenset[str] = frozenset(get_args(Resolution))

_RECEIPT_COLS = (
    "id, key, session_id, turn_id, call_id, tool, effect, arguments_sha256, status, "
    "admitted_at, finished_at, outcome, resolution, resolved_by, resolved_at, approval_id"
)
_SWITCH_COLS = "name, enabled, set_by, set_at, expires_at, reason"
SELECT_SWITCH = f"SELECT {_SWITCH_COLS} FROM operator_switches"

# DO NOTHING + RETURNING yields a row only when this call inserted it, so "was it mine?" needs
# no second look that another writer could race.
_ADMIT = f"""
INSERT INTO effect_receipts (id, key, session_id, turn_id, call_id, tool, effect,
    arguments_sha256, status, admitted_at, finished_at, outcome, approval_id)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'admitted', ?, NULL, '{{}}', ?)
ON CONFLICT (key) DO NOTHING
RETURNING {_RECEIPT_COLS}
"""
# The status condition is the guard: a completion arriving after the startup sweep or after an
# operator's reconciliation matches no row instead of overwriting either.
_FINISH = f"""
UPDATE effect_receipts SET status = ?, outcome = ?, finished_at = ?
WHERE id = ? AND status = 'admitted'
RETURNING {_RECEIPT_COLS}
"""
_RESOLVE = f"""
UPDATE effect_receipts SET resolution = ?, resolved_by = ?, resolved_at = ?
WHERE id = ? AND status = 'uncertain' AND resolution IS NULL
RETURNING {_RECEIPT_COLS}
"""
_UPSERT_SWITCH = f"""
INSERT INTO operator_switches ({_SWITCH_COLS}) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (name) DO UPDATE SET enabled = excluded.enabled, set_by = excluded.set_by,
    set_at = excluded.set_at, expires_at = excluded.expires_at, reason = excluded.reason
"""
_INSERT_SWITCH_HISTORY = (
    f"INSERT INTO operator_switch_history ({_SWITCH_COLS}) VALUES (?, ?, ?, ?, ?, ?)"
)


def _receipts(rows: Any) -> list[EffectReceipt]:
    return [from_row(EffectReceipt, row) for row in rows]


def switch_from_row(row: Row) -> OperatorSwitch:
    return OperatorSwitch(
        name=row["name"],
        enabled=bool(row["enabled"]),
        set_by=row["set_by"],
        set_at=row["set_at"],
        expires_at=row["expires_at"],
        reason=row["reason"],
    )


def _is_fresh(receipt: EffectReceipt) -> bool:
    return (
        receipt.status == "admitted"
        and receipt.finished_at is None
        and not receipt.outcome
        and receipt.resolution is None
        and receipt.resolved_by is None
        and receipt.resolved_at is None
    )


async def _current(db: Tx, receipt_id: str) -> EffectReceipt | None:
    sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE id = ?"
    row = await db.one(sql, (receipt_id,))
    return None if row is None else from_row(EffectReceipt, row)


class ReceiptStore(Protocol):
    """Effect receipts and operator switches."""

    async def admit_receipt(self, receipt: EffectReceipt) -> tuple[EffectReceipt, bool]:
        """Record ``receipt`` as ``admitted`` before its call is dispatched.

        ``receipt`` must be fresh (status ``admitted``, no outcome, not finished or resolved).
        If a receipt with the same ``key`` exists, nothing is written and ``(existing, False)``
        is returned: the call was already admitted once and must not be dispatched again.
        Otherwise ``(stored, True)``. Concurrent admissions of one key admit exactly one.
        """

    async def finish_receipt(
        self, receipt_id: str, status: FinishStatus, outcome: Mapping[str, Any]
    ) -> EffectReceipt:
        """Record how an ``admitted`` receipt ended.

        Raises :class:`StoreError` for an unknown id or a receipt that is no longer
        ``admitted``: a late completion must not overwrite a sweep or an operator's decision.
        """

    async def mark_admitted_uncertain(
        self, reason: str, *, session_id: str | None = None
    ) -> list[EffectReceipt]:
        """Turn every ``admitted`` receipt (of one session, if given) ``uncertain`` with outcome
        ``{"reason": reason}`` and return them in admission order.

        Only safe when none of those calls can still be running, e.g. at daemon startup.
        """

    async def get_receipt(self, receipt_id: str) -> EffectReceipt | None: ...

    async def find_receipt(self, key: str) -> EffectReceipt | None:
        """The receipt with this idempotency key, if any."""

    async def list_receipts(
        self,
        *,
        status: ReceiptStatus | None = None,
        session_id: str | None = None,
        unresolved_only: bool = False,
        limit: int | None = None,
    ) -> list[EffectReceipt]:
        """Receipts in admission order (``admitted_at``, then ``id``).

        ``unresolved_only`` keeps the receipts waiting for an operator: ``uncertain`` and not
        yet resolved.
        """

    async def resolve_receipt(
        self, receipt_id: str, resolution: Resolution, *, by: str
    ) -> EffectReceipt:
        """Record an operator's reconciliation of an ``uncertain`` receipt, once.

        The status stays ``uncertain``; ``resolution``, ``resolved_by`` and ``resolved_at`` are
        set, and a ``receipt_resolved`` timeline event is appended to the receipt's session in
        the same transaction. Raises :class:`StoreError` for any other status or a second
        resolution.
        """

    # -- operator switches ----------------------------------------------------------------
    async def set_switch(
        self,
        name: str,
        enabled: bool,
        *,
        by: str,
        expires_at: float | None = None,
        reason: str = "",
    ) -> OperatorSwitch:
        """Replace the switch's current value and append it to the switch's history."""

    async def get_switch(self, name: str) -> OperatorSwitch | None:
        """The current value, expired or not; use :meth:`OperatorSwitch.active` to decide."""

    async def switch_history(self, name: str, *, limit: int | None = None) -> list[OperatorSwitch]:
        """Every value the switch was set to, newest first."""


class ReceiptsAndSwitches:
    # -- effect receipts ------------------------------------------------------------------
    async def admit_receipt(
        self: Transactions, receipt: EffectReceipt
    ) -> tuple[EffectReceipt, bool]:
        what = f"admission of receipt {receipt.id!r}"
        if not _is_fresh(receipt):
            raise StoreError(f"{what} failed: only a fresh, admitted receipt can be admitted")
        params = (
            receipt.id,
            receipt.key,
            receipt.session_id,
            receipt.turn_id,
            receipt.call_id,
            receipt.tool,
            receipt.effect,
            receipt.arguments_sha256,
            receipt.admitted_at,
            receipt.approval_id,
        )

        async def admit(db: Tx) -> tuple[EffectReceipt, bool]:
            inserted = await db.one(_ADMIT, params)
            if inserted is not None:
                return from_row(EffectReceipt, inserted), True
            sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE key = ?"
            return from_row(EffectReceipt, await db.one(sql, (receipt.key,))), False

        # The tool's effect begins next.
        return await self._write(what, admit, durable=True)

    async def finish_receipt(
        self: Transactions, receipt_id: str, status: FinishStatus, outcome: Mapping[str, Any]
    ) -> EffectReceipt:
        what = f"finishing receipt {receipt_id!r} as {status!r}"
        if status not in _FINISH_STATUSES:
            raise StoreError(f"{what} failed: status must be one of {sorted(_FINISH_STATUSES)}")
        with encoding(what):
            outcome_json = dumps(dict(outcome))

        async def finish(db: Tx) -> EffectReceipt:
            row = await db.one(_FINISH, (status, outcome_json, time.time(), receipt_id))
            if row is None:
                current = await _current(db, receipt_id)
                if current is None:
                    raise StoreError(f"{what} failed: no such receipt")
                raise StoreError(
                    f"{what} failed: it is already {current.status!r}; "
                    "only an admitted receipt can be finished"
                )
            return from_row(EffectReceipt, row)

        return await self._write(what, finish)

    async def mark_admitted_uncertain(
        self: Transactions, reason: str, *, session_id: str | None = None
    ) -> list[EffectReceipt]:
        what = "marking admitted receipts uncertain"
        where, params = "status = 'admitted'", [dumps({"reason": reason}), time.time()]
        if session_id is not None:
            what = f"{what} in session {session_id!r}"
            where += " AND session_id = ?"
            params.append(session_id)
        sql = (
            "UPDATE effect_receipts SET status = 'uncertain', outcome = ?, finished_at = ? "
            f"WHERE {where} RETURNING {_RECEIPT_COLS}"
        )
        rows = await self._write(what, lambda db: db.all(sql, params))
        # RETURNING has no defined order.
        return sorted(_receipts(rows), key=lambda r: (r.admitted_at, r.id))

    async def get_receipt(self: Transactions, receipt_id: str) -> EffectReceipt | None:
        return await self._read(
            f"reading receipt {receipt_id!r}", lambda db: _current(db, receipt_id)
        )

    async def find_receipt(self: Transactions, key: str) -> EffectReceipt | None:
        sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE key = ?"
        row = await self._read(
            f"finding the receipt with key {key!r}", lambda db: db.one(sql, (key,))
        )
        return None if row is None else from_row(EffectReceipt, row)

    async def list_receipts(
        self: Transactions,
        *,
        status: ReceiptStatus | None = None,
        session_id: str | None = None,
        unresolved_only: bool = False,
        limit: int | None = None,
    ) -> list[EffectReceipt]:
        # Conditions are added only when asked for, so each query can use a plain index.
        conditions: list[str] = []
        params: dict[str, Any] = {}
        if status is not None:
            conditions.append("status = :status")
            params["status"] = status
        if session_id is not None:
            conditions.append("session_id = :sid")
            params["sid"] = session_id
        if unresolved_only:
            conditions.append("status = 'uncertain' AND resolution IS NULL")
        where = f"WHERE {' AND '.join(conditions)} " if conditions else ""
        sql, params = paged(
            f"SELECT {_RECEIPT_COLS} FROM effect_receipts {where}ORDER BY admitted_at, id",
            params,
            limit,
        )
        rows = await self._read("listing receipts", lambda db: db.all(sql, params))
        return _receipts(rows)

    async def resolve_receipt(
        self: Transactions, receipt_id: str, resolution: Resolution, *, by: str
    ) -> EffectReceipt:
        what = f"resolving receipt {receipt_id!r} as {resolution!r}"
        if resolution not in _RESOLUTIONS:
            raise StoreError(f"{what} failed: resolution must be one of {sorted(_RESOLUTIONS)}")
        if not by:
            raise StoreError(f"{what} failed: the resolving operator must be named")
        now = time.time()

        async def resolve(db: Tx) -> EffectReceipt:
            row = await db.one(_RESOLVE, (resolution, by, now, receipt_id))
            if row is None:
                raise StoreError(f"{what} failed: {await _unresolvable(db, receipt_id)}")
            resolved = from_row(EffectReceipt, row)
            data = dumps({"receipt": receipt_id, "resolution": resolution, "by": by})
            event = (resolved.session_id, resolved.turn_id, now, "receipt_resolved", data)
            await db.run(INSERT_EVENT, event)
            return resolved

        return await self._write(what, resolve, durable=True)

    # -- operator switches ----------------------------------------------------------------
    async def set_switch(
        self: Transactions,
        name: str,
        enabled: bool,
        *,
        by: str,
        expires_at: float | None = None,
        reason: str = "",
    ) -> OperatorSwitch:
        what = f"setting switch {name!r}"
        if not by:
            raise StoreError(f"{what} failed: the operator setting it must be named")
        switch = OperatorSwitch(name, bool(enabled), by, time.time(), expires_at, reason)
        row = (name, int(switch.enabled), by, switch.set_at, expires_at, reason)

        async def write(db: Tx) -> None:
            await db.run(_UPSERT_SWITCH, row)
            await db.run(_INSERT_SWITCH_HISTORY, row)

        await self._write(what, write, durable=True)
        return switch

    async def get_switch(self: Transactions, name: str) -> OperatorSwitch | None:
        sql = f"{SELECT_SWITCH} WHERE name = ?"
        row = await self._read(f"reading switch {name!r}", lambda db: db.one(sql, (name,)))
        return None if row is None else switch_from_row(row)

    async def switch_history(
        self: Transactions, name: str, *, limit: int | None = None
    ) -> list[OperatorSwitch]:
        sql, params = paged(
            f"SELECT {_SWITCH_COLS} FROM operator_switch_history WHERE name = :name "
            "ORDER BY id DESC",
            {"name": name},
            limit,
        )
        rows = await self._read(
            f"reading the history of switch {name!r}", lambda db: db.all(sql, params)
        )
        return [switch_from_row(row) for row in rows]


async def _unresolvable(db: Tx, receipt_id: str) -> str:
    current = await _current(db, receipt_id)
    if current is None:
        return "no such receipt"
    if current.status != "uncertain":
        return f"it is {current.status!r}; only an uncertain receipt can be resolved"
    return f"it was already resolved as {current.resolution!r} by {current.resolved_by!r}"
