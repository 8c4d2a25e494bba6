"""DM pairing end to end on Discord: ``geodebot serve`` (discord.py) on the fake REST API and
gateway, and the operator's ``geodebot pairing`` / ``geodebot bindings`` commands as separate
processes.

A stranger's direct message (a message in a DM channel, no guild) gets one code and costs no
model call; the operator's approval lets their next message be answered without a restart; a
code is used once; more strangers at once than ``max_pending`` get no more codes while known
channels are answered; a stranger's message in a guild channel no binding has, even one
mentioning the bot, never pairs (the daemon's own counters say
when it was decided).

Discord acknowledges nothing the daemon takes in, and its channels are taken in side by side:
a control answered in the bound channel shows that messages sent before it were decided (the
model's answer takes longer than any pairing decision), and a DM channel's own next answer,
after the approval, that its earlier messages were (each channel's messages are decided in
order, and a chat's replies sent in order). What a test says arrived "exactly once" it checks
again after the daemon stopped (SIGTERM drains the outbox)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, answer_controls, asks_control, until_answered
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.waiting import until

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.e2e-pairing-token-0123456789abcdef"
TOKEN_ENV = "E2E_DISCORD_TOKEN"
ALICE, STRANGER = "700000000000000001", "700000000000000501"
STRANGER_DM = "800000000000000501"  # the stranger's DM channel with the bot: in no guild
RANDOM = "900000000000000014"  # a guild text channel no binding names
CODE = re.compile(r"\b([0-9A-Z]{5}-[0-9A-Z]{5})\b")
MAX_PENDING = 3


class FakeGuild(FakeDiscord):
    """The fake with one more guild text channel, which no binding names."""

    extra_channels: ClassVar[dict[str, str]] = {RANDOM: "random"}

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in self.extra_channels or super()._in_guild(channel_id)

    def _guild(self) -> Json:
        guild = super()._guild()
        ops = guild["channels"][0]
        extra = [ops | {"id": cid, "name": name} for cid, name in self.extra_channels.items()]
        return guild | {"channels": [ops, *extra]}


@dataclass
class World:
    discord: FakeGuild
    llm: FakeLLMServer
    config: Path
    env: dict[str, str]
    state: Path
    started: list[DaemonProcess] = field(default_factory=list)

    async def daemon(self) -> DaemonProcess:
        """A daemon once its gateway is up and its model SDK loaded."""
        self.started.append(DaemonProcess(self.config, self.env))
        daemon = await self.started[-1].start()
        await daemon.wait_for_line(MODELS_MARK)
        return daemon

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await geodebot(*args, "--config", str(self.config), env=self.env)

    @property
    def ops(self) -> str:
        return self.discord.channel_id

    def replies(self, channel: str) -> list[Json]:
        return list(self.discord.posted.get(channel, []))

    def texts(self, channel: str) -> list[str]:
        """What the bot's messages in ``channel`` read now (a streamed one: as last edited)."""
        return [self.discord.texts(p["id"])[-1] for p in self.replies(channel)]

    def answered(self, channel: str) -> list[str | None]:
        """The message each reply in ``channel`` answers, in posting order."""
        return [(p["message_reference"] or {}).get("message_id") for p in self.replies(channel)]

    def say(self, channel: str, text: str, *, user: str, **kw: Any) -> str:
        return self.discord.push_message(channel, text, author_id=user, **kw)

    def dm(self, user: str, channel: str, text: str) -> str:
        """A direct message: a DM channel is in no guild, so the fake sends no guild_id."""
        return self.say(channel, text, user=user, guild_id=None)

    async def control(self) -> list[str]:
        """A control message in the bound channel, answered: what strangers' messages
        before it would have caused has happened by then."""
        answer_controls(self.llm)
        self.say(self.ops, CONTROL, user=ALICE)
        return await until_answered(lambda: self.texts(self.ops))

    async def messages(self) -> dict[str, int]:
        """The daemon's message counters, as ``geodebot status --json`` reports them."""
        rc, out, err = await self.cli("status", "--json")
        assert rc == 0, err
        counters: dict[str, int] = json.loads(out)["messages"]
        return counters

    async def counted(self, event: str, n: int) -> bool:
        return (await self.messages()).get(event, 0) >= n

    async def code_for(self, channel: str) -> str:
        await until(lambda: bool(self.replies(channel)), f"a code in {channel}")
        text = self.texts(channel)[0]
        found = CODE.search(text)
        assert found is not None, text
        return found.group(1)


@pytest.fixture
async def world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[World]:
    async with FakeGuild(token=TOKEN) as discord:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nuser_rate_per_min = 0\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm_server.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\n'
            f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
            f"[pairing]\nenabled = true\nmax_pending = {MAX_PENDING}\n"
            f'[[bindings]]\nplatform = "discord"\nchannel = "{discord.channel_id}"\n'
            f'session = "ops"\nallowed_users = ["{ALICE}"]\n'
        )
        env = dict(os.environ, **{TOKEN_ENV: TOKEN, TEST_KEY_ENV: TEST_KEY})
        env.pop("GEODEBOT_CONFIG", None)
        world = World(discord, llm_server, config, env, tmp_path / "var")
        try:
            yield world
        finally:  # a test that failed early leaves no daemon behind (no-op once exited)
            for daemon in world.started:
                await daemon.kill()


def assert_clean_log(daemon: DaemonProcess) -> None:
    text = daemon.text()
    assert "Traceback" not in text
    assert TOKEN not in text
    assert TEST_KEY not in text


async def test_a_stranger_gets_a_code_and_once_approved_is_answered_without_a_restart(
    world: World,
) -> None:
    daemon = await world.daemon()
    try:
        first_text = "hello, may I use you? " + "x" * 400
        first = world.dm(STRANGER, STRANGER_DM, first_text)
        code = await world.code_for(STRANGER_DM)
        # A second message within the minute: no second code, no reminder.
        second = world.dm(STRANGER, STRANGER_DM, "anyone there?")
        await world.control()
        assert len(world.replies(STRANGER_DM)) == 1
        assert [asks_control(r) for r in world.llm.requests] == [True]
        assert f"geodebot pairing approve discord {code}" in world.texts(STRANGER_DM)[0]
        # The code answers the message that asked.
        assert world.answered(STRANGER_DM) == [first]

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
        assert listed["first_text"] == first_text[:200]

        rc, out, err = await world.cli("pairing", "approve", "discord", code)
        assert rc == 0, err
        assert f"discord:{STRANGER_DM}" in out
        await until(lambda: len(world.replies(STRANGER_DM)) >= 2, "the welcome")
        assert "paired" in world.texts(STRANGER_DM)[1]

        world.llm.script(Reply("Hello, new friend"))
        third = world.dm(STRANGER, STRANGER_DM, "what can you do?")
        await until(
            lambda: world.texts(STRANGER_DM)[2:] == ["Hello, new friend"],
            lambda: f"the answer; the DM holds {world.texts(STRANGER_DM)}",
        )
        assert world.answered(STRANGER_DM)[2] == third
        asked = [r for r in world.llm.requests if not asks_control(r)]
        assert len(asked) == 1
        assert "what can you do?" in json.dumps(asked[0].json)
        # Nothing the stranger wrote before the approval reached the model.
        assert "anyone there?" not in json.dumps(asked[0].json)
        # What a pairing grants by default: no tools at all.
        assert not (asked[0].json or {}).get("tools")

        rc, _, err = await world.cli("pairing", "approve", "discord", code)
        assert rc == 1
        assert "approved already" in err

        rc, out, err = await world.cli("bindings", "list", "--json")
        assert rc == 0, err
        rows = {row["key"]: row for row in map(json.loads, out.splitlines())}
        assert rows[f"discord:{world.ops}"]["origin"] == "config"
        stored = rows[f"discord:{STRANGER_DM}"]
        assert (stored["origin"], stored["session"], stored["made_by"]) == (
            "stored",
            f"dm:discord:{STRANGER}",
            f"pairing:{code.replace('-', '')}",
        )
    finally:
        assert await daemon.stop() == 0
    # The outbox drained: the code, the welcome and the answer, each once, nothing more;
    # the second message (decided before the third, in the same channel) got nothing.
    assert len(world.replies(STRANGER_DM)) == 3
    assert world.texts(STRANGER_DM)[2] == "Hello, new friend"
    assert second not in world.answered(STRANGER_DM)
    assert [asks_control(r) for r in world.llm.requests] == [True, False]
    ledger = [json.loads(line) for line in (world.state / "ledger.jsonl").read_text().splitlines()]
    kinds = [row["kind"] for row in ledger if row["kind"].startswith(("pairing", "binding"))]
    assert kinds == ["pairing_approved"]
    assert_clean_log(daemon)


def refused(daemon: DaemonProcess) -> list[str]:
    """The users the daemon logged as refused a code for max_pending, in order."""
    found = (re.search(r"max_pending\); user (\d+) got no code", line) for line in daemon.log)
    return [m.group(1) for m in found if m is not None]


async def test_more_strangers_than_max_pending_get_no_more_codes_and_ops_goes_on(
    world: World,
) -> None:
    daemon = await world.daemon()
    strangers = {f"7000000000000010{n:02d}": f"8000000000000010{n:02d}" for n in range(6)}
    try:
        for user, channel in strangers.items():
            world.dm(user, channel, f"hi from {user}")
        # Taken in side by side, so who gets a code is the store's to decide; that every
        # stranger was decided shows in the log: a code, or a warning.
        await until(
            lambda: (
                sum(1 for c in strangers.values() if world.replies(c)) >= MAX_PENDING
                and len(refused(daemon)) >= len(strangers) - MAX_PENDING
            ),
            lambda: f"every stranger decided; refused so far: {refused(daemon)}",
        )
        # Known channels keep being answered while strangers wait.
        answered = await world.control()
        assert answered[-1].startswith("control answer")
    finally:
        assert await daemon.stop() == 0
    coded = {u for u, c in strangers.items() if world.replies(c)}
    assert len(coded) == MAX_PENDING
    assert sorted(refused(daemon)) == sorted(set(strangers) - coded)
    assert all(len(world.replies(strangers[u])) == 1 for u in coded)
    assert all(CODE.search(world.texts(strangers[u])[0]) for u in coded)
    assert [asks_control(r) for r in world.llm.requests] == [True]
    rc, out, _ = await world.cli("pairing", "list", "--json")
    assert rc == 0
    assert {json.loads(line)["user"] for line in out.splitlines()} == coded
    assert_clean_log(daemon)


async def test_a_strangers_guild_message_never_pairs(world: World) -> None:
    daemon = await world.daemon()
    mention = f"<@{world.discord.bot_id}>"
    try:
        world.say(RANDOM, f"{mention} let me in", user=STRANGER, mentions_bot=True)
        world.say(RANDOM, "hello? anyone?", user=STRANGER)
        # Both decided, as the daemon counts them: dropped as unbound, never offered a code.
        await until(lambda: world.counted("dropped:unbound", 2), "both messages dropped as unbound")
        await world.control()
        messages = await world.messages()
        assert not [k for k in messages if k.startswith("pairing:")], messages
    finally:
        assert await daemon.stop() == 0
    assert world.replies(RANDOM) == []
    assert set(world.discord.posted) <= {world.ops}
    assert [asks_control(r) for r in world.llm.requests] == [True]
    rc, out, _ = await world.cli("pairing", "list", "--all", "--json")
    assert (rc, out) == (0, "")
    assert_clean_log(daemon)
