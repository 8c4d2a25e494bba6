"""geodebot serve end to end on Discord: the real daemon process, discord.py against the fake
Discord (REST + gateway), the anthropic SDK against the fake model server, both in this loop."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aiohttp import web

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import (
    CONTROL,
    CONTROL_ANSWER,
    answer_controls,
    asks_control,
    until_answered,
)
from tests.support.daemon import DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.e2e-discord-token-0123456789abcdef"
TOKEN_ENV = "E2E_DISCORD_TOKEN"
ALICE, MALLORY, OTHER_BOT = "700000000000000001", "700000000000000666", "700000000000000777"
# Guild text channels besides the fake's own ("ops", bound for ALICE only):
DEV = "900000000000000013"  # bound, anyone, but only when the bot is mentioned
RANDOM = "900000000000000014"  # in the guild, named by no binding


class FakeGuild(FakeDiscord):
    """The fake with two more guild text channels, and every message create attempt counted."""

    extra_channels: ClassVar[dict[str, str]] = {DEV: "dev", RANDOM: "random"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.create_attempts: list[str] = []  # channel of each POST .../messages, failed or not

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in self.extra_channels or super()._in_guild(channel_id)

    def _guild(self) -> Json:
        guild = super()._guild()
        ops = guild["channels"][0]
        extra = [ops | {"id": cid, "name": name} for cid, name in self.extra_channels.items()]
        return guild | {"channels": [ops, *extra]}

    async def _create_message(self, request: web.Request) -> web.StreamResponse:
        self.create_attempts.append(request.match_info["cid"])
        return await super()._create_message(request)


@dataclass
class World:
    discord: FakeGuild
    llm: FakeLLMServer
    config: Path
    env: dict[str, str]
    started: list[DaemonProcess] = field(default_factory=list)

    def daemon(self) -> DaemonProcess:
        self.started.append(DaemonProcess(self.config, self.env))
        return self.started[-1]

    @property
    def ops(self) -> str:
        return self.discord.channel_id

    def say(self, channel: str, text: str, *, user: str = ALICE, **kw: Any) -> str:
        return self.discord.push_message(channel, text, author_id=user, **kw)

    def mention(self, text: str) -> str:
        return f"<@{self.discord.bot_id}> {text}"

    def replies(self, channel: str) -> list[Json]:
        return list(self.discord.posted.get(channel, []))

    def all_posted(self) -> list[Json]:
        return [p for posted in self.discord.posted.values() for p in posted]

    def answered(self, channel: str) -> list[str | None]:
        """The message each reply in ``channel`` answers, in posting order."""
        return [(p["message_reference"] or {}).get("message_id") for p in self.replies(channel)]

    async def control(self) -> str:
        """A control message in ops (tests/support/control.py), once answered; its id."""
        answer_controls(self.llm)
        mid = self.say(self.ops, CONTROL)
        await until_answered(lambda: [p["content"] for p in self.replies(self.ops)])
        return mid


def write_config(tmp_path: Path, discord: FakeDiscord, llm: FakeLLMServer, log_level: str) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nlog_level = "{log_level}"\n'
        "max_concurrent_sessions = 4\nsession_queue = 10\nshutdown_grace_s = 10\n"
        f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        '[tools]\nipc_tools = ["get_time"]\n'
        f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\n'
        f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        f'[[bindings]]\nplatform = "discord"\nchannel = "{discord.channel_id}"\n'
        f'session = "ops"\nallowed_users = ["{ALICE}"]\ntime_budget_s = 60\n'
        f'[[bindings]]\nplatform = "discord"\nchannel = "{DEV}"\nsession = "dev"\n'
        'allowed_users = ["*"]\nrequire_mention = true\n'
    )
    return config


@pytest.fixture
async def world(
    request: pytest.FixtureRequest, tmp_path: Path, llm_server: FakeLLMServer
) -> AsyncIterator[World]:
    async with FakeGuild(token=TOKEN) as discord:
        level = str(getattr(request, "param", "info"))  # a test may ask for another level
        config = write_config(tmp_path, discord, llm_server, level)
        env = dict(os.environ, **{TOKEN_ENV: TOKEN, TEST_KEY_ENV: TEST_KEY})
        world = World(discord, llm_server, config, env)
        try:
            yield world
        finally:  # a test that failed early leaves no daemon behind (no-op once exited)
            for daemon in world.started:
                await daemon.kill()


async def until(
    predicate: Callable[[], bool], what: str, daemon: DaemonProcess, within: float = 20.0
) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            tail = "\n".join(daemon.log[-30:])
            raise AssertionError(f"not reached within {within:g} s: {what}\n{tail}")
        await asyncio.sleep(0.02)


async def shut_down(daemon: DaemonProcess) -> None:
    code = await daemon.stop()
    text = daemon.text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
    assert TOKEN not in text
    assert TEST_KEY not in text


def asked(world: World, index: int) -> str:
    """All text of the model request ``index``, for checking what a turn was given."""
    return json.dumps(world.llm.requests[index].json)


async def test_bound_message_is_answered_once_as_a_reply(world: World) -> None:
    world.llm.script(Reply("All systems nominal, Alice."))
    daemon = await world.daemon().start()
    try:
        mid = world.say(world.ops, "status of the fleet?")
        await until(lambda: len(world.replies(world.ops)) == 1, "the reply", daemon)
        control = await world.control()
    finally:
        await shut_down(daemon)
    reply, answer = world.all_posted()
    assert answer["content"] == CONTROL_ANSWER
    assert answer["message_reference"]["message_id"] == control
    assert reply["content"] == "All systems nominal, Alice."
    assert reply["message_reference"]["message_id"] == mid
    assert reply["message_reference"]["channel_id"] == world.ops
    assert isinstance(reply["nonce"], str)
    assert 0 < len(reply["nonce"]) <= 25
    assert world.discord.create_attempts == [world.ops, world.ops]  # and the control's
    assert [asks_control(r) for r in world.llm.requests] == [False, True]
    assert "status of the fleet?" in asked(world, 0)
    assert world.llm.requests[0].json["model"] == "e2e-model"


async def test_gate_drops_cost_no_model_call_and_post_nothing(world: World) -> None:
    world.llm.default = Reply("control answer")
    daemon = await world.daemon().start()
    try:
        world.say(RANDOM, world.mention("unbound channel"))
        world.say(world.ops, world.mention("let me in"), user=MALLORY, mentions_bot=True)
        world.say(world.ops, "my own words", user=world.discord.bot_id)
        world.say(world.ops, world.mention("beep"), user=OTHER_BOT, bot=True, mentions_bot=True)
        world.say(DEV, "nobody mentioned the bot")
        # Controls, last in the same channels: when they are answered, the drops were decided.
        ops_ok = world.say(world.ops, "control ops")
        dev_ok = world.say(DEV, world.mention("control dev"), mentions_bot=True)
        # Each channel's messages are decided in order: once the controls are answered,
        # whatever the drops (wrongly) caused has arrived.
        await until(
            lambda: ops_ok in world.answered(world.ops) and dev_ok in world.answered(DEV),
            "both control replies",
            daemon,
        )
    finally:
        await shut_down(daemon)
    assert world.answered(world.ops) == [ops_ok]
    assert world.answered(DEV) == [dev_ok]
    assert not world.replies(RANDOM)
    assert len(world.all_posted()) == 2
    assert len(world.llm.requests) == 2
    prompts = asked(world, 0) + asked(world, 1)
    assert "control ops" in prompts
    assert "control dev" in prompts
    for dropped in ("unbound channel", "let me in", "my own words", "beep", "nobody mentioned"):
        assert dropped not in prompts


async def test_long_answer_arrives_split_complete_and_in_order(world: World) -> None:
    lines = [f"line {n:04d} " + "lorem ipsum dolor sit amet " * 3 for n in range(110)]
    answer = "\n".join(lines)
    assert len(answer) > 10_000
    world.llm.script(Reply(answer))
    daemon = await world.daemon().start()
    try:
        mid = world.say(world.ops, "tell me everything")
        await until(
            lambda: any("line 0109" in p["content"] for p in world.replies(world.ops)),
            "the last part",
            daemon,
        )
        control = await world.control()
    finally:
        await shut_down(daemon)
    *parts, last = [p["content"] for p in world.replies(world.ops)]
    assert last == CONTROL_ANSWER
    assert world.answered(world.ops)[-1] == control
    assert len(parts) >= 5
    assert all(len(p) <= 2000 for p in parts)
    assert " ".join(parts).split() == answer.split()  # complete, in order, nothing twice
    posted = world.replies(world.ops)
    assert posted[0]["message_reference"]["message_id"] == mid
    assert len({p["nonce"] for p in posted}) == len(posted)
    assert len(world.discord.create_attempts) == len(parts) + 1  # and the control's
    assert [asks_control(r) for r in world.llm.requests] == [False, True]


async def test_rate_limited_reply_arrives_exactly_once(world: World) -> None:
    world.llm.script(Reply("worth the wait"))
    world.discord.fail_next_post(429, retry_after=1.0)  # Retry-After, X-RateLimit-*, Via
    daemon = await world.daemon().start()
    try:
        mid = world.say(world.ops, "hello?")
        await until(lambda: len(world.replies(world.ops)) == 1, "the reply", daemon)
        control = await world.control()
    finally:
        await shut_down(daemon)
    assert [p["content"] for p in world.all_posted()] == ["worth the wait", CONTROL_ANSWER]
    assert world.answered(world.ops) == [mid, control]
    # The 429, then the message; then the control's.
    assert world.discord.create_attempts == [world.ops, world.ops, world.ops]


async def test_sigkill_mid_turn_restart_answers_once_and_catches_up(world: World) -> None:
    world.llm.script(Reply("answer zero"), Delay(5.0, Reply("lost with the process")))
    daemon = await world.daemon().start()
    m0 = world.say(world.ops, "question zero")
    await until(lambda: world.answered(world.ops) == [m0], "the first reply", daemon)
    m1 = world.say(world.ops, "question one")
    await until(lambda: len(world.llm.requests) == 2, "question one at the model", daemon)
    await daemon.kill()
    assert daemon.proc is not None
    assert daemon.proc.returncode == -9

    # Discord never redelivers: these exist only in the channel's history.
    m2 = world.say(world.ops, "asked while down")
    m3 = world.say(world.ops, "also asked while down")
    world.llm.script(Reply("answer one"), Reply("answer two"), Reply("answer three"))
    restarted = await world.daemon().start()
    try:
        await until(lambda: len(world.replies(world.ops)) >= 4, "three more replies", restarted)
        control = await world.control()
    finally:
        await shut_down(restarted)
    assert world.answered(world.ops) == [m0, m1, m2, m3, control]
    # A new process identifies afresh (no RESUME replay): m2 and m3 came from history.
    assert (world.discord.identify_count, world.discord.resume_count) == (2, 0)
    contents = [p["content"] for p in world.replies(world.ops)]
    assert contents == ["answer zero", "answer one", "answer two", "answer three", CONTROL_ANSWER]
    assert len(world.all_posted()) == 5
    # m0 once, m1 twice (the killed attempt and the retry), then m2 and m3 once each; the
    # control.
    assert [asks_control(r) for r in world.llm.requests] == [False] * 5 + [True]
    assert "question one" in asked(world, 2)
    assert "asked while down" in asked(world, 3)
    assert "also asked while down" in asked(world, 4)


async def test_one_session_answers_in_order_while_busy(world: World) -> None:
    world.llm.script(Delay(1.5, Reply("answer one")), Reply("answer two"), Reply("answer three"))
    daemon = await world.daemon().start()
    try:
        m1 = world.say(world.ops, "first")
        await until(lambda: len(world.llm.requests) == 1, "the first turn at the model", daemon)
        m2 = world.say(world.ops, "second")
        m3 = world.say(world.ops, "third")
        assert not world.all_posted()  # they arrived while the first turn was running
        await until(lambda: len(world.replies(world.ops)) == 3, "three replies", daemon)
        control = await world.control()
    finally:
        await shut_down(daemon)
    assert world.answered(world.ops) == [m1, m2, m3, control]
    contents = [p["content"] for p in world.replies(world.ops)]
    assert contents == ["answer one", "answer two", "answer three", CONTROL_ANSWER]
    assert [asks_control(r) for r in world.llm.requests] == [False] * 3 + [True]
    # One turn after the other: each saw the previous exchange in its context.
    assert "answer one" in asked(world, 1)
    assert "second" in asked(world, 1)
    assert "answer two" in asked(world, 2)


@pytest.mark.parametrize("world", ["debug"], indirect=True)
async def test_sigterm_mid_turn_exits_cleanly_and_keeps_secrets(world: World) -> None:
    world.llm.script(Delay(1.5, Reply("finished in the grace period")))
    daemon = await world.daemon().start()
    mid = world.say(world.ops, "one last thing")
    await until(lambda: len(world.llm.requests) == 1, "the turn at the model", daemon)
    started = time.monotonic()
    await shut_down(daemon)  # exit 0, no traceback, neither secret in the (debug) log
    assert time.monotonic() - started < 10
    assert any("shutting down" in line for line in daemon.log)
    # The running turn got its grace, and its reply went out before the process ended.
    assert world.answered(world.ops) == [mid]
    # Nothing was left half done: the next start neither answers again nor asks the model.
    restarted = await world.daemon().start()
    try:
        # Answered after whatever the restart (wrongly) found to redo in the session.
        control = await world.control()
    finally:
        await shut_down(restarted)
    assert [p["content"] for p in world.all_posted()] == [
        "finished in the grace period",
        CONTROL_ANSWER,
    ]
    assert world.answered(world.ops) == [mid, control]
    assert [asks_control(r) for r in world.llm.requests] == [False, True]
