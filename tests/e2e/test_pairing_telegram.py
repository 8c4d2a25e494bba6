"""DM pairing end to end on Telegram: ``geodebot serve`` on the fake Bot API, and the
operator's ``geodebot pairing`` / ``geodebot bindings`` commands as separate processes.

A stranger's direct message gets one code and costs no model call; the operator's approval
lets their next message be answered without a restart; a code is used once, and not after it
expired; many strangers at once get at most ``max_pending`` codes while known chats are
answered; a group message from a stranger never pairs."""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, answer_controls, asks_control, until_answered
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.waiting import until

GROUP, UNBOUND_GROUP = -1001, -1999
ALICE, STRANGER = 4242, 5001
CODE = re.compile(r"\b([0-9A-Z]{5}-[0-9A-Z]{5})\b")
MAX_PENDING = 10


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    config: Path
    env: dict[str, str]
    state: Path

    def daemon(self) -> DaemonProcess:
        return DaemonProcess(self.config, self.env)

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await geodebot(*args, "--config", str(self.config), env=self.env)

    def texts(self, chat: int) -> list[str]:
        return [m.text for m in self.telegram.sent[chat]]

    async def control(self) -> list[str]:
        """A control message in the bound group, answered: what strangers' messages
        before it would have caused has happened by then."""
        answer_controls(self.llm)
        self.telegram.push_message(GROUP, CONTROL, user_id=ALICE)
        return await until_answered(lambda: self.texts(GROUP))

    def dm(self, user: int, text: str, **options: Any) -> int:
        return self.telegram.push_message(user, text, user_id=user, chat_type="private", **options)

    async def code_for(self, user: int) -> str:
        sent = await self.telegram.wait_for_sent(user, 1, timeout=20)
        found = CODE.search(sent[0].text)
        assert found is not None, sent[0].text
        return found.group(1)


@pytest.fixture
async def world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[World]:
    async with FakeTelegram() as telegram:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nuser_rate_per_min = 0\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm_server.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f"[pairing]\nenabled = true\nmax_pending = {MAX_PENDING}\n"
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n'
        )
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        yield World(telegram, llm_server, config, env, tmp_path / "var")


async def test_a_stranger_gets_a_code_and_once_approved_is_answered_without_a_restart(
    world: World,
) -> None:
    daemon = await world.daemon().start()
    try:
        first = world.dm(STRANGER, "hello, may I use you? " + "x" * 400)
        code = await world.code_for(STRANGER)
        # A redelivery and a second message within the minute: no second code.
        world.dm(STRANGER, "hello, may I use you?", update_id=first)
        world.dm(STRANGER, "anyone there?")
        await world.control()
        assert len(world.texts(STRANGER)) == 1
        assert [asks_control(r) for r in world.llm.requests] == [True]
        assert f"geodebot pairing approve telegram {code}" in world.texts(STRANGER)[0]

        rc, out, err = await world.cli("pairing", "list", "--json")
        assert rc == 0, err
        [listed] = [json.loads(line) for line in out.splitlines()]
        assert (listed["code"], listed["user"], listed["status"]) == (
            code,
            str(STRANGER),
            "pending",
        )
        # Nothing of the text is kept beyond its first 200 characters.
        assert listed["first_text"] == ("hello, may I use you? " + "x" * 400)[:200]

        rc, out, err = await world.cli("pairing", "approve", "telegram", code.lower())
        assert rc == 0, err
        assert f"telegram:{STRANGER}" in out
        welcome = await world.telegram.wait_for_sent(STRANGER, 2, timeout=20)
        assert "paired" in welcome[1].text

        world.llm.script(Reply("Hello, new friend"))
        world.dm(STRANGER, "what can you do?")
        await world.telegram.wait_for_sent(STRANGER, 3, timeout=20)
        assert world.texts(STRANGER)[2] == "Hello, new friend"
        asked = [r for r in world.llm.requests if not asks_control(r)]
        assert len(asked) == 1
        assert "what can you do?" in json.dumps(asked[0].json)
        # What a pairing grants by default: no tools at all.
        assert not (asked[0].json or {}).get("tools")

        rc, _, err = await world.cli("pairing", "approve", "telegram", code)
        assert rc == 1
        assert "approved already" in err

        rc, out, err = await world.cli("bindings", "list", "--json")
        assert rc == 0, err
        rows = {row["key"]: row for row in map(json.loads, out.splitlines())}
        assert rows[f"telegram:{GROUP}"]["origin"] == "config"
        stored = rows[f"telegram:{STRANGER}"]
        assert (stored["origin"], stored["session"], stored["made_by"]) == (
            "stored",
            f"dm:telegram:{STRANGER}",
            f"pairing:{code.replace('-', '')}",
        )
        rc, _, err = await world.cli("bindings", "remove", f"telegram:{GROUP}")
        assert rc == 1
        assert "edit the file" in err

        # Removed, the chat is a stranger's again: a new code, no model call.
        rc, _, err = await world.cli("bindings", "remove", f"telegram:{STRANGER}")
        assert rc == 0, err
        await until(lambda: "binding telegram:5001 removed" in daemon.text(), "the removal")
        world.dm(STRANGER, "still there?")
        sent = await world.telegram.wait_for_sent(STRANGER, 4, timeout=20)
        renewed = CODE.search(sent[3].text)
        assert renewed is not None
        assert renewed.group(1) != code
        assert len([r for r in world.llm.requests if not asks_control(r)]) == 1
    finally:
        assert await daemon.stop() == 0
    ledger = [json.loads(line) for line in (world.state / "ledger.jsonl").read_text().splitlines()]
    kinds = [row["kind"] for row in ledger if row["kind"].startswith(("pairing", "binding"))]
    assert kinds == ["pairing_approved", "binding_removed"]
    assert "Traceback" not in daemon.text()
    assert world.telegram.token not in daemon.text()


async def test_an_expired_code_cannot_be_approved(world: World) -> None:
    daemon = await world.daemon().start()
    try:
        world.dm(STRANGER, "let me in")
        code = await world.code_for(STRANGER)
        with sqlite3.connect(world.state / "geodebot.db") as db:
            db.execute("UPDATE pairings SET expires_at = expires_at - 7200")
        rc, _, err = await world.cli("pairing", "approve", "telegram", code)
        assert rc == 1
        assert "expired" in err
        rc, _, err = await world.cli("pairing", "deny", "telegram", code)
        assert rc == 1
        rc, out, _ = await world.cli("bindings", "list", "--json")
        assert f"telegram:{STRANGER}" not in out
        rc, out, _ = await world.cli("pairing", "list", "--all", "--json")
        assert json.loads(out.splitlines()[0])["status"] == "expired"
    finally:
        assert await daemon.stop() == 0


async def test_fifty_strangers_get_at_most_max_pending_codes_and_known_chats_go_on(
    world: World,
) -> None:
    daemon = await world.daemon().start()
    strangers = range(6000, 6050)
    try:
        for user in strangers:
            world.dm(user, f"hi from {user}")
        answered = await world.control()
        assert answered[-1].startswith("control answer")
        await until(
            lambda: sum(1 for u in strangers if world.telegram.sent[u]) >= MAX_PENDING,
            "the codes",
        )
        # Known chats keep being answered while strangers wait.
        await world.control()
    finally:
        assert await daemon.stop() == 0
    coded = [u for u in strangers if world.telegram.sent[u]]
    assert len(coded) == MAX_PENDING
    assert all(len(world.telegram.sent[u]) == 1 for u in coded)
    assert all(asks_control(r) for r in world.llm.requests)
    assert "max_pending" in daemon.text()
    rc, out, _ = await world.cli("pairing", "list", "--json")
    assert rc == 0
    assert len(out.splitlines()) == MAX_PENDING


async def test_a_strangers_group_message_never_pairs(world: World) -> None:
    daemon = await world.daemon().start()
    try:
        world.telegram.push_message(
            UNBOUND_GROUP, f"@{world.telegram.bot_user['username']} let me in", user_id=STRANGER
        )
        world.telegram.push_message(UNBOUND_GROUP, "/start", user_id=STRANGER)
        await world.control()
    finally:
        assert await daemon.stop() == 0
    assert not world.telegram.sent[UNBOUND_GROUP]
    assert not world.telegram.sent[STRANGER]
    rc, out, _ = await world.cli("pairing", "list", "--all", "--json")
    assert (rc, out) == (0, "")
