"""The job scheduler: APScheduler says when, the store's fire claims say whether.

APScheduler 3.x runs with its in-memory job store only (it cannot share a persistent one
between processes); the store is the single source of truth for job definitions and is
polled, so changes made by the CLI or a chat tool reach a running daemon within a second.
A due fire is handed to :class:`_FireExecutor`, which passes the exact scheduled times on:
the claim is keyed by them.

With replicas sharing a PostgreSQL store, every replica runs a scheduler and computes the same
fires; the claim row decides who runs each. A replica claims a fire only while it holds the
job's session lease (replicas/leases.py), the claim fenced with it, so a fire runs on the replica
that holds its session, as the session's chat turns do; the others wait a while for its row
(the holder may be slow, or gone: its lease then expires and one of them takes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from apscheduler.executors.base import BaseExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from geodebot.chat.bindings import BindingIndex
from geodebot.chat.ownership import SessionElsewhere, SessionOwner
from geodebot.config.schema import BindingConfig
from geodebot.engine.lanes import Grace, cancel_and_wait
from geodebot.engine.session import TurnRunner
from geodebot.scheduler.catch_up import CatchUpPlan, plan_catch_up
from geodebot.scheduler.definitions import name_delivery_bindings, schedule_of
from geodebot.scheduler.fire_runner import (
    FireRunner,
    FireRunnerStore,
    OnFire,
    guarded,
    ignore_fire,
)
from geodebot.scheduler.schedule import (
    CronFields,
    ScheduleError,
    build_trigger,
    from_ms,
    next_fire,
    to_ms,
)
from geodebot.store.records import FireCause, FireRecord, JobRecord, StoreError

log = logging.getLogger(__name__)

POLL_S = 1.0
# Jobs scheduled between two turns of the event loop when the store's jobs are (re)read:
# 10,000 of them take about a second, which chat messages and due fires must not wait for.
BATCH = 200
# Logged once every job of the store has been scheduled after a start (benchmarks wait for it
# before they call the daemon idle).
SCHEDULED_MARK = "scheduler: scheduled"
# With replicas: fires due this shortly before a start are left to the normal schedule, not
# caught up: another replica's claim of them may be on its way, and a catch-up would record
# them skipped-missed under it.
CLAIM_SLACK_S = 2.0
INTERRUPTED = "the daemon stopped during the run"
ORPHANED = "the replica running it stopped"


class _FireExecutor(BaseExecutor):  # type: ignore[misc]  # APScheduler ships no types
    """Hands due fires to the scheduler with their scheduled times.

    Overlap is decided by the fire claims, not by APScheduler's max_instances, which would
    drop a fire with only a log line.
    """

    def __init__(self, on_due: Callable[[str, list[datetime]], None]) -> None:
        super().__init__()
        self._on_due = on_due

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        self._on_due(job.id, run_times)

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        self._on_due(job.id, run_times)


def _never_called() -> None:
    """APScheduler wants a callable per job; fires go through the executor instead."""


class JobScheduler:
    """``async with`` it: entering syncs and schedules, leaving stops new fires and gives the
    running ones what is left of ``grace``."""

    def __init__(
        self,
        run_turn: TurnRunner,
        store: FireRunnerStore,
        bindings: BindingIndex | Sequence[BindingConfig],
        kick: Callable[[], None],
        *,
        config_jobs: Callable[[], Sequence[JobRecord]] = tuple,
        grace: Grace | None = None,
        poll_s: float = POLL_S,
        on_fire: OnFire = ignore_fire,
        owner: SessionOwner,
    ) -> None:
        self._store = store
        # Told of each fire whose row this scheduler wrote: claimed (or skipped), finished,
        # settled (its delivery's outcome known); what shows fires (the console) follows it.
        self._on_fire = guarded(on_fire)
        self._index = BindingIndex.of(bindings)
        # Asked at start, not before: a new job owes fires only from the moment it is synced.
        self._config_jobs = config_jobs
        self._grace = grace if grace is not None else Grace(0.0)
        self._runner = FireRunner(
            run_turn, store, self._index, kick, on_fire=self._on_fire, owner=owner
        )
        self._poll_s = poll_s
        self._jobs: dict[str, JobRecord] = {}
        self._revision: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        # Set once every job of the store has been looked at (scheduled, caught up) once.
        self._scheduled = asyncio.Event()
        self._cron = CronFields()
        self._aps: AsyncIOScheduler | None = None
        self._closing = False
        # Which process runs each job's session (chat/ownership.py).
        self._owner = owner
        # Each fire's claim names who runs it (empty on SQLite: one process).
        self._replica = owner.replica_id or ""
        self._slack_ms = 0 if owner.replica_id is None else int(CLAIM_SLACK_S * 1000)
        # Requested runs being started here: a refresh meanwhile does not start them again.
        self._requested: set[int] = set()
        # Jobs whose catch-up has not claimed its first fire yet: their scheduled fires wait
        # for it, so an owed fire is not left skipped as an overlap of a newer one that a slow
        # store let claim first.
        self._catching_up: dict[str, asyncio.Event] = {}
        # Store polls done since the start (tests wait on it).
        self.polls = 0

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Sync the config's jobs and settle what a previous run left; then, in the poll
        task, catch up and schedule every job.

        Scheduling is the part of the start that grows with the jobs (a job's next fire and
        what a downtime missed cost tens of microseconds each), so it runs after this
        returns, which is before READY in ``geodebot serve``, in batches that let the event
        loop through. Nothing is lost or late for it: what each job owes is fixed by the
        moment taken here (``cut``), not by when its batch comes. Fires up to it are caught
        up per the job's ``catch_up`` (a missed one recorded), and the first one after it is
        scheduled at its own time, even when that time has passed when the job's batch runs:
        APScheduler then hands it over at once with its scheduled time, the key of its claim.
        Doing this work before READY instead would schedule each job no sooner (the work and
        its order are the same), it would only hold READY up.
        """
        # Before the sync: a config job's row that gains its binding's key this way is not a
        # changed definition, which would forgo the fires it owes.
        named = await name_delivery_bindings(self._store, self._index)
        if named:
            log.info("scheduler: %d older jobs now name the binding they post in", named)
        await self._store.jobs_sync_config(self._config_jobs())
        # Nothing of a previous process can still run: its claimed fires are not re-run. With
        # replicas, only this replica's (its id is kept across restarts when configured):
        # the others' fires may be running; those of a replica gone are swept by _poll.
        for fire in await self._store.fires_interrupted(
            INTERRUPTED, replica=self._owner.replica_id
        ):
            log.warning("job %s: fire %s was cut short by a restart", fire.job_id, fire.id)
            self._on_fire(fire)
        for fire in await self._store.fires_settle():
            self._on_fire(fire)
        cut_ms = int(time.time() * 1000)
        self._aps = AsyncIOScheduler(
            timezone=UTC,
            jobstores={"default": MemoryJobStore()},
            executors={"default": _FireExecutor(self._on_due)},
            job_defaults={"misfire_grace_time": None, "coalesce": False, "max_instances": 1},
            event_loop=asyncio.get_running_loop(),
        )
        self._aps.start()
        self._poller = asyncio.create_task(self._poll(cut_ms))

    async def __aenter__(self) -> JobScheduler:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(self._grace.left())

    async def stop(self, grace_s: float) -> None:
        """No new fires; running ones get ``grace_s``, then are cancelled (and say so)."""
        self._closing = True
        if self._aps is not None and self._aps.running:
            self._aps.shutdown(wait=False)
        if self._poller is not None:
            await cancel_and_wait(self._poller)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    @property
    def running(self) -> bool:
        """The store poll (and so the scheduler) is alive."""
        return self._poller is not None and not self._poller.done()

    def registered(self) -> int:
        return len(self._aps.get_jobs()) if self._aps is not None else 0

    # -- the store as source of truth -------------------------------------------------------
    async def _poll(self, cut_ms: int) -> None:
        first: int | None = cut_ms
        # Until stop(): also if a cancellation was lost on the way (see cancel_and_wait).
        while not self._closing:
            try:
                await self._refresh(first)
                if first is not None:
                    log.info(
                        "%s: %d of %d jobs", SCHEDULED_MARK, self.registered(), len(self._jobs)
                    )
                first = None
                self._scheduled.set()
                for fire in await self._store.fires_settle():
                    log.info("job %s: fire %s is %s", fire.job_id, fire.id, fire.outcome)
                    self._on_fire(fire)
                if self._owner.replica_id is not None:
                    await self._sweep_orphaned(self._owner.takeover_s)
            except StoreError:
                log.exception("scheduler: cannot read the store; trying again")
            self.polls += 1
            await asyncio.sleep(self._poll_s)

    async def _sweep_orphaned(self, ttl_s: float) -> None:
        """Fail the running fires of replicas silent for a lease's time to live: such a
        replica's session leases have expired too, so its run could not commit its end."""
        for fire in await self._store.fires_orphaned(ORPHANED, silent_s=ttl_s):
            log.warning(
                "job %s: fire %s was cut short: replica %r stopped",
                fire.job_id,
                fire.id,
                fire.replica,
            )
            self._on_fire(fire)

    async def _refresh(self, cut_ms: int | None = None) -> None:
        """Schedule the store's jobs as they are now; ``cut_ms``: the moment up to which
        fires are owed (caught up), now unless given."""
        revision = await self._store.jobs_revision()
        if revision == self._revision:
            return
        jobs = {job.id: job for job in await self._store.job_list()}
        last_fires = await self._store.fires_latest_scheduled()
        cut_ms = int(time.time() * 1000) if cut_ms is None else cut_ms
        for job_id in self._jobs.keys() - jobs.keys():
            self._unregister(job_id)
            del self._jobs[job_id]
        scheduled = 0
        for job in jobs.values():
            old = self._jobs.get(job.id)
            # The newest row always: who made it and since when count at its next fire.
            self._jobs[job.id] = job
            if old is not None and (old.definition(), old.paused) == (job.definition(), job.paused):
                continue
            if old is not None:
                self._unregister(job.id)
            if not job.paused:
                self._register(job, last_fires.get(job.id), cut_ms)
                scheduled += 1
                if scheduled % BATCH == 0:
                    await asyncio.sleep(0)
        # Only now: a refresh cut short by a store error is done again in full.
        self._revision = revision
        for fire in await self._store.fires_requested():
            if fire.id not in self._requested:
                self._requested.add(fire.id)
                self._spawn(self._run_requested(fire))

    def _unregister(self, job_id: str) -> None:
        if self._aps is not None:
            with contextlib.suppress(JobLookupError):
                self._aps.remove_job(job_id)

    def _register(self, job: JobRecord, last: int | None, cut_ms: int) -> None:
        """Catch up on the fires owed up to ``cut_ms`` (the last one that has a row is
        ``last``), then schedule the ones after it."""
        schedule = schedule_of(job)
        owed_after = max(job.since_ms, last if last is not None else job.since_ms)
        # Missed: due up to here (the fires after it are scheduled, even those already due).
        missed_upto = cut_ms - self._slack_ms
        plan = None
        try:
            trigger = build_trigger(schedule, self._cron)
            # One step of the trigger for most jobs: when its first fire after what is owed
            # comes after the cut, nothing was missed and that is the one to schedule.
            first = next_fire(schedule, min(owed_after, cut_ms), trigger)
            if first is not None and first <= missed_upto:
                plan = plan_catch_up(job, owed_after, missed_upto, trigger)
                first = next_fire(schedule, missed_upto, trigger)
        except ScheduleError as exc:
            log.error("job %s: cannot schedule %s: %s", job.id, schedule.describe(), exc)
            return
        if plan is not None:
            claimed = asyncio.Event()
            self._catching_up[job.id] = claimed
            self._spawn(self._catch_up(job, plan, claimed))
        if first is not None and self._aps is not None:
            self._aps.add_job(
                _never_called,
                trigger=trigger,
                id=job.id,
                name=job.id,
                next_run_time=from_ms(first),
                replace_existing=True,
            )

    # -- fires ------------------------------------------------------------------------------
    def _on_due(self, job_id: str, run_times: list[datetime]) -> None:
        for moment in run_times:
            self._spawn(self._fire(job_id, to_ms(moment), "schedule"))

    async def _hold(self, job: JobRecord, settled: Callable[[], Awaitable[bool]]) -> bool:
        """Whether the job's session is held here (taken now if nobody holds it), for a fire
        that ``settled`` (awaited; true once the fire needs nothing of this process) does not
        say is settled. Held by another replica: that one computes the same fire and claims
        it; should it be gone, its lease expires within a time to live, so the fire is
        looked at until its row shows up, for at most two of them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self._owner.takeover_s
        pause = min(self._poll_s, self._owner.takeover_s / 3)
        while True:
            if await self._owner.hold(job.session_id):
                return True
            try:
                if await settled():
                    return False
            except StoreError as exc:
                log.warning("job %s: cannot read its fire: %s", job.id, exc)
            if self._closing or loop.time() >= deadline:
                log.info("job %s: its session is held by another replica; left to it", job.id)
                return False
            await asyncio.sleep(pause)

    def _spawn(self, work: Any) -> None:
        if self._closing:
            work.close()
            return
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fire(
        self,
        job_id: str,
        scheduled_ms: int,
        cause: FireCause,
        claimed: asyncio.Event | None = None,
    ) -> None:
        """``claimed``: set as soon as this fire's claim is settled, before its run."""
        if cause == "schedule" and (catching_up := self._catching_up.get(job_id)) is not None:
            await catching_up.wait()
        job = self._jobs.get(job_id)
        if job is None or job.paused:
            return

        async def made() -> bool:
            return await self._store.fire_at(job_id, scheduled_ms) is not None

        if not await self._hold(job, made):
            return
        # The claim is the session's work: refused if the session was lost meanwhile.
        with contextlib.suppress(SessionElsewhere):
            async with self._owner.running(job.session_id):
                await self._claim(job, scheduled_ms, cause, claimed)

    async def _claim(
        self,
        job: JobRecord,
        scheduled_ms: int,
        cause: FireCause,
        claimed: asyncio.Event | None = None,
    ) -> None:
        job_id = job.id
        try:
            try:
                fire, won = await self._store.fire_claim(
                    job_id, scheduled_ms, cause, replica=self._replica
                )
            finally:
                if claimed is not None:
                    claimed.set()
        except StoreError as exc:
            # Its message says it all (the store unwell, or the session's lease lost).
            log.error("job %s: cannot claim fire %s: %s", job_id, scheduled_ms, exc)
            return
        if fire is None:
            log.info("job %s: paused; fire %s not run", job_id, scheduled_ms)
            return
        if not won:
            if fire.outcome == "skipped-overlap":
                log.warning("job %s: fire skipped, %s", job_id, fire.reason)
                self._on_fire(fire)
            return
        self._on_fire(fire)
        await self._runner.run(job, fire)

    async def _catch_up(self, job: JobRecord, plan: CatchUpPlan, claimed: asyncio.Event) -> None:
        try:
            if plan.skipped_ms is not None:
                await self._record_missed(job, plan.skipped_ms, plan.reason)
            for scheduled_ms in plan.run_ms:
                await self._fire(job.id, scheduled_ms, "catch-up", claimed)
                # Also when it made no claim (the job paused, its session held elsewhere).
                claimed.set()
        finally:
            claimed.set()
            if self._catching_up.get(job.id) is claimed:
                del self._catching_up[job.id]

    async def _record_missed(self, job: JobRecord, skipped_ms: int, reason: str) -> None:
        try:
            skipped = await self._store.fire_skip(job.id, skipped_ms, "catch-up", reason)
        except StoreError as exc:
            log.error("job %s: cannot record missed fires: %s", job.id, exc)
            return
        # None: its row exists (another replica caught up first, or a restart).
        if skipped is not None:
            log.warning("job %s: %s", job.id, reason)
            self._on_fire(skipped)

    async def _run_requested(self, requested: FireRecord) -> None:
        try:
            await self._start_requested(requested)
        finally:
            self._requested.discard(requested.id)

    async def _start_requested(self, requested: FireRecord) -> None:
        job = self._jobs.get(requested.job_id)
        if job is None:
            await self._requested_run(job, requested)
            return

        async def started() -> bool:
            fire = await self._store.fire_at(requested.job_id, requested.scheduled_ms)
            return fire is None or fire.outcome != "requested"

        if not await self._hold(job, started):
            return
        with contextlib.suppress(SessionElsewhere):
            async with self._owner.running(job.session_id):
                await self._requested_run(job, requested)

    async def _requested_run(self, job: JobRecord | None, requested: FireRecord) -> None:
        try:
            fire, won = await self._store.fire_start_requested(requested.id, replica=self._replica)
        except StoreError as exc:
            log.error(
                "job %s: cannot start requested run %s: %s", requested.job_id, requested.id, exc
            )
            return
        if not won:
            return
        self._on_fire(fire)
        if job is None:
            done = await self._store.fire_finish(
                fire.id, started_at=time.time(), failure=("failed", "no such job any more")
            )
            self._on_fire(done)
            return
        await self._runner.run(job, fire)

    async def wait_idle(self) -> None:
        """Until every job has been scheduled once and no fire task runs (tests and
        benchmarks)."""
        if self._poller is not None and not self._scheduled.is_set():
            scheduled = asyncio.create_task(self._scheduled.wait())
            await asyncio.wait({scheduled, self._poller}, return_when=asyncio.FIRST_COMPLETED)
            scheduled.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
