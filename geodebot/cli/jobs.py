"""``geodebot jobs ...``: the operator's view of scheduled jobs, straight on the store.

Works whether or not the daemon runs: every change bumps the store's jobs revision, which a
running daemon polls, so it picks the change up within a second without a restart.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from typing import Any

from pydantic import ValidationError

from geodebot.app.store import opened_store
from geodebot.chat.bindings import BindingIndex
from geodebot.config.jobs import JobConfig
from geodebot.config.schema import Config, ConfigError
from geodebot.engine.modes import Mode
from geodebot.engine.tools.plan import allowlist_problems
from geodebot.scheduler.chat_tools import JOB_TOOL_NAMES
from geodebot.scheduler.definitions import (
    config_jobs,
    delivery_key,
    delivery_problems,
    fresh_session,
    schedule_of,
    schedule_problems,
)
from geodebot.scheduler.schedule import (
    Schedule,
    ScheduleError,
    ScheduleKind,
    check_schedule,
    format_fire,
)
from geodebot.scheduler.schedule import upcoming as upcoming_fires
from geodebot.scheduler.status import job_lines, next_fire_text, took_text
from geodebot.store.protocol import JobStore
from geodebot.store.records import FireRecord, JobRecord

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_jobs_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    jobs = sub.add_parser("jobs", help="scheduled jobs")
    actions = jobs.add_subparsers(dest="action", required=True)
    actions.add_parser("list", parents=[common], help="jobs, next fire and last outcome")
    for action, text in (
        ("show", "one job in full"),
        ("remove", "delete a job made with the CLI or from chat"),
        ("pause", "stop firing until resumed"),
        ("resume", "fire again; fires while paused are not caught up"),
        ("run", "fire now (the daemon runs it, now or when it starts)"),
    ):
        actions.add_parser(action, parents=[common], help=text).add_argument("id")
    history = actions.add_parser("history", parents=[common], help="fires, newest first")
    history.add_argument("id")
    history.add_argument("--limit", type=int, default=20)
    add = actions.add_parser("add", parents=[common], help="add a job to the store")
    add.add_argument("id")
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="5 fields, or 6 with seconds first")
    when.add_argument("--every", help="90s, 15m, 2h, 1d")
    when.add_argument("--at", help="ISO 8601 date and time")
    add.add_argument("--prompt", required=True)
    add.add_argument("--deliver-to", required=True, metavar="SESSION", help="a binding's session")
    add.add_argument(
        "--deliver-binding",
        metavar="PLATFORM:CHANNEL",
        help="the binding to post in, needed when several share the session",
    )
    add.add_argument("--timezone")
    add.add_argument(
        "--session", help='the job\'s session (default: a new "job:<id>:<stamp>" of its own)'
    )
    add.add_argument("--tool", action="append", default=[], dest="tools", metavar="NAME")
    add.add_argument("--time-budget", type=float, metavar="S")
    add.add_argument("--catch-up", choices=["latest", "skip", "all"], default="latest")
    add.add_argument("--no-notify", action="store_true", help="no failure notice in the chat")


async def jobs_command(config: Config, args: argparse.Namespace) -> int:
    problems = schedule_problems(config)
    if problems:
        raise ConfigError(str(config.source or "<config>"), problems)
    async with opened_store(config, create=True) as store:
        # Only the daemon removes config jobs: this CLI may have been given another file.
        await store.jobs_sync_config(config_jobs(config), remove_missing=False)
        if args.action == "list":
            return await _list(store)
        if args.action == "add":
            return await _add(store, config, args)
        job = await store.job_get(args.id)
        if job is None and args.action == "history":
            return await _removed_history(store, args)
        if job is None:
            return _fail(f"no job {args.id!r}")
        handler = {
            "show": _show,
            "remove": _remove,
            "pause": _pause,
            "resume": _pause,
            "run": _run,
            "history": _job_history,
        }[args.action]
        return await handler(store, job, args)


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"geodebot: {message}", file=sys.stderr)
    return code


async def _list(store: JobStore) -> int:
    lines = await job_lines(store)
    print(f"{'JOB':<24} {'ORIGIN':<7} {'SCHEDULE':<28} {'NEXT FIRE':<26} LAST")
    for line in lines:
        job = line.job
        schedule = f"{job.schedule_kind} {job.schedule}"
        print(
            f"{job.id:<24} {job.origin:<7} {schedule:<28} {line.next_fire:<26} {line.last_outcome}"
        )
    return EXIT_OK


def _add_problems(config: Config, index: BindingIndex, args: argparse.Namespace) -> list[str]:
    fields: dict[str, Any] = {
        "id": args.id,
        "cron": args.cron,
        "every": args.every,
        "at": args.at,
        "timezone": args.timezone,
        "prompt": args.prompt,
        "deliver_to": args.deliver_to,
        "deliver_binding": args.deliver_binding,
        "session": args.session,
        "tools": args.tools,
        "time_budget_s": args.time_budget,
        "catch_up": args.catch_up,
        "notify_on_failure": not args.no_notify,
    }
    try:
        job = JobConfig.model_validate(fields)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors()]
    problems = []
    if not index.with_session(job.deliver_to):
        problems.append(f"--deliver-to: {job.deliver_to!r} is not the session of a binding")
    problems += delivery_problems(
        index,
        job.deliver_to,
        job.deliver_binding,
        to_label="--deliver-to",
        binding_label="--deliver-binding",
    )
    # Here, not at the top: the built-in tools bring aiohttp, which only `jobs add` needs.
    from geodebot.engine.tools.builtin import BuiltinSettings, builtin_tools

    known = [spec.name for spec in builtin_tools(BuiltinSettings(config.workspace))]
    problems += [
        f"--tool {p}" for p in allowlist_problems(Mode.DAEMON, job.tools, [*known, *JOB_TOOL_NAMES])
    ]
    return problems


async def _add(store: JobStore, config: Config, args: argparse.Namespace) -> int:
    index = BindingIndex(config.bindings)
    problems = _add_problems(config, index, args)
    kind: ScheduleKind = "cron" if args.cron else "every" if args.every else "at"
    now = time.time()
    timezone = args.timezone or config.daemon.timezone
    schedule = Schedule(kind, getattr(args, kind), timezone, anchor_ms=int(now) * 1000)
    if not problems:
        try:
            check_schedule(schedule)
        except ScheduleError as exc:
            problems.append(f"--{kind}: {exc}")
    if problems:
        for problem in problems:
            print(f"geodebot: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if await store.job_get(args.id) is not None:
        return _fail(f"a job {args.id!r} exists already")
    # Checked above: the session has one binding, or --deliver-binding names it.
    deliver_binding = delivery_key(args.deliver_to, args.deliver_binding, index)
    job = JobRecord(
        id=args.id,
        origin="cli",
        schedule_kind=kind,
        schedule=schedule.expr,
        timezone=timezone,
        anchor_ms=schedule.anchor_ms,
        prompt=args.prompt,
        deliver_to=args.deliver_to,
        session_id=args.session or fresh_session(args.id, now),
        tools=tuple(args.tools),
        time_budget_s=args.time_budget,
        catch_up=args.catch_up,
        notify_on_failure=not args.no_notify,
        creator=f"cli:{getpass.getuser()}",
        paused=False,
        since_ms=int(now * 1000),
        created_at=now,
        updated_at=now,
        deliver_binding=deliver_binding,
    )
    await store.job_add(job)
    fires = [format_fire(ms, timezone) for ms in upcoming_fires(schedule, int(now * 1000))]
    print(f"job {job.id} added: {schedule.describe()}; next fires: {', '.join(fires) or 'none'}")
    return EXIT_OK


async def _show(store: JobStore, job: JobRecord, args: argparse.Namespace) -> int:
    now_ms = int(time.time() * 1000)
    history = await store.fire_history(job.id, limit=1)
    try:
        fires = upcoming_fires(schedule_of(job), max(now_ms, job.since_ms))
    except ScheduleError:
        fires = []
    info = {
        "id": job.id,
        "origin": job.origin,
        "creator": job.creator,
        "schedule": schedule_of(job).describe(),
        "next_fire": next_fire_text(job, now_ms),
        "next_fires": [format_fire(ms, job.timezone) for ms in fires],
        "paused": job.paused,
        "prompt": job.prompt,
        "deliver_to": job.deliver_to,
        "deliver_binding": job.deliver_binding or None,
        "session": job.session_id,
        "tools": list(job.tools),
        "time_budget_s": job.time_budget_s,
        "catch_up": job.catch_up,
        "notify_on_failure": job.notify_on_failure,
        "last": _fire_json(history[0], job) if history else None,
    }
    print(json.dumps(info, indent=2, ensure_ascii=False))
    return EXIT_OK


async def _remove(store: JobStore, job: JobRecord, args: argparse.Namespace) -> int:
    if job.origin == "config":
        return _fail(f"job {job.id} is defined in the config file: remove it there, or pause it")
    await store.job_remove(job.id)
    print(f"job {job.id} removed (its history is kept)")
    return EXIT_OK


async def _pause(store: JobStore, job: JobRecord, args: argparse.Namespace) -> int:
    paused = args.action == "pause"
    await store.job_set_paused(job.id, paused, since_ms=int(time.time() * 1000))
    print(f"job {job.id} {'paused' if paused else 'resumed'}")
    return EXIT_OK


async def _run(store: JobStore, job: JobRecord, args: argparse.Namespace) -> int:
    fire = await store.fire_request(job.id, int(time.time() * 1000))
    print(
        f"run of job {job.id} requested (fire {fire.id}); a running daemon starts it within "
        "a second, otherwise the daemon runs it when it starts"
    )
    return EXIT_OK


def _fire_json(fire: FireRecord, job: JobRecord) -> dict[str, Any]:
    return {
        "fire": fire.id,
        "scheduled": format_fire(fire.scheduled_ms, job.timezone),
        "cause": fire.cause,
        "outcome": fire.outcome,
        "reason": fire.reason,
        "started": _iso(fire.started_at, job),
        "ended": _iso(fire.ended_at, job),
        "notice": fire.notice or None,
    }


def _iso(ts: float | None, job: JobRecord) -> str | None:
    return None if ts is None else format_fire(int(ts * 1000), job.timezone)


async def _removed_history(store: JobStore, args: argparse.Namespace) -> int:
    """A removed job's history is kept; it is shown in UTC, its timezone being gone."""
    if not await store.fire_history(args.id, limit=1):
        return _fail(f"no job {args.id!r}")
    print(f"job {args.id} was removed; its history (times in UTC):")
    return await _history(store, args.id, "UTC", args.limit)


async def _job_history(store: JobStore, job: JobRecord, args: argparse.Namespace) -> int:
    return await _history(store, job.id, job.timezone, args.limit)


async def _history(store: JobStore, job_id: str, timezone: str, limit: int) -> int:
    fires = await store.fire_history(job_id, limit=limit)
    print(f"{'SCHEDULED':<26} {'CAUSE':<9} {'OUTCOME':<16} {'TOOK':>7}  REASON")
    for fire in fires:
        took = took_text(fire)
        outcome: str = fire.outcome
        if fire.notice:
            outcome += "+notice"
        scheduled = format_fire(fire.scheduled_ms, timezone)
        print(f"{scheduled:<26} {fire.cause:<9} {outcome:<16} {took:>7}  {fire.reason}")
    return EXIT_OK
