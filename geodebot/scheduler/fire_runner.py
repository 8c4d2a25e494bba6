"""One job run: a DAEMON turn on the job's session, then delivery through the outbox to the
binding the job names (see definitions.delivery_binding: by key, never "the first binding
of a session").

The run's one catch-all lives here (one per job run): whatever goes wrong ends the fire as
failed with a reason, and the bound chat gets a short notice when the job asks for one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.chat.ownership import SessionElsewhere, SessionOwner
from geodebot.chat.send_file import OutboxOutlet
from geodebot.config.schema import BindingConfig
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, TurnResult, TurnRunner
from geodebot.engine.spend import SpendScope
from geodebot.logs.context import log_context
from geodebot.scheduler.definitions import delivery_binding
from geodebot.scheduler.schedule import format_fire
from geodebot.store.protocol import InboxOutboxStore, JobStore
from geodebot.store.records import FireEnd, FireRecord, JobRecord, NewOutbound, StoreError

log = logging.getLogger(__name__)

MAX_REASON = 300

# Told of a fire whose row just changed (claimed, finished, settled), after the commit.
OnFire = Callable[[FireRecord], None]


def ignore_fire(fire: FireRecord) -> None:
    """The default :data:`OnFire`: nobody follows the fires."""


def guarded(on_fire: OnFire) -> OnFire:
    """``on_fire`` whose failure is logged, never the scheduler's: a fire's record is what
    counts, telling of it is a courtesy."""
    if on_fire is ignore_fire:
        return on_fire

    def tell(fire: FireRecord) -> None:
        try:
            on_fire(fire)
        except Exception:
            log.exception("job %s: telling of fire %s failed", fire.job_id, fire.id)

    return tell


def _tools(job: JobRecord, binding: BindingConfig) -> tuple[str, ...]:
    """A job made from chat never has a tool its chat's binding lacks, now or later."""
    if job.origin != "chat":
        return job.tools
    return tuple(name for name in job.tools if name in binding.tools)


def _preapproved(job: JobRecord, binding: BindingConfig, tools: tuple[str, ...]) -> tuple[str, ...]:
    """A job runs with nobody to approve anything. An operator's job (config or CLI) was
    written with its tools on purpose, so they are pre-approved; a job made from chat gets
    only what its binding pre-approves."""
    if job.origin != "chat":
        return tools
    return tuple(name for name in tools if name in binding.preapproved)


def _failure(result: TurnResult) -> tuple[FireEnd, str]:
    if result.outcome == "budget":
        return "budget", result.text[:MAX_REASON]
    detail = f" ({result.error})" if result.error else ""
    return "failed", f"{result.outcome}{detail}: {result.text}"[:MAX_REASON]


class FireRunnerStore(JobStore, InboxOutboxStore, Protocol):
    """What a fire's run records: its end, and the files it sends (written to the outbox)."""


class FireRunner:
    def __init__(
        self,
        run_turn: TurnRunner,
        store: FireRunnerStore,
        bindings: BindingIndex | Sequence[BindingConfig],
        kick: Callable[[], None],
        *,
        on_fire: OnFire = ignore_fire,
        owner: SessionOwner,
    ) -> None:
        self._run_turn = run_turn
        # A run holds its job's session, as a chat turn does (chat/ownership.py).
        self._owner = owner
        self._store = store
        self._index = BindingIndex.of(bindings)
        self._kick = kick
        # The scheduler hands its own, already guarded (see guarded()).
        self._on_fire = on_fire

    async def run(self, job: JobRecord, fire: FireRecord) -> FireRecord:
        """Run a claimed (``running``) fire to its end; never raises but for cancellation."""
        with log_context(job=job.id, fire=str(fire.id), session=job.session_id):
            try:
                async with self._owner.running(job.session_id):
                    return await self._run(job, fire)
            except SessionElsewhere:
                elsewhere = "its session is running on another replica"
                return await self._finish(job, fire, time.time(), None, None, ("failed", elsewhere))

    async def _run(self, job: JobRecord, fire: FireRecord) -> FireRecord:
        started = time.time()
        target = delivery_binding(job, self._index)
        binding = None if isinstance(target, str) else target
        result: TurnResult | None = None
        failure: tuple[FireEnd, str] | None = None
        try:
            if isinstance(target, str):
                failure = ("failed", target[:MAX_REASON])
            else:
                tools = _tools(job, target)
                spec = SessionSpec(
                    job.session_id,
                    tools=tools,
                    preapproved=_preapproved(job, target, tools),
                    time_budget_s=job.time_budget_s,
                    # The chat it delivers to: its project is the run's (project memory).
                    origin=binding_key(target),
                    # A job made in a chat spends from that chat's budget too: making jobs
                    # must not be a way around it. Every run has its own per-run budget.
                    spend=SpendScope(
                        binding=binding_key(target) if job.origin == "chat" else None,
                        job=job.id,
                        run=f"fire-{fire.id}",
                    ),
                    # Files the run sends go where its result goes, before it.
                    outlet=OutboxOutlet(
                        self._store,
                        NewOutbound(
                            job.session_id, target.platform, target.channel, None, None, ""
                        ),
                        lambda _row: self._kick(),
                    ),
                )
                result = await self._run_turn(Mode.DAEMON, spec, job.prompt)
                if not result.ok:
                    failure = _failure(result)
                elif result.refused_by_model:
                    failure = ("failed", f"the model refused: {result.text}"[:MAX_REASON])
        except asyncio.CancelledError:
            # Shut down mid-run: the fire stays claimed and says so; it is never re-run.
            await asyncio.shield(
                self._finish(job, fire, started, binding, None, ("failed", "daemon stopped"))
            )
            raise
        except Exception as exc:
            log.exception("job %s: run of fire %s failed", job.id, fire.id)
            failure = ("failed", f"internal error: {type(exc).__name__}: {exc}"[:MAX_REASON])
        return await self._finish(job, fire, started, binding, result, failure)

    async def _finish(
        self,
        job: JobRecord,
        fire: FireRecord,
        started: float,
        binding: BindingConfig | None,
        result: TurnResult | None,
        failure: tuple[FireEnd, str] | None,
    ) -> FireRecord:
        when = format_fire(fire.scheduled_ms, job.timezone)
        message: NewOutbound | None = None
        if binding is not None and (failure is None or job.notify_on_failure):
            if failure is None:
                assert result is not None
                text, kind = f"**Job {job.id}** ({when})\n\n{result.text}", "job"
            else:
                what = "stopped on a budget" if failure[0] == "budget" else "failed"
                text = f"Job {job.id} ({when}) {what}: {failure[1][:300]}"
                kind = "notice"
            message = NewOutbound(
                session_id=job.session_id,
                platform=binding.platform,
                channel=binding.channel,
                thread=None,
                reply_to=None,
                text=text,
                kind=kind,
            )
        try:
            if failure is None:
                done = await self._store.fire_finish(fire.id, started_at=started, result=message)
            else:
                done = await self._store.fire_finish(
                    fire.id, started_at=started, failure=failure, notice=message
                )
        except StoreError:
            log.exception("job %s: cannot record the end of fire %s", job.id, fire.id)
            return fire
        if message is not None:
            self._kick()
        self._on_fire(done)
        level = logging.INFO if failure is None else logging.WARNING
        log.log(
            level, "job %s fire %s (%s): %s %s", job.id, fire.id, when, done.outcome, done.reason
        )
        return done
