"""Abuse through ``geodebot serve`` on Discord: malformed gateway dispatches, an oversized
message, other bots and webhooks answering every message. discord.py against the fake Discord
(REST + gateway), the anthropic SDK against the fake model server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.abuse import daemon_and_model, free_port, metric, scrape, scrape_until
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.llm_server import FakeLLMServer, Reply

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.abuse-discord-LeakCanary-0123456789"
TOKEN_ENV = "ABUSE_DISCORD_TOKEN"
ALICE, OTHER_BOT, WEBHOOK = "700000000000000001", "700000000000000777", "700000000000000888"


@dataclass
class World:
    discord: FakeDiscord
    llm: FakeLLMServer
    tmp_path: Path
    http_port: int = field(default_factory=free_port)
    daemons: list[DaemonProcess] = field(default_factory=list)

    async def start(self) -> DaemonProcess:
        config = self.tmp_path / "config.toml"
        config.write_text(
            daemon_and_model(self.tmp_path / "var", self.http_port, self.llm.url, TEST_KEY_ENV)
            + f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\nmax_message_chars = 1500\n'
            f'api_base_url = "{self.discord.api_base_url}"\n'
            f'gateway_url = "{self.discord.gateway_url}"\n'
            f'[[bindings]]\nplatform = "discord"\nchannel = "{self.discord.channel_id}"\n'
            'session = "ops"\nallowed_users = ["*"]\n'
        )
        env = dict(os.environ, **{TOKEN_ENV: TOKEN, TEST_KEY_ENV: TEST_KEY})
        daemon = DaemonProcess(config, env)
        self.daemons.append(daemon)
        return await daemon.start()

    @property
    def ops(self) -> str:
        return self.discord.channel_id

    def replies(self) -> list[Json]:
        return list(self.discord.posted.get(self.ops, []))

    async def until_replies(self, n: int, daemon: DaemonProcess, within: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + within
        while len(self.replies()) < n:
            exited = daemon.proc is not None and daemon.proc.returncode is not None
            if exited or asyncio.get_running_loop().time() > deadline:
                what = "the daemon exited" if exited else f"no reply {n} within {within:g} s"
                raise AssertionError(what + ":\n" + daemon.text()[-4000:])
            await asyncio.sleep(0.02)

    def dispatch_raw(self, data: Json) -> None:
        """A MESSAGE_CREATE with exactly ``data``, whatever it lacks."""
        self.discord._dispatch("MESSAGE_CREATE", data)

    def message(self, content: str, author: Json, **extra: Any) -> Json:
        """A well-formed message from ``author``, stored in history, not yet dispatched."""
        fake = self.discord
        msg = fake._store(self.ops, fake.guild_id, author, content)
        msg.update(extra)
        return msg


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with FakeDiscord(token=TOKEN) as discord, FakeLLMServer() as llm:
        world = World(discord, llm, tmp_path)
        try:
            yield world
        finally:
            for daemon in world.daemons:
                await daemon.kill()


async def stop_cleanly(daemon: DaemonProcess) -> None:
    code = await daemon.stop()
    text = daemon.text()
    assert code == 0, text[-3000:]
    assert TOKEN not in text
    assert TEST_KEY not in text


async def test_malformed_dispatches_and_an_oversized_message_leave_the_gateway_working(
    world: World,
) -> None:
    world.llm.default = Reply("answer to the good one")
    daemon = await world.start()
    fake = world.discord
    try:
        alice = fake.user(ALICE)
        world.dispatch_raw({"id": fake._next_id(), "channel_id": world.ops})  # no author etc.
        world.dispatch_raw({"id": fake._next_id(), "content": "no channel", "author": alice})
        world.dispatch_raw({"id": "not-a-snowflake", "channel_id": world.ops, "author": "x"})
        world.dispatch_raw(world.message("bad author", {"id": None}))
        fake._dispatch("NOT_A_REAL_EVENT", {"what": "ever"})
        oversized = fake.push_message(world.ops, "z" * 1800, author_id=ALICE)
        await world.until_replies(1, daemon)
        # The good one, last, is the control: the gateway's dispatches are handled in order.
        good = fake.push_message(world.ops, "the good one", author_id=ALICE)
        await world.until_replies(2, daemon)
        scraped = await scrape(world.http_port)
    finally:
        await stop_cleanly(daemon)
    refusal, answer = world.replies()
    assert refusal["message_reference"]["message_id"] == oversized
    assert "limit here is 1,500" in refusal["content"]
    assert len(refusal["content"]) < 200
    assert answer["message_reference"]["message_id"] == good
    assert answer["content"] == "answer to the good one"
    assert len(world.llm.requests) == 1
    assert "the good one" in json.dumps(world.llm.requests[0].json)
    assert fake.identify_count == 1  # one session all along: nothing reconnected
    assert metric(scraped, "geodebot_channel_events_total", platform="discord", event="malformed")
    assert metric(scraped, "geodebot_messages_total", event="accepted") == 2
    assert metric(scraped, "geodebot_messages_total", event="too_large") == 1


async def test_other_bots_and_webhooks_answering_every_message_get_no_answer(
    world: World,
) -> None:
    world.llm.default = Reply("hello human")
    daemon = await world.start()
    fake = world.discord
    try:
        fake.push_message(world.ops, "start", author_id=ALICE)
        await world.until_replies(1, daemon)
        first = world.replies()[0]["id"]
        reference = {"message_id": first, "channel_id": world.ops}
        mention = f"<@{fake.bot_id}> thanks, and what else?"
        bot = fake.user(OTHER_BOT, bot=True)
        # A webhook's author is no user: Discord marks the message with webhook_id; the
        # author object need not say bot.
        hook = fake.user(WEBHOOK, name="Relay") | {"discriminator": "0000"}
        hook.pop("bot")
        for i in range(3):
            for author, extra in ((bot, {}), (hook, {"webhook_id": WEBHOOK})):
                msg = world.message(
                    f"{mention} ({i})",
                    author,
                    type=19,
                    message_reference=reference,
                    mentions=[fake.bot_user()],
                    **extra,
                )
                world.dispatch_raw(msg)
        fake.push_message(world.ops, "control", author_id=ALICE)
        await world.until_replies(2, daemon)
        # geodebot's own second answer comes back over the gateway after it was posted.
        scraped = await scrape_until(
            world.http_port, "geodebot_messages_total", 2, event="dropped:self"
        )
    finally:
        await stop_cleanly(daemon)
    assert [r["content"] for r in world.replies()] == ["hello human", "hello human"]
    assert len(world.llm.requests) == 2
    assert all("what else" not in json.dumps(r.json) for r in world.llm.requests)
    assert metric(scraped, "geodebot_messages_total", event="dropped:bot") == 6
    # geodebot's own two answers came back over the gateway too, and were dropped as its own.
    assert metric(scraped, "geodebot_messages_total", event="dropped:self") == 2
