"""``geodebot serve`` on Telegram in webhook mode: the fake Bot API POSTs each update to the
daemon's listener (retrying until it gets a 2xx, as Telegram does), python-telegram-bot
answers through the fake, the anthropic SDK talks to the fake model.

One daemon on SQLite (a message answered once, a SIGKILL mid-turn), then replicas on
PostgreSQL behind a load balancer that the fake plays: each POST goes to the next replica's
listener in turn, the standing-by one included, and the serving one answers everything once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import pytest_asyncio

from geodebot.replicas.daemon_lease import LEAD_MARK
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, CONTROL_ANSWER, answer_controls, until_answered
from tests.support.daemon import READY_MARK, DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port
from tests.support.postgres import Cluster, inbox_by_pickup

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT, ALICE = -3001, 4242
SECRET = "e2e-webhook_secret-0123456789"
HOOK_PATH = "/telegram/hook-e2e"
LISTENING = "receiving webhooks"
TTL_S = 3
TAKEOVER_S = TTL_S + 30


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    tmp: Path
    env: dict[str, str]
    store_url: str | None = None
    ports: dict[str, int] = field(default_factory=dict)
    daemons: dict[str, DaemonProcess] = field(default_factory=dict)

    def listen(self, name: str) -> str:
        return f"127.0.0.1:{self.ports.setdefault(name, free_port())}"

    def config(self, name: str, webhook_url: str) -> Path:
        store = ""
        if self.store_url is not None:
            store = f'[store]\nurl = "{self.store_url}"\nlease_ttl_s = {TTL_S}\n'
        path = self.tmp / f"{name}.toml"
        path.write_text(
            f'[daemon]\nstate_dir = "{self.tmp / name}"\nreplica_id = "{name}"\n'
            f"shutdown_grace_s = 2\n{store}"
            f'[model]\nprovider = "anthropic"\nname = "webhook-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\n'
            f'webhook_url = "{webhook_url}"\nwebhook_listen = "{self.listen(name)}"\n'
            'webhook_secret_env = "E2E_TELEGRAM_WEBHOOK_SECRET"\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{CHAT}"\nsession = "team"\n'
            f'allowed_users = ["{ALICE}"]\nstream = false\n'
        )
        return path

    async def start(self, name: str) -> DaemonProcess:
        """The daemon ``name`` (webhook_url on its own listener unless replicas share a
        balancer), once it listens."""
        url = f"http://{self.listen('balancer' if self.store_url else name)}{HOOK_PATH}"
        daemon = DaemonProcess(self.config(name, url), self.env)
        self.daemons[name] = daemon
        await daemon.start(mark=READY_MARK)
        await daemon.wait_for_line(LISTENING, timeout_s=30)
        return daemon

    def texts(self) -> list[str]:
        return [m.text for m in self.telegram.sent[CHAT]]

    async def control(self) -> list[str]:
        """The control message (tests/support/control.py) answered; every text then."""
        self.telegram.push_message(CHAT, CONTROL, user_id=ALICE)
        return await until_answered(self.texts, timeout=TAKEOVER_S)

    async def close(self) -> None:
        for daemon in self.daemons.values():
            if daemon.proc is not None and daemon.proc.returncode is None:
                daemon.proc.send_signal(signal.SIGCONT)
            await daemon.kill()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fakes() -> AsyncIterator[tuple[FakeTelegram, FakeLLMServer, dict[str, str]]]:
    async with FakeTelegram() as telegram, FakeLLMServer() as llm:
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env["E2E_TELEGRAM_WEBHOOK_SECRET"] = SECRET
        env[TEST_KEY_ENV] = TEST_KEY
        env.pop("GEODEBOT_CONFIG", None)
        answer_controls(llm)
        yield telegram, llm, env


@pytest_asyncio.fixture(loop_scope="module")
async def single(
    tmp_path: Path, fakes: tuple[FakeTelegram, FakeLLMServer, dict[str, str]]
) -> AsyncIterator[World]:
    telegram, llm, env = fakes
    telegram.sent.clear()
    world = World(telegram, llm, tmp_path, env)
    try:
        yield world
    finally:
        await world.close()


async def test_a_message_by_webhook_is_answered_once(single: World) -> None:
    world = single
    world.llm.script(Reply("hello by webhook"))
    polls = world.telegram.count("getUpdates")
    daemon = await world.start("solo")
    assert world.telegram.webhook == {
        "url": f"http://{world.listen('solo')}{HOOK_PATH}",
        "secret_token": SECRET,
        "allowed_updates": ["callback_query", "channel_post", "message"],
    }
    update = world.telegram.push_message(CHAT, "hi there", user_id=ALICE)
    await world.telegram.wait_for_sent(CHAT, 1, timeout=30)
    # Telegram delivers the same update again (its 200 got lost, say): taken, not answered.
    world.telegram.push_message(CHAT, "hi there", user_id=ALICE, update_id=update)
    assert await world.control() == ["hello by webhook", CONTROL_ANSWER]
    assert world.telegram.webhook_statuses(update) == [200, 200]
    assert world.telegram.count("getUpdates") == polls
    assert await daemon.stop() == 0
    assert "Traceback" not in daemon.text()
    assert SECRET not in daemon.text()


async def test_sigkill_mid_turn_then_restart_answers_once(single: World) -> None:
    world = single
    world.llm.script(Delay(30, Reply("lost with the process")))
    asked = len(world.llm.requests)
    daemon = await world.start("crashy")
    update = world.telegram.push_message(CHAT, "important question", user_id=ALICE)
    await world.telegram.wait_for_webhook_ok(update, timeout=30)  # committed
    await world.llm.wait_for_requests(asked + 1)
    await daemon.kill()
    # Sent while nobody listens: Telegram retries until the restarted daemon answers 2xx.
    world.llm.script(Reply("the one answer"), Reply("the later one"))
    later = world.telegram.push_message(CHAT, "while down", user_id=ALICE)
    await world.telegram.wait_until(lambda: 0 in world.telegram.webhook_statuses(later))
    restarted = await world.start("crashy")
    await world.telegram.wait_for_webhook_ok(later, timeout=30)
    assert await world.control() == ["the one answer", "the later one", CONTROL_ANSWER]
    assert world.telegram.webhook_statuses(later)[-1] == 200
    assert world.telegram.webhook_statuses(update) == [200]
    assert await restarted.stop() == 0


# -- replicas on PostgreSQL ---------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="module")
async def replicas(
    tmp_path: Path,
    postgres_cluster: Cluster,
    fakes: tuple[FakeTelegram, FakeLLMServer, dict[str, str]],
) -> AsyncIterator[World]:
    telegram, llm, env = fakes
    telegram.sent.clear()
    world = World(telegram, llm, tmp_path, env, postgres_cluster.new_database(migrated=True))
    # The balancer: each POST to the next replica's listener in turn.
    telegram.webhook_targets = [world.listen("alpha"), world.listen("beta")]
    try:
        yield world
    finally:
        telegram.webhook_targets = []
        await world.close()


def inbox_rows(world: World) -> dict[tuple[str | None, str], int]:
    assert world.store_url is not None
    return inbox_by_pickup(world.store_url, "telegram")


def outbox_rows(world: World) -> dict[str, int]:
    assert world.store_url is not None
    with psycopg.connect(world.store_url, autocommit=True) as conn:
        rows = conn.execute("SELECT status, COUNT(*) FROM outbox GROUP BY status").fetchall()
    return {r[0]: r[1] for r in rows}


async def until_sent(world: World, n: int) -> None:
    """Until the outbox recorded ``n`` replies as sent. A reply Telegram got but the outbox
    had not recorded yet would be sent again by the next serving replica (the Bot API cannot
    look a message up), which is not what this test is about."""
    async with asyncio.timeout(30):
        while outbox_rows(world) != {"sent": n}:  # noqa: ASYNC110 - a database, polled
            await asyncio.sleep(0.05)


async def test_replicas_behind_a_balancer_answer_every_message_once(replicas: World) -> None:
    world = replicas
    world.llm.default = Reply("answered")
    sets = world.telegram.webhook_sets
    await world.start("alpha")
    beta = await world.start("beta")
    # Only the leader registered the webhook.
    assert world.telegram.webhook_sets == sets + 1
    updates = [world.telegram.push_message(CHAT, f"spread {n}", user_id=ALICE) for n in range(6)]
    await world.telegram.wait_until(lambda: len(world.texts()) >= 6, timeout=30)
    targets = {a.target for a in world.telegram.webhook_answers if a.update_id in updates}
    assert targets == {world.listen("alpha"), world.listen("beta")}
    # Each replica committed its share, and the one holding the chat's session answered all.
    assert inbox_rows(world) == {("alpha", "done"): 3, ("beta", "done"): 3}
    await until_sent(world, 6)

    # The leader dies: its listener is gone, beta's takes every POST, and beta takes the
    # leadership over (registering the webhook again) and the chat's session, if alpha held
    # it, and answers what came meanwhile.
    await world.daemons["alpha"].kill()
    late = [world.telegram.push_message(CHAT, f"late {n}", user_id=ALICE) for n in range(2)]
    await beta.wait_for_line(LEAD_MARK, timeout_s=TAKEOVER_S)
    texts = await world.control()
    assert texts == ["answered"] * 8 + [CONTROL_ANSWER]
    assert world.telegram.webhook_sets == sets + 2
    for update in updates + late:
        assert world.telegram.webhook_statuses(update)[-1] == 200
    # The control answer reaches Telegram just before its row is marked sent.
    await until_sent(world, 9)
    assert sum(inbox_rows(world).values()) == 9
    assert all(status == "done" for _, status in inbox_rows(world))
    assert await beta.stop() == 0
    assert "Traceback" not in beta.text()
