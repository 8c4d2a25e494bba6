"""Chat tools for jobs: ``schedule_job``, ``list_jobs``, ``cancel_job``.

They act for the binding the chat message came through: the router puts its key in the
session spec's ``origin``, which every tool call's context carries. Never the session's
binding: several bindings may share a session, and each has its own tools. A job made from
chat records that binding (by key) as its target and its creator, can have only tools the
binding has, gets a session of its own, and is listed and cancelled from that binding only
(the operator can remove any with the CLI). A call without an origin (a job's own turn, a
terminal, a headless run) gets a tool error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from geodebot.chat.bindings import BindingIndex, binding_key, calling_binding
from geodebot.config.jobs import JOB_ID_PATTERN
from geodebot.config.schema import BindingConfig
from geodebot.engine.tools.spec import Effect, Safety, ToolCallContext, ToolError, ToolSpec
from geodebot.scheduler.definitions import chat_creator, fresh_session
from geodebot.scheduler.schedule import (
    Schedule,
    ScheduleError,
    ScheduleKind,
    check_schedule,
    format_fire,
    upcoming,
    zone,
)
from geodebot.store.jobs import JobStore
from geodebot.store.records import JobRecord, StoreError

SCHEDULE_JOB, LIST_JOBS, CANCEL_JOB = "schedule_job", "list_jobs", "cancel_job"
JOB_TOOL_NAMES = (SCHEDULE_JOB, LIST_JOBS, CANCEL_JOB)


_SCHEDULE_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": JOB_ID_PATTERN},
        "cron": {
            "type": "string",
            "maxLength": 200,
            "description": "5 fields (minute hour day month weekday), or 6 with seconds first",
        },
        "every": {"type": "string", "maxLength": 16, "description": "e.g. 90s, 15m, 2h, 1d"},
        "at": {"type": "string", "maxLength": 64, "description": "ISO 8601 date and time"},
        "timezone": {"type": "string", "maxLength": 64, "description": "IANA name"},
        "prompt": {"type": "string", "minLength": 1, "maxLength": 8000},
        "tools": {"type": "array", "items": {"type": "string", "maxLength": 128}},
        "time_budget_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
        "catch_up": {"enum": ["latest", "skip", "all"]},
    },
    "required": ["id", "prompt"],
    "additionalProperties": False,
}


class JobTools:
    def __init__(
        self,
        store: JobStore,
        bindings: BindingIndex | Sequence[BindingConfig],
        *,
        default_timezone: str,
    ) -> None:
        self._store = store
        self._index = BindingIndex.of(bindings)
        self._timezone = default_timezone

    def specs(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name=SCHEDULE_JOB,
                description=(
                    "Schedule a job that runs a prompt later and posts the answer in this chat. "
                    "Give exactly one of cron, every or at; turn natural-language times into "
                    "one of them. Answers with the parsed schedule and the next three fire times."
                ),
                input_schema=_SCHEDULE_SCHEMA,
                safety=Safety.WRITE,
                effect=Effect.ADMINISTRATIVE,
                handler=self._schedule,
                resource_keys=("jobs",),
                timeout_s=10.0,
            ),
            ToolSpec(
                name=LIST_JOBS,
                description="The jobs that post in this chat, with their next fire times.",
                input_schema={"type": "object", "properties": {}, "additionalProperties": False},
                safety=Safety.READ,
                effect=Effect.NONE,
                handler=self._list,
                timeout_s=10.0,
            ),
            ToolSpec(
                name=CANCEL_JOB,
                description="Cancel a job that was scheduled from this chat.",
                input_schema={
                    "type": "object",
                    "properties": {"id": {"type": "string", "maxLength": 64}},
                    "required": ["id"],
                    "additionalProperties": False,
                },
                safety=Safety.WRITE,
                effect=Effect.ADMINISTRATIVE,
                handler=self._cancel,
                resource_keys=("jobs",),
                timeout_s=10.0,
            ),
        ]

    def _binding(self, ctx: ToolCallContext) -> BindingConfig:
        binding = calling_binding(self._index, ctx)
        if binding is None:
            raise ToolError("jobs can be managed only from a bound chat")
        return binding

    async def _schedule(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        binding = self._binding(ctx)
        given = [k for k in ("cron", "every", "at") if arguments.get(k)]
        if len(given) != 1:
            raise ToolError("give exactly one of cron, every or at")
        kind: ScheduleKind = given[0]  # type: ignore[assignment]  # one of the three keys
        timezone = str(arguments.get("timezone") or self._timezone)
        now = time.time()
        schedule = Schedule(kind, str(arguments[kind]), timezone, anchor_ms=int(now) * 1000)
        try:
            zone(timezone)
            check_schedule(schedule)
        except ScheduleError as exc:
            raise ToolError(str(exc)) from None
        tools = tuple(dict.fromkeys(str(t) for t in arguments.get("tools", ())))
        lacking = [t for t in tools if t not in binding.tools]
        if lacking:
            raise ToolError(
                f"this chat's binding does not have {', '.join(lacking)}; a job can have only "
                "tools its chat has"
            )
        next_three = upcoming(schedule, int(now * 1000))
        if not next_three:
            raise ToolError(f"{schedule.describe()} never fires after now")
        key = binding_key(binding)
        job = JobRecord(
            id=str(arguments["id"]),
            origin="chat",
            schedule_kind=kind,
            schedule=schedule.expr,
            timezone=timezone,
            anchor_ms=schedule.anchor_ms,
            prompt=str(arguments["prompt"]),
            deliver_to=binding.session,
            session_id=fresh_session(str(arguments["id"]), now),
            tools=tools,
            time_budget_s=arguments.get("time_budget_s"),
            catch_up=arguments.get("catch_up", "latest"),
            notify_on_failure=True,
            creator=chat_creator(binding),
            paused=False,
            since_ms=int(now * 1000),
            created_at=now,
            updated_at=now,
            deliver_binding=key,
        )
        try:
            await self._store.job_add(job)
        except StoreError as exc:
            raise ToolError(f"job {job.id!r} exists already; pick another id") from exc
        return json.dumps(
            {
                "scheduled": job.id,
                "schedule": schedule.describe(),
                "next_fires": [format_fire(ms, timezone) for ms in next_three],
                "delivers_to": key,
                "tools": list(tools),
            },
            ensure_ascii=False,
        )

    async def _list(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        binding = self._binding(ctx)
        key, creator = binding_key(binding), chat_creator(binding)
        now_ms = int(time.time() * 1000)
        # What posts here: a chat's own jobs and the operator's ones for this binding.
        jobs = [job for job in await self._store.job_list() if job.deliver_binding == key]
        rows = []
        for job in jobs:
            schedule = Schedule(job.schedule_kind, job.schedule, job.timezone, job.anchor_ms)
            try:
                fires = upcoming(schedule, now_ms, 1)
            except ScheduleError:
                fires = []
            rows.append(
                {
                    "id": job.id,
                    "schedule": schedule.describe(),
                    "paused": job.paused,
                    "next_fire": format_fire(fires[0], job.timezone) if fires else None,
                    "made_here": job.creator == creator,
                }
            )
        return json.dumps({"jobs": rows}, ensure_ascii=False)

    async def _cancel(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        binding = self._binding(ctx)
        job_id = str(arguments["id"])
        job = await self._store.job_get(job_id)
        if job is None or job.creator != chat_creator(binding):
            # The same answer whether the job is another chat's or does not exist: a chat
            # learns nothing here of the jobs of others.
            raise ToolError(
                f"no job {job_id!r} was scheduled from this chat; a chat can cancel only the "
                "jobs it scheduled (the operator can remove any with geodebot jobs remove)"
            )
        await self._store.job_remove(job_id)
        return json.dumps({"cancelled": job_id})
