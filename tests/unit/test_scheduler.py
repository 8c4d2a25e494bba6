"""Scheduled jobs in process: fires, delivery through the outbox, honest history, overlap,
catch-up across a restart and exactly-once claims."""

from __future__ import annotations

import asyncio
import functools
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from geodebot.channels.base import ChannelError
from geodebot.chat.ownership import LocalOwner
from geodebot.config.schema import DB_FILE
from geodebot.scheduler.definitions import config_jobs
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.scheduler.schedule import to_ms
from geodebot.store.records import FireRecord, JobRecord
from geodebot.store.sqlite import SQLiteStore
from tests.support.fakes.llm_server import Call, Delay, Error, FakeLLMServer, Reply
from tests.support.scheduler_world import BINDINGS, NOT_DUE, job, scheduler_world


async def test_interval_job_posts_its_result_and_records_ok(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("All deploys green.")
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        await world.start_scheduler()
        texts = await world.sent(1)
        rows = await world.wait_history(lambda rows: any(r.outcome == "ok" for r in rows))
        session = await world.store.get_session("job:digest")
    assert "All deploys green." in texts[0]
    assert "digest" in texts[0]
    ok = next(r for r in rows if r.outcome == "ok")
    assert ok.cause == "schedule"
    assert ok.scheduled_ms % 1000 == 0
    assert ok.started_at is not None
    assert ok.ended_at is not None
    assert ok.started_at >= ok.scheduled_ms / 1000
    assert ok.outbox_id is not None
    # The run is a DAEMON session on the job's own session id.
    assert session is not None
    assert session.mode == "daemon"


async def test_six_field_cron_fires_on_its_seconds(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("tick")
    async with scheduler_world(tmp_path, llm_server, [job(cron="*/2 * * * * *")]) as world:
        await world.start_scheduler()
        rows = await world.wait_history(lambda rows: any(r.outcome == "ok" for r in rows))
    assert all(r.scheduled_ms % 2000 == 0 for r in rows)


async def test_failing_model_posts_a_notice_and_records_failed_never_ok(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Error.server()
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        await world.start_scheduler()
        texts = await world.sent(1)
        rows = await world.wait_history(lambda rows: any(r.notice == "delivered" for r in rows))
    assert "Job digest" in texts[0]
    assert "failed" in texts[0]
    assert {r.outcome for r in rows if r.outcome not in ("running", "delivering")} == {"failed"}
    failed = next(r for r in rows if r.notice == "delivered")
    assert "model_error" in failed.reason


async def test_a_model_refusal_is_a_failed_run_with_a_notice(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("I can't help with that.", stop="refusal")
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        await world.start_scheduler()
        texts = await world.sent(1)
        rows = await world.wait_history(lambda rows: any(r.notice == "delivered" for r in rows))
    assert "failed: the model refused" in texts[0]
    assert not any(r.outcome == "ok" for r in rows)


async def test_no_notice_when_the_job_does_not_want_one(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Error.server()
    spec = job(every="1s", notify_on_failure=False)
    async with scheduler_world(tmp_path, llm_server, [spec]) as world:
        await world.start_scheduler()
        rows = await world.wait_history(lambda rows: any(r.outcome == "failed" for r in rows))
    assert world.chat.texts() == []
    assert all(r.notice == "" for r in rows)


async def test_budget_overrun_is_recorded_as_budget(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Delay(5, Reply("too late"))
    spec = job(every="1s", time_budget_s=0.3)
    async with scheduler_world(tmp_path, llm_server, [spec]) as world:
        await world.start_scheduler()
        texts = await world.sent(1)
        rows = await world.wait_history(lambda rows: any(r.outcome == "budget" for r in rows))
    assert "time budget" in texts[0]
    assert not any(r.outcome == "ok" for r in rows)


async def test_job_that_overruns_its_interval_records_skipped_overlap(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Delay(1.6, Reply("slow digest")))
    llm_server.default = Reply("fast digest")
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        await world.start_scheduler()
        rows = await world.wait_history(
            lambda rows: (
                any(r.outcome == "skipped-overlap" for r in rows)
                and any(r.outcome == "ok" for r in rows)
            )
        )
    skipped = [r for r in rows if r.outcome == "skipped-overlap"]
    assert skipped[0].reason.startswith("fire ")
    assert skipped[0].started_at is None
    slow = rows[0]
    assert slow.outcome == "ok"
    assert any(slow.scheduled_ms < r.scheduled_ms for r in skipped)


async def test_failed_delivery_is_recorded_as_delivery_failed(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("cannot arrive")
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        world.chat.fail_next(*[ChannelError("chat not found", permanent=True)] * 50)
        await world.start_scheduler()
        rows = await world.wait_history(
            lambda rows: any(r.outcome == "delivery-failed" for r in rows)
        )
    failed = next(r for r in rows if r.outcome == "delivery-failed")
    assert "chat not found" in failed.reason
    assert not any(r.outcome == "ok" for r in rows)


class Heard(list[FireRecord]):
    """An ``on_fire`` that keeps what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self._told = asyncio.Event()

    def __call__(self, fire: FireRecord) -> None:
        self.append(fire)
        self._told.set()

    async def until(self, outcome: str, timeout: float = 15.0) -> FireRecord:
        """Until a fire with ``outcome`` was told of; the first such one."""
        async with asyncio.timeout(timeout):
            while not any(f.outcome == outcome for f in self):
                self._told.clear()
                await self._told.wait()
        return next(f for f in self if f.outcome == outcome)


@pytest.mark.parametrize(
    ("refused", "end"), [(False, "ok"), (True, "delivery-failed")], ids=["sent", "refused"]
)
async def test_whoever_follows_the_fires_hears_each_start_end_and_settling(
    tmp_path: Path, llm_server: FakeLLMServer, refused: bool, end: str
) -> None:
    """What shows the fires (the console's /jobs) is told as each fire's row changes, up to
    the outcome the outbox's delivery settles, without reading the store itself."""
    llm_server.default = Reply("All deploys green.")
    heard = Heard()
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        if refused:
            world.chat.fail_next(*[ChannelError("chat not found", permanent=True)] * 50)
        await world.start_scheduler(on_fire=heard)
        settled = await heard.until(end)
        [stored] = [r for r in await world.history() if r.id == settled.id]
    assert stored == settled
    outcomes = [f.outcome for f in heard if f.id == settled.id]
    assert outcomes == ["running", "delivering", end]
    assert all(f.job_id == "digest" for f in heard)


async def test_a_requested_fire_is_heard_when_it_starts_and_ends(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("On demand.")
    heard = Heard()
    async with scheduler_world(tmp_path, llm_server, [job(cron="0 3 * * *")]) as world:
        await world.start_scheduler(on_fire=heard)
        requested = await world.store.fire_request("digest", int(time.time() * 1000))
        await heard.until("ok")
    assert [(f.id, f.cause, f.outcome) for f in heard] == [
        (requested.id, "manual", "running"),
        (requested.id, "manual", "delivering"),
        (requested.id, "manual", "ok"),
    ]


async def test_restart_with_catch_up_skip_runs_none_and_says_so(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("on time")
    spec = job(every="1s", catch_up="skip")
    async with scheduler_world(tmp_path, llm_server, [spec]) as world:
        await world.down_after_a_run(1.5)
        await world.start_scheduler()
        rows = await world.wait_history(
            lambda rows: any(r.outcome == "skipped-missed" for r in rows)
        )
        # Stop before the live schedule adds more rows that would blur the count.
        await world.schedulers[-1].stop(5)
        rows = await world.history()
    catch_up = [r for r in rows if r.cause == "catch-up"]
    assert [r.outcome for r in catch_up] == ["skipped-missed"]
    assert "catch_up = skip" in catch_up[0].reason


async def test_racing_claims_of_one_fire_run_it_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with scheduler_world(tmp_path, llm_server, [job(every="1h")]) as world:
        other = SQLiteStore(tmp_path / "var" / DB_FILE)
        await other.open()
        try:
            fire_ms = 1_900_000_000_000
            results = await asyncio.gather(
                *(
                    store.fire_claim("digest", fire_ms, "schedule")
                    for _ in range(10)
                    for store in (world.store, other)
                )
            )
        finally:
            await other.close()
        rows = await world.history()
    assert sum(won for _, won in results) == 1
    assert len({fire.id for fire, _ in results}) == 1
    assert len(rows) == 1


async def test_restart_right_after_a_claim_does_not_run_the_fire_again(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("must not run")
    fire_s = int(time.time()) + 1
    at = datetime.fromtimestamp(fire_s, UTC).isoformat()
    async with scheduler_world(tmp_path, llm_server, [job(at=at)]) as world:
        scheduler = await world.start_scheduler()
        # A previous process claimed the fire and died before it ran.
        await scheduler.stop(1)
        _, won = await world.store.fire_claim("digest", fire_s * 1000, "schedule")
        assert won
        await asyncio.sleep(max(0.0, fire_s + 0.2 - time.time()))
        restarted = await world.start_scheduler()
        await restarted.wait_idle()
        rows = await world.history()
    assert llm_server.requests == []
    assert len(rows) == 1
    assert rows[0].outcome == "failed"
    assert "stopped" in rows[0].reason


async def test_pause_stops_fires_and_resume_owes_nothing_for_the_pause(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("tick")
    # A control job on the same schedule that nobody pauses: its fires show the fire times
    # the paused job lets pass.
    jobs = [job(every="1s"), job("control", every="1s")]
    async with scheduler_world(tmp_path, llm_server, jobs) as world:
        scheduler = await world.start_scheduler()
        await world.wait_history(lambda rows: any(r.outcome == "ok" for r in rows))
        paused_at = time.time()
        await world.store.job_set_paused("digest", True, since_ms=int(paused_at * 1000))
        async with asyncio.timeout(5):
            # The scheduler shows it took the pause by dropping the job from APScheduler.
            while True:
                if scheduler.registered() == 1:  # the control's is left
                    break
                await asyncio.sleep(0.02)
        await scheduler.wait_idle()
        # Nothing is due while paused: let two of the control's fire times pass, then look.
        await world.wait_history(
            lambda rows: (
                sum(r.scheduled_ms / 1000 > paused_at + 0.1 and r.final for r in rows) >= 2
            ),
            job_id="control",
        )
        during = [r for r in await world.history() if r.scheduled_ms / 1000 > paused_at + 0.1]
        resumed_at = time.time()
        await world.store.job_set_paused("digest", False, since_ms=int(resumed_at * 1000))
        rows = await world.wait_history(
            lambda rows: any(r.scheduled_ms / 1000 > resumed_at and r.final for r in rows)
        )
    assert during == []
    assert not any(r.cause == "catch-up" for r in rows)


async def test_a_pause_stops_a_fire_due_before_the_scheduler_reloads_its_jobs(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("must not run")
    fire_s = int(time.time()) + 2
    at = datetime.fromtimestamp(fire_s, UTC).isoformat()
    async with scheduler_world(tmp_path, llm_server, [job(at=at)]) as world:
        # The store is polled once a minute: the scheduler still holds the job as unpaused
        # when its fire comes, so only the claim can see the pause.
        scheduler = await world.start_scheduler(poll_s=60)
        await scheduler.wait_idle()
        assert scheduler.registered() == 1
        await world.store.job_set_paused("digest", True, since_ms=int(time.time() * 1000))
        async with asyncio.timeout(5):
            # APScheduler drops a one-shot job once it has fired.
            while True:
                if not scheduler.registered():
                    break
                await asyncio.sleep(0.02)
        await scheduler.wait_idle()
        rows = await world.history()
    assert llm_server.requests == []
    assert rows == []


async def test_a_chat_made_job_loses_tools_its_binding_no_longer_has(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("done")
    control = job("control", at=NOT_DUE, tools=["get_time"])
    async with scheduler_world(tmp_path, llm_server, [control]) as world:
        now = time.time()
        made_in_chat = JobRecord(
            id="chatty", origin="chat", schedule_kind="every", schedule="1h", timezone="UTC",
            anchor_ms=int(now * 1000), prompt="Use the clock.", deliver_to="ops",
            session_id="job:chatty", tools=("get_time",), time_budget_s=None, catch_up="latest",
            notify_on_failure=True,
            creator="binding:ops", paused=False, since_ms=int(now * 1000), created_at=now,
            updated_at=now,
        )  # fmt: skip
        await world.store.job_add(made_in_chat)
        await world.start_scheduler()
        for job_id in ("chatty", "control"):
            await world.store.fire_request(job_id, int(now * 1000))
        for job_id in ("chatty", "control"):
            await world.wait_history(lambda rows: any(r.final for r in rows), job_id=job_id)
    offered = {
        "chatty" if "Use the clock." in str(r.json["messages"]) else "control": [
            tool["name"] for tool in r.json.get("tools", [])
        ]
        for r in llm_server.requests
    }
    # The ops binding lists no tools: the chat-made job's model call offers none, while the
    # operator's job keeps its own allowlist.
    assert offered == {"chatty": [], "control": ["get_time"]}


async def test_an_operator_job_writes_unattended_a_chat_job_only_what_its_binding_preapproves(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """Nobody can approve a job's write: the operator's own job has its tools pre-approved by
    being written with them; a chat-made one gets only its binding's pre-approvals."""
    marker = tmp_path / "marker"
    bindings = [{**BINDINGS[0], "tools": ["write_marker"]}, BINDINGS[1]]
    writer = job("writer", at=NOT_DUE, tools=["write_marker"])
    async with scheduler_world(tmp_path, llm_server, [writer], bindings=bindings) as world:
        now = time.time()
        made_in_chat = JobRecord(
            id="chatty", origin="chat", schedule_kind="every", schedule="1h", timezone="UTC",
            anchor_ms=int(now * 1000), prompt="Write.", deliver_to="ops", session_id="job:chatty",
            tools=("write_marker",), time_budget_s=None, catch_up="latest",
            notify_on_failure=True, creator="binding:ops", paused=False,
            since_ms=int(now * 1000), created_at=now, updated_at=now,
        )  # fmt: skip
        await world.store.job_add(made_in_chat)
        await world.start_scheduler()
        for job_id, text in (("writer", "operator"), ("chatty", "chat")):
            llm_server.script(
                Reply(tool_calls=[Call("write_marker", {"text": text}, id=f"w-{text}")]),
                Reply("finished"),
            )
            await world.store.fire_request(job_id, int(now * 1000))
            await world.wait_history(lambda rows: any(r.final for r in rows), job_id=job_id)
    assert marker.read_text().splitlines() == ["write_marker:operator"]
    refused = str(llm_server.requests[-1].json["messages"])
    assert "refused" in refused


async def test_a_new_config_job_owes_nothing_from_before_the_scheduler_started(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """The daemon builds the scheduler before the channels connect, which can take longer
    than a job's interval: the config's jobs are read when the scheduler starts, so a new
    job's first fire is a scheduled one, not a catch-up for time before it existed."""
    llm_server.default = Reply("tick")
    async with scheduler_world(tmp_path, llm_server, [job(every="1s")]) as world:
        scheduler = JobScheduler(
            world.app.run_turn,
            world.store,
            world.config.bindings,
            world.outbox.kick,
            config_jobs=functools.partial(config_jobs, world.config),
            poll_s=0.05,
            owner=LocalOwner(),
        )
        await asyncio.sleep(1.3)  # the start-up in between, longer than the interval
        async with scheduler:
            rows = await world.wait_history(lambda rows: any(r.outcome == "ok" for r in rows))
    assert [(r.cause, r.outcome) for r in rows][:1] == [("schedule", "ok")]
    assert all(r.cause == "schedule" for r in rows)


async def test_a_fire_due_before_its_job_is_scheduled_runs_once_with_its_own_time(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """``start`` returns (and the daemon says READY) before the jobs are scheduled, which
    the poll task does in batches. A fire after the start's moment that passes before its
    job's batch runs is neither lost nor taken for a missed one: it runs at once, as a
    scheduled fire keyed by its own time."""
    llm_server.default = Reply("on its time")
    fire_s = time.time() + 3.0
    at = datetime.fromtimestamp(fire_s, UTC).isoformat()
    others = [job(f"other-{index:03d}", at=NOT_DUE) for index in range(300)]
    async with scheduler_world(tmp_path, llm_server, [job(at=at), *others]) as world:
        scheduler = await world.start_scheduler()
        assert scheduler.registered() == 0
        # Hold the event loop past the fire time, as a long run of batches would.
        time.sleep(max(0.0, fire_s + 0.3 - time.time()))  # noqa: ASYNC251  # on purpose
        await scheduler.wait_idle()
        assert scheduler.registered() == len(others)
        rows = await world.wait_history(lambda rows: any(r.final for r in rows))
    assert [(r.cause, r.outcome) for r in rows] == [("schedule", "ok")]
    assert rows[0].scheduled_ms == to_ms(datetime.fromisoformat(at))


async def test_a_slow_catch_up_still_runs_before_the_next_scheduled_fire(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catch-up claims its fire before the live schedule claims the next one: a store
    slow to record the missed fires must not let the next fire run first and leave the owed
    one skipped as an overlap."""
    llm_server.default = Reply("done")
    spec = job(every="1s", catch_up="latest")
    async with scheduler_world(tmp_path, llm_server, [spec]) as world:
        await world.down_after_a_run(2.2)
        recorded = world.store.fire_skip

        async def slow_skip(*args: object, **kwargs: object) -> FireRecord | None:
            # Longer than the interval: the next scheduled fire falls due meanwhile.
            await asyncio.sleep(1.2)
            return await recorded(*args, **kwargs)

        monkeypatch.setattr(world.store, "fire_skip", slow_skip)
        # Whichever fire runs first after the restart still runs when the other is claimed.
        llm_server.script(Delay(1.5, Reply("slow")))
        await world.start_scheduler()
        await world.wait_history(
            lambda rows: any(
                r.cause == "catch-up" and r.outcome in ("ok", "skipped-overlap") for r in rows
            )
        )
        await world.schedulers[-1].stop(5)
        rows = await world.history()
    catch_up = [r for r in rows if r.cause == "catch-up"]
    assert [r.outcome for r in catch_up] == ["skipped-missed", "ok"]
    assert catch_up[0].scheduled_ms < catch_up[1].scheduled_ms
    later = [r for r in rows if r.cause == "schedule" and r.scheduled_ms > catch_up[1].scheduled_ms]
    assert later
    assert later[0].outcome == "skipped-overlap"
    assert later[0].reason == f"fire {catch_up[1].id} of this job was still running"
