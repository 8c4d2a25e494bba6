"""Dead letters and the unanswered-message alert through ``geodebot serve`` on the fake
Telegram server, driven with the ``geodebot deadletters`` CLI as an operator would.

One daemon serves the file; each test has a chat of its own. "Nothing more was sent" is
checked without sleeping: a later message in the same chat is answered after anything still
pending there (the outbox sends a chat's rows in order), so once its answer is in, every
earlier reply that was going to go has gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess, geodebot_status
from tests.support.fakes.llm_server import Dialect, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE = 4242
REPLAYED, DISCARDED, RESTARTED, HELD, LOST = -7001, -7002, -7003, -7004, -7005
CHATS = (REPLAYED, DISCARDED, RESTARTED, HELD, LOST)
BLOCKED = "Forbidden: bot was blocked by the user"
ALERT_S = 1


class HeldModel(FakeLLMServer):
    """A fake model that holds each request while ``gate`` is set and not yet opened."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.held = 0

    async def _handle(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        gate = self.gate
        if gate is not None:
            self.held += 1
            await gate.wait()
        return await super()._handle(request, dialect)


@dataclass
class World:
    telegram: FakeTelegram
    model: HeldModel
    config: Path
    env: dict[str, str]
    base: str
    http: aiohttp.ClientSession
    daemon: DaemonProcess | None = None
    logs: list[str] = field(default_factory=list)

    async def start(self) -> None:
        self.daemon = await DaemonProcess(self.config, self.env).start()

    async def stop(self) -> None:
        assert self.daemon is not None
        code = await self.daemon.stop()
        text = self.daemon.text()
        self.logs.append(text)
        self.daemon = None
        assert code == 0, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert TEST_KEY not in text
        assert self.telegram.token not in text

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await geodebot("deadletters", *args, "--config", str(self.config), env=self.env)

    async def letters(self, *extra: str) -> list[dict[str, Any]]:
        code, out, err = await self.cli("list", "--json", *extra)
        assert code == 0, err
        return [json.loads(line) for line in out.splitlines()]

    async def letter_of(self, chat: int, timeout: float = 30.0) -> dict[str, Any]:
        """The one dead letter of ``chat``, once it is listed."""
        async with asyncio.timeout(timeout):
            while True:
                found = [d for d in await self.letters() if d["channel"] == str(chat)]
                if found:
                    [letter] = found
                    return letter

    def ask(self, chat: int, text: str) -> int:
        return self.telegram.push_message(chat, text, user_id=ALICE)

    def texts(self, chat: int) -> list[str]:
        return [m.text for m in self.telegram.sent[chat]]

    async def given_up(self, chat: int, answer: str) -> dict[str, Any]:
        """Alice asks in ``chat``; the platform refuses the answer for good, once."""
        self.model.script(Reply(answer))
        self.telegram.fail_next("sendMessage", 403, BLOCKED)
        self.ask(chat, f"question in {chat}")
        letter = await self.letter_of(chat)
        assert self.texts(chat) == []
        return letter

    async def barrier(self, chat: int, count: int) -> list[str]:
        """Ask once more in ``chat`` and wait for its answer: the chat's ``count``-th
        message. Returns every message the chat got."""
        self.model.script(Reply(f"barrier {count}"))
        self.ask(chat, f"anything else in {chat}?")
        await self.telegram.wait_for_sent(chat, count, timeout=30)
        return self.texts(chat)

    @contextmanager
    def database(self) -> Iterator[sqlite3.Connection]:
        """The daemon's store, opened beside it as a person with sqlite3 would."""
        path = self.config.parent / "var" / "geodebot.db"
        with closing(sqlite3.connect(path, isolation_level=None)) as db:
            yield db

    async def health(self) -> tuple[int, dict[str, Any]]:
        async with self.http.get(self.base + "/healthz") as response:
            body: dict[str, Any] = await response.json()
            return response.status, body

    async def until_unanswered(self, count: int, timeout: float = 30.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                _, body = await self.health()
                if body["components"]["unanswered"]["count"] == count:
                    return body
                await asyncio.sleep(0.1)

    async def metrics(self) -> str:
        async with self.http.get(self.base + "/metrics") as response:
            assert response.status == 200
            return await response.text()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("deadletters")
    port = free_port()
    async with (
        FakeTelegram() as telegram,
        HeldModel() as model,
        aiohttp.ClientSession() as http,
    ):
        bindings = "".join(
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{chat}"\n'
            f'session = "dead{-chat}"\nallowed_users = ["{ALICE}"]\n'
            for chat in CHATS
        )
        config = tmp / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp / "var"}"\nshutdown_grace_s = 5\n'
            f'http = "127.0.0.1:{port}"\nunanswered_alert_s = {ALERT_S}\n'
            f'[model]\nprovider = "anthropic"\nname = "dead-model"\n'
            f'base_url = "{model.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[channels.telegram]\ntoken_env = "DEAD_TG_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n{bindings}'
        )
        env = dict(os.environ, DEAD_TG_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        world = World(telegram, model, config, env, f"http://127.0.0.1:{port}", http)
        await world.start()
        try:
            yield world
        finally:
            if world.model.gate is not None:
                world.model.gate.set()
            if world.daemon is not None:
                await world.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: World) -> World:
    # A test that failed with the daemon stopped leaves none: the next one gets a fresh one.
    if shared.daemon is None:
        await shared.start()
    return shared


async def test_a_reply_given_up_on_is_replayed_from_the_cli_and_arrives_once(
    world: World,
) -> None:
    letter = await world.given_up(REPLAYED, "the answer, late")
    assert re.fullmatch(r"out-\d+", letter["id"])
    assert letter["kind"] == "outbox"
    assert letter["status"] == "failed"
    assert BLOCKED in letter["error"]
    assert letter["text"] == "the answer, late"
    assert letter["decision"] is None
    code, out, err = await world.cli("show", letter["id"])
    assert code == 0, err
    assert f"{letter['id']}: a dead letter" in out
    assert BLOCKED in out

    code, out, err = await world.cli("replay", letter["id"])
    assert code == 0, err
    assert out.strip() == f"{letter['id']} replayed: it is sent again"
    # The running daemon picks the replay up by itself.
    sent = await world.telegram.wait_for_sent(REPLAYED, 1, timeout=30)
    assert [m.text for m in sent] == ["the answer, late"]
    assert all(d["id"] != letter["id"] for d in await world.letters())

    code, out, err = await world.cli("replay", letter["id"])
    assert code == 1
    assert out == ""
    assert re.search(rf"{letter['id']} was already replayed by \S+ via cli at ", err), err
    assert await world.barrier(REPLAYED, 2) == ["the answer, late", "barrier 2"]
    code, out, err = await world.cli("show", letter["id"], "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["status"], shown["dead"]) == ("sent", False)
    assert shown["decision"]["action"] == "replay"
    assert shown["decision"]["via"] == "cli"


async def test_a_discarded_dead_letter_leaves_the_list_and_is_never_sent(world: World) -> None:
    letter = await world.given_up(DISCARDED, "never to be seen")
    code, out, err = await world.cli("discard", letter["id"])
    assert code == 0, err
    assert out.strip().startswith(f"{letter['id']} discarded")
    assert all(d["id"] != letter["id"] for d in await world.letters())
    [decided] = [d for d in await world.letters("--all") if d["id"] == letter["id"]]
    assert decided["decision"]["action"] == "discard"
    assert decided["status"] == "failed"

    code, _, err = await world.cli("replay", letter["id"])
    assert code == 1
    assert f"{letter['id']} was already discarded by " in err
    code, _, err = await world.cli("discard", letter["id"])
    assert code == 1
    assert await world.barrier(DISCARDED, 1) == ["barrier 1"]

    code, _, err = await world.cli("replay", "out-999999")
    assert code == 1
    assert "no dead letter out-999999" in err
    code, _, err = await world.cli("show", "bogus")
    assert code == 1
    assert "no dead letter bogus" in err


async def test_a_replay_made_while_the_daemon_is_down_is_sent_when_it_starts(
    world: World,
) -> None:
    letter = await world.given_up(RESTARTED, "sent after the restart")
    await world.stop()
    code, out, err = await world.cli("replay", letter["id"])
    assert code == 0, err
    assert "replayed" in out
    await world.start()
    sent = await world.telegram.wait_for_sent(RESTARTED, 1, timeout=30)
    assert [m.text for m in sent] == ["sent after the restart"]
    assert await world.barrier(RESTARTED, 2) == ["sent after the restart", "barrier 2"]


async def test_a_message_left_unanswered_shows_on_health_and_metrics_until_answered(
    world: World,
) -> None:
    await world.until_unanswered(0)
    code, body = await world.health()
    assert code == 200, body
    assert body["components"]["unanswered"] == {
        "ok": True,
        "count": 0,
        "oldest_age_s": None,
        "alert_s": ALERT_S,
    }
    world.model.gate = gate = asyncio.Event()
    try:
        world.model.script(Reply("answered at last"))
        world.ask(HELD, "are you there?")
        body = await world.until_unanswered(1)
        assert body["status"] == "unhealthy"
        unanswered = body["components"]["unanswered"]
        assert unanswered["ok"] is False
        assert unanswered["oldest_age_s"] >= ALERT_S
        code, _ = await world.health()
        assert code == 503
        async with world.http.get(world.base + "/livez") as response:
            assert response.status == 200
        assert "geodebot_unanswered_messages 1.0" in (await world.metrics()).splitlines()
        code, out, err = await geodebot_status(world.config, "--json")
        assert code == 0, err
        assert json.loads(out)["unanswered"]["count"] == 1
        code, out, err = await geodebot_status(world.config)
        assert code == 0, err
        assert f"unanswered: 1 message(s) without a reply for over {ALERT_S} s" in out
        assert world.texts(HELD) == []
    finally:
        gate.set()
        world.model.gate = None
    await world.telegram.wait_for_sent(HELD, 1, timeout=30)
    assert world.texts(HELD) == ["answered at last"]
    await world.until_unanswered(0)
    code, _ = await world.health()
    assert code == 200
    assert "geodebot_unanswered_messages 0.0" in (await world.metrics()).splitlines()


async def test_a_message_whose_answer_was_lost_is_answered_again_once(world: World) -> None:
    world.model.script(Reply("the answer that was lost"))
    world.ask(LOST, "what was it?")
    await world.telegram.wait_for_sent(LOST, 1, timeout=30)
    with world.database() as db:
        [(inbox_id,)] = db.execute("SELECT id FROM inbox WHERE channel = ?", (str(LOST),))
    # Its reply's row is lost once sent, as in a database restored without it: the message
    # is finished and nothing answers it (migration 0012 marks such rows of an older
    # database as it does here).
    async with asyncio.timeout(30):
        while True:
            with world.database() as db:
                deleted = db.execute(
                    "DELETE FROM outbox WHERE inbox_id = ? AND status = 'sent'", (inbox_id,)
                ).rowcount
                if deleted:
                    db.execute("UPDATE inbox SET no_reply = 1 WHERE id = ?", (inbox_id,))
            if deleted:
                break
            await asyncio.sleep(0.05)
    letter = await world.letter_of(LOST)
    assert (letter["id"], letter["kind"], letter["status"]) == (f"in-{inbox_id}", "inbox", "done")
    asked = world.model.request_count

    code, out, err = await world.cli("replay", f"in-{inbox_id}")
    assert code == 0, err
    assert out.strip() == f"in-{inbox_id} replayed: its turn runs again"
    sent = await world.telegram.wait_for_sent(LOST, 2, timeout=30)
    # The turn had finished: the engine answers it from the store, without the model.
    assert [m.text for m in sent] == ["the answer that was lost"] * 2
    assert world.model.request_count == asked
    code, _, err = await world.cli("replay", f"in-{inbox_id}")
    assert code == 1
    assert "was already replayed" in err
    assert await world.barrier(LOST, 3) == ["the answer that was lost"] * 2 + ["barrier 3"]
    with world.database() as db:
        replies = db.execute("SELECT COUNT(*) FROM outbox WHERE inbox_id = ?", (inbox_id,))
        assert replies.fetchone() == (1,)
