"""geodebot serve end to end on Telegram: the real daemon process, python-telegram-bot
against the fake Bot API, the anthropic SDK against the fake model server."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import (
    CONTROL,
    CONTROL_ANSWER,
    answer_controls,
    asks_control,
    until_answered,
)
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram

GROUP, OTHER_GROUP, UNBOUND = -1001, -1002, -1999
ALICE, MALLORY, OTHER_BOT = 4242, 666, 777


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    config: Path
    env: dict[str, str]

    def daemon(self) -> DaemonProcess:
        return DaemonProcess(self.config, self.env)


@pytest.fixture
async def world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[World]:
    async with FakeTelegram() as telegram:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nmax_concurrent_sessions = 4\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm_server.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[tools]\nipc_tools = ["get_time"]\n'
            f'[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            "max_message_chars = 2000\n"
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{OTHER_GROUP}"\nsession = "dev"\n'
            'allowed_users = ["*"]\nrequire_mention = true\n'
        )
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        yield World(telegram, llm_server, config, env)


def texts(world: World, chat: int) -> list[str]:
    return [m.text for m in world.telegram.sent[chat]]


async def control(world: World) -> list[str]:
    """A control message in GROUP (tests/support/control.py) and its answer; then every text
    GROUP got."""
    answer_controls(world.llm)
    world.telegram.push_message(GROUP, CONTROL, user_id=ALICE)
    return await until_answered(lambda: texts(world, GROUP))


async def test_bound_message_is_answered_in_its_chat_once(world: World) -> None:
    world.llm.script(Reply("**Hello** Alice"))
    daemon = await world.daemon().start()
    try:
        message_update = world.telegram.push_message(GROUP, "hi there", user_id=ALICE)
        sent = await world.telegram.wait_for_sent(GROUP, 1, timeout=20)
        await world.telegram.wait_for_confirmed(message_update + 1, timeout=10)
    finally:
        assert await daemon.stop() == 0
    assert sent[0].text == "<b>Hello</b> Alice"
    assert sent[0].reply_to_message_id is not None
    assert len(world.llm.requests) == 1
    # The daemon's log (JSON off a terminal) names the turn's platform, session and turn.
    rows = [json.loads(line) for line in daemon.log if line.startswith("{")]
    [finished] = [r for r in rows if r["msg"].startswith("turn finished: completed")]
    assert (finished["platform"], finished["session"]) == ("telegram", "ops")
    assert finished["turn"].startswith("t-")
    assert world.telegram.commands is not None
    assert "Traceback" not in daemon.text()
    assert world.telegram.token not in daemon.text()


async def test_gate_drops_cost_no_model_call(world: World) -> None:
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(UNBOUND, "anyone?", user_id=ALICE)
        world.telegram.push_message(GROUP, "let me in", user_id=MALLORY)
        world.telegram.push_message(GROUP, "beep", user_id=OTHER_BOT, is_bot=True)
        world.telegram.push_message(GROUP, "echo", user_id=world.telegram.bot_id, is_bot=True)
        last = world.telegram.push_message(OTHER_GROUP, "no mention here", user_id=ALICE)
        await world.telegram.wait_for_confirmed(last + 1, timeout=20)
        await control(world)
    finally:
        await daemon.stop()
    assert [asks_control(r) for r in world.llm.requests] == [True]
    assert texts(world, GROUP) == [CONTROL_ANSWER]
    assert all(not messages for chat, messages in world.telegram.sent.items() if chat != GROUP)


async def test_long_answer_arrives_split_complete_and_in_order(world: World) -> None:
    paragraphs = [f"Paragraph {i:03d}. " + "word " * 60 for i in range(40)]
    answer = "\n\n".join(paragraphs)
    assert len(answer) > 10_000
    world.llm.script(Reply(answer))
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(GROUP, "tell me everything", user_id=ALICE)
        await world.telegram.wait_for_sent(GROUP, 3, timeout=20)
        await control(world)  # sent after every part of the answer
    finally:
        await daemon.stop()
    *parts, last = texts(world, GROUP)
    assert last == CONTROL_ANSWER
    assert all(len(p) <= 4096 for p in parts)
    joined = " ".join(parts).split()
    assert joined == answer.split()


async def test_rate_limited_reply_arrives_once_after_the_pause(world: World) -> None:
    world.llm.script(Reply("worth the wait"))
    world.telegram.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", 1)
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(GROUP, "hi", user_id=ALICE)
        await world.telegram.wait_for_sent(GROUP, 1, timeout=20)
        await control(world)
    finally:
        await daemon.stop()
    assert texts(world, GROUP) == ["worth the wait", CONTROL_ANSWER]
    assert world.telegram.count("sendMessage") == 2 + 1  # the 429, the reply; the control's


async def test_sigkill_mid_turn_then_restart_gives_exactly_one_reply(world: World) -> None:
    world.llm.script(Delay(30, Reply("lost with the process")))
    daemon = await world.daemon().start()
    update = world.telegram.push_message(GROUP, "important question", user_id=ALICE)
    # The offset is confirmed only after the inbox commit; then the turn is under way.
    await world.telegram.wait_for_confirmed(update + 1, timeout=20)
    async with asyncio.timeout(20):
        await world.llm.wait_for_requests(1)
    await daemon.kill()
    world.llm.script(Reply("the one answer"))
    restarted = await world.daemon().start()
    try:
        await world.telegram.wait_for_sent(GROUP, 1, timeout=30)
        # Telegram redelivers the same update (e.g. a lost confirmation): not answered again.
        world.telegram.push_message(GROUP, "important question", user_id=ALICE, update_id=update)
        await world.telegram.wait_for_confirmed(update + 1, timeout=10)
        await control(world)
    finally:
        await restarted.stop()
    assert texts(world, GROUP) == ["the one answer", CONTROL_ANSWER]
    # The killed attempt and the one after the restart; the control's.
    assert [asks_control(r) for r in world.llm.requests] == [False, False, True]


async def test_messages_of_one_chat_are_answered_in_order_while_busy(world: World) -> None:
    world.llm.script(Delay(1.5, Reply("answer one")), Reply("answer two"), Reply("answer three"))
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(GROUP, "one", user_id=ALICE)
        async with asyncio.timeout(20):
            await world.llm.wait_for_requests(1)
        # Sent while the first turn is still running.
        world.telegram.push_message(GROUP, "two", user_id=ALICE)
        world.telegram.push_message(GROUP, "three", user_id=ALICE)
        await world.telegram.wait_for_sent(GROUP, 3, timeout=30)
    finally:
        await daemon.stop()
    assert texts(world, GROUP) == ["answer one", "answer two", "answer three"]


async def test_different_chats_run_concurrently(world: World) -> None:
    world.llm.default = Delay(1.0, Reply("done"))
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(GROUP, "first", user_id=ALICE)
        world.telegram.push_message(OTHER_GROUP, "@geode_test_bot second", user_id=ALICE)
        async with asyncio.timeout(20):
            await world.llm.wait_for_requests(2)
        # Both turns reached the model before either answer went out.
        assert not world.telegram.sent[GROUP]
        assert not world.telegram.sent[OTHER_GROUP]
        await world.telegram.wait_for_sent(GROUP, 1, timeout=20)
        await world.telegram.wait_for_sent(OTHER_GROUP, 1, timeout=20)
    finally:
        await daemon.stop()


async def test_too_long_message_is_refused_without_a_model_call(world: World) -> None:
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(GROUP, "x" * 2500, user_id=ALICE)
        sent = await world.telegram.wait_for_sent(GROUP, 1, timeout=20)
    finally:
        await daemon.stop()
    assert "limit here is 2,000" in sent[0].text
    assert world.llm.requests == []
