"""Telegram's webhook mode: the channel's listener against the fake Bot API, which registers
the webhook and POSTs updates to it as Telegram does, and against POSTs made by hand."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geodebot.channels.base import Inbound, Press, PressAnswer, press_data
from geodebot.channels.factory import build_channels
from geodebot.channels.telegram import TelegramChannel
from geodebot.channels.telegram.webhook import MAX_BODY, SECRET_HEADER
from geodebot.config.schema import ConfigError, TelegramConfig, parse_config
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port

GROUP = -1001234
SECRET = "s3cret_token-for-tests"
PATH = "/telegram/hook-7f3a"


class Inbox:
    """The sink as the router's inbox behaves: an update's event id is committed once (a
    redelivery is taken without effect); ``fail_next`` refuses that many commits; ``gate``
    (when set) holds a commit open. ``answered_at_commit`` is, per commit, whether the fake
    had recorded any answer to that update's POSTs when the commit happened."""

    def __init__(self, fake: FakeTelegram) -> None:
        self.fake = fake
        self.committed: list[str] = []
        self.handed: list[str] = []
        self.fail_next = 0
        self.gate: asyncio.Event | None = None
        self.answered_at_commit: list[bool] = []

    async def __call__(self, inbound: Inbound) -> None:
        self.handed.append(inbound.event_id)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("the inbox is unavailable")
        if inbound.event_id not in self.committed:
            self.answered_at_commit.append(bool(self.fake.webhook_statuses(int(inbound.event_id))))
            self.committed.append(inbound.event_id)


OpenChannel = Callable[..., Awaitable[TelegramChannel]]


def webhook_config(fake: FakeTelegram, port: int) -> TelegramConfig:
    return TelegramConfig(
        api_base_url=fake.api_base_url,
        webhook_url=f"http://127.0.0.1:{port}{PATH}",
        webhook_listen=f"127.0.0.1:{port}",
        webhook_secret_env="TG_HOOK_SECRET",
    )


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        server.webhook_retry_s = 0.01
        yield server


@pytest.fixture
async def open_channel(fake: FakeTelegram) -> AsyncIterator[OpenChannel]:
    opened: list[TelegramChannel] = []

    async def _open(
        sink: Inbox,
        presses: Callable[[Press], Awaitable[PressAnswer]] | None = None,
        *,
        ingest_later: bool = False,
        port: int | None = None,
    ) -> TelegramChannel:
        config = webhook_config(fake, port or free_port())
        channel = TelegramChannel(
            config, fake.token, webhook_secret=SECRET, ingest_later=ingest_later
        )
        opened.append(channel)
        await channel.start(sink, presses)
        return channel

    yield _open
    for channel in opened:
        await channel.stop()


async def post(
    channel: TelegramChannel,
    body: bytes,
    *,
    secret: str | None = SECRET,
    path: str = PATH,
    chunked: bool = False,
) -> int:
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers[SECRET_HEADER] = secret
    data: Any = io.BytesIO(body)  # with its length, not chunked
    if chunked:

        async def pieces() -> AsyncIterator[bytes]:
            for at in range(0, len(body), 64 * 1024):
                yield body[at : at + 64 * 1024]

        data = pieces()
    url = f"http://127.0.0.1:{channel.webhook_port}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as response,
    ):
        await response.read()
        return response.status


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - a plain value, nothing to await
            await asyncio.sleep(0.01)


def update_json(fake: FakeTelegram, text: str) -> bytes:
    """A user's message as Telegram would POST it (queued in the fake, then taken out, so
    only the hand-made POST delivers it)."""
    update_id = fake.push_message(GROUP, text, user_id=42)
    update = fake.pushed[update_id]
    fake._updates.remove(update)
    return json.dumps(update).encode()


async def test_the_serving_channel_registers_its_webhook_and_never_polls(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    port = free_port()
    channel = await open_channel(Inbox(fake), port=port)
    assert fake.webhook == {
        "url": f"http://127.0.0.1:{port}{PATH}",
        "secret_token": SECRET,
        "allowed_updates": ["callback_query", "channel_post", "message"],
    }
    (registered,) = [p for m, p in fake.requests if m == "setwebhook"]
    assert registered["drop_pending_updates"] in ("False", "false", False)
    assert (fake.webhook_deletes, fake.count("getUpdates")) == (0, 0)
    assert fake.commands is not None
    assert channel.status().connected
    assert channel.ingesting
    assert channel.webhook_port == port


async def test_a_pushed_update_is_answered_200_only_after_its_commit(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    inbox = Inbox(fake)
    inbox.gate = asyncio.Event()
    await open_channel(inbox)
    update = fake.push_message(GROUP, "hello", user_id=42)
    await until(lambda: inbox.handed == [str(update)])
    assert fake.webhook_statuses(update) == []  # the POST waits for the commit
    inbox.gate.set()
    await fake.wait_for_webhook_ok(update)
    assert inbox.committed == [str(update)]
    assert inbox.answered_at_commit == [False]
    assert fake.webhook_statuses(update) == [200]


async def test_a_failed_commit_is_not_acknowledged_and_telegram_delivers_it_again(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    inbox = Inbox(fake)
    inbox.fail_next = 2
    channel = await open_channel(inbox)
    update = fake.push_message(GROUP, "hello", user_id=42)
    later = fake.push_message(GROUP, "after it", user_id=42)
    await fake.wait_for_webhook_ok(later)
    assert fake.webhook_statuses(update) == [503, 503, 200]
    assert inbox.committed == [str(update), str(later)]
    counters = channel.status().counters
    assert (counters["sink_errors"], counters["webhook_not_taken"]) == (2, 2)
    assert counters["webhook_taken"] == 2


async def test_a_redelivered_update_is_answered_200_and_committed_once(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    inbox = Inbox(fake)
    channel = await open_channel(inbox)
    body = update_json(fake, "once")
    assert [await post(channel, body) for _ in range(3)] == [200, 200, 200]
    update_id = str(json.loads(body)["update_id"])
    assert (inbox.handed, inbox.committed) == ([update_id] * 3, [update_id])


async def test_refused_posts_commit_nothing(fake: FakeTelegram, open_channel: OpenChannel) -> None:
    inbox = Inbox(fake)
    channel = await open_channel(inbox)
    body = update_json(fake, "refused")
    assert await post(channel, body, secret=None) == 401
    assert await post(channel, body, secret="wrong") == 401
    assert await post(channel, body, secret=SECRET + "x") == 401
    assert await post(channel, b"{not json", secret=SECRET) == 400
    assert await post(channel, b"\xff\xfe", secret=SECRET) == 400
    assert await post(channel, b"[1, 2]", secret=SECRET) == 400
    assert await post(channel, b'{"update_id": "7", "message": {}}', secret=SECRET) == 400
    assert await post(channel, b'{"message": {}}', secret=SECRET) == 400
    assert await post(channel, b"[" * 100_000, secret=SECRET) == 400
    huge = b'{"update_id": 1, "pad": "' + b"x" * MAX_BODY + b'"}'
    assert await post(channel, huge) == 413
    assert await post(channel, huge, chunked=True) == 413
    assert await post(channel, body, path="/telegram/other") == 404
    assert inbox.handed == []
    counters = channel.status().counters
    assert counters["webhook_refused_secret"] == 3
    assert counters["webhook_refused_body"] == 6
    assert counters["webhook_too_large"] == 2
    # An update that is valid JSON but no message geodebot reads is taken and skipped.
    assert await post(channel, b'{"update_id": 5, "edited_message": {}}') == 200
    assert await post(channel, body) == 200
    assert inbox.committed == [str(json.loads(body)["update_id"])]


async def test_a_press_arrives_by_webhook_and_is_answered(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    presses: list[Press] = []

    async def decide(press: Press) -> PressAnswer:
        presses.append(press)
        return PressAnswer(counted=True, text="")

    await open_channel(Inbox(fake), decide)
    card = fake.push_message(GROUP, "anchor", user_id=42)
    message_id = int(fake.pushed[card]["message"]["message_id"])
    await fake.wait_for_webhook_ok(card)
    query = fake.push_callback_query(GROUP, message_id, press_data("1", True), user_id=42)
    answer = await fake.wait_for_callback_answer(query)
    assert answer.text == "Approved."
    assert [(p.approval_id, p.approve) for p in presses] == [("1", True)]


async def test_taking_in_later_listens_and_commits_and_registers_only_when_told(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    inbox = Inbox(fake)
    port = free_port()
    channel = await open_channel(inbox, ingest_later=True, port=port)
    assert (fake.webhook, fake.webhook_deletes, fake.commands) == (None, 0, None)
    assert {m for m, _ in fake.requests} == {"getme"}
    assert not channel.ingesting
    status = channel.status()
    assert (status.connected, status.detail) == (
        True,
        "receiving webhooks: another replica registers them",
    )
    body = update_json(fake, "via a replica that does not take in")
    assert await post(channel, body) == 200
    assert inbox.committed == [str(json.loads(body)["update_id"])]
    assert fake.count("setWebhook") == 0

    await channel.start_ingest()
    await channel.start_ingest()  # already registered: nothing more
    assert channel.ingesting
    assert fake.count("setWebhook") == 1
    assert fake.webhook is not None
    assert fake.webhook["url"] == f"http://127.0.0.1:{port}{PATH}"
    assert fake.webhook["secret_token"] == SECRET
    assert fake.commands is not None
    assert (fake.webhook_deletes, fake.count("getUpdates")) == (0, 0)
    assert (channel.status().connected, channel.status().detail) == (True, "")
    # Registered, Telegram itself now POSTs to the listener.
    pushed = fake.push_message(GROUP, "by Telegram", user_id=42)
    await fake.wait_for_webhook_ok(pushed)
    assert inbox.committed[-1] == str(pushed)


async def test_polling_again_removes_the_webhook_first(
    fake: FakeTelegram, open_channel: OpenChannel
) -> None:
    hooked = await open_channel(Inbox(fake))
    await hooked.stop()
    assert fake.webhook is not None  # left registered: Telegram keeps updates meanwhile
    queued = fake.push_message(GROUP, "while nobody listened", user_id=42)
    # Telegram refuses getUpdates while a webhook is set.
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{fake.api_base_url}{fake.token}/getUpdates", json={}) as refused,
    ):
        assert refused.status == 409
        assert "webhook is active" in (await refused.json())["description"]
    inbox = Inbox(fake)
    polling = TelegramChannel(
        TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=1), fake.token
    )
    await polling.start(inbox)
    try:
        await fake.wait_until(lambda: inbox.committed == [str(queued)])
    finally:
        await polling.stop()
    assert (fake.webhook, fake.webhook_deletes) == (None, 1)


# -- configuration ------------------------------------------------------------------------
def telegram_table(**keys: Any) -> dict[str, Any]:
    return {
        "model": {"provider": "anthropic", "name": "m"},
        "channels": {"telegram": {"token_env": "TG_TOKEN", **keys}},
    }


def problems(**keys: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(telegram_table(**keys))
    return "; ".join(caught.value.problems)


def test_webhook_config_errors_name_the_key() -> None:
    hook = {"webhook_listen": "127.0.0.1:8443", "webhook_secret_env": "TG_SECRET"}
    assert "webhook_secret_env is required with webhook_url" in problems(
        webhook_url="https://bot.example.com/tg", webhook_listen="127.0.0.1:8443"
    )
    assert "webhook_listen" in problems(
        webhook_url="https://bot.example.com/tg", webhook_secret_env="TG_SECRET"
    )
    found = problems(webhook_url="http://bot.example.com/tg", **hook)
    assert "channels.telegram.webhook_url" in found
    assert "https" in found
    found = problems(webhook_url="https://bot.example.com/tg?x=1", **hook)
    assert "channels.telegram.webhook_url" in found
    found = problems(webhook_url="https://bot.example.com/tg", webhook_listen="8443",
                     webhook_secret_env="TG_SECRET")  # fmt: skip
    assert "channels.telegram.webhook_listen" in found
    assert "host:port" in found
    assert "need webhook_url" in problems(webhook_listen="127.0.0.1:8443")
    # Plain http for a local proxy or a test, and the path Telegram POSTs to.
    local = parse_config(telegram_table(webhook_url="http://localhost:8080/a/b", **hook))
    assert local.channels.telegram is not None
    assert local.channels.telegram.webhook_path == "/a/b"


def test_the_webhook_secret_must_be_set_and_as_telegram_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = parse_config(
        telegram_table(
            webhook_url="https://bot.example.com/tg",
            webhook_listen="127.0.0.1:8443",
            webhook_secret_env="TG_SECRET",
        )
    )
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    monkeypatch.setenv("TG_TOKEN", "1:abc")
    monkeypatch.delenv("TG_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"channels\.telegram\.webhook_secret_env.*TG_SECRET"):
        build_channels(config, store=None)  # type: ignore[arg-type]  # not reached
    monkeypatch.setenv("TG_SECRET", "has spaces!")
    with pytest.raises(ConfigError, match=r"channels\.telegram\.webhook_secret_env.*1 to 256"):
        build_channels(config, store=None)  # type: ignore[arg-type]
    monkeypatch.setenv("TG_SECRET", "x" * 256)
    channels = build_channels(config, store=None, ingest_later=True)  # type: ignore[arg-type]
    assert isinstance(channels["telegram"], TelegramChannel)


def test_a_polling_channel_does_not_load_the_webhook_server() -> None:
    # Its aiohttp.web server is memory a long-polling daemon would carry for nothing.
    code = (
        "import sys; import geodebot.channels.telegram; "
        "print('geodebot.channels.telegram.webhook' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip() == "False"
