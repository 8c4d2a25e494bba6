"""SQL statements and row conversions of the jobs mixin (see fires.py)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from geodebot.store.records import FireRecord, JobRecord, NewOutbound
from geodebot.store.rows import Row, Tx, dumps

REVISION_CURSOR = "jobs:revision"

JOB_COLS = (
    "id, origin, schedule_kind, schedule, timezone, anchor_ms, prompt, deliver_to, session_id, "
    "tools, time_budget_s, catch_up, notify_on_failure, creator, paused, since_ms, created_at, "
    "updated_at, deliver_binding"
)
FIRE_COLS = (
    "id, job_id, scheduled_ms, cause, outcome, reason, claimed_at, started_at, ended_at, "
    "outbox_id, notice, replica"
)
# The columns of JobRecord.definition(), in its order.
DEFINITION_COLS = (
    "schedule_kind, schedule, timezone, anchor_ms, prompt, deliver_to, session_id, tools, "
    "time_budget_s, catch_up, notify_on_failure, deliver_binding"
)
INSERT_JOB = f"INSERT INTO scheduled_jobs ({JOB_COLS}) VALUES ({', '.join('?' * 19)})"
UPDATE_DEFINITION = """
UPDATE scheduled_jobs SET schedule_kind = ?, schedule = ?, timezone = ?, anchor_ms = ?, prompt = ?,
    deliver_to = ?, session_id = ?, tools = ?, time_budget_s = ?, catch_up = ?,
    notify_on_failure = ?, deliver_binding = ?, since_ms = ?, updated_at = ?
WHERE id = ?
"""
# DO NOTHING + RETURNING yields a row only when this call inserted it: the claim needs no
# second look that another writer could race.
INSERT_FIRE = f"""
INSERT INTO job_fires (job_id, scheduled_ms, cause, outcome, reason, claimed_at, started_at,
    ended_at, outbox_id, notice, replica)
VALUES (?, ?, ?, ?, ?, ?, NULL, ?, NULL, '', ?)
ON CONFLICT (job_id, scheduled_ms) DO NOTHING
RETURNING {FIRE_COLS}
"""
RUNNING_OTHER = (
    "SELECT id FROM job_fires WHERE outcome = 'running' AND job_id = ? AND id <> ? LIMIT 1"
)
SET_REVISION = """
INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)
ON CONFLICT (name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
"""
ADD_OUTBOX = """
INSERT INTO outbox (inbox_id, session_id, platform, channel, thread, reply_to, text, kind,
    status, sent_parts, in_flight, attempts, created_at, updated_at, error, blind_resends)
VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, 'pending', '{}', NULL, 0, ?, ?, '', 0)
RETURNING id
"""
SETTLE_RESULTS = f"""
UPDATE job_fires SET
    outcome = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN 'ok' ELSE 'delivery-failed' END,
    reason = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN reason ELSE (SELECT error FROM outbox WHERE outbox.id = job_fires.outbox_id) END
WHERE outcome = 'delivering'
  AND outbox_id IN (SELECT id FROM outbox WHERE status <> 'pending')
RETURNING {FIRE_COLS}
"""
SETTLE_NOTICES = f"""
UPDATE job_fires SET
    notice = CASE WHEN (SELECT status FROM outbox WHERE outbox.id = job_fires.outbox_id) = 'sent'
        THEN 'delivered' ELSE 'delivery-failed' END
WHERE notice = 'pending'
  AND outbox_id IN (SELECT id FROM outbox WHERE status <> 'pending')
RETURNING {FIRE_COLS}
"""


# A running fire whose replica has not said it is there since ``?`` (store/replicas.py), or
# never did, claimed before ``?``: that replica stopped (or was cut off) during the run. The
# claim's age counts too: a replica may claim its first fire before its first word.
ORPHANED = """
outcome = 'running' AND claimed_at < ?
AND replica NOT IN (SELECT replica_id FROM replicas WHERE seen_at >= ?)
"""

# Polled every second: two index range reads, each joined to outbox rows by primary key.
SETTLEABLE = """
SELECT 1 FROM job_fires JOIN outbox ON outbox.id = job_fires.outbox_id
WHERE job_fires.outcome = 'delivering' AND outbox.status <> 'pending'
UNION ALL
SELECT 1 FROM job_fires JOIN outbox ON outbox.id = job_fires.outbox_id
WHERE job_fires.notice = 'pending' AND outbox.status <> 'pending'
LIMIT 1
"""


def job_from_row(row: Row) -> JobRecord:
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
        deliver_binding=row["deliver_binding"],
    )


def fire_from_row(row: Row) -> FireRecord:
    return FireRecord(**{name: row[name] for name in row.keys()})  # noqa: SIM118  # a Row iterates values


def job_params(job: JobRecord) -> tuple[Any, ...]:
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
        dumps(list(job.tools)) if job.tools else "[]",
        job.time_budget_s,
        job.catch_up,
        int(job.notify_on_failure),
        job.creator,
        int(job.paused),
        job.since_ms,
        job.created_at,
        job.updated_at,
        job.deliver_binding,
    )


def definition_params(job: JobRecord) -> tuple[Any, ...]:
    """``job.definition()`` as its DEFINITION_COLS are stored."""
    return (
        job.schedule_kind,
        job.schedule,
        job.timezone,
        job.anchor_ms,
        job.prompt,
        job.deliver_to,
        job.session_id,
        # Most jobs list no tools: json.dumps with options costs more than the rest together.
        dumps(list(job.tools)) if job.tools else "[]",
        job.time_budget_s,
        job.catch_up,
        int(job.notify_on_failure),
        job.deliver_binding,
    )


def definition_from_stored(stored: tuple[Any, ...]) -> tuple[object, ...]:
    """DEFINITION_COLS as read back, in the form of ``JobRecord.definition()``."""
    (kind, schedule, timezone, anchor_ms, prompt, deliver_to, session_id, tools, budget) = stored[
        :9
    ]
    catch_up, notify, deliver_binding = stored[9:]
    return (
        *(kind, schedule, timezone, anchor_ms, prompt, deliver_to, session_id),
        *(tuple(json.loads(tools)), budget, catch_up, bool(notify), deliver_binding),
    )


async def bump(db: Tx) -> None:
    await db.run(SET_REVISION, (REVISION_CURSOR, uuid.uuid4().hex, time.time()))


async def job_row(db: Tx, job_id: str) -> JobRecord | None:
    row = await db.one(f"SELECT {JOB_COLS} FROM scheduled_jobs WHERE id = ?", (job_id,))
    return None if row is None else job_from_row(row)


async def fire_row(db: Tx, fire_id: int, *, lock: bool = False) -> FireRecord | None:
    row = await db.one(f"SELECT {FIRE_COLS} FROM job_fires WHERE id = ?", (fire_id,), lock=lock)
    return None if row is None else fire_from_row(row)


async def start_or_skip(db: Tx, fire: FireRecord, replica: str) -> tuple[FireRecord, bool]:
    """The fire runs, on ``replica``, unless another fire of its job still runs: then it is
    skipped-overlap."""
    running = await db.one(RUNNING_OTHER, (fire.job_id, fire.id))
    if running is not None:
        sql = (
            "UPDATE job_fires SET outcome = 'skipped-overlap', reason = ?, ended_at = ? "
            f"WHERE id = ? RETURNING {FIRE_COLS}"
        )
        reason = f"fire {running[0]} of this job was still running"
        return fire_from_row(await db.one(sql, (reason, time.time(), fire.id))), False
    sql = (
        f"UPDATE job_fires SET outcome = 'running', replica = ? WHERE id = ? RETURNING {FIRE_COLS}"
    )
    return fire_from_row(await db.one(sql, (replica, fire.id))), True


async def add_outbound(db: Tx, message: NewOutbound, now: float) -> int:
    params = (
        *(message.session_id, message.platform, message.channel, message.thread),
        *(message.reply_to, message.text, message.kind, now, now),
    )
    return int((await db.one(ADD_OUTBOX, params))[0])
