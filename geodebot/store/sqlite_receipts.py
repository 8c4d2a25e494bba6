"""Effect receipts and operator switches of :class:`~geodebot.store.sqlite.SQLiteStore`.

A mixin rather than a second store: the methods run inside the store's own transactions and
lock, and callers keep using the single ``SQLiteStore`` class.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, get_args

import aiosqlite

from geodebot.store.protocol import (
    EffectReceipt,
    FinishStatus,
    OperatorSwitch,
    ReceiptStatus,
    Resolution,
    StoreError,
)
from geodebot.store.sqlite_rows import INSERT_EVENT, dumps, encoding, from_row, paged

__all__ = ["ReceiptsAndSwitches"]

_FINISH_STATUSES: frozenset[str] = frozenset(get_args(FinishStatus))
_RESOLUTIONS: frozenset[str] = frozenset(get_args(Resolution))

_RECEIPT_COLS = (
    "id, key, session_id, turn_id, call_id, tool, effect, arguments_sha256, status, "
    "admitted_at, finished_at, outcome, resolution, resolved_by, resolved_at"
)
_SWITCH_COLS = "name, enabled, set_by, set_at, expires_at, reason"

# DO NOTHING + RETURNING yields a row only when this call inserted it, so "was it mine?" needs
# no second look that another writer could race.
_ADMIT = f"""
INSERT INTO effect_receipts (id, key, session_id, turn_id, call_id, tool, effect,
    arguments_sha256, status, admitted_at, finished_at, outcome)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'admitted', ?, NULL, '{{}}')
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


class _Transactions(Protocol):
    """What the mixin needs from the store: its locked read and write transactions."""

    def _read(self, what: str) -> AbstractAsyncContextManager[aiosqlite.Connection]: ...

    def _write(self, what: str) -> AbstractAsyncContextManager[aiosqlite.Connection]: ...


def _receipts(rows: Any) -> list[EffectReceipt]:
    return [from_row(EffectReceipt, row) for row in rows]


def _switch(row: sqlite3.Row) -> OperatorSwitch:
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


async def _current(db: aiosqlite.Connection, receipt_id: str) -> EffectReceipt | None:
    sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE id = ?"
    rows = list(await db.execute_fetchall(sql, (receipt_id,)))
    return from_row(EffectReceipt, rows[0]) if rows else None


class ReceiptsAndSwitches:
    # -- effect receipts ------------------------------------------------------------------
    async def admit_receipt(
        self: _Transactions, receipt: EffectReceipt
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
        )
        async with self._write(what) as db:
            inserted = list(await db.execute_fetchall(_ADMIT, params))
            if inserted:
                return from_row(EffectReceipt, inserted[0]), True
            sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE key = ?"
            existing = list(await db.execute_fetchall(sql, (receipt.key,)))
        return from_row(EffectReceipt, existing[0]), False

    async def finish_receipt(
        self: _Transactions, receipt_id: str, status: FinishStatus, outcome: Mapping[str, Any]
    ) -> EffectReceipt:
        what = f"finishing receipt {receipt_id!r} as {status!r}"
        if status not in _FINISH_STATUSES:
            raise StoreError(f"{what} failed: status must be one of {sorted(_FINISH_STATUSES)}")
        with encoding(what):
            outcome_json = dumps(dict(outcome))
        async with self._write(what) as db:
            params = (status, outcome_json, time.time(), receipt_id)
            rows = list(await db.execute_fetchall(_FINISH, params))
            if not rows:
                current = await _current(db, receipt_id)
                if current is None:
                    raise StoreError(f"{what} failed: no such receipt")
                raise StoreError(
                    f"{what} failed: it is already {current.status!r}; "
                    "only an admitted receipt can be finished"
                )
        return from_row(EffectReceipt, rows[0])

    async def mark_admitted_uncertain(
        self: _Transactions, reason: str, *, session_id: str | None = None
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
        async with self._write(what) as db:
            rows = await db.execute_fetchall(sql, params)
        # RETURNING has no defined order.
        return sorted(_receipts(rows), key=lambda r: (r.admitted_at, r.id))

    async def get_receipt(self: _Transactions, receipt_id: str) -> EffectReceipt | None:
        async with self._read(f"reading receipt {receipt_id!r}") as db:
            return await _current(db, receipt_id)

    async def find_receipt(self: _Transactions, key: str) -> EffectReceipt | None:
        async with self._read(f"finding the receipt with key {key!r}") as db:
            sql = f"SELECT {_RECEIPT_COLS} FROM effect_receipts WHERE key = ?"
            rows = list(await db.execute_fetchall(sql, (key,)))
        return from_row(EffectReceipt, rows[0]) if rows else None

    async def list_receipts(
        self: _Transactions,
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
        async with self._read("listing receipts") as db:
            rows = await db.execute_fetchall(sql, params)
        return _receipts(rows)

    async def resolve_receipt(
        self: _Transactions, receipt_id: str, resolution: Resolution, *, by: str
    ) -> EffectReceipt:
        what = f"resolving receipt {receipt_id!r} as {resolution!r}"
        if resolution not in _RESOLUTIONS:
            raise StoreError(f"{what} failed: resolution must be one of {sorted(_RESOLUTIONS)}")
        if not by:
            raise StoreError(f"{what} failed: the resolving operator must be named")
        now = time.time()
        async with self._write(what) as db:
            rows = list(await db.execute_fetchall(_RESOLVE, (resolution, by, now, receipt_id)))
            if not rows:
                raise StoreError(f"{what} failed: {await _unresolvable(db, receipt_id)}")
            resolved = from_row(EffectReceipt, rows[0])
            data = dumps({"receipt": receipt_id, "resolution": resolution, "by": by})
            event = (resolved.session_id, resolved.turn_id, now, "receipt_resolved", data)
            await db.execute(INSERT_EVENT, event)
        return resolved

    # -- operator switches ----------------------------------------------------------------
    async def set_switch(
        self: _Transactions,
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
        async with self._write(what) as db:
            await db.execute(_UPSERT_SWITCH, row)
            await db.execute(_INSERT_SWITCH_HISTORY, row)
        return switch

    async def get_switch(self: _Transactions, name: str) -> OperatorSwitch | None:
        async with self._read(f"reading switch {name!r}") as db:
            sql = f"SELECT {_SWITCH_COLS} FROM operator_switches WHERE name = ?"
            rows = list(await db.execute_fetchall(sql, (name,)))
        return _switch(rows[0]) if rows else None

    async def switch_history(
        self: _Transactions, name: str, *, limit: int | None = None
    ) -> list[OperatorSwitch]:
        sql, params = paged(
            f"SELECT {_SWITCH_COLS} FROM operator_switch_history WHERE name = :name "
            "ORDER BY id DESC",
            {"name": name},
            limit,
        )
        async with self._read(f"reading the history of switch {name!r}") as db:
            rows = await db.execute_fetchall(sql, params)
        return [_switch(row) for row in rows]


async def _unresolvable(db: aiosqlite.Connection, receipt_id: str) -> str:
    current = await _current(db, receipt_id)
    if current is None:
        return "no such receipt"
    if current.status != "uncertain":
        return f"it is {current.status!r}; only an uncertain receipt can be resolved"
    return f"it was already resolved as {current.resolution!r} by {current.resolved_by!r}"
