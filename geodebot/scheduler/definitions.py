"""Job definitions: the config's ``[[jobs]]`` as store records, and their config checks;
which binding a job posts in; the session a new job gets."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable

from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.config.jobs import JobConfig
from geodebot.config.schema import BindingConfig, Config, ConfigError
from geodebot.engine.modes import Mode
from geodebot.engine.tools.plan import allowlist_problems
from geodebot.scheduler.schedule import (
    CronFields,
    Schedule,
    ScheduleError,
    ScheduleKind,
    check_schedule,
)
from geodebot.store.jobs import JobStore
from geodebot.store.records import JobRecord

log = logging.getLogger(__name__)

# A chat-made job's creator: this and the binding's key.
CHAT_CREATOR = "binding:"


def schedule_of(job: JobRecord) -> Schedule:
    return Schedule(job.schedule_kind, job.schedule, job.timezone, job.anchor_ms)


def chat_creator(binding: BindingConfig) -> str:
    return CHAT_CREATOR + binding_key(binding)


def fresh_session(job_id: str, now: float) -> str:
    """The session of a job made now from chat or with the CLI: ``job:<id>:<stamp>``, a
    creation stamp and a random part. A removed job's session keeps its history; a later
    job with the same id must not continue it (it would read, and post, what the earlier
    job's chat obtained), so no two jobs' lives share a session."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"job:{job_id}:{stamp}-{secrets.token_hex(4)}"


def delivery_binding(job: JobRecord, index: BindingIndex) -> BindingConfig | str:
    """The binding ``job`` posts in (and, made from chat, whose tools bound it), or why
    there is none. By key when the job names one; a row from before keys were recorded
    names a session, which counts only when exactly one binding has it."""
    if job.deliver_binding:
        binding = index.by_key(job.deliver_binding)
        if binding is None:
            return f"deliver_binding {job.deliver_binding!r} is not a binding any more"
        return binding
    owners = index.with_session(job.deliver_to)
    if not owners:
        return f"deliver_to {job.deliver_to!r} is not a binding's session"
    if len(owners) > 1:
        keys = ", ".join(binding_key(b) for b in owners)
        return (
            f"deliver_to {job.deliver_to!r} is a session shared by {keys}, and the job does "
            "not say which of them it posts in; remove it (geodebot jobs remove) and make it "
            "again in its chat, or with --deliver-binding"
        )
    return owners[0]


async def name_delivery_bindings(store: JobStore, index: BindingIndex) -> int:
    """Give every older row that names only a session the key of the one binding of that
    session (a chat job's creator too), so that everything after this goes by key; rows
    whose session several bindings share are left alone, and their fires fail."""
    named = 0
    for job in await store.jobs_without_binding():
        binding = delivery_binding(job, index)
        if isinstance(binding, str):
            log.warning("job %s: %s", job.id, binding)
            continue
        creator = job.creator
        if job.origin == "chat" and creator == CHAT_CREATOR + binding.session:
            creator = chat_creator(binding)
        if await store.job_set_delivery(job.id, binding_key(binding), creator=creator):
            named += 1
    return named


def delivery_key(deliver_to: str, deliver_binding: str | None, index: BindingIndex) -> str:
    """The key an operator's job (config file or CLI) records: the binding it names, else
    the one binding of its session; "" when several share it (the config check and the CLI
    refuse that, and a record made anyway fails its fires)."""
    if deliver_binding is not None:
        return deliver_binding
    owners = index.with_session(deliver_to)
    return binding_key(owners[0]) if len(owners) == 1 else ""


def delivery_problems(
    index: BindingIndex,
    deliver_to: str,
    deliver_binding: str | None,
    *,
    to_label: str,
    binding_label: str,
) -> list[str]:
    """What keeps a job's target from naming one binding, each problem under the label of
    its setting (``jobs.0.deliver_to`` in the file, ``--deliver-to`` on the command line)."""
    if deliver_binding is not None:
        binding = index.by_key(deliver_binding)
        if binding is None:
            return [f"{binding_label}: {deliver_binding!r} is not a binding (platform:channel)"]
        if binding.session != deliver_to:
            return [
                f"{binding_label}: binding {deliver_binding} has the session "
                f"{binding.session!r}, not {deliver_to!r}"
            ]
        return []
    owners = index.with_session(deliver_to)
    if len(owners) > 1:
        keys = ", ".join(binding_key(b) for b in owners)
        setting = binding_label.rsplit(".", 1)[-1]
        return [
            f"{to_label}: the session {deliver_to!r} is shared by {keys}; "
            f"name the one to post in with {setting}"
        ]
    return []


def _kind_and_expr(job: JobConfig) -> tuple[ScheduleKind, str]:
    if job.cron is not None:
        return "cron", job.cron
    if job.every is not None:
        return "every", job.every
    assert job.at is not None
    return "at", job.at


def config_job(
    job: JobConfig, config: Config, bindings: BindingIndex, *, now: float | None = None
) -> JobRecord:
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
        deliver_binding=delivery_key(job.deliver_to, job.deliver_binding, bindings),
    )


def config_jobs(config: Config, *, now: float | None = None) -> list[JobRecord]:
    bindings = BindingIndex(config.bindings)
    # One moment for all: they are synced together.
    moment = time.time() if now is None else now
    return [config_job(job, config, bindings, now=moment) for job in config.jobs]


def schedule_problems(config: Config) -> list[str]:
    """Schedules that do not parse and targets that do not name one binding."""
    problems = []
    bindings = BindingIndex(config.bindings)
    cron = CronFields()
    for index, job in enumerate(config.jobs):
        kind, expr = _kind_and_expr(job)
        try:
            check_schedule(Schedule(kind, expr, job.timezone or config.daemon.timezone), cron)
        except ScheduleError as exc:
            problems.append(f"jobs.{index}.{kind}: {exc}")
        problems += delivery_problems(
            bindings,
            job.deliver_to,
            job.deliver_binding,
            to_label=f"jobs.{index}.deliver_to",
            binding_label=f"jobs.{index}.deliver_binding",
        )
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
