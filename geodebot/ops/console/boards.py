"""The operator's boards: jobs with their honest history, uncertain effect receipts,
pending approvals with the exact call, and the computer-use switch with its history."""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.engine.session import COMPUTER_USE_SWITCH
from geodebot.ops.console.parts import ConsoleParts
from geodebot.scheduler.definitions import schedule_of
from geodebot.scheduler.schedule import ScheduleError, format_fire, upcoming
from geodebot.scheduler.status import JobLine, job_lines, took_text
from geodebot.store.records import (
    ApprovalRecord,
    EffectReceipt,
    FireRecord,
    OperatorSwitch,
)

HISTORY = 10
NEXT_FIRES = 3
SWITCH_HISTORY = 20


@dataclass(frozen=True, slots=True)
class FireLine:
    fire: FireRecord
    scheduled: str
    took: str


@dataclass(frozen=True, slots=True)
class JobView:
    line: JobLine
    schedule: str
    next_fires: tuple[str, ...]
    history: tuple[FireLine, ...]


async def jobs_view(parts: ConsoleParts) -> list[JobView]:
    now_ms = int(parts.clock() * 1000)
    views = []
    for line in await job_lines(parts.store):
        job = line.job
        try:
            schedule = schedule_of(job)
            described = schedule.describe()
            fires = () if job.paused else upcoming(schedule, max(now_ms, job.since_ms))
        except ScheduleError as exc:
            described, fires = f"invalid schedule: {exc}", ()
        history = await parts.store.fire_history(job.id, limit=HISTORY)
        views.append(
            JobView(
                line,
                described,
                tuple(format_fire(ms, job.timezone) for ms in fires[:NEXT_FIRES]),
                tuple(_fire_line(fire, job.timezone) for fire in history),
            )
        )
    return views


def _fire_line(fire: FireRecord, timezone: str) -> FireLine:
    return FireLine(fire, format_fire(fire.scheduled_ms, timezone), took_text(fire))


async def receipts_view(parts: ConsoleParts) -> list[EffectReceipt]:
    """Receipts whose outcome nobody knows and no operator reconciled yet."""
    return await parts.store.list_receipts(status="uncertain", unresolved_only=True)


async def approvals_view(parts: ConsoleParts) -> list[ApprovalRecord]:
    return await parts.store.approvals_pending()


@dataclass(frozen=True, slots=True)
class OperatorView:
    current: OperatorSwitch | None
    active: bool
    history: list[OperatorSwitch]


async def operator_view(parts: ConsoleParts) -> OperatorView:
    store = parts.store
    current = await store.get_switch(COMPUTER_USE_SWITCH)
    history = await store.switch_history(COMPUTER_USE_SWITCH, limit=SWITCH_HISTORY)
    active = current is not None and current.active(parts.clock())
    return OperatorView(current, active, history)
