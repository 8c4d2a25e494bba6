"""A platform websocket dropped under a live daemon serving Slack and Discord at once.

The dropped channel reconnects (Slack asks ``apps.connections.open`` for a new socket;
discord.py resumes its gateway session); messages sent around the drop are answered once,
and the other platform keeps answering while one is down. The model echoes the question, so
every reply shows which message it answers."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord
from tests.support.fakes.llm_server import Dialect, FakeLLMServer, Item, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.slack_world import APP_TOKEN_ENV, BOT_TOKEN_ENV, eventually, new_ts
from tests.support.telegram_world import shut_down

SLACK_OPS = "C0OPS0001"
ALICE_SLACK = "UALICE001"
ALICE_DISCORD = "700000000000000001"
DISCORD_TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.faults-discord-token-0123456789ab"
DISCORD_TOKEN_ENV = "FAULTS_DISCORD_TOKEN"


class EchoLLM(FakeLLMServer):
    """Answers every request with ``re: <the last user text>``."""

    def __init__(self) -> None:
        super().__init__()
        self.default = Reply("")  # replaced by the echo

    async def _render(
        self, request: web.Request, dialect: Dialect, body: dict[str, Any], item: Item
    ) -> web.StreamResponse:
        content = body["messages"][-1]["content"]
        text = content if isinstance(content, str) else content[-1].get("text", "")
        return await super()._render(request, dialect, body, Reply(f"re: {text.strip()}"))


@dataclass
class Both:
    slack: FakeSlack
    discord: FakeDiscord
    llm: EchoLLM
    daemon: DaemonProcess

    async def slack_says(self, text: str) -> str:
        event = FakeSlack.message_event(SLACK_OPS, ALICE_SLACK, text, ts=new_ts())
        await self.slack.wait_for_ack(await self.slack.push_event(event), timeout=15)
        return text

    def discord_says(self, text: str) -> str:
        self.discord.push_message(self.discord.channel_id, text, author_id=ALICE_DISCORD)
        return text

    def slack_replies(self) -> list[str]:
        return [p.text for p in self.slack.posted.get(SLACK_OPS, [])]

    def discord_replies(self) -> list[str]:
        return [str(p["content"]) for p in self.discord.posted.get(self.discord.channel_id, [])]

    async def until_answered(self, replies: Any, text: str) -> None:
        await eventually(
            lambda: f"re: {text}" in replies(), f"the answer to {text!r}", log=self.daemon
        )

    async def controls(self) -> None:
        """A control message on each platform, answered: a chat's messages are answered in
        order, so anything the earlier ones (wrongly) caused has been sent by then."""
        await self.slack_says("control")
        self.discord_says("control")
        await self.until_answered(self.slack_replies, "control")
        await self.until_answered(self.discord_replies, "control")


def write_config(
    tmp_path: Path, slack: FakeSlack, discord: FakeDiscord, llm: FakeLLMServer
) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nshutdown_grace_s = 5\n'
        f'[model]\nprovider = "anthropic"\nname = "faults-model"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        '[tools]\nipc_tools = ["get_time"]\n'
        f'[channels.slack]\nbot_token_env = "{BOT_TOKEN_ENV}"\n'
        f'app_token_env = "{APP_TOKEN_ENV}"\napi_base_url = "{slack.api_base_url}"\n'
        f'[channels.discord]\ntoken_env = "{DISCORD_TOKEN_ENV}"\n'
        f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        f'[[bindings]]\nplatform = "slack"\nchannel = "{SLACK_OPS}"\nsession = "slack-ops"\n'
        'allowed_users = ["*"]\n'
        f'[[bindings]]\nplatform = "discord"\nchannel = "{discord.channel_id}"\n'
        f'session = "discord-ops"\nallowed_users = ["{ALICE_DISCORD}"]\n'
    )
    return path


@pytest.fixture
async def both(tmp_path: Path) -> AsyncIterator[Both]:
    async with FakeSlack() as slack, FakeDiscord(token=DISCORD_TOKEN) as discord, EchoLLM() as llm:
        env = dict(os.environ, **{TEST_KEY_ENV: TEST_KEY, DISCORD_TOKEN_ENV: DISCORD_TOKEN})
        env |= {BOT_TOKEN_ENV: slack.bot_token, APP_TOKEN_ENV: slack.app_token}
        daemon = DaemonProcess(write_config(tmp_path, slack, discord, llm), env)
        try:
            await daemon.start()
            await slack.wait_for_connections(1, timeout=15)
            yield Both(slack, discord, llm, daemon)
        finally:
            await daemon.kill()


async def test_slack_socket_drop_reconnects_and_discord_answers_meanwhile(both: Both) -> None:
    event = FakeSlack.message_event(SLACK_OPS, ALICE_SLACK, "sent before the drop", ts=new_ts())
    first = await both.slack.push_event(event, event_id="Ev0DROPPED1")
    await both.slack.wait_for_ack(first, timeout=15)
    await both.slack.disconnect_clients()
    # While Slack has no socket, Discord is answered.
    during = both.discord_says("asked while slack is down")
    await both.until_answered(both.discord_replies, during)
    # Slack, unsure the ack arrived before the drop, sends the event again on the new socket.
    again = await both.slack.push_event(event, event_id="Ev0DROPPED1", retry_attempt=1)
    await both.slack.wait_for_ack(again, timeout=15)
    after = await both.slack_says("sent after the drop")
    await both.until_answered(both.slack_replies, "sent before the drop")
    await both.until_answered(both.slack_replies, after)
    await both.controls()
    await shut_down(both.daemon)
    assert both.slack_replies() == ["re: sent before the drop", f"re: {after}", "re: control"]
    assert both.discord_replies() == [f"re: {during}", "re: control"]
    assert both.slack.connections == 2
    assert len(both.slack.calls_to("apps.connections.open")) == 2


async def test_discord_gateway_drop_resumes_and_slack_answers_meanwhile(both: Both) -> None:
    before = both.discord_says("sent before the drop")
    await both.until_answered(both.discord_replies, before)
    await both.discord.drop_gateway(4000)
    # Sent while the gateway is down: replayed when discord.py resumes its session.
    during = both.discord_says("sent while the gateway is down")
    meanwhile = await both.slack_says("asked while discord is down")
    await both.until_answered(both.slack_replies, meanwhile)
    await both.until_answered(both.discord_replies, during)
    after = both.discord_says("sent after the resume")
    await both.until_answered(both.discord_replies, after)
    await both.controls()
    await shut_down(both.daemon)
    assert both.discord_replies() == [
        f"re: {before}",
        f"re: {during}",
        f"re: {after}",
        "re: control",
    ]
    assert both.slack_replies() == [f"re: {meanwhile}", "re: control"]
    assert (both.discord.identify_count, both.discord.resume_count) == (1, 1)
    assert json.dumps(both.discord.posted).count("re: ") == 3 + 1  # and the control's
