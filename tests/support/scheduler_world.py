"""An in-process scheduler world: the real app and store, the fake model server, an in-memory
chat platform behind the chat path as the daemon wires it, and :class:`JobScheduler`
instances that can be stopped and started again on the same state (a restart)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodebot.app.build import App
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.ownership import LocalOwner
from geodebot.chat.router import ChatRouter
from geodebot.config.schema import Config
from geodebot.engine.lanes import Grace
from geodebot.scheduler.definitions import config_jobs
from geodebot.scheduler.fire_runner import OnFire, ignore_fire
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.store.records import FireRecord
from geodebot.testing import MemoryChannel
from tests.support.app import open_app
from tests.support.chat import chat_pipeline
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import FakeLLMServer

BINDINGS = [
    {"platform": "telegram", "channel": "c1", "session": "ops", "allowed_users": ["*"]},
    {"platform": "telegram", "channel": "c2", "session": "dev", "allowed_users": ["*"]},
]


# A schedule for jobs a test runs by hand: it does not fire while a test runs (an "every" of
# a config job is anchored at the epoch, so "1h" fires at every whole hour).
NOT_DUE = "2099-01-01T00:00:00+00:00"


def job(job_id: str = "digest", **fields: Any) -> dict[str, Any]:
    return {"id": job_id, "prompt": "Summarise.", "deliver_to": "ops", **fields}


@dataclass
class World:
    app: App
    config: Config
    chat: MemoryChannel
    outbox: OutboxSender
    llm: FakeLLMServer
    router: ChatRouter
    schedulers: list[JobScheduler] = field(default_factory=list)

    @property
    def store(self) -> Any:
        return self.app.services.store

    async def start_scheduler(
        self, *, poll_s: float = 0.05, on_fire: OnFire = ignore_fire
    ) -> JobScheduler:
        scheduler = JobScheduler(
            self.app.run_turn,
            self.store,
            self.config.bindings,
            self.outbox.kick,
            config_jobs=functools.partial(config_jobs, self.config),
            poll_s=poll_s,
            on_fire=on_fire,
            owner=LocalOwner(),
        )
        await scheduler.start()
        self.schedulers.append(scheduler)
        return scheduler

    async def down_after_a_run(self, down_s: float) -> None:
        """A scheduler runs until the job's first ``ok`` fire, stops, and stays stopped for
        ``down_s`` (a downtime a restart catches up on)."""
        scheduler = await self.start_scheduler()
        await self.wait_history(lambda rows: any(r.outcome == "ok" for r in rows))
        await scheduler.stop(5)
        await asyncio.sleep(down_s)

    async def history(self, job_id: str = "digest") -> list[FireRecord]:
        return list(reversed(await self.store.fire_history(job_id)))

    async def wait_history(
        self,
        predicate: Callable[[list[FireRecord]], bool],
        job_id: str = "digest",
        timeout: float = 15.0,
    ) -> list[FireRecord]:
        """Until the job's history (oldest first) satisfies ``predicate``; the store is the
        only place the outcome shows, so it is read every few milliseconds."""
        async with asyncio.timeout(timeout):
            while True:
                rows = await self.history(job_id)
                if predicate(rows):
                    return rows
                await asyncio.sleep(0.02)

    async def sent(self, n: int, channel: str = "c1") -> list[str]:
        async with asyncio.timeout(15):
            return await self.chat.wait_sent(n, channel)


@asynccontextmanager
async def scheduler_world(
    tmp_path: Path,
    llm: FakeLLMServer,
    jobs: Sequence[Mapping[str, Any]],
    *,
    budgets: Mapping[str, Any] | None = None,
    bindings: Sequence[Mapping[str, Any]] = BINDINGS,
    turns_grace: Grace | None = None,
) -> AsyncIterator[World]:
    config = with_sections(
        make_config(tmp_path, llm, budgets=budgets), bindings=list(bindings), jobs=list(jobs)
    )
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        chat = MemoryChannel("telegram")
        # The chat path as the daemon wires it; its router takes in only once a test starts
        # the channel with it.
        chat_path = chat_pipeline(
            app,
            {"telegram": chat},
            streams=False,
            max_chars={"telegram": 500},
            turns_grace=turns_grace if turns_grace is not None else Grace(1.0),
        )
        world = World(app, config, chat, chat_path.outbox, llm, chat_path.router)
        async with chat_path:
            try:
                yield world
            finally:
                for scheduler in world.schedulers:
                    await scheduler.stop(1)
