"""Jobs and fire history (see store/jobs.py): a mixin of both stores (see rows.py).

A mixin like the chat one: each method is one function the store runs, inside one transaction
when it writes. Commits that something acts on next (a run, a send,
an operator's order) are durable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from geodebot.store.fires_sql import (
    DEFINITION_COLS,
    FIRE_COLS,
    INSERT_FIRE,
    INSERT_JOB,
    JOB_COLS,
    ORPHANED,
    REVISION_CURSOR,
    SETTLE_NOTICES,
    SETTLE_RESULTS,
    SETTLEABLE,
    UPDATE_DEFINITION,
    add_outbound,
    bump,
    definition_from_stored,
    definition_params,
    fire_from_row,
    fire_row,
    job_from_row,
    job_params,
    job_row,
    start_or_skip,
)
from geodebot.store.records import (
    FireCause,
    FireEnd,
    FireRecord,
    JobRecord,
    NewOutbound,
    StoreError,
)
from geodebot.store.rows import Transactions, Tx

__all__ = ["JobsAndFires"]

FIRE_AT = f"SELECT {FIRE_COLS} FROM job_fires WHERE job_id = ? AND scheduled_ms = ?"
# Read in the claim's transaction: a pause committed before it stops the fire, even when the
# scheduler has not yet seen the pause (it reloads jobs at its next store poll).
PAUSED = "SELECT paused FROM scheduled_jobs WHERE id = ?"


class JobsAndFires:
    # -- definitions ----------------------------------------------------------------------
    async def jobs_sync_config(
        self: Transactions, jobs: Sequence[JobRecord], *, remove_missing: bool = True
    ) -> bool:
        now = time.time()
        # Encoded before the transaction, like every payload; one stored form per job.
        wanted = [(job, definition_params(job)) for job in jobs]

        async def sync(db: Tx) -> bool:
            # Two processes starting at once sync one after the other: the second finds the
            # first's rows instead of inserting them again.
            await db.exclusive("jobs:config")
            # One read of every row's definition as stored, in plain tuples: a daemon with
            # 10,000 config jobs syncs them at every start, and most are unchanged.
            sql = f"SELECT id, origin, {DEFINITION_COLS} FROM scheduled_jobs"
            stored = {row[0]: row[1:] for row in await db.tuples(sql)}
            config = {job_id for job_id, row in stored.items() if row[0] == "config"}
            new: list[tuple[Any, ...]] = []
            updates: list[tuple[Any, ...]] = []
            for job, params in wanted:
                row = stored.get(job.id)
                if row is None:
                    new.append(job_params(job))
                elif row[0] != "config":
                    raise StoreError(
                        f"job {job.id!r} of the config clashes with a job made with "
                        f"{row[0]}; remove one of them"
                    )
                elif row[1:] != params and definition_from_stored(row[1:]) != job.definition():
                    # Decoded before deciding: a tools list stored in another JSON spelling
                    # is the same definition, and a changed one forgoes the fires it owes.
                    updates.append((*params, job.since_ms, now, job.id))
                config.discard(job.id)
            await db.many(INSERT_JOB, new)
            await db.many(UPDATE_DEFINITION, updates)
            gone = [(job_id,) for job_id in config] if remove_missing else []
            await db.many("DELETE FROM scheduled_jobs WHERE id = ?", gone)
            changed = bool(new or updates or gone)
            if changed:
                await bump(db)
            return changed

        return await self._write("syncing the config's jobs", sync)

    async def job_add(self: Transactions, job: JobRecord) -> JobRecord:
        what = f"adding job {job.id!r}"

        async def add(db: Tx) -> JobRecord:
            if await job_row(db, job.id) is not None:
                raise StoreError(f"{what} failed: a job with that id exists")
            await db.run(INSERT_JOB, job_params(job))
            await bump(db)
            return job

        return await self._write(what, add, durable=True)

    async def job_remove(self: Transactions, job_id: str) -> bool:
        async def remove(db: Tx) -> bool:
            sql = "DELETE FROM scheduled_jobs WHERE id = ? RETURNING id"
            removed = await db.one(sql, (job_id,)) is not None
            if removed:
                await bump(db)
            return removed

        return await self._write(f"removing job {job_id!r}", remove, durable=True)

    async def job_set_delivery(
        self: Transactions, job_id: str, deliver_binding: str, *, creator: str
    ) -> bool:
        async def name(db: Tx) -> bool:
            sql = (
                "UPDATE scheduled_jobs SET deliver_binding = ?, creator = ?, updated_at = ? "
                "WHERE id = ? AND deliver_binding = '' RETURNING id"
            )
            params = (deliver_binding, creator, time.time(), job_id)
            named = await db.one(sql, params) is not None
            if named:
                await bump(db)
            return named

        return await self._write(f"naming the binding of job {job_id!r}", name, durable=True)

    async def job_set_paused(
        self: Transactions, job_id: str, paused: bool, *, since_ms: int
    ) -> JobRecord | None:
        async def pause(db: Tx) -> JobRecord | None:
            sql = (
                "UPDATE scheduled_jobs SET paused = ?, updated_at = ?, "
                "since_ms = CASE WHEN ? = 0 THEN ? ELSE since_ms END "
                f"WHERE id = ? RETURNING {JOB_COLS}"
            )
            params = (int(paused), time.time(), int(paused), since_ms, job_id)
            row = await db.one(sql, params)
            if row is None:
                return None
            await bump(db)
            return job_from_row(row)

        return await self._write(f"pausing job {job_id!r}", pause, durable=True)

    async def job_get(self: Transactions, job_id: str) -> JobRecord | None:
        return await self._read(f"reading job {job_id!r}", lambda db: job_row(db, job_id))

    async def job_list(self: Transactions) -> list[JobRecord]:
        sql = f"SELECT {JOB_COLS} FROM scheduled_jobs ORDER BY id"
        rows = await self._read("listing jobs", lambda db: db.all(sql))
        return [job_from_row(row) for row in rows]

    async def jobs_without_binding(self: Transactions) -> list[JobRecord]:
        sql = f"SELECT {JOB_COLS} FROM scheduled_jobs WHERE deliver_binding = '' ORDER BY id"
        rows = await self._read("listing jobs without a binding", lambda db: db.all(sql))
        return [job_from_row(row) for row in rows]

    async def jobs_revision(self: Transactions) -> str:
        async def read(db: Tx) -> str:
            sql = "SELECT value FROM cursors WHERE name = ?"
            row = await db.one(sql, (REVISION_CURSOR,))
            return "" if row is None else str(row[0])

        return await self._read("reading the jobs revision", read)

    # -- fires ----------------------------------------------------------------------------
    async def fire_claim(
        self: Transactions, job_id: str, scheduled_ms: int, cause: FireCause, *, replica: str = ""
    ) -> tuple[FireRecord | None, bool]:
        async def claim(db: Tx) -> tuple[FireRecord | None, bool]:
            paused = await db.one(PAUSED, (job_id,), lock=True)
            if paused is not None and paused[0]:
                return None, False
            params = (job_id, scheduled_ms, cause, "requested", "", time.time(), None, "")
            row = await db.one(INSERT_FIRE, params)
            if row is None:
                return fire_from_row(await db.one(FIRE_AT, (job_id, scheduled_ms))), False
            return await start_or_skip(db, fire_from_row(row), replica)

        # The run starts next: the claim must survive anything that happens during it.
        what = f"claiming fire {scheduled_ms} of job {job_id!r}"
        return await self._write(what, claim, durable=True)

    async def fire_skip(
        self: Transactions, job_id: str, scheduled_ms: int, cause: FireCause, reason: str
    ) -> FireRecord | None:
        async def skip(db: Tx) -> FireRecord | None:
            now = time.time()
            params = (job_id, scheduled_ms, cause, "skipped-missed", reason, now, now, "")
            row = await db.one(INSERT_FIRE, params)
            return None if row is None else fire_from_row(row)

        return await self._write(f"recording a missed fire of job {job_id!r}", skip)

    async def fire_request(self: Transactions, job_id: str, scheduled_ms: int) -> FireRecord:
        what = f"requesting a run of job {job_id!r}"

        async def request(db: Tx) -> FireRecord:
            params = (job_id, scheduled_ms, "manual", "requested", "", time.time(), None, "")
            row = await db.one(INSERT_FIRE, params)
            if row is None:
                raise StoreError(f"{what} failed: a run at that moment exists; try again")
            await bump(db)
            return fire_from_row(row)

        return await self._write(what, request, durable=True)

    async def fires_requested(self: Transactions) -> list[FireRecord]:
        sql = f"SELECT {FIRE_COLS} FROM job_fires WHERE outcome = 'requested' ORDER BY id"
        rows = await self._read("reading requested runs", lambda db: db.all(sql))
        return [fire_from_row(row) for row in rows]

    async def fire_start_requested(
        self: Transactions, fire_id: int, *, replica: str = ""
    ) -> tuple[FireRecord, bool]:
        what = f"starting requested run {fire_id}"

        async def start(db: Tx) -> tuple[FireRecord, bool]:
            fire = await fire_row(db, fire_id, lock=True)
            if fire is None:
                raise StoreError(f"{what} failed: no such fire")
            if fire.outcome != "requested":
                return fire, False
            await db.one(PAUSED, (fire.job_id,), lock=True)  # as a claim of the job does
            return await start_or_skip(db, fire, replica)

        return await self._write(what, start, durable=True)

    async def fire_at(self: Transactions, job_id: str, scheduled_ms: int) -> FireRecord | None:
        async def read(db: Tx) -> FireRecord | None:
            row = await db.one(FIRE_AT, (job_id, scheduled_ms))
            return None if row is None else fire_from_row(row)

        return await self._read(f"reading fire {scheduled_ms} of job {job_id!r}", read)

    async def fire_finish(
        self: Transactions,
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

        async def finish(db: Tx) -> FireRecord:
            now = time.time()
            fire = await fire_row(db, fire_id, lock=True)
            if fire is None or fire.outcome != "running":
                state = "no such fire" if fire is None else f"it is {fire.outcome!r}"
                raise StoreError(f"{what} failed: {state}")
            message = result if result is not None else notice
            outbox_id = None if message is None else await add_outbound(db, message, now)
            outcome, reason = ("delivering", "") if failure is None else failure
            notice_status = "pending" if failure is not None and notice is not None else ""
            sql = (
                "UPDATE job_fires SET outcome = ?, reason = ?, started_at = ?, ended_at = ?, "
                f"outbox_id = ?, notice = ? WHERE id = ? RETURNING {FIRE_COLS}"
            )
            params = (outcome, reason, started_at, now, outbox_id, notice_status, fire_id)
            return fire_from_row(await db.one(sql, params))

        # The outbox sends the message next.
        return await self._write(what, finish, durable=True)

    async def fires_settle(self: Transactions) -> list[FireRecord]:
        if await self._read("looking for fires to settle", lambda db: db.one(SETTLEABLE)) is None:
            return []

        async def settle(db: Tx) -> list[FireRecord]:
            rows = await db.all(SETTLE_RESULTS)
            rows += await db.all(SETTLE_NOTICES)
            return [fire_from_row(row) for row in rows]

        return await self._write("settling fire deliveries", settle)

    async def fires_interrupted(
        self: Transactions, reason: str, *, replica: str | None = None
    ) -> list[FireRecord]:
        async def sweep(db: Tx) -> list[FireRecord]:
            sql = "UPDATE job_fires SET outcome = 'failed', reason = ?, ended_at = ? "
            params: tuple[Any, ...] = (reason, time.time())
            if replica is None:
                sql += "WHERE outcome = 'running' "
            else:
                sql += "WHERE outcome = 'running' AND replica = ? "
                params += (replica,)
            rows = await db.all(sql + f"RETURNING {FIRE_COLS}", params)
            return sorted((fire_from_row(row) for row in rows), key=lambda fire: fire.id)

        return await self._write("sweeping interrupted fires", sweep)

    async def fires_orphaned(
        self: Transactions, reason: str, *, silent_s: float
    ) -> list[FireRecord]:
        async def look(db: Tx) -> bool:
            since = await db.now() - silent_s
            sql = f"SELECT 1 FROM job_fires WHERE {ORPHANED} LIMIT 1"
            return await db.one(sql, (since, since)) is not None

        # Polled by every replica's scheduler: a read, and a write only when there is work.
        if not await self._read("looking for fires of silent replicas", look):
            return []

        async def sweep(db: Tx) -> list[FireRecord]:
            since = await db.now() - silent_s
            sql = (
                "UPDATE job_fires SET outcome = 'failed', reason = ?, ended_at = ? "
                f"WHERE {ORPHANED} RETURNING {FIRE_COLS}"
            )
            params = (reason, time.time(), since, since)
            rows = await db.all(sql, params)
            return sorted((fire_from_row(row) for row in rows), key=lambda fire: fire.id)

        return await self._write("sweeping the fires of silent replicas", sweep)

    async def fire_history(
        self: Transactions, job_id: str, *, limit: int | None = None
    ) -> list[FireRecord]:
        sql = f"SELECT {FIRE_COLS} FROM job_fires WHERE job_id = ? ORDER BY id DESC"
        params: tuple[Any, ...] = (job_id,)
        if limit is not None:
            sql += " LIMIT ?"
            params += (limit,)
        rows = await self._read(
            f"reading the history of job {job_id!r}", lambda db: db.all(sql, params)
        )
        return [fire_from_row(row) for row in rows]

    async def fires_latest(self: Transactions) -> dict[str, FireRecord]:
        sql = (
            f"SELECT {FIRE_COLS} FROM job_fires "
            "WHERE id IN (SELECT MAX(id) FROM job_fires GROUP BY job_id)"
        )
        rows = await self._read("reading the latest fires", lambda db: db.all(sql))
        return {row["job_id"]: fire_from_row(row) for row in rows}

    async def fire_counts(self: Transactions) -> dict[str, int]:
        sql = "SELECT outcome, COUNT(*) FROM job_fires GROUP BY outcome"
        rows = await self._read("counting fires", lambda db: db.all(sql))
        return {str(row[0]): int(row[1]) for row in rows}

    async def fires_latest_scheduled(self: Transactions) -> dict[str, int]:
        sql = (
            "SELECT job_id, MAX(scheduled_ms) FROM job_fires WHERE cause <> 'manual' "
            "GROUP BY job_id"
        )
        rows = await self._read("reading the last fire of every job", lambda db: db.all(sql))
        return {str(row[0]): int(row[1]) for row in rows}

    async def fire_latest_scheduled(self: Transactions, job_id: str) -> int | None:
        sql = "SELECT MAX(scheduled_ms) FROM job_fires WHERE job_id = ? AND cause <> 'manual'"

        async def read(db: Tx) -> int | None:
            value = (await db.one(sql, (job_id,)))[0]
            return None if value is None else int(value)

        return await self._read(f"reading the last fire of job {job_id!r}", read)
