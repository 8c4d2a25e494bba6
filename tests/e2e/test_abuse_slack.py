"""Abuse through ``geodebot serve`` on Slack: broken Socket Mode envelopes, an oversized
message, and other bots (``bot_id``, ``subtype: bot_message``) answering every message.
slack-bolt against the fake Slack, the anthropic SDK against the fake model server."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.abuse import daemon_and_model, free_port, metric, scrape
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack, Posted, _Envelope

OPS = "C0OPS0001"
ALICE, BOB = "UALICE001", "UBOB00001"
BOT_TOKEN_ENV, APP_TOKEN_ENV = "ABUSE_SLACK_BOT_TOKEN", "ABUSE_SLACK_APP_TOKEN"


@dataclass
class World:
    slack: FakeSlack
    llm: FakeLLMServer
    tmp_path: Path
    http_port: int = field(default_factory=free_port)
    daemons: list[DaemonProcess] = field(default_factory=list)
    ts: int = 0

    async def start(self) -> DaemonProcess:
        config = self.tmp_path / "config.toml"
        config.write_text(
            daemon_and_model(self.tmp_path / "var", self.http_port, self.llm.url, TEST_KEY_ENV)
            + f'[channels.slack]\nbot_token_env = "{BOT_TOKEN_ENV}"\n'
            f'app_token_env = "{APP_TOKEN_ENV}"\napi_base_url = "{self.slack.api_base_url}"\n'
            "max_message_chars = 3000\n"
            f'[[bindings]]\nplatform = "slack"\nchannel = "{OPS}"\nsession = "ops"\n'
            'allowed_users = ["*"]\n'
        )
        env = dict(os.environ)
        env.update({BOT_TOKEN_ENV: self.slack.bot_token, APP_TOKEN_ENV: self.slack.app_token})
        env[TEST_KEY_ENV] = TEST_KEY
        daemon = DaemonProcess(config, env)
        self.daemons.append(daemon)
        return await daemon.start()

    def new_ts(self) -> str:
        self.ts += 1
        return f"{1_700_000_000 + self.ts}.000100"

    async def say(self, text: str, user: str = ALICE, **kw: Any) -> tuple[dict[str, Any], str]:
        event = FakeSlack.message_event(OPS, user, text, ts=self.new_ts(), **kw)
        return event, await self.slack.push_event(event)

    async def raw(self, envelope_type: str, payload: Any) -> str:
        """A Socket Mode envelope with exactly ``payload``, whatever it lacks."""
        envelope_id = str(uuid.uuid4())
        self.slack._envelopes[envelope_id] = _Envelope()
        frame = {"envelope_id": envelope_id, "type": envelope_type, "payload": payload}
        await self.slack._send(frame | {"accepts_response_payload": False, "retry_attempt": 0})
        return envelope_id

    def posts(self) -> list[Posted]:
        return list(self.slack.posted.get(OPS, []))

    async def until_posts(self, n: int, daemon: DaemonProcess, within: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + within
        while len(self.posts()) < n:
            exited = daemon.proc is not None and daemon.proc.returncode is not None
            if exited or asyncio.get_running_loop().time() > deadline:
                what = "the daemon exited" if exited else f"no post {n} within {within:g} s"
                raise AssertionError(what + ":\n" + daemon.text()[-4000:])
            await asyncio.sleep(0.02)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with FakeSlack() as slack, FakeLLMServer() as llm:
        world = World(slack, llm, tmp_path)
        try:
            yield world
        finally:
            for daemon in world.daemons:
                await daemon.kill()


async def stop_cleanly(world: World, daemon: DaemonProcess) -> None:
    code = await daemon.stop()
    text = daemon.text()
    assert code == 0, text[-3000:]
    for secret in (world.slack.bot_token, world.slack.app_token, TEST_KEY):
        assert secret not in text


def callback(event: Any, event_id: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"type": "event_callback", "team_id": "TFAKE0001", "event": event}
    return body | {"event_id": event_id or f"EvBAD{uuid.uuid4().hex[:8]}"}


async def test_broken_envelopes_and_an_oversized_message_are_survived(world: World) -> None:
    world.llm.default = Reply("answer to the good one")
    daemon = await world.start()
    try:
        broken = [
            await world.raw("events_api", callback("garbage")),
            await world.raw("events_api", callback({"type": "message", "text": "no channel"})),
            await world.raw(
                "events_api",
                callback({"type": "message", "channel": OPS, "ts": ["x"], "text": {"a": 1}}),
            ),
            await world.raw("events_api", {"type": "event_callback"}),  # no event at all
            await world.raw("events_api", None),
            await world.raw("slash_commands", {"command": "/status"}),  # no channel, no user
        ]
        await world.slack._send({"type": "events_api"})  # no envelope id, no payload
        _, oversized = await world.say("w" * 3500)
        await world.until_posts(1, daemon)
        good, _ = await world.say("the good one")
        await world.until_posts(2, daemon)
        await asyncio.sleep(0.5)
        scraped = await scrape(world.http_port)
        daemon_alive = daemon.proc is not None and daemon.proc.returncode is None
    finally:
        await stop_cleanly(world, daemon)
    assert daemon_alive
    refusal, answer = world.posts()
    assert "limit here is 3,000" in refusal.text
    assert len(refusal.text) < 200
    assert answer.text == "answer to the good one"
    assert answer.thread_ts == good["ts"]
    assert world.slack.acked(oversized)
    assert len(world.llm.requests) == 1
    assert "the good one" in json.dumps(world.llm.requests[0].json)
    # What reaches the adapter is acknowledged (not redelivered) and counted as ignored; what
    # Bolt or slack_sdk cannot read at all is left unacknowledged (Slack retries it three
    # times, then gives up), logged, and, where Bolt reports it, counted as an error.
    assert [world.slack.acked(e) for e in broken] == [False, True, True, False, False, True]
    slack_events = {"name": "geodebot_channel_events_total", "platform": "slack"}
    assert metric(scraped, **slack_events, event="ignored") == 3
    assert metric(scraped, **slack_events, event="errors") == 1
    assert metric(scraped, "geodebot_messages_total", event="accepted") == 2
    assert metric(scraped, "geodebot_messages_total", event="too_large") == 1


async def test_other_bots_answering_every_message_get_no_answer(world: World) -> None:
    world.llm.default = Reply("hello human")
    daemon = await world.start()
    slack = world.slack
    try:
        await world.say("start")
        await world.until_posts(1, daemon)
        mention = f"<@{slack.bot_user_id}> thanks, and what else?"
        envelopes: list[str] = []
        for i in range(3):
            answer = world.posts()[0]
            # An app's bot user (user and bot_id), a classic integration (bot_message, no
            # user), and a reply in geodebot's thread; all mention it.
            _, own = await world.say(f"{mention} {i}", user="UOTHERBOT", bot_id="BOTHER001")
            _, classic = await world.say(
                f"{mention} {i}", user="", bot_id="BOTHER002", subtype="bot_message"
            )
            _, threaded = await world.say(
                f"{mention} {i}", user="UOTHERBOT", bot_id="BOTHER001", thread_ts=answer.ts
            )
            mentioned = await slack.push_event(
                {"type": "app_mention", "channel": OPS, "user": "UOTHERBOT", "text": mention}
                | {"bot_id": "BOTHER001", "ts": world.new_ts()}
            )
            envelopes += [own, classic, threaded, mentioned]
        # Socket Mode hands envelopes over concurrently: the control goes once every bot
        # message was decided (acked), so its answer comes after anything they caused.
        for envelope in envelopes:
            await slack.wait_for_ack(envelope, timeout=15)
        await world.say("control", user=BOB)
        await world.until_posts(2, daemon)
        scraped = await scrape(world.http_port)
    finally:
        await stop_cleanly(world, daemon)
    assert [p.text for p in world.posts()] == ["hello human", "hello human"]
    assert len(world.llm.requests) == 2
    assert all("what else" not in json.dumps(r.json) for r in world.llm.requests)
    assert metric(scraped, "geodebot_messages_total", event="dropped:bot") == 12
