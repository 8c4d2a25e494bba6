"""Jobs and fire history of :class:`~geodebot.store.sqlite.SQLiteStore` (see store/jobs.py).

A mixin like the chat one: its methods run inside the store's own transactions and lock.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import aiosqlite

from geodebot.store.jobs import FireCause, FireEnd, FireRecord, JobRecord
from geodebot.store.protocol import NewOutbound, StoreError
from geodebot.store.sqlite_rows import dumps

__all__ = ["JobsAndFires"]

REVISION_CURSOR = "jobs:revision"

_JOB_COLS = (
    "id, origin, schedule_kind, schedule, timezone, anchor_ms, prompt, deliver_to, session_id, "
    "tools, time_budget_s, catch_up, notify_on_failure, creator, paused, since_ms, created_at, "
    "updated_at"
)
_FIRE_COLS = (
    "id, job_id, scheduled_ms, cause, outcome, reason, claimed_at, started_at, ended_at, "
    "outbox_id, notice"
)
_INSERT_JOB = f"INSERT INTO scheduled_jobs ({_JOB_COLS}) VALUES ({', '.join('?' * 18)})"
_UPDATE_DEFINITION = """
UPDATE scheduled_jobs SET schedule_kind = ?, schedule = ?, timezone = ?, anchor_ms = ?, prompt = ?,
    deliver_to = ?, session_id = ?, tools = ?, time_budget_s = ?, catch_up = ?,
    notify_on_failure = ?, since_ms = ?, updated_at = ?
WHERE id = ?
"""
# DO NOTHING + RETURNING yields a row only when this call inserted it: the claim needs no
# second look that another writer could race.
_INSERT_FIRE = f"""
INSERT INTO job_fires (job_id, scheduled_ms, cause, outcome, reason, claimed_at, started_at,
    ended_at, outbox_id, notice)
VALUES (?, ?, ?, ?, ?, ?, NULL, ?, NULL, '')
ON CONFLICT (job_id, scheduled_ms) DO NOTHING
RETURNING {_FIRE_COLS}
"""
_RUNNING_OTHER = (
    "SELECT id FROM job_fires WHERE outcome = 'running' AND job_id = ? AND id <> ? LIMIT 1"
)
_SET_REVISION = """
INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
"""
_ADD_OUTBOX = """
INSERT INTO outbox (inbox_id, session_id, platform, channel, thread, reply_to, text, kind,
    status, sent_parts, in_flight, attempts, created_at, updated_at, error, blind_resends)
VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, 'pending', '{}', NULL, 0, ?, ?, '', 0)
RETURNING id
"""
_SETTLE_RESULTS = f"""
UPDATE job_fires SET
    outcome = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN 'ok' ELSE 'delivery-failed' END,
    reason = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN reason ELSE (SELECT error FROM outbox WHERE outbox.id = job_fires.outbox_id) END
WHERE outcome = 'delivering'
  AND outbox_id IN (SELECT id FROM outbox WHERE status <> 'pending')
RETURNING {_FIRE_COLS}
"""
_SETTLE_NOTICES = f"""
UPDATE job_fires SET
    notice = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN 'delivered' ELSE 'delivery-failed' END
WHERE notice = 'pending'
  AND outbox_id IN (SELECT id FROM outbox WHERE status <> 'pending')
RETURNING {_FIRE_COLS}
"""


# Polled every second: two index range reads, each joined to outbox rows by primary key.
_SETTLEABLE = """
SELECT 1 FROM job_fires JOIN outbox ON outbox.id = job_fires.outbox_id
WHERE job_fires.outcome = 'delivering' AND outbox.status <> 'pending'
UNION ALL
SELECT 1 FROM job_fires JOIN outbox ON outbox.id = job_fires.outbox_id
WHERE job_fires.notice = 'pending' AND outbox.status <> 'pending'
LIMIT 1
"""


class _Transactions(Protocol):
    def _read(self, what: str) -> AbstractAsyncContextManager[aiosqlite.Connection]: ...

    def _write(self, what: str) -> AbstractAsyncContextManager[aiosqlite.Connection]: ...


def _job(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        id=row["id"],
        origin=row["origin"],
        schedule_kind=row["schedule_kind"],
        schedule=row["schedule"],
        timezone=row["timezone"],
        anchor_ms=row["anchor_ms"],
        prompt=row["prompt"],
        deliver_to=row["deliver_to"],
        session_id=row["session_id"],
        tools=tuple(json.loads(row["tools"])),
        time_budget_s=row["time_budget_s"],
        catch_up=row["catch_up"],
        notify_on_failure=bool(row["notify_on_failure"]),
        creator=row["creator"],
        paused=bool(row["paused"]),
        since_ms=row["since_ms"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _fire(row: sqlite3.Row) -> FireRecord:
    return FireRecord(**{name: row[name] for name in row.keys()})  # noqa: SIM118


def _job_params(job: JobRecord) -> tuple[Any, ...]:
    return (
        job.id,
        job.origin,
        job.schedule_kind,
        job.schedule,
        job.timezone,
        job.anchor_ms,
        job.prompt,
        job.deliver_to,
        job.session_id,
        dumps(list(job.tools)),
        job.time_budget_s,
        job.catch_up,
        int(job.notify_on_failure),
        job.creator,
        int(job.paused),
        job.since_ms,
        job.created_at,
        job.updated_at,
    )


async def _bump(db: aiosqlite.Connection) -> None:
    await db.execute(_SET_REVISION, (REVISION_CURSOR, uuid.uuid4().hex, time.time()))


async def _job_row(db: aiosqlite.Connection, job_id: str) -> JobRecord | None:
    rows = list(
        await db.execute_fetchall(f"SELECT {_JOB_COLS} FROM scheduled_jobs WHERE id = ?", (job_id,))
    )
    return _job(rows[0]) if rows else None


async def _fire_row(db: aiosqlite.Connection, fire_id: int) -> FireRecord | None:
    sql = f"SELECT {_FIRE_COLS} FROM job_fires WHERE id = ?"
    rows = list(await db.execute_fetchall(sql, (fire_id,)))
    return _fire(rows[0]) if rows else None


async def _start_or_skip(db: aiosqlite.Connection, fire: FireRecord) -> tuple[FireRecord, bool]:
    """The fire runs unless another fire of its job still runs: then it is skipped-overlap."""
    running = list(await db.execute_fetchall(_RUNNING_OTHER, (fire.job_id, fire.id)))
    now = time.time()
    if running:
        sql = (
            "UPDATE job_fires SET outcome = 'skipped-overlap', reason = ?, ended_at = ? "
            f"WHERE id = ? RETURNING {_FIRE_COLS}"
        )
        reason = f"fire {running[0][0]} of this job was still running"
        rows = list(await db.execute_fetchall(sql, (reason, now, fire.id)))
        return _fire(rows[0]), False
    sql = f"UPDATE job_fires SET outcome = 'running' WHERE id = ? RETURNING {_FIRE_COLS}"
    rows = list(await db.execute_fetchall(sql, (fire.id,)))
    return _fire(rows[0]), True


async def _add_outbound(db: aiosqlite.Connection, message: NewOutbound, now: float) -> int:
    params = (
        *(message.session_id, message.platform, message.channel, message.thread),
        *(message.reply_to, message.text, message.kind, now, now),
    )
    rows = list(await db.execute_fetchall(_ADD_OUTBOX, params))
    return int(rows[0][0])


class JobsAndFires:
    # -- definitions ----------------------------------------------------------------------
    async def jobs_sync_config(
        self: _Transactions, jobs: Sequence[JobRecord], *, remove_missing: bool = True
    ) -> bool:
        now = time.time()
        changed = False
        async with self._write("syncing the config's jobs") as db:
            sql = f"SELECT {_JOB_COLS} FROM scheduled_jobs WHERE origin = 'config'"
            current = {row["id"]: _job(row) for row in await db.execute_fetchall(sql)}
            for job in jobs:
                old = current.pop(job.id, None)
                if old is None:
                    taken = await _job_row(db, job.id)
                    if taken is not None:
                        raise StoreError(
                            f"job {job.id!r} of the config clashes with a job made with "
                            f"{taken.origin}; remove one of them"
                        )
                    await db.execute(_INSERT_JOB, _job_params(job))
                    changed = True
                elif old.definition() != job.definition():
                    d = _job_params(job)
                    await db.execute(_UPDATE_DEFINITION, (*d[2:13], job.since_ms, now, job.id))
                    changed = True
            for gone in current if remove_missing else ():
                await db.execute("DELETE FROM scheduled_jobs WHERE id = ?", (gone,))
                changed = True
            if changed:
                await _bump(db)
        return changed

    async def job_add(self: _Transactions, job: JobRecord) -> JobRecord:
        what = f"adding job {job.id!r}"
        async with self._write(what) as db:
            if await _job_row(db, job.id) is not None:
                raise StoreError(f"{what} failed: a job with that id exists")
            await db.execute(_INSERT_JOB, _job_params(job))
            await _bump(db)
        return job

    async def job_remove(self: _Transactions, job_id: str) -> bool:
        async with self._write(f"removing job {job_id!r}") as db:
            rows = list(
                await db.execute_fetchall(
                    "DELETE FROM scheduled_jobs WHERE id = ? RETURNING id", (job_id,)
                )
            )
            if rows:
                await _bump(db)
        return bool(rows)

    async def job_set_paused(
        self: _Transactions, job_id: str, paused: bool, *, since_ms: int
    ) -> JobRecord | None:
        async with self._write(f"pausing job {job_id!r}") as db:
            sql = (
                "UPDATE scheduled_jobs SET paused = ?, updated_at = ?, "
                "since_ms = CASE WHEN ? = 0 THEN ? ELSE since_ms END "
                f"WHERE id = ? RETURNING {_JOB_COLS}"
            )
            params = (int(paused), time.time(), int(paused), since_ms, job_id)
            rows = list(await db.execute_fetchall(sql, params))
            if rows:
                await _bump(db)
        return _job(rows[0]) if rows else None

    async def job_get(self: _Transactions, job_id: str) -> JobRecord | None:
        async with self._read(f"reading job {job_id!r}") as db:
            return await _job_row(db, job_id)

    async def job_list(self: _Transactions) -> list[JobRecord]:
        async with self._read("listing jobs") as db:
            rows = await db.execute_fetchall(f"SELECT {_JOB_COLS} FROM scheduled_jobs ORDER BY id")
        return [_job(row) for row in rows]

    async def jobs_revision(self: _Transactions) -> str:
        async with self._read("reading the jobs revision") as db:
            sql = "SELECT value FROM cursors WHERE name = ?"
            rows = list(await db.execute_fetchall(sql, (REVISION_CURSOR,)))
        return str(rows[0][0]) if rows else ""

    # -- fires ----------------------------------------------------------------------------
    async def fire_claim(
        self: _Transactions, job_id: str, scheduled_ms: int, cause: FireCause
    ) -> tuple[FireRecord, bool]:
        what = f"claiming fire {scheduled_ms} of job {job_id!r}"
        async with self._write(what) as db:
            params = (job_id, scheduled_ms, cause, "requested", "", time.time(), None)
            rows = list(await db.execute_fetchall(_INSERT_FIRE, params))
            if not rows:
                sql = f"SELECT {_FIRE_COLS} FROM job_fires WHERE job_id = ? AND scheduled_ms = ?"
                existing = list(await db.execute_fetchall(sql, (job_id, scheduled_ms)))
                return _fire(existing[0]), False
            return await _start_or_skip(db, _fire(rows[0]))

    async def fire_skip(
        self: _Transactions, job_id: str, scheduled_ms: int, cause: FireCause, reason: str
    ) -> FireRecord | None:
        now = time.time()
        async with self._write(f"recording a missed fire of job {job_id!r}") as db:
            params = (job_id, scheduled_ms, cause, "skipped-missed", reason, now, now)
            rows = list(await db.execute_fetchall(_INSERT_FIRE, params))
        return _fire(rows[0]) if rows else None

    async def fire_request(self: _Transactions, job_id: str, scheduled_ms: int) -> FireRecord:
        what = f"requesting a run of job {job_id!r}"
        async with self._write(what) as db:
            params = (job_id, scheduled_ms, "manual", "requested", "", time.time(), None)
            rows = list(await db.execute_fetchall(_INSERT_FIRE, params))
            if not rows:
                raise StoreError(f"{what} failed: a run at that moment exists; try again")
            await _bump(db)
        return _fire(rows[0])

    async def fires_requested(self: _Transactions) -> list[FireRecord]:
        async with self._read("reading requested runs") as db:
            sql = f"SELECT {_FIRE_COLS} FROM job_fires WHERE outcome = 'requested' ORDER BY id"
            rows = await db.execute_fetchall(sql)
        return [_fire(row) for row in rows]

    async def fire_start_requested(self: _Transactions, fire_id: int) -> tuple[FireRecord, bool]:
        what = f"starting requested run {fire_id}"
        async with self._write(what) as db:
            fire = await _fire_row(db, fire_id)
            if fire is None:
                raise StoreError(f"{what} failed: no such fire")
            if fire.outcome != "requested":
                return fire, False
            return await _start_or_skip(db, fire)

    async def fire_finish(
        self: _Transactions,
        fire_id: int,
        *,
        started_at: float,
        result: NewOutbound | None = None,
        failure: tuple[FireEnd, str] | None = None,
        notice: NewOutbound | None = None,
    ) -> FireRecord:
        what = f"finishing fire {fire_id}"
        if (result is None) == (failure is None):
            raise StoreError(f"{what} failed: give exactly one of result or failure")
        now = time.time()
        async with self._write(what) as db:
            fire = await _fire_row(db, fire_id)
            if fire is None or fire.outcome != "running":
                state = "no such fire" if fire is None else f"it is {fire.outcome!r}"
                raise StoreError(f"{what} failed: {state}")
            message = result if result is not None else notice
            outbox_id = None if message is None else await _add_outbound(db, message, now)
            outcome, reason = ("delivering", "") if failure is None else failure
            notice_status = "pending" if failure is not None and notice is not None else ""
            sql = (
                "UPDATE job_fires SET outcome = ?, reason = ?, started_at = ?, ended_at = ?, "
                f"outbox_id = ?, notice = ? WHERE id = ? RETURNING {_FIRE_COLS}"
            )
            params = (outcome, reason, started_at, now, outbox_id, notice_status, fire_id)
            rows = list(await db.execute_fetchall(sql, params))
        return _fire(rows[0])

    async def fires_settle(self: _Transactions) -> list[FireRecord]:
        async with self._read("looking for fires to settle") as db:
            if not list(await db.execute_fetchall(_SETTLEABLE)):
                return []
        async with self._write("settling fire deliveries") as db:
            rows = list(await db.execute_fetchall(_SETTLE_RESULTS))
            rows += list(await db.execute_fetchall(_SETTLE_NOTICES))
        return [_fire(row) for row in rows]

    async def fires_interrupted(self: _Transactions, reason: str) -> list[FireRecord]:
        async with self._write("sweeping interrupted fires") as db:
            sql = (
                "UPDATE job_fires SET outcome = 'failed', reason = ?, ended_at = ? "
                f"WHERE outcome = 'running' RETURNING {_FIRE_COLS}"
            )
            rows = list(await db.execute_fetchall(sql, (reason, time.time())))
        return sorted((_fire(row) for row in rows), key=lambda fire: fire.id)

    async def fire_history(
        self: _Transactions, job_id: str, *, limit: int | None = None
    ) -> list[FireRecord]:
        sql = f"SELECT {_FIRE_COLS} FROM job_fires WHERE job_id = ? ORDER BY id DESC"
        params: tuple[Any, ...] = (job_id,)
        if limit is not None:
            sql += " LIMIT ?"
            params += (limit,)
        async with self._read(f"reading the history of job {job_id!r}") as db:
            rows = await db.execute_fetchall(sql, params)
        return [_fire(row) for row in rows]

    async def fires_latest(self: _Transactions) -> dict[str, FireRecord]:
        sql = (
            f"SELECT {_FIRE_COLS} FROM job_fires "
            "WHERE id IN (SELECT MAX(id) FROM job_fires GROUP BY job_id)"
        )
        async with self._read("reading the latest fires") as db:
            rows = await db.execute_fetchall(sql)
        return {row["job_id"]: _fire(row) for row in rows}

    async def fires_latest_scheduled(self: _Transactions) -> dict[str, int]:
        sql = (
            "SELECT job_id, MAX(scheduled_ms) FROM job_fires WHERE cause <> 'manual' "
            "GROUP BY job_id"
        )
        async with self._read("reading the last fire of every job") as db:
            rows = await db.execute_fetchall(sql)
        return {str(row[0]): int(row[1]) for row in rows}

    async def fire_latest_scheduled(self: _Transactions, job_id: str) -> int | None:
        sql = "SELECT MAX(scheduled_ms) FROM job_fires WHERE job_id = ? AND cause <> 'manual'"
        async with self._read(f"reading the last fire of job {job_id!r}") as db:
            rows = list(await db.execute_fetchall(sql, (job_id,)))
        return None if rows[0][0] is None else int(rows[0][0])
