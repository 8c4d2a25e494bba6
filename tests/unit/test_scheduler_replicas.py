"""Every replica runs the scheduler on one PostgreSQL store, and the fire claims decide: each
replica here is a real app with its own store connection, session leases, outbox and
:class:`JobScheduler` (what app/daemon.py wires with ``[store] url``), and its own in-memory
chat connection.

A fire is claimed only by the replica holding its job's session lease, so it runs once
whichever replicas compute it; a fire whose replica goes silent is failed by another, and
not before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.chat.outbox import OutboxSender
from geodebot.replicas.leases import SessionLeases, lease_name
from geodebot.replicas.owner import LeasedOwner
from geodebot.scheduler.definitions import config_jobs
from geodebot.scheduler.job_scheduler import ORPHANED, JobScheduler
from geodebot.store.records import FireRecord, JobRecord
from geodebot.testing import MemoryChannel
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.postgres import Cluster
from tests.support.replicas import replica_app
from tests.support.waiting import until
from tests.unit.test_store_jobs import record

TTL_S = 3.0
HOUR_MS = 3_600_000
BINDINGS = [{"platform": "telegram", "channel": "c1", "session": "ops", "allowed_users": ["*"]}]
RAN = ("running", "delivering", "ok", "failed", "budget", "delivery-failed")


@dataclass
class Replica:
    name: str
    app: App
    leases: SessionLeases
    chat: MemoryChannel
    scheduler: JobScheduler
    told: list[FireRecord] = field(default_factory=list)

    @property
    def store(self) -> Any:
        return self.app.services.store


@asynccontextmanager
async def replica(
    name: str,
    url: str,
    tmp_path: Path,
    llm: FakeLLMServer,
    *,
    jobs: Sequence[dict[str, Any]] = (),
    poll_s: float = 0.1,
) -> AsyncIterator[Replica]:
    """A replica whose scheduler is built but not started (``start`` it, several at once)."""
    async with (
        AsyncExitStack() as stack,
        replica_app(name, url, tmp_path, llm, stack, bindings=BINDINGS, ttl_s=TTL_S, jobs=jobs) as (
            config,
            app,
            leases,
        ),
    ):
        store = app.services.store
        chat = MemoryChannel("telegram")
        owner = LeasedOwner(store, leases)
        outbox = OutboxSender(store, {"telegram": chat}, owner=owner)
        told: list[FireRecord] = []
        scheduler = JobScheduler(
            app.run_turn,
            store,
            config.bindings,
            outbox.kick,
            config_jobs=functools.partial(config_jobs, config),
            poll_s=poll_s,
            on_fire=told.append,
            owner=owner,
        )
        await stack.enter_async_context(leases)
        await stack.enter_async_context(outbox)
        await chat.start(_no_messages, _no_presses)
        try:
            yield Replica(name, app, leases, chat, scheduler, told)
        finally:
            await scheduler.stop(1)
            await chat.stop()


async def _no_messages(*_: Any) -> None:
    raise AssertionError("no chat message is sent to these replicas")


async def _no_presses(*_: Any) -> None:
    raise AssertionError("no button is pressed on these replicas")


@pytest.fixture
def url(postgres_cluster: Cluster) -> str:
    return postgres_cluster.new_database(migrated=True)


async def fires(one: Replica, job_id: str) -> list[FireRecord]:
    return list(reversed(await one.store.fire_history(job_id)))


def hourly(job_id: str, *, missed: int, catch_up: str) -> JobRecord:
    """A job of the CLI due every hour, last due half an hour ago, that has not run for
    ``missed`` of its fires."""
    last_ms = int(time.time() * 1000) - HOUR_MS // 2
    return dataclasses.replace(
        record(job_id),
        origin="cli",
        session_id=f"job:{job_id}",
        deliver_binding="telegram:c1",
        tools=(),
        catch_up=catch_up,  # type: ignore[arg-type]  # a literal of the test's choosing
        # An interval's anchor is its first fire.
        anchor_ms=last_ms - 100 * HOUR_MS,
        since_ms=last_ms - (missed - 1) * HOUR_MS - 1,
    )


async def test_a_job_due_every_second_runs_each_fire_once_across_two_replicas(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("tick")
    job = {"id": "tick", "prompt": "Tick.", "deliver_to": "ops", "every": "1s"}
    async with (
        replica("alpha", url, tmp_path, llm_server, jobs=[job]) as alpha,
        replica("beta", url, tmp_path, llm_server, jobs=[job]) as beta,
    ):
        # Started at once: both sync the config's job and name bindings at the same moment.
        await asyncio.gather(alpha.scheduler.start(), beta.scheduler.start())

        async def delivered() -> bool:
            return sum(f.outcome == "ok" for f in await fires(alpha, "tick")) >= 4

        await until(delivered, "four fires delivered", timeout=30)
        await alpha.store.job_set_paused("tick", True, since_ms=int(time.time() * 1000))

        async def settled() -> bool:
            rows = await fires(alpha, "tick")
            return not any(f.outcome in ("running", "delivering") for f in rows)

        await until(settled, "every fire settled")
        await asyncio.gather(alpha.scheduler.wait_idle(), beta.scheduler.wait_idle())
        rows = await fires(beta, "tick")
        holder = await alpha.store.lease(lease_name("job:tick"))
        sent = alpha.chat.texts() + beta.chat.texts()

    ran = [f for f in rows if f.outcome in RAN]
    # One row per fire (the claim's key), and one model request per row that ran.
    assert len({f.scheduled_ms for f in rows}) == len(rows)
    assert len(llm_server.requests) == len(ran) >= 4
    assert {f.outcome for f in ran} == {"ok"}
    assert not [f for f in rows if f.outcome == "skipped-missed"]
    # Each run on the replica holding the job's session, its result sent once.
    assert holder is not None
    assert {f.replica for f in ran} == {holder.holder}
    assert len(sent) == len(set(sent)) == len(ran)
    # Each fire told of on the replica that wrote it, not also on the other.
    told = [f.id for f in alpha.told + beta.told if f.outcome == "running"]
    assert sorted(told) == sorted(f.id for f in ran)


async def test_a_catch_up_runs_the_missed_fires_once_across_two_replicas(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # Seven fires missed, catch_up = all: the newest five run one after the other, the two
    # before are one skipped-missed row, whichever replicas start.
    llm_server.default = Reply("caught up")
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await alpha.store.job_add(hourly("hourly", missed=7, catch_up="all"))
        # Older rows that name only a session: both replicas name their binding as they start.
        for n in range(20):
            older = record(f"older{n}", origin="chat", session_id=f"job:older{n}", paused=True)
            await alpha.store.job_add(older)
        await asyncio.gather(alpha.scheduler.start(), beta.scheduler.start())
        assert await beta.store.jobs_without_binding() == []

        async def caught_up() -> bool:
            return sum(f.outcome == "ok" for f in await fires(alpha, "hourly")) == 5

        await until(caught_up, "five runs delivered", timeout=30)
        await asyncio.gather(alpha.scheduler.wait_idle(), beta.scheduler.wait_idle())
        rows = await fires(alpha, "hourly")
        told = alpha.told + beta.told

    assert [(f.cause, f.outcome) for f in rows] == [("catch-up", "skipped-missed")] + [
        ("catch-up", "ok")
    ] * 5
    assert "2 fire(s)" in rows[0].reason
    assert len(llm_server.requests) == 5
    assert [f.id for f in told if f.outcome == "skipped-missed"] == [rows[0].id]


async def test_a_fire_whose_replica_goes_silent_is_failed_by_another_and_not_before(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # alpha runs the fire (it holds the job's session) and, seen as silent later, is as a
    # paused replica: its scheduler does not poll, its run goes on.
    llm_server.script(Delay(12, Reply("too late")))
    async with (
        replica("alpha", url, tmp_path, llm_server, poll_s=3600) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await alpha.store.job_add(hourly("hourly", missed=1, catch_up="latest"))
        assert await alpha.leases.hold("job:hourly") is not None

        async def seen(one: Replica) -> None:
            await one.store.replica_seen(one.name, role="member", host="h", pid=1)

        await seen(alpha)
        await seen(beta)
        await asyncio.gather(alpha.scheduler.start(), beta.scheduler.start())
        await llm_server.wait_for_requests(1)
        [fire] = await fires(beta, "hourly")
        assert (fire.outcome, fire.replica) == ("running", "alpha")

        # alpha keeps saying it is there past a time to live after the claim: beta polls and
        # leaves its fire alone.
        last_seen = 0.0

        async def alpha_live_past_a_ttl() -> bool:
            nonlocal last_seen
            last_seen = time.time()
            await seen(alpha)
            return last_seen > fire.claimed_at + TTL_S + 0.5

        await until(alpha_live_past_a_ttl, "a time to live after the claim")
        polls = beta.scheduler.polls
        await until(lambda: beta.scheduler.polls >= polls + 2, "two more polls of beta")
        running = await beta.store.fire_at("hourly", fire.scheduled_ms)
        assert running is not None
        assert running.outcome == "running"

        # alpha falls silent: a time to live later, beta fails the fire, and tells of it.
        async def failed() -> bool:
            row = await beta.store.fire_at("hourly", fire.scheduled_ms)
            return row is not None and row.outcome == "failed"

        await until(failed, "the silent replica's fire failed", timeout=10)
        swept_at = time.time()
        assert swept_at >= last_seen + TTL_S
        [told] = [f for f in beta.told if f.outcome == "failed"]
        assert (told.id, told.reason, told.replica) == (fire.id, ORPHANED, "alpha")
        assert not [f for f in alpha.told if f.outcome == "failed"]

        # alpha's run ends after all: its end is refused, nothing of it is posted.
        await alpha.scheduler.wait_idle()
        after = await alpha.store.fire_at("hourly", fire.scheduled_ms)
        pending = await alpha.store.outbox_pending()
    assert after is not None
    assert (after.outcome, after.reason, after.outbox_id) == ("failed", ORPHANED, None)
    assert pending == []
    assert alpha.chat.texts() == beta.chat.texts() == []
    assert len(llm_server.requests) == 1


async def test_a_requested_run_starts_once_on_the_replica_holding_the_session(
    url: str, tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("run now")
    async with (
        replica("alpha", url, tmp_path, llm_server) as alpha,
        replica("beta", url, tmp_path, llm_server) as beta,
    ):
        await alpha.store.job_add(hourly("hourly", missed=0, catch_up="latest"))
        assert await beta.leases.hold("job:hourly") is not None
        await asyncio.gather(alpha.scheduler.start(), beta.scheduler.start())
        requested = await alpha.store.fire_request("hourly", int(time.time() * 1000))

        async def delivered() -> bool:
            row = await alpha.store.fire_at("hourly", requested.scheduled_ms)
            return row is not None and row.outcome == "ok"

        await until(delivered, "the requested run delivered")
        await asyncio.gather(alpha.scheduler.wait_idle(), beta.scheduler.wait_idle())
        rows = await fires(alpha, "hourly")

    assert [(f.id, f.cause, f.outcome, f.replica) for f in rows] == [
        (requested.id, "manual", "ok", "beta")
    ]
    assert len(llm_server.requests) == 1
    assert [f.id for f in beta.told if f.outcome == "running"] == [requested.id]
    assert not [f for f in alpha.told if f.outcome == "running"]
    # Settled (told of) once, by whichever replica's poll saw it first.
    assert [f.id for f in alpha.told + beta.told if f.outcome == "ok"] == [requested.id]
    assert alpha.chat.texts() == []
    assert len(beta.chat.texts()) == 1
