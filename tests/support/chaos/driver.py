"""The chaos run: ``geodebot serve`` on Telegram, Slack and Discord at once, SIGKILLed and
restarted at seeded points while messages keep arriving, then counted.

Shared by ``tests/e2e/test_chaos.py`` (a short run in CI) and ``bench/chaos.py`` (any length).
:func:`schedule` turns a :class:`ChaosPlan` into the messages (chat, pause before each) and the
kill points (after which message, how long after it, how long the daemon stays down), all from
``random.Random(seed)``. :func:`run_chaos` plays it: a sender task pushes the messages on the
fakes whether or not the daemon is up (the fakes redeliver what it never acknowledged, as the
platforms do), a killer task kills and restarts the daemon on the same state directory. After
the last restart the daemon gets a quiet period to drain, is stopped with SIGTERM, and
:func:`tests.support.chaos.checks.tally` counts what happened.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from geodebot.config.schema import DB_FILE
from tests.support.chaos.checks import ChaosReport, tally
from tests.support.chaos.world import (
    DISCORD_TOKEN,
    USER_DISCORD,
    USER_SLACK,
    USER_TG,
    ChaosGuild,
    ChaosModel,
    Chat,
    Fakes,
    Sent,
    chats,
    write_config,
)
from tests.support.config import TEST_KEY
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram


@dataclass(frozen=True)
class ChaosPlan:
    seed: int = 1
    messages: int = 120
    kills: int = 6
    chats_per_platform: int = 4
    rate: float = 12.0  # messages per second, on average
    job_every_s: int = 2
    max_kill_delay_s: float = 0.8  # a kill comes this long at most after its message
    max_down_s: float = 0.5  # the daemon stays down this long at most before the restart
    drain_timeout_s: float = 60.0
    settle_s: float = 2.0  # quiet time after the drain, for late duplicates to show


@dataclass(frozen=True)
class Outgoing:
    index: int
    chat: Chat
    pause_s: float  # before sending it


@dataclass(frozen=True)
class KillPoint:
    after_message: int  # once this message (0-based) was sent
    delay_s: float
    down_s: float


def schedule(plan: ChaosPlan) -> tuple[list[Outgoing], list[KillPoint]]:
    rng = random.Random(plan.seed)
    bound = chats(plan.chats_per_platform)
    outgoing = [
        Outgoing(i, rng.choice(bound), rng.expovariate(plan.rate)) for i in range(plan.messages)
    ]
    if plan.kills <= plan.messages:
        afters = rng.sample(range(plan.messages), plan.kills)
    else:
        afters = rng.choices(range(plan.messages), k=plan.kills)
    kills = [
        KillPoint(after, rng.uniform(0, plan.max_kill_delay_s), rng.uniform(0, plan.max_down_s))
        for after in sorted(afters)
    ]
    return outgoing, kills


@dataclass
class _Run:
    plan: ChaosPlan
    fakes: Fakes
    config: Path
    env: dict[str, str]
    say: Callable[[str], None]
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    kills_done: int = 0
    pushed: int = 0
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def db(self) -> Path:
        return self.config.parent / "var" / DB_FILE

    async def start(self) -> None:
        began = time.monotonic()
        self.daemon = DaemonProcess(self.config, self.env)
        self.daemons.append(self.daemon)
        await self.daemon.start(timeout_s=60)
        self.restart_s.append(time.monotonic() - began)

    async def kill(self) -> None:
        if self.daemon is not None:
            await self.daemon.kill()

    def _pushed_past(self, index: int) -> bool:
        return self.pushed > index

    def logs(self) -> list[str]:
        return [line for daemon in self.daemons for line in daemon.log]

    async def send_all(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            await asyncio.sleep(out.pause_s)
            await self._send(out)
            async with self.progress:
                self.pushed += 1
                self.progress.notify_all()

    async def _send(self, out: Outgoing) -> None:
        marker = f"CHX{out.index:05d}"
        text = f"{marker} please log to {out.chat.session}.log"
        chat, fakes = out.chat, self.fakes
        if chat.platform == "telegram":
            update_id = fakes.telegram.push_message(int(chat.channel), text, user_id=USER_TG)
            message_id = fakes.telegram.pushed[update_id]["message"]["message_id"]
            event_id, reply_to, envelope = str(update_id), str(message_id), ""
        elif chat.platform == "slack":
            ts = f"{1_700_000_000 + out.index}.000100"
            event = FakeSlack.message_event(chat.channel, USER_SLACK, text, ts=ts)
            event_id, reply_to = f"EvCHX{out.index:05d}", ts
            envelope = await fakes.slack.push_event(event, event_id=event_id)
        else:
            event_id = fakes.discord.push_message(chat.channel, text, author_id=USER_DISCORD)
            reply_to, envelope = event_id, ""
        sent = Sent(out.index, marker, chat, event_id, reply_to, time.monotonic(), envelope)
        fakes.sent.append(sent)

    async def kill_all(self, kills: list[KillPoint]) -> None:
        for point in kills:
            async with self.progress:
                await self.progress.wait_for(partial(self._pushed_past, point.after_message))
            await asyncio.sleep(point.delay_s)
            assert self.daemon is not None
            await self.daemon.kill()
            self.kills_done += 1
            self.say(f"kill {self.kills_done}/{len(kills)} after message {point.after_message}")
            await asyncio.sleep(point.down_s)
            await self.start()

    async def drain(self) -> bool:
        """Until every message is acknowledged and answered and the outbox is empty, then
        ``settle_s`` more; False if that did not happen within ``drain_timeout_s``."""
        deadline = time.monotonic() + self.plan.drain_timeout_s
        while time.monotonic() < deadline:
            if await self._quiet():
                await asyncio.sleep(self.plan.settle_s)
                if await self._quiet():
                    return True
            await asyncio.sleep(0.25)
        return False

    async def _quiet(self) -> bool:
        fakes = self.fakes
        telegram = [int(s.event_id) for s in fakes.sent if s.chat.platform == "telegram"]
        if telegram and fakes.telegram.confirmed_offset <= max(telegram):
            return False
        slack = [s.envelope for s in fakes.sent if s.chat.platform == "slack"]
        if not all(fakes.slack.acked(e) for e in slack):
            return False
        discord = {s.event_id for s in fakes.sent if s.chat.platform == "discord"}
        busy, seen = await asyncio.to_thread(_store_state, self.db)
        return busy == 0 and discord <= seen


def _store_state(db: Path) -> tuple[int, set[str]]:
    """(inbox rows unanswered + outbox rows unsent, Discord event ids in the inbox)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        busy = conn.execute(
            "SELECT (SELECT count(*) FROM inbox WHERE status IN ('pending', 'running'))"
            " + (SELECT count(*) FROM outbox WHERE status = 'pending')"
        ).fetchone()[0]
        rows = conn.execute("SELECT event_id FROM inbox WHERE platform = 'discord'").fetchall()
    return int(busy), {str(r[0]) for r in rows}


async def run_chaos(
    plan: ChaosPlan, workdir: Path, say: Callable[[str], None] = lambda line: None
) -> ChaosReport:
    outgoing, kills = schedule(plan)
    bound = chats(plan.chats_per_platform)
    began = time.monotonic()
    async with AsyncExitStack() as stack:
        llm = await stack.enter_async_context(FakeLLMServer())
        llm.responder = ChaosModel(plan.seed)
        telegram = await stack.enter_async_context(FakeTelegram())
        # Slack retries an unacknowledged event; here until it is acknowledged.
        slack = FakeSlack(redeliver_after_s=2.0, max_redeliveries=10_000)
        await stack.enter_async_context(slack)
        discord_ids = [c.channel for c in bound if c.platform == "discord"]
        discord = await stack.enter_async_context(ChaosGuild(discord_ids, token=DISCORD_TOKEN))
        fakes = Fakes(telegram, slack, discord, llm.url)
        config = write_config(workdir / "config.toml", fakes, bound, plan.job_every_s)
        run = _Run(plan, fakes, config, fakes.env(dict(os.environ), TEST_KEY), say)
        stack.push_async_callback(run.kill)  # never leave a daemon behind
        await run.start()
        say(f"daemon up; sending {plan.messages} messages, {plan.kills} kills (seed {plan.seed})")
        await asyncio.gather(run.send_all(outgoing), run.kill_all(kills))
        say("all sent and every kill done; draining")
        drained = await run.drain()
        assert run.daemon is not None
        exit_code = await run.daemon.stop(timeout_s=60)
        return await asyncio.to_thread(
            tally,
            plan_line=f"seed={plan.seed} messages={plan.messages} kills={plan.kills}",
            fakes=fakes,
            workspace=workdir / "workspace",
            db=run.db,
            kills_done=run.kills_done,
            kills_planned=len(kills),
            restart_s=run.restart_s,
            drained=drained,
            exit_code=exit_code,
            logs=run.logs(),
            wall_s=time.monotonic() - began,
        )
