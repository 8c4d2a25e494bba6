"""The store's job definitions and fire rows: sync of the config's jobs, revisions, claims,
finishing and settling against the outbox."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import pytest

from geodebot.scheduler.status import took_text
from geodebot.store.protocol import Store
from geodebot.store.records import JobRecord, NewOutbound, StoreError
from geodebot.store.schema import load_migrations
from tests.support.postgres import Place


def record(job_id: str, **fields: object) -> JobRecord:
    base = JobRecord(
        id=job_id,
        origin="config",
        schedule_kind="every",
        schedule="1h",
        timezone="UTC",
        anchor_ms=0,
        prompt="p",
        deliver_to="ops",
        session_id=f"job:{job_id}",
        tools=("get_time",),
        time_budget_s=None,
        catch_up="latest",
        notify_on_failure=True,
        creator="",
        paused=False,
        since_ms=1_000,
        created_at=1.0,
        updated_at=1.0,
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]  # fields of the test's choosing


MESSAGE = NewOutbound("job:a", "telegram", "c1", None, None, "result", kind="job")


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:
        yield s


async def test_config_sync_adds_updates_and_removes(store: Store) -> None:
    first = await store.jobs_revision()
    assert await store.jobs_sync_config([record("a"), record("b")])
    assert await store.jobs_revision() != first
    await store.job_set_paused("a", True, since_ms=5_000)
    unchanged = await store.jobs_revision()
    assert not await store.jobs_sync_config([record("a", since_ms=9_000), record("b")])
    assert await store.jobs_revision() == unchanged
    # A changed definition owes nothing before the sync; the pause stays.
    assert await store.jobs_sync_config([record("a", schedule="2h", since_ms=9_000)])
    a = await store.job_get("a")
    assert a is not None
    assert (a.schedule, a.since_ms, a.paused, a.tools) == ("2h", 9_000, True, ("get_time",))
    assert [j.id for j in await store.job_list()] == ["a"]


async def test_a_sync_that_keeps_missing_jobs_and_a_clash_with_a_cli_job(
    store: Store,
) -> None:
    await store.jobs_sync_config([record("a"), record("b")])
    assert not await store.jobs_sync_config([record("a")], remove_missing=False)
    assert [j.id for j in await store.job_list()] == ["a", "b"]
    await store.job_add(record("c", origin="cli"))
    with pytest.raises(StoreError, match="clashes with a job made with cli"):
        await store.jobs_sync_config([record("a"), record("c")])
    with pytest.raises(StoreError, match="exists"):
        await store.job_add(record("c", origin="chat"))


async def test_a_sync_of_many_jobs_rewrites_only_what_changed(store: Store) -> None:
    """The daemon syncs every config job at each start: unchanged rows are left as they are
    (their since_ms with them: a rewritten row would forgo the fires it owes), a changed one
    is rewritten, a deleted one removed, a new one added, all in one go."""
    jobs = [record(f"j{i:04d}", tools=() if i % 2 else ("get_time",)) for i in range(2000)]
    assert await store.jobs_sync_config(jobs)
    unchanged = await store.jobs_revision()
    later = [dataclasses.replace(job, since_ms=9_000, updated_at=9.0) for job in jobs]
    assert not await store.jobs_sync_config(later)
    assert await store.jobs_revision() == unchanged
    assert {job.since_ms for job in await store.job_list()} == {1_000}

    edited = dataclasses.replace(later[7], prompt="new words")
    added = record("new", since_ms=9_000)
    assert await store.jobs_sync_config([*later[:7], edited, *later[8:1999], added])
    assert await store.jobs_revision() != unchanged
    rows = {job.id: job for job in await store.job_list()}
    assert "j1999" not in rows
    assert (rows["j0007"].prompt, rows["j0007"].since_ms) == ("new words", 9_000)
    assert (rows["new"].origin, rows["new"].since_ms) == ("config", 9_000)
    assert rows["j0006"] == jobs[6]
    assert len(rows) == 2000


async def test_a_tools_list_stored_in_another_spelling_is_not_a_change(
    store: Store, place: Place
) -> None:
    """Stored rows are compared as they are written, and decoded when that differs: JSON
    with spaces (a row from another writer) is the same list, and keeps what it owes."""
    await store.jobs_sync_config([record("a", tools=("get_time", "http_get"))])
    await store.close()
    place.execute(
        "UPDATE scheduled_jobs SET tools = ? WHERE id = 'a'", ('[ "get_time", "http_get" ]',)
    )
    await store.open()
    assert not await store.jobs_sync_config(
        [record("a", tools=("get_time", "http_get"), since_ms=9_000)]
    )
    assert await store.jobs_sync_config([record("a", tools=("get_time",), since_ms=9_000)])
    a = await store.job_get("a")
    assert a is not None
    assert (a.tools, a.since_ms) == (("get_time",), 9_000)


async def test_fire_rows_move_forward_only(store: Store) -> None:
    fire, won = await store.fire_claim("a", 60_000, "schedule")
    assert won
    assert fire.outcome == "running"
    again, won_again = await store.fire_claim("a", 60_000, "catch-up")
    assert (again.id, won_again) == (fire.id, False)
    overlap, won_overlap = await store.fire_claim("a", 120_000, "schedule")
    assert not won_overlap
    assert overlap.outcome == "skipped-overlap"
    done = await store.fire_finish(fire.id, started_at=61.0, result=MESSAGE)
    assert done.outcome == "delivering"
    assert done.outbox_id is not None
    with pytest.raises(StoreError, match="it is 'delivering'"):
        await store.fire_finish(fire.id, started_at=61.0, failure=("failed", "late"))
    assert await store.fires_settle() == []
    await store.outbox_finish(done.outbox_id, "sent")
    settled = await store.fires_settle()
    assert [(f.id, f.outcome) for f in settled] == [(fire.id, "ok")]
    assert await store.fire_latest_scheduled("a") == 120_000
    assert await store.fires_latest_scheduled() == {"a": 120_000}


async def test_a_paused_job_claims_nothing_until_resumed(store: Store) -> None:
    await store.jobs_sync_config([record("a")])
    await store.job_set_paused("a", True, since_ms=5_000)
    assert await store.fire_claim("a", 60_000, "schedule") == (None, False)
    assert await store.fire_history("a") == []
    await store.job_set_paused("a", False, since_ms=70_000)
    fire, won = await store.fire_claim("a", 80_000, "schedule")
    assert won
    assert fire is not None
    assert [f.id for f in await store.fire_history("a")] == [fire.id]


async def test_failure_notice_and_delivery_failure_are_settled(store: Store) -> None:
    failed, _ = await store.fire_claim("a", 1_000, "schedule")
    failed = await store.fire_finish(
        failed.id, started_at=1.0, failure=("budget", "too slow"), notice=MESSAGE
    )
    assert (failed.outcome, failed.notice) == ("budget", "pending")
    undelivered, _ = await store.fire_claim("a", 2_000, "schedule")
    undelivered = await store.fire_finish(undelivered.id, started_at=2.0, result=MESSAGE)
    assert failed.outbox_id is not None
    assert undelivered.outbox_id is not None
    await store.outbox_finish(failed.outbox_id, "sent")
    await store.outbox_finish(undelivered.outbox_id, "failed", error="chat not found")
    settled = {f.id: f for f in await store.fires_settle()}
    assert settled[failed.id].notice == "delivered"
    assert settled[failed.id].outcome == "budget"
    assert settled[undelivered.id].outcome == "delivery-failed"
    assert settled[undelivered.id].reason == "chat not found"


async def test_a_fire_shows_how_long_its_run_took(store: Store) -> None:
    fire, _ = await store.fire_claim("a", 1_000, "schedule")
    assert fire is not None
    assert took_text(fire) == "-"
    done = await store.fire_finish(fire.id, started_at=fire.claimed_at, failure=("failed", "x"))
    assert took_text(done).endswith(" ms")
    assert took_text(dataclasses.replace(done, started_at=10.0, ended_at=10.012)) == "12 ms"
    assert took_text(dataclasses.replace(done, started_at=10.0, ended_at=12.54)) == "2.5 s"


async def test_interrupted_fires_stay_claimed(store: Store) -> None:
    fire, _ = await store.fire_claim("a", 1_000, "schedule")
    swept = await store.fires_interrupted("restart")
    assert [(f.id, f.outcome, f.reason) for f in swept] == [(fire.id, "failed", "restart")]
    _, won = await store.fire_claim("a", 1_000, "catch-up")
    assert not won


async def test_requested_runs_start_once(store: Store) -> None:
    before = await store.jobs_revision()
    requested = await store.fire_request("a", 5_000)
    assert await store.jobs_revision() != before
    assert [f.id for f in await store.fires_requested()] == [requested.id]
    started, won = await store.fire_start_requested(requested.id)
    assert won
    assert started.outcome == "running"
    _, won_again = await store.fire_start_requested(requested.id)
    assert not won_again
    assert await store.fires_requested() == []


async def test_the_binding_a_job_posts_in_is_kept_and_named_once(store: Store) -> None:
    await store.job_add(record("chat", origin="chat", deliver_binding="telegram:c1"))
    await store.job_add(record("old", origin="chat", creator="binding:ops"))
    chat = await store.job_get("chat")
    assert chat is not None
    assert chat.deliver_binding == "telegram:c1"
    before = await store.jobs_revision()
    assert await store.job_set_delivery("old", "telegram:c1", creator="binding:telegram:c1")
    assert await store.jobs_revision() != before
    old = await store.job_get("old")
    assert old is not None
    assert (old.deliver_binding, old.creator) == ("telegram:c1", "binding:telegram:c1")
    # Only a row without a binding is named: one that has one keeps it.
    assert not await store.job_set_delivery("old", "telegram:c2", creator="x")
    assert not await store.job_set_delivery("chat", "telegram:c2", creator="x")
    assert not await store.job_set_delivery("ghost", "telegram:c2", creator="x")
    old = await store.job_get("old")
    assert old is not None
    assert (old.deliver_binding, old.creator) == ("telegram:c1", "binding:telegram:c1")
    # The binding is part of a config job's definition.
    await store.jobs_sync_config([record("a")])
    assert await store.jobs_sync_config([record("a", deliver_binding="telegram:c2")])
    a = await store.job_get("a")
    assert a is not None
    assert a.deliver_binding == "telegram:c2"


async def test_rows_written_before_the_binding_was_recorded_still_read(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    place.unmigrated()
    older = [m for m in load_migrations() if m[0] <= 4]
    with monkeypatch.context() as patch:
        patch.setattr(place.module, "load_migrations", lambda: older)
        async with place.store() as old:
            assert await old.schema_version() == 4
    place.execute(
        "INSERT INTO scheduled_jobs (id, origin, schedule_kind, schedule, timezone, "
        "anchor_ms, prompt, deliver_to, session_id, tools, time_budget_s, catch_up, "
        "notify_on_failure, creator, paused, since_ms, created_at, updated_at) VALUES "
        "('daily', 'chat', 'every', '1h', 'UTC', 0, 'p', 'ops', 'job:daily', '[]', NULL, "
        "'latest', 1, 'binding:ops', 0, 1000, 1.0, 1.0)"
    )
    async with place.store() as store:
        job = await store.job_get("daily")
        unnamed = await store.jobs_without_binding()
        named = await store.job_set_delivery("daily", "telegram:-1", creator="binding:x")
        after = await store.jobs_without_binding()
    assert job is not None
    assert (job.deliver_to, job.deliver_binding, job.creator) == ("ops", "", "binding:ops")
    assert [j.id for j in unnamed] == ["daily"]
    assert named
    assert after == []


async def test_a_fire_names_the_replica_that_runs_it_and_a_start_sweeps_only_its_own(
    store: Store,
) -> None:
    alpha, won = await store.fire_claim("a", 1_000, "schedule", replica="alpha")
    assert won
    beta, _ = await store.fire_claim("b", 1_000, "schedule", replica="beta")
    assert (alpha.replica, beta.replica) == ("alpha", "beta")
    # What never ran names nobody: a missed fire, a run asked for, a fire skipped for overlap.
    missed = await store.fire_skip("c", 1_000, "catch-up", "missed")
    requested = await store.fire_request("d", 5_000)
    overlap, _ = await store.fire_claim("a", 2_000, "schedule", replica="beta")
    assert missed is not None
    assert (missed.replica, requested.replica) == ("", "")
    assert (overlap.outcome, overlap.replica) == ("skipped-overlap", "")
    started, won = await store.fire_start_requested(requested.id, replica="beta")
    assert won
    assert started.replica == "beta"
    assert await store.fire_at("d", 5_000) == started
    assert await store.fire_at("d", 6_000) is None

    swept = await store.fires_interrupted("alpha restarted", replica="alpha")
    assert [(f.id, f.outcome, f.reason) for f in swept] == [(alpha.id, "failed", "alpha restarted")]
    assert await store.fires_interrupted("alpha restarted", replica="alpha") == []
    # One process (SQLite): every running fire.
    swept = await store.fires_interrupted("restart")
    assert [f.id for f in swept] == [beta.id, started.id]


async def test_the_running_fires_of_a_silent_replica_are_failed_and_cannot_finish(
    store: Store, place: Place
) -> None:
    for name in ("alpha", "beta"):
        await store.replica_seen(name, role="member", host="h", pid=1)
    fires = {
        who: (await store.fire_claim(f"job-{who}", 1_000, "schedule", replica=who))[0]
        for who in ("alpha", "beta", "ghost", "")
    }
    # Claimed just now: nothing is swept, not even the fire of a replica never heard of (a
    # replica may claim its first fire before it first says it is there).
    assert await store.fires_orphaned("gone", silent_s=60) == []

    # Ten minutes later: ghost and "" (a row from before fires named their replica) are no
    # live replica's; alpha and beta still say they are there.
    place.execute("UPDATE job_fires SET claimed_at = claimed_at - 600")
    swept = await store.fires_orphaned("gone", silent_s=60)
    assert sorted((f.replica, f.outcome, f.reason) for f in swept) == [
        ("", "failed", "gone"),
        ("ghost", "failed", "gone"),
    ]
    # alpha was last heard of a minute and a half ago.
    place.execute("UPDATE replicas SET seen_at = seen_at - 90 WHERE replica_id = 'alpha'")
    swept = await store.fires_orphaned("the replica running it stopped", silent_s=60)
    assert [(f.id, f.outcome, f.reason) for f in swept] == [
        (fires["alpha"].id, "failed", "the replica running it stopped")
    ]
    assert await store.fires_orphaned("gone", silent_s=60) == []
    beta = await store.fire_at("job-beta", 1_000)
    assert beta is not None
    assert beta.outcome == "running"
    # alpha comes back: its run's end is refused, and nothing is posted for it.
    with pytest.raises(StoreError, match="it is 'failed'"):
        await store.fire_finish(fires["alpha"].id, started_at=1.0, result=MESSAGE)
    assert await store.outbox_pending() == []
    # Swept fires stay claimed: none is run again.
    _, won = await store.fire_claim("job-alpha", 1_000, "catch-up", replica="beta")
    assert not won


async def test_fires_written_before_they_named_their_replica_read_as_nobodys(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    place.unmigrated()
    older = [m for m in load_migrations() if m[0] <= 15]
    with monkeypatch.context() as patch:
        patch.setattr(place.module, "load_migrations", lambda: older)
        async with place.store() as old:
            assert await old.schema_version() == 15
    # A fire an older daemon was running, claimed ten minutes ago.
    place.execute(
        "INSERT INTO job_fires (job_id, scheduled_ms, cause, outcome, reason, claimed_at, "
        "notice) VALUES ('a', 1000, 'schedule', 'running', '', ?, '')",
        (time.time() - 600,),
    )
    async with place.store() as store:
        assert store.version_found == 15
        before = await store.fire_at("a", 1_000)
        # No live replica's: with replicas, the first poll of any fails it.
        swept = await store.fires_orphaned("the replica running it stopped", silent_s=60)
    assert before is not None
    assert (before.outcome, before.replica) == ("running", "")
    assert [(f.id, f.outcome) for f in swept] == [(before.id, "failed")]
