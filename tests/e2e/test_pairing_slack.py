"""DM pairing end to end on Slack: ``geodebot serve`` on the fake Web API + Socket Mode, and
the operator's ``geodebot pairing`` / ``geodebot bindings`` commands as separate processes.

A stranger's direct message (an ``im`` channel, its id starting with D) gets one code and
costs no model call; the operator's approval lets their next message be answered without a
restart; a code is used once; more strangers at once than ``max_pending`` get no more codes
while known channels are answered; a stranger's message in a channel no binding has, even
one mentioning the bot, never pairs.

Every event is pushed over Socket Mode and waited for until the daemon acked it, i.e. until
the gate (and the pairing desk) decided on it; whatever a test says arrived "exactly once" it
checks again after the daemon stopped (SIGTERM drains the outbox)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, answer_controls, asks_control, until_answered
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack, Posted
from tests.support.waiting import until

BOT_TOKEN_ENV, APP_TOKEN_ENV = "E2E_SLACK_BOT_TOKEN", "E2E_SLACK_APP_TOKEN"
OPS, UNBOUND = "C0OPS0001", "C0NOBIND1"
ALICE, STRANGER = "UALICE001", "USTRANGE1"
STRANGER_DM = "D0STRANGE1"  # the stranger's direct message channel with the bot
CODE = re.compile(r"\b([0-9A-Z]{5}-[0-9A-Z]{5})\b")
MAX_PENDING = 3


@dataclass
class World:
    slack: FakeSlack
    llm: FakeLLMServer
    config: Path
    env: dict[str, str]
    state: Path

    async def daemon(self) -> DaemonProcess:
        """A daemon once its socket is open and its model SDK loaded (see slack_world.py)."""
        daemon = await DaemonProcess(self.config, self.env).start()
        await daemon.wait_for_line(MODELS_MARK)
        return daemon

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await geodebot(*args, "--config", str(self.config), env=self.env)

    def posts(self, channel: str) -> list[Posted]:
        return list(self.slack.posted.get(channel, []))

    def texts(self, channel: str) -> list[str]:
        return [p.text for p in self.posts(channel)]

    async def send(self, channel: str, text: str, *, user: str, **kw: Any) -> dict[str, Any]:
        """A user's message event, once the daemon acked it (its gate decided on it)."""
        event = FakeSlack.message_event(channel, user, text, **kw)
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=15)
        return event

    async def dm(self, user: str, channel: str, text: str) -> dict[str, Any]:
        return await self.send(channel, text, user=user, channel_type="im")

    async def control(self) -> list[str]:
        """A control message in the bound channel, answered: what strangers' messages
        before it would have caused has happened by then."""
        answer_controls(self.llm)
        await self.send(OPS, CONTROL, user=ALICE)
        return await until_answered(lambda: self.texts(OPS))

    async def code_for(self, channel: str) -> str:
        await until(lambda: bool(self.posts(channel)), f"a code in {channel}")
        text = self.posts(channel)[0].text
        found = CODE.search(text)
        assert found is not None, text
        return found.group(1)


@pytest.fixture
async def world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[World]:
    async with FakeSlack() as slack:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nuser_rate_per_min = 0\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm_server.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[channels.slack]\nbot_token_env = "{BOT_TOKEN_ENV}"\n'
            f'app_token_env = "{APP_TOKEN_ENV}"\napi_base_url = "{slack.api_base_url}"\n'
            f"[pairing]\nenabled = true\nmax_pending = {MAX_PENDING}\n"
            f'[[bindings]]\nplatform = "slack"\nchannel = "{OPS}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n'
        )
        env = dict(os.environ, **{BOT_TOKEN_ENV: slack.bot_token, APP_TOKEN_ENV: slack.app_token})
        env[TEST_KEY_ENV] = TEST_KEY
        env.pop("GEODEBOT_CONFIG", None)
        yield World(slack, llm_server, config, env, tmp_path / "var")


def assert_clean_log(daemon: DaemonProcess, slack: FakeSlack) -> None:
    text = daemon.text()
    assert "Traceback" not in text
    for secret in (slack.bot_token, slack.app_token, TEST_KEY):
        assert secret not in text


async def test_a_stranger_gets_a_code_and_once_approved_is_answered_without_a_restart(
    world: World,
) -> None:
    daemon = await world.daemon()
    try:
        first = await world.dm(STRANGER, STRANGER_DM, "hello, may I use you? " + "x" * 400)
        code = await world.code_for(STRANGER_DM)
        # A second message within the minute: no second code, no reminder.
        await world.dm(STRANGER, STRANGER_DM, "anyone there?")
        await world.control()
        assert len(world.posts(STRANGER_DM)) == 1
        assert [asks_control(r) for r in world.llm.requests] == [True]
        [told] = world.posts(STRANGER_DM)
        assert f"geodebot pairing approve slack {code}" in told.text
        # A direct message is answered in the conversation, not in a thread under it.
        assert told.thread_ts is None

        rc, out, err = await world.cli("pairing", "list", "--json")
        assert rc == 0, err
        [listed] = [json.loads(line) for line in out.splitlines()]
        assert (listed["code"], listed["user"], listed["channel"], listed["status"]) == (
            code,
            STRANGER,
            STRANGER_DM,
            "pending",
        )
        assert listed["direct"] is True
        assert listed["first_text"] == first["text"][:200]

        rc, out, err = await world.cli("pairing", "approve", "slack", code)
        assert rc == 0, err
        assert f"slack:{STRANGER_DM}" in out
        await until(lambda: len(world.posts(STRANGER_DM)) >= 2, "the welcome")
        assert "paired" in world.texts(STRANGER_DM)[1]

        world.llm.script(Reply("Hello, new friend"))
        await world.dm(STRANGER, STRANGER_DM, "what can you do?")
        await until(
            lambda: world.texts(STRANGER_DM)[2:] == ["Hello, new friend"],
            lambda: f"the answer; the DM holds {world.texts(STRANGER_DM)}",
        )
        asked = [r for r in world.llm.requests if not asks_control(r)]
        assert len(asked) == 1
        assert "what can you do?" in json.dumps(asked[0].json)
        # Nothing the stranger wrote before the approval reached the model.
        assert "anyone there?" not in json.dumps(asked[0].json)
        # What a pairing grants by default: no tools at all.
        assert not (asked[0].json or {}).get("tools")

        rc, _, err = await world.cli("pairing", "approve", "slack", code)
        assert rc == 1
        assert "approved already" in err

        rc, out, err = await world.cli("bindings", "list", "--json")
        assert rc == 0, err
        rows = {row["key"]: row for row in map(json.loads, out.splitlines())}
        assert rows[f"slack:{OPS}"]["origin"] == "config"
        stored = rows[f"slack:{STRANGER_DM}"]
        assert (stored["origin"], stored["session"], stored["made_by"]) == (
            "stored",
            f"dm:slack:{STRANGER}",
            f"pairing:{code.replace('-', '')}",
        )
    finally:
        assert await daemon.stop() == 0
    # The outbox drained: the code, the welcome and the answer, each once, nothing more.
    posts = world.posts(STRANGER_DM)
    assert len(posts) == 3
    assert posts[2].text == "Hello, new friend"
    assert all(p.thread_ts is None for p in posts)
    assert world.slack.ephemeral == []
    assert [asks_control(r) for r in world.llm.requests] == [True, False]
    ledger = [json.loads(line) for line in (world.state / "ledger.jsonl").read_text().splitlines()]
    kinds = [row["kind"] for row in ledger if row["kind"].startswith(("pairing", "binding"))]
    assert kinds == ["pairing_approved"]
    assert_clean_log(daemon, world.slack)


async def test_more_strangers_than_max_pending_get_no_more_codes_and_ops_goes_on(
    world: World,
) -> None:
    daemon = await world.daemon()
    strangers = {f"U0STR{n:04d}": f"D0STR{n:04d}" for n in range(2 * MAX_PENDING)}
    try:
        # Each acked, so each decided, in this order: the first MAX_PENDING get codes.
        for user, channel in strangers.items():
            await world.dm(user, channel, f"hi from {user}")
        answered = await world.control()
        assert answered[-1].startswith("control answer")
        coded = list(strangers.values())[:MAX_PENDING]
        await until(lambda: all(world.posts(c) for c in coded), "the codes")
    finally:
        assert await daemon.stop() == 0
    assert [c for c in strangers.values() if world.posts(c)] == coded
    assert all(len(world.posts(c)) == 1 for c in coded)
    assert all(CODE.search(world.posts(c)[0].text) for c in coded)
    assert all(asks_control(r) for r in world.llm.requests)
    assert len(world.llm.requests) == 1
    assert "max_pending" in daemon.text()
    rc, out, _ = await world.cli("pairing", "list", "--json")
    assert rc == 0
    assert sorted(json.loads(line)["user"] for line in out.splitlines()) == sorted(
        list(strangers)[:MAX_PENDING]
    )
    assert_clean_log(daemon, world.slack)


async def test_a_strangers_channel_message_never_pairs(world: World) -> None:
    daemon = await world.daemon()
    mention = f"<@{world.slack.bot_user_id}> let me in"
    try:
        # As Slack sends a mention in a channel: a message event and an app_mention event.
        message = await world.send(UNBOUND, mention, user=STRANGER)
        app_mention = dict(message, type="app_mention")
        app_mention.pop("channel_type")
        await world.slack.wait_for_ack(await world.slack.push_event(app_mention), timeout=15)
        await world.send(UNBOUND, "hello? anyone?", user=STRANGER)
        await world.control()
    finally:
        assert await daemon.stop() == 0
    assert world.posts(UNBOUND) == []
    assert set(world.slack.posted) <= {OPS}
    assert world.slack.ephemeral == []
    assert [asks_control(r) for r in world.llm.requests] == [True]
    rc, out, _ = await world.cli("pairing", "list", "--all", "--json")
    assert (rc, out) == (0, "")
    assert_clean_log(daemon, world.slack)
