"""The chaos run: ``geodebot serve`` on Telegram, Slack and Discord at once, SIGKILLed and
restarted at seeded points while messages keep arriving, then counted.

Shared by ``tests/e2e/test_chaos.py`` (short runs in CI) and ``bench/chaos.py`` (any length).
:func:`tests.support.chaos.plan.schedule` turns a :class:`ChaosPlan` into the messages and the
kill points; :func:`run_chaos` plays it: a sender pushes the messages on the fakes whether or
not a daemon is up (:mod:`tests.support.chaos.traffic`), while

- without replicas, a killer kills the one daemon and restarts it on the same SQLite state;
- with ``replicas``, N daemons share one PostgreSQL database (a throwaway durable cluster):
  kills hit random replicas and pauses the serving one (:mod:`tests.support.chaos.replicas`).

After the last event the daemons get a quiet period to drain, are stopped with SIGTERM, and
:func:`tests.support.chaos.checks.tally` counts what happened.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

from geodebot.config.schema import DB_FILE
from tests.support.chaos.checks import ChaosReport, tally
from tests.support.chaos.plan import ChaosPlan, KillPoint, replica_events, schedule
from tests.support.chaos.replicas import Fleet
from tests.support.chaos.stores import PostgresDatabase, SQLiteFile
from tests.support.chaos.traffic import Traffic
from tests.support.chaos.world import (
    DISCORD_TOKEN,
    ChaosGuild,
    ChaosModel,
    Chat,
    Fakes,
    ReplicaSetup,
    chats,
    prepare_workspace,
    write_config,
)
from tests.support.config import TEST_KEY
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.postgres import Cluster

__all__ = ["ChaosPlan", "run_chaos"]


def discord_ids(bound: list[Chat]) -> list[str]:
    return [c.channel for c in bound if c.platform == "discord"]


@dataclass
class _Single:
    """The one daemon on SQLite, killed and restarted on the same state directory."""

    plan: ChaosPlan
    config: Path
    env: dict[str, str]
    say: Callable[[str], None]
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    kills_done: int = 0

    async def start(self) -> None:
        began = time.monotonic()
        self.daemon = DaemonProcess(self.config, self.env)
        self.daemons.append(self.daemon)
        await self.daemon.start(timeout_s=60)
        self.restart_s.append(time.monotonic() - began)

    async def kill(self) -> None:
        if self.daemon is not None:
            await self.daemon.kill()

    def logs(self) -> list[str]:
        return [line for daemon in self.daemons for line in daemon.log]

    async def kill_all(self, kills: list[KillPoint], traffic: Traffic) -> None:
        for point in kills:
            await traffic.sent_past(point.after_message)
            await asyncio.sleep(point.delay_s)
            assert self.daemon is not None
            await self.daemon.kill()
            self.kills_done += 1
            self.say(f"kill {self.kills_done}/{len(kills)} after message {point.after_message}")
            await asyncio.sleep(point.down_s)
            await self.start()


async def run_chaos(
    plan: ChaosPlan,
    workdir: Path,
    say: Callable[[str], None] = lambda line: None,
    *,
    cluster: Cluster | None = None,
) -> ChaosReport:
    """Play ``plan`` in ``workdir``. With replicas, their database is a new one on
    ``cluster``, else on a durable cluster of the run's own."""
    began = time.monotonic()
    async with AsyncExitStack() as stack:
        llm = await stack.enter_async_context(FakeLLMServer())
        llm.responder = ChaosModel(plan.seed)
        telegram = await stack.enter_async_context(FakeTelegram())
        # Slack retries an unacknowledged event; here until it is acknowledged.
        slack = FakeSlack(redeliver_after_s=2.0, max_redeliveries=10_000)
        await stack.enter_async_context(slack)
        bound = chats(plan.chats_per_platform)
        guild = ChaosGuild(discord_ids(bound), token=DISCORD_TOKEN)
        discord = await stack.enter_async_context(guild)
        fakes = Fakes(telegram, slack, discord, llm.url)
        env = fakes.env(dict(os.environ), TEST_KEY)
        if plan.replicas:
            if cluster is None:
                # Durable: the database pays for its commits as a real one does.
                cluster = Cluster()
                stack.callback(cluster.stop)
                await asyncio.to_thread(cluster.start, durable=True)
            url = await asyncio.to_thread(cluster.new_database)
            return await _run_replicas(plan, workdir, fakes, env, url, stack, say, began)
        return await _run_single(plan, workdir, fakes, env, stack, say, began)


async def _run_single(
    plan: ChaosPlan,
    workdir: Path,
    fakes: Fakes,
    env: dict[str, str],
    stack: AsyncExitStack,
    say: Callable[[str], None],
    began: float,
) -> ChaosReport:
    outgoing, kills = schedule(plan)
    bound = chats(plan.chats_per_platform)
    config = write_config(workdir / "config.toml", fakes, bound, plan.job_every_s)
    store = SQLiteFile(config.parent / "var" / DB_FILE)
    traffic = Traffic(plan, fakes, store)
    run = _Single(plan, config, env, say)
    stack.push_async_callback(run.kill)  # never leave a daemon behind
    await run.start()
    say(f"daemon up; sending {plan.messages} messages, {plan.kills} kills (seed {plan.seed})")
    await asyncio.gather(traffic.send_all(outgoing), run.kill_all(kills, traffic))
    say("all sent and every kill done; draining")
    drained = await traffic.drain()
    assert run.daemon is not None
    exit_code = await run.daemon.stop(timeout_s=60)
    return await asyncio.to_thread(
        tally,
        plan_line=plan.line(),
        fakes=fakes,
        workspace=workdir / "workspace",
        store=store,
        kills_done=run.kills_done,
        kills_planned=len(kills),
        restart_s=run.restart_s,
        drained=drained,
        stops={"the daemon": exit_code},
        logs=run.logs(),
        wall_s=time.monotonic() - began,
    )


async def _run_replicas(
    plan: ChaosPlan,
    workdir: Path,
    fakes: Fakes,
    env: dict[str, str],
    url: str,
    stack: AsyncExitStack,
    say: Callable[[str], None],
    began: float,
) -> ChaosReport:
    outgoing, kills = schedule(plan)
    events = replica_events(plan, kills)
    bound = chats(plan.chats_per_platform)
    workspace = prepare_workspace(workdir / "workspace", bound)
    configs = {}
    for n in range(1, plan.replicas + 1):
        name = f"r{n}"
        setup = ReplicaSetup(name, url, plan.lease_ttl_s)
        path = workdir / name / "config.toml"
        path.parent.mkdir(parents=True)
        configs[name] = write_config(
            path, fakes, bound, plan.job_every_s, replica=setup, workspace=workspace
        )
    store = PostgresDatabase(url)
    traffic = Traffic(plan, fakes, store)
    fleet = await stack.enter_async_context(Fleet(plan, configs, env, url, say))
    await fleet.start_all(discord_channels=len(discord_ids(bound)))
    say(
        f"{plan.replicas} replicas up; sending {plan.messages} messages, {plan.kills} kills,"
        f" {plan.pauses} pauses (seed {plan.seed})"
    )
    await asyncio.gather(traffic.send_all(outgoing), fleet.run_events(events, traffic))
    say("all sent and every kill and pause done; draining")
    drained = await traffic.drain()
    if not drained:
        for line in await asyncio.to_thread(traffic.waiting_for):
            say(f"not drained: {line}")
    stops = await fleet.stop_all()
    fleet.keep_logs()
    return await asyncio.to_thread(
        tally,
        plan_line=plan.line(),
        fakes=fakes,
        workspace=workspace,
        store=store,
        kills_done=fleet.kills_done,
        kills_planned=len(kills),
        restart_s=fleet.start_s,
        drained=drained,
        stops=stops,
        logs=fleet.logs(),
        wall_s=time.monotonic() - began,
        replicas=fleet.report(),
    )
