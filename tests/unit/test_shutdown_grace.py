"""Shutdown: running turns get the grace period once, whoever drains them.

The job scheduler and the chat router both drain turns when the daemon stops; they share one
:class:`Grace`, so a job that uses all of it leaves none for a chat turn that would need more,
instead of each getting a grace of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.daemon import _slow_shutdown
from geodebot.channels.base import Inbound
from geodebot.chat.ownership import LocalOwner
from geodebot.engine.lanes import Grace, cancel_and_wait
from geodebot.scheduler.definitions import config_jobs
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.scheduler.schedule import format_fire
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Hang, Item, Reply
from tests.support.scheduler_world import NOT_DUE, job, scheduler_world

GRACE_S = 1.0
# Longer than the grace, shorter than twice it: a chat turn this slow is answered only if
# the router's drain got a grace of its own.
SLOW_CHAT_S = 1.5


def test_the_clock_starts_at_the_first_ask_and_runs_out() -> None:
    now = [100.0]
    grace = Grace(5.0, clock=lambda: now[0])
    now[0] = 130.0  # nobody asked yet: nothing is used up
    assert grace.left() == 5.0
    now[0] = 133.5
    assert grace.left() == 1.5
    now[0] = 140.0
    assert grace.left() == 0.0


async def test_running_turns_get_the_grace_once_not_once_per_service(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    def model(body: dict[str, Any]) -> Item | None:
        text = str(body.get("messages"))
        if "Summarise." in text:
            return Hang()
        if "a slow question" in text:
            return Delay(SLOW_CHAT_S, Reply("a late answer"))
        return None

    llm_server.responder = model
    grace = Grace(GRACE_S)
    jobs = [job("digest", at=NOT_DUE)]
    async with scheduler_world(tmp_path, llm_server, jobs, turns_grace=grace) as world:
        config = world.config
        scheduler = JobScheduler(
            world.app.run_turn,
            world.store,
            config.bindings,
            world.outbox.kick,
            config_jobs=functools.partial(config_jobs, config),
            grace=grace,
            poll_s=0.05,
            owner=LocalOwner(),
        )
        await world.chat.start(world.router.accept)
        async with scheduler:
            await world.store.fire_request("digest", int(time.time() * 1000))
            await world.chat.deliver(
                Inbound(
                    platform="telegram",
                    event_id="e1",
                    channel="c1",
                    thread=None,
                    user="u1",
                    text="a slow question",
                    message_id="m1",
                )
            )
            async with asyncio.timeout(15):
                await llm_server.wait_for_requests(2)
        # The scheduler's drain used the whole grace on the hung job; the router drains
        # next, as the daemon's stop does, with what is left of it.
        assert grace.left() == 0.0
        await world.router.drain(grace.left())
        fires = await world.history()
        assert (fires[-1].outcome, fires[-1].reason) == ("failed", "daemon stopped")
        # Nothing was left for the chat turn: stopped, not answered, and its message is
        # still unfinished, for the restart to answer. (Answered, its row would be done.)
        unfinished = await world.store.inbox_unfinished()
        assert [(row.text, row.status) for row in unfinished] == [("a slow question", "running")]
        # The job's failure notice still goes out; it is all the chat gets.
        assert await world.sent(1) == [
            f"Job digest ({format_fire(fires[-1].scheduled_ms, 'UTC')}) failed: daemon stopped"
        ]


def test_a_grace_ended_now_gives_nothing_to_whoever_asks_before_or_after() -> None:
    # The daemon's lease was lost: its turns and outbox could commit and send nothing more.
    now = [100.0]
    asked_first, untouched = Grace(30, clock=lambda: now[0]), Grace(30, clock=lambda: now[0])
    assert asked_first.left() == 30
    now[0] += 5
    asked_first.end_now()
    untouched.end_now()
    assert (asked_first.left(), untouched.left()) == (0.0, 0.0)
    now[0] += 60
    assert asked_first.left() == untouched.left() == 0.0


async def test_a_task_that_loses_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    # What Python 3.11's asyncio.wait_for can do inside a driver: the cancellation arrives as
    # the wait completes and is lost, and the loop runs on.
    lost = 0

    async def loop_that_loses_one() -> None:
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost += 1

    task = asyncio.create_task(loop_that_loses_one())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, again_every_s=0.01), 10)
    assert task.cancelled()
    assert lost == 1


async def test_a_stop_that_takes_too_long_names_the_tasks_it_waits_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def waiting_for_a_peer_that_never_answers(gate: asyncio.Event) -> None:
        await gate.wait()

    gate = asyncio.Event()
    stuck = asyncio.create_task(waiting_for_a_peer_that_never_answers(gate), name="renewals")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="geodebot.app.daemon"):
        await _slow_shutdown(0.0)
    gate.set()
    await stuck
    [record] = [r for r in caplog.records if "still stopping" in r.getMessage()]
    text = record.getMessage()
    assert "renewals: waiting_for_a_peer_that_never_answers (test_shutdown_grace.py:" in text
