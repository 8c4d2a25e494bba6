"""Job definitions: the config's ``[[jobs]]`` as store records, and their config checks."""

from __future__ import annotations

import time
from collections.abc import Iterable

from geodebot.config import Config, ConfigError
from geodebot.engine.modes import Mode
from geodebot.engine.tools.plan import allowlist_problems
from geodebot.job_config import JobConfig
from geodebot.scheduler.schedule import Schedule, ScheduleError, ScheduleKind, check_schedule
from geodebot.store.jobs import JobRecord


def schedule_of(job: JobRecord) -> Schedule:
    return Schedule(job.schedule_kind, job.schedule, job.timezone, job.anchor_ms)


def _kind_and_expr(job: JobConfig) -> tuple[ScheduleKind, str]:
    if job.cron is not None:
        return "cron", job.cron
    if job.every is not None:
        return "every", job.every
    assert job.at is not None
    return "at", job.at


def config_job(job: JobConfig, config: Config, *, now: float | None = None) -> JobRecord:
    moment = time.time() if now is None else now
    kind, expr = _kind_and_expr(job)
    return JobRecord(
        id=job.id,
        origin="config",
        schedule_kind=kind,
        schedule=expr,
        timezone=job.timezone or config.daemon.timezone,
        # Interval jobs of the config count from the epoch: the same fire times in every
        # process and across restarts, aligned to the clock ("15m" fires at :00, :15, ...).
        anchor_ms=0,
        prompt=job.prompt,
        deliver_to=job.deliver_to,
        session_id=job.session_id,
        tools=job.tools,
        time_budget_s=job.time_budget_s,
        catch_up=job.catch_up,
        notify_on_failure=job.notify_on_failure,
        creator="",
        paused=False,
        since_ms=int(moment * 1000),
        created_at=moment,
        updated_at=moment,
    )


def config_jobs(config: Config, *, now: float | None = None) -> list[JobRecord]:
    return [config_job(job, config, now=now) for job in config.jobs]


def schedule_problems(config: Config) -> list[str]:
    problems = []
    for index, job in enumerate(config.jobs):
        kind, expr = _kind_and_expr(job)
        try:
            check_schedule(Schedule(kind, expr, job.timezone or config.daemon.timezone))
        except ScheduleError as exc:
            problems.append(f"jobs.{index}.{kind}: {exc}")
    return problems


def check_jobs(config: Config, known_tools: Iterable[str] | None = None) -> None:
    """Schedules that parse, and (given the known tools) tool lists a DAEMON job can have."""
    problems = schedule_problems(config)
    if known_tools is not None:
        known = list(known_tools)
        for index, job in enumerate(config.jobs):
            problems += [
                f"jobs.{index}.tools: {problem}"
                for problem in allowlist_problems(Mode.DAEMON, job.tools, known)
            ]
    if problems:
        raise ConfigError(str(config.source or "<config>"), problems)
