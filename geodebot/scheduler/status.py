"""Each job's next fire time and last outcome, for /status in chat and ``geodebot jobs list``."""

from __future__ import annotations

import time
from dataclasses import dataclass

from geodebot.scheduler.definitions import schedule_of
from geodebot.scheduler.schedule import ScheduleError, format_fire, next_fire
from geodebot.store.jobs import JobStore
from geodebot.store.records import FireRecord, JobRecord


@dataclass(frozen=True, slots=True)
class JobLine:
    job: JobRecord
    next_fire: str  # ISO time in the job's timezone, "paused" or "none"
    last: FireRecord | None

    @property
    def last_outcome(self) -> str:
        if self.last is None:
            return "never fired"
        outcome: str = self.last.outcome
        if self.last.notice:
            outcome += f" (notice {self.last.notice})"
        return f"{outcome} at {format_fire(self.last.scheduled_ms, self.job.timezone)}"


def took_text(fire: FireRecord) -> str:
    """How long a fire's run took, "-" while it has not ended. A run on a fast model ends in
    milliseconds, which a tenth of a second would show as 0."""
    if fire.started_at is None or fire.ended_at is None:
        return "-"
    took = max(0.0, fire.ended_at - fire.started_at)
    return f"{took * 1000:.0f} ms" if took < 1 else f"{took:.1f} s"


def next_fire_text(job: JobRecord, now_ms: int) -> str:
    if job.paused:
        return "paused"
    try:
        upcoming = next_fire(schedule_of(job), max(now_ms, job.since_ms))
    except ScheduleError as exc:
        return f"invalid schedule: {exc}"
    return "none" if upcoming is None else format_fire(upcoming, job.timezone)


async def job_lines(store: JobStore, *, binding: str | None = None) -> list[JobLine]:
    """Every job's line, or those of the jobs posting in the binding with key ``binding``."""
    now_ms = int(time.time() * 1000)
    latest = await store.fires_latest()
    return [
        JobLine(job, next_fire_text(job, now_ms), latest.get(job.id))
        for job in await store.job_list()
        if binding is None or job.deliver_binding == binding
    ]


class JobStatus:
    def __init__(self, store: JobStore) -> None:
        self._store = store

    async def for_binding(self, key: str) -> str:
        """The /status lines of the jobs posting in a binding's chat, given by its key
        (``platform:channel``), not by its session, which other chats may share; "" when
        there are none. A row that names no binding is shown in no chat: the daemon names
        the binding of older rows when it starts, unless several bindings share their
        session (and then their fires fail)."""
        lines = await job_lines(self._store, binding=key)
        if not lines:
            return ""
        rows = [
            f"- {line.job.id}: next {line.next_fire}; last {line.last_outcome}" for line in lines
        ]
        return "Jobs posting here:\n" + "\n".join(rows)
