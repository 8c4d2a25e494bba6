"""``geodebot serve`` on PostgreSQL end to end: the real daemon process with ``[store] url``
naming a database of the test cluster that only a password opens (the password through
``[store] password_env``), python-telegram-bot against the fake Bot API, the anthropic SDK
against the fake model server; then the CLI on the same store.

One daemon serves the tests of this file (the crash test starts it again on the same
database); each test talks in a chat and session of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import (
    CONTROL,
    CONTROL_ANSWER,
    answer_controls,
    asks_control,
    until_answered,
)
from tests.support.daemon import DaemonProcess, geodebot_status
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.pg_password import PasswordDatabase, password_database
from tests.support.ports import free_port
from tests.support.postgres import Cluster

pytestmark = pytest.mark.asyncio(loop_scope="module")

HELLO, CRASH, CLI = -1001, -1002, -1003
ALICE = 4242
PASSWORD_ENV = "E2E_DB_PASSWORD"
REPLICA = "tg-replica-1"


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    db: PasswordDatabase
    superuser_url: str
    http: str
    config: Path
    state_dir: Path
    env: dict[str, str]
    daemons: list[DaemonProcess] = field(default_factory=list)

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    async def start(self) -> DaemonProcess:
        self.daemons.append(DaemonProcess(self.config, self.env))
        return await self.daemon.start()

    def texts(self, chat: int) -> list[str]:
        return [m.text for m in self.telegram.sent[chat]]

    async def control(self, chat: int) -> list[str]:
        """A control message in ``chat`` and its answer (tests/support/control.py); then
        every text the chat got."""
        answer_controls(self.llm)
        self.telegram.push_message(chat, CONTROL, user_id=ALICE)
        return await until_answered(lambda: self.texts(chat))

    def rows(self, sql: str) -> list[tuple[object, ...]]:
        """What the daemon committed to its database, read behind its back."""
        with psycopg.connect(self.superuser_url, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def everything_logged(self) -> str:
        return "\n".join(daemon.text() for daemon in self.daemons)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(
    tmp_path_factory: pytest.TempPathFactory, postgres_cluster: Cluster
) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("daemon-postgres")
    db = password_database(postgres_cluster)
    async with FakeTelegram() as telegram, FakeLLMServer() as llm:
        state_dir = tmp / "var"
        http = f"127.0.0.1:{free_port()}"
        config = tmp / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{state_dir}"\nreplica_id = "{REPLICA}"\n'
            f'shutdown_grace_s = 5\nhttp = "{http}"\n'
            f'[store]\nurl = "{db.url}"\npassword_env = "{PASSWORD_ENV}"\n'
            f'[model]\nprovider = "anthropic"\nname = "pg-e2e-model"\nbase_url = "{llm.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[tools]\nipc_tools = ["get_time"]\n'
            '[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{HELLO}"\nsession = "hello"\n'
            f'allowed_users = ["{ALICE}"]\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{CRASH}"\nsession = "crash"\n'
            f'allowed_users = ["{ALICE}"]\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{CLI}"\nsession = "cli"\n'
            f'allowed_users = ["{ALICE}"]\n'
        )
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token, **{PASSWORD_ENV: db.password})
        env[TEST_KEY_ENV] = TEST_KEY
        env.pop("GEODEBOT_CONFIG", None)
        superuser_url = postgres_cluster.url(db.dbname)
        world = World(telegram, llm, db, superuser_url, http, config, state_dir, env)
        await world.start()
        try:
            yield world
        finally:
            for daemon in world.daemons[:-1]:
                await daemon.kill()  # reaped already: SIGKILLed by its test
            code = await world.daemon.stop()
            text = world.everything_logged()
            assert code == 0, text[-3000:]
            assert "Traceback" not in text
            assert db.password not in text
            assert TEST_KEY not in text
            assert telegram.token not in text


async def test_a_message_is_answered_and_everything_is_in_postgresql(world: World) -> None:
    world.llm.script(Reply("Hello from PostgreSQL"))
    update = world.telegram.push_message(HELLO, "hi there", user_id=ALICE)
    await world.telegram.wait_for_sent(HELLO, 1, timeout=30)
    await world.telegram.wait_for_confirmed(update + 1, timeout=10)
    assert await world.control(HELLO) == ["Hello from PostgreSQL", CONTROL_ANSWER]
    # The inbox, the session and its messages are the database's; no SQLite file was made.
    assert world.rows("SELECT session_id, status FROM inbox WHERE session_id = 'hello'") == [
        ("hello", "done"),
        ("hello", "done"),
    ]
    [(stored,)] = world.rows("SELECT COUNT(*) FROM messages WHERE session_id = 'hello'")
    assert isinstance(stored, int)
    assert stored >= 4
    assert not (world.state_dir / "geodebot.db").exists()
    # The daemon logs which replica it is and where its store is, without the password.
    [serving] = [line for line in world.daemon.log if "geodebot serving" in line]
    assert REPLICA in serving
    assert f"postgresql://{world.db.role}@127.0.0.1:{world.db.port}/{world.db.dbname}" in serving


async def test_status_names_the_replica_and_the_store_without_a_password(world: World) -> None:
    code, out, err = await geodebot_status(world.config, "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["replica_id"] == REPLICA
    assert answer["store"] == {
        "kind": "postgresql",
        "host": "127.0.0.1",
        "port": world.db.port,
        "dbname": world.db.dbname,
    }
    code, text, err = await geodebot_status(world.config)
    assert code == 0, err
    assert (
        f"replica {REPLICA}, store postgresql 127.0.0.1:{world.db.port}/{world.db.dbname}"
    ) in text.splitlines()
    lines = text.splitlines()
    lease_line = (
        lines.index(
            f"replica {REPLICA}, store postgresql 127.0.0.1:{world.db.port}/{world.db.dbname}"
        )
        + 1
    )
    assert re.fullmatch(
        r"lease daemon: leading, epoch (\d+), (\d+) takeover\(s\) so far", lines[lease_line]
    )
    assert re.fullmatch(
        r"sessions held here: \d+ \(\d+ taken, 0 lost so far\)", lines[lease_line + 1]
    )
    assert lines[lease_line + 2] == "  no other replica"
    # /healthz shows the same two facts beside the store's own component, and the daemon's
    # lease, which this replica holds (a restart with the same id keeps holding it).
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://{world.http}/healthz") as response,
    ):
        health = await response.text()
    components = json.loads(health)["components"]
    lease = components["replica"].pop("lease")
    assert components["replica"].pop("peers") == answer["peers"] == []
    assert components["replica"].pop("sessions")["lost"] == 0
    assert components["replica"] == {"ok": True, "id": REPLICA, "store": answer["store"]}
    assert (lease["holder"], lease["leading"], lease["lost"]) == (REPLICA, True, None)
    assert answer["lease"]["holder"] == REPLICA
    assert components["store"]["ok"] is True
    for shown in (out, text, err, health):
        assert world.db.password not in shown


async def test_sigkill_mid_turn_then_restart_answers_exactly_once(world: World) -> None:
    world.llm.script(Delay(30, Reply("lost with the process")))
    requests = world.llm.request_count
    update = world.telegram.push_message(CRASH, "important question", user_id=ALICE)
    # The offset is confirmed only after the inbox commit; then the turn is under way.
    await world.telegram.wait_for_confirmed(update + 1, timeout=20)
    async with asyncio.timeout(20):
        await world.llm.wait_for_requests(requests + 1)
    await world.daemon.kill()
    world.llm.script(Reply("the one answer"))
    await world.start()
    await world.telegram.wait_for_sent(CRASH, 1, timeout=30)
    # Telegram redelivers the same update (a lost confirmation): not answered again.
    world.telegram.push_message(CRASH, "important question", user_id=ALICE, update_id=update)
    await world.telegram.wait_for_confirmed(update + 1, timeout=10)
    assert await world.control(CRASH) == ["the one answer", CONTROL_ANSWER]
    # The killed attempt and the one after the restart; the control's.
    asked = world.llm.requests[requests:]
    assert [asks_control(r) for r in asked] == [False, False, True]
    assert all("important question" in json.dumps(r.json["messages"][-1]) for r in asked[:2])
    assert world.rows(
        "SELECT COUNT(*) FROM inbox WHERE session_id = 'crash' AND status = 'done'"
    ) == [(2,)]


async def test_the_cli_reads_the_daemons_postgresql_store(world: World) -> None:
    assert await world.control(CLI) == [CONTROL_ANSWER]  # a model call of this test's own
    config = str(world.config)
    code, out, err = await geodebot("usage", "--by", "binding", "--config", config, env=world.env)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("BINDING")
    assert any(line.startswith(f"telegram:{CLI} ") for line in lines[1:]), out
    code, out, err = await geodebot("usage", "--json", "--config", config, env=world.env)
    assert code == 0, err
    [total] = [json.loads(line) for line in out.splitlines()]
    # Every model request of the file but those a SIGKILL cut off: with no budget set, a
    # call is recorded once answered (nothing is reserved before it).
    killed = len(world.daemons) - 1
    assert (total["calls"], total["unsettled"]) == (len(world.llm.requests) - killed, 0)
    code, out, err = await geodebot("jobs", "list", "--config", config, env=world.env)
    assert code == 0, err
    assert out.split() == ["JOB", "ORIGIN", "SCHEDULE", "NEXT", "FIRE", "LAST"]
    # The killed turn's request got no reply, but its message did: no dead letter.
    code, out, err = await geodebot("deadletters", "list", "--config", config, env=world.env)
    assert code == 0, err
    assert out == "no dead letters\n"
    code, out, err = await geodebot("store", "migrate", "--config", config, env=world.env)
    assert code == 0, err
    assert out.endswith("nothing pending\n"), out
    # Without the password the store is not opened, and the message says which variable.
    bare = {k: v for k, v in world.env.items() if k != PASSWORD_ENV}
    code, out, err = await geodebot("jobs", "list", "--config", config, env=bare)
    assert (code, out) == (1, "")
    assert f"set the environment variable {PASSWORD_ENV}" in err
    assert "Traceback" not in err
    for shown in (out, err):
        assert world.db.password not in shown
