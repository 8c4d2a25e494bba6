"""Token and spend budgets, a mixin of both stores (see rows.py): each model call's row and
the counters of the budgets it is charged to (migration 0011).

A reservation checks every limited counter and, only if the call's worst case fits all of
them, writes the call's row and adds its worst case to every counter, in one transaction:
two calls cannot both take the last of a budget. Settling replaces the worst case by what
the call used, in the same counters. A row left reserved by a crash keeps its worst case.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from geodebot.store.records import (
    ModelCall,
    SpendCharge,
    SpendRefusal,
    StoreError,
    UsageGrouping,
    UsageRow,
)
from geodebot.store.rows import Transactions, Tx, dumps

__all__ = [
    "Spend",
    "SpendStore",
]

_FIELDS = tuple(f.name for f in dataclasses.fields(ModelCall))
_INSERT = (
    f"INSERT INTO model_calls ({', '.join(_FIELDS)}, charges) "
    f"VALUES ({', '.join('?' * len(_FIELDS))}, ?)"
)
_ADD = """
INSERT INTO spend_counters (scope, period, used) VALUES (?, ?, ?)
ON CONFLICT (scope, period) DO UPDATE SET used = spend_counters.used + excluded.used
"""
_USED = "SELECT used FROM spend_counters WHERE scope = ? AND period = ?"
_SETTLE = """
UPDATE model_calls SET state = ?, settled_at = ?, provider = ?, model = ?, input_tokens = ?,
    output_tokens = ?, cache_read_tokens = ?, cache_write_tokens = ?, cost_usd = ?,
    audio_seconds = ?, spoken_chars = ?
WHERE id = ? AND state = 'reserved'
RETURNING reserved_tokens, reserved_usd, charges
"""
_GROUPS: Mapping[str, str] = {
    "all": "'all'",
    "binding": "COALESCE(binding, '(none)')",
    "job": "COALESCE(job, '(none)')",
    "day": "day",
}
_REPORT = """
SELECT {key} AS key, COUNT(*) AS calls,
    SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens),
    SUM(CASE WHEN state = 'reserved' THEN 1 ELSE 0 END),
    SUM(CASE WHEN state = 'reserved' THEN reserved_tokens ELSE 0 END),
    COALESCE(SUM(cost_usd), 0),
    SUM(CASE WHEN cost_usd IS NULL AND state = 'settled' THEN 1 ELSE 0 END),
    SUM(audio_seconds), SUM(spoken_chars)
FROM model_calls {where} GROUP BY 1 ORDER BY 1
"""


def _params(call: ModelCall, charges: Sequence[SpendCharge]) -> tuple[Any, ...]:
    values = tuple(getattr(call, name) for name in _FIELDS)
    return (*values, dumps([[c.scope, c.period, c.unit] for c in charges]))


def _amount(unit: str, tokens: int, usd: float | None) -> float:
    return float(tokens) if unit == "tokens" else float(usd or 0.0)


class SpendStore(Protocol):
    """Token and spend budgets: reservations, settlements and the usage report."""

    async def spend_reserve(
        self, call: ModelCall, charges: Sequence[SpendCharge]
    ) -> SpendRefusal | None:
        """Reserve a model call's worst case (``call``, state ``reserved``: its
        ``reserved_tokens`` and ``reserved_usd``) against every charge, durably and in one
        transaction: the first limited charge it does not fit is returned and nothing is
        written; otherwise the row is written and every charge's counter grows by it."""

    async def spend_record(self, call: ModelCall, charges: Sequence[SpendCharge]) -> None:
        """Write a call that reserved nothing (settled or failed) and count what it used."""

    async def spend_settle(self, settled: ModelCall) -> bool:
        """Settle a reserved call with what it used (``settled``: state ``settled`` or
        ``failed``), moving its charges' counters from its worst case to that. False: the
        row was not reserved (settled already, or unknown), and nothing changed."""

    async def spend_used(self, counters: Sequence[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """What each ``(scope, period)`` counter has used (0 for one never charged)."""

    async def model_calls(
        self, *, session_id: str | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """Newest first."""

    async def usage_report(
        self, *, by: UsageGrouping = "all", since_day: str | None = None
    ) -> list[UsageRow]:
        """Model calls summed per group (``all``, ``binding``, ``job`` or ``day``)."""


class Spend:
    async def spend_reserve(
        self: Transactions, call: ModelCall, charges: Sequence[SpendCharge]
    ) -> SpendRefusal | None:
        if call.state != "reserved":
            raise StoreError(f"reserving model call {call.id!r} failed: it is {call.state}")
        params = _params(call, charges)

        limited = sorted({(c.scope, c.period) for c in charges if c.limit is not None})

        async def reserve(db: Tx) -> SpendRefusal | None:
            # A counter may have no row yet, so the counters are locked by name; in one order,
            # so two reservations sharing counters cannot wait for each other.
            for scope, period in limited:
                await db.exclusive(f"spend:{scope}:{period}")
            for charge in charges:
                needed = _amount(charge.unit, call.reserved_tokens, call.reserved_usd)
                if charge.limit is None:
                    continue
                row = await db.one(_USED, (charge.scope, charge.period))
                used = float(row[0]) if row is not None else 0.0
                if used + needed > charge.limit:
                    return SpendRefusal(charge, used, needed)
            await db.run(_INSERT, params)
            for charge in charges:
                needed = _amount(charge.unit, call.reserved_tokens, call.reserved_usd)
                await db.run(_ADD, (charge.scope, charge.period, needed))
            return None

        # The call that follows spends money outside: its reservation must outlive a crash.
        return await self._write(f"reserving model call {call.id!r}", reserve, durable=True)

    async def spend_record(
        self: Transactions, call: ModelCall, charges: Sequence[SpendCharge]
    ) -> None:
        if call.state == "reserved":
            raise StoreError(f"recording model call {call.id!r} failed: it is not settled")
        params = _params(call, charges)
        tokens = call.input_tokens + call.output_tokens

        async def record(db: Tx) -> None:
            await db.run(_INSERT, params)
            for charge in charges:
                used = _amount(charge.unit, tokens, call.cost_usd)
                await db.run(_ADD, (charge.scope, charge.period, used))

        await self._write(f"recording model call {call.id!r}", record)

    async def spend_settle(self: Transactions, settled: ModelCall) -> bool:
        if settled.state == "reserved":
            raise StoreError(f"settling model call {settled.id!r} failed: it is not settled")
        tokens = settled.input_tokens + settled.output_tokens
        at = settled.settled_at if settled.settled_at is not None else time.time()

        async def settle(db: Tx) -> bool:
            row = await db.one(
                _SETTLE,
                (
                    settled.state,
                    at,
                    settled.provider,
                    settled.model,
                    settled.input_tokens,
                    settled.output_tokens,
                    settled.cache_read_tokens,
                    settled.cache_write_tokens,
                    settled.cost_usd,
                    settled.audio_seconds,
                    settled.spoken_chars,
                    settled.id,
                ),
            )
            if row is None:
                return False  # settled already, or never reserved
            reserved_tokens, reserved_usd, charges = row
            for scope, period, unit in json.loads(charges):
                delta = _amount(unit, tokens, settled.cost_usd) - _amount(
                    unit, reserved_tokens, reserved_usd
                )
                if delta:
                    await db.run(_ADD, (scope, period, delta))
            return True

        return await self._write(f"settling model call {settled.id!r}", settle)

    async def spend_used(
        self: Transactions, counters: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], float]:
        async def read(db: Tx) -> dict[tuple[str, str], float]:
            used: dict[tuple[str, str], float] = {}
            for scope, period in counters:
                row = await db.one(_USED, (scope, period))
                used[(scope, period)] = float(row[0]) if row is not None else 0.0
            return used

        return await self._read("reading budget counters", read)

    async def model_calls(
        self: Transactions, *, session_id: str | None = None, limit: int = 100
    ) -> list[ModelCall]:
        columns = ", ".join(_FIELDS)
        if session_id is None:
            sql, params = (
                f"SELECT {columns} FROM model_calls ORDER BY created_at DESC LIMIT ?",
                (limit,),
            )
        else:
            sql = f"SELECT {columns} FROM model_calls WHERE session_id = ? "
            sql += "ORDER BY created_at DESC LIMIT ?"
            params = (session_id, limit)  # type: ignore[assignment]

        async def read(db: Tx) -> list[ModelCall]:
            rows = await db.tuples(sql, params)
            return [ModelCall(**dict(zip(_FIELDS, row, strict=True))) for row in rows]

        return await self._read("listing model calls", read)

    async def usage_report(
        self: Transactions, *, by: UsageGrouping = "all", since_day: str | None = None
    ) -> list[UsageRow]:
        if by not in _GROUPS:
            raise StoreError(f"usage report failed: cannot group by {by!r}")
        where, params = ("WHERE day >= ?", (since_day,)) if since_day else ("", ())
        sql = _REPORT.format(key=_GROUPS[by], where=where)

        async def read(db: Tx) -> list[UsageRow]:
            return [
                UsageRow(
                    key=str(row[0]),
                    calls=int(row[1]),
                    input_tokens=int(row[2] or 0),
                    output_tokens=int(row[3] or 0),
                    cache_read_tokens=int(row[4] or 0),
                    cache_write_tokens=int(row[5] or 0),
                    unsettled=int(row[6] or 0),
                    unsettled_tokens=int(row[7] or 0),
                    cost_usd=float(row[8] or 0.0),
                    unpriced=int(row[9] or 0),
                    audio_seconds=float(row[10] or 0.0),
                    spoken_chars=int(row[11] or 0),
                )
                for row in await db.tuples(sql, params)
            ]

        return await self._read("reporting model usage", read)
