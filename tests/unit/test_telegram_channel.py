"""The Telegram adapter against a fake Bot API speaking real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    ChannelError,
    Destination,
    Inbound,
    Lookups,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.telegram import TelegramChannel
from geodebot.channels.telegram.cursor import CURSOR_NAME
from geodebot.channels.telegram.inbound import html_to_plain
from geodebot.config.schema import TelegramConfig
from geodebot.logs.redact import Redactor
from geodebot.logs.setup import setup_logging
from tests.support.fakes.telegram_server import FakeTelegram, html_visible

GROUP = -1001234
OpenChannel = Callable[..., Awaitable[TelegramChannel]]


class Recorder:
    """The sink: records every Inbound it is handed; ``gate`` (when set) holds it open."""

    def __init__(self, *, fail_on: set[str] | None = None) -> None:
        self.items: list[Inbound] = []
        self.fail_on = set(fail_on or ())
        self.gate: asyncio.Event | None = None
        self.offset_seen: list[tuple[str, int]] = []
        self.fake: FakeTelegram | None = None
        self._changed = asyncio.Event()

    async def __call__(self, inbound: Inbound) -> None:
        if self.fake is not None:
            self.offset_seen.append((inbound.event_id, self.fake.confirmed_offset))
        self.items.append(inbound)
        self._changed.set()
        if self.gate is not None:
            await self.gate.wait()
        if inbound.event_id in self.fail_on:
            self.fail_on.discard(inbound.event_id)
            raise RuntimeError(f"inbox unavailable for {inbound.event_id}")

    async def wait(self, n: int, within: float = 5.0) -> list[Inbound]:
        async with asyncio.timeout(within):
            while len(self.items) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.items

    def ids(self) -> list[str]:
        return [i.event_id for i in self.items]


class MemoryCursors:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def get_cursor(self, name: str) -> str | None:
        return self.values.get(name)

    async def set_cursor(self, name: str, value: str) -> None:
        self.values[name] = value

    def offset(self) -> int:
        return int(json.loads(self.values[CURSOR_NAME])["offset"])


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def open_channel(fake: FakeTelegram) -> AsyncIterator[OpenChannel]:
    opened: list[TelegramChannel] = []

    async def _open(
        sink: Recorder, *, cursors: MemoryCursors | None = None, poll_timeout_s: int = 2
    ) -> TelegramChannel:
        config = TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=poll_timeout_s)
        channel = TelegramChannel(config, fake.token, cursor_store=cursors)
        opened.append(channel)
        await channel.start(sink)
        return channel

    yield _open
    for channel in opened:
        await channel.stop()


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - status() is a plain value, nothing to await
            await asyncio.sleep(0.01)


def part(channel: str, text: str, **dest: Any) -> OutboundPart:
    return OutboundPart(Destination("telegram", channel, **dest), text, key="gb-1-0")


async def test_start_registers_commands_and_polls(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Recorder())
    assert fake.commands == [
        {"command": c.name, "description": c.description} for c in CHAT_COMMANDS
    ]
    assert fake.webhook_deletes == 1
    assert channel.status().connected
    assert channel.bot_username == "geode_test_bot"
    polls = [p for m, p in fake.requests if m == "getupdates"]
    assert polls[0]["allowed_updates"] == ["message", "channel_post", "callback_query"]


async def test_taking_in_later_sends_at_once_and_polls_only_when_told(fake: FakeTelegram):
    sink, cursors = Recorder(), MemoryCursors()
    config = TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=2)
    channel = TelegramChannel(config, fake.token, cursor_store=cursors, ingest_later=True)
    await channel.start(sink)
    try:
        waiting = fake.push_message(GROUP, "sent while another replica takes in", user_id=42)
        sent = await channel.send(part(str(GROUP), "from a replica that only sends"))
        (shown,) = await fake.wait_for_sent(GROUP, 1)
        assert sent.message_id == str(shown.message_id)
        assert [m for m, _ in fake.requests] == ["getme", "sendmessage"]
        assert (fake.webhook_deletes, fake.commands) == (0, None)
        status = channel.status()
        assert (status.connected, status.detail, channel.ingesting) == (True, SENDING_ONLY, False)

        # Told at once twice, then again: one poller (a second would end the first's long
        # poll with 409), one deleteWebhook, one command registration.
        await asyncio.gather(channel.start_ingest(), channel.start_ingest())
        await channel.start_ingest()
        assert channel.ingesting
        await sink.wait(1)
        later = fake.push_message(GROUP, "once it takes in", user_id=42)
        await sink.wait(2)
        await fake.wait_for_confirmed(later + 1)
        assert sink.ids() == [str(waiting), str(later)]
        assert (fake.webhook_deletes, fake.count("setMyCommands"), fake.conflicts) == (1, 1, 0)
        assert (channel.status().connected, channel.status().detail) == (True, "")
        await until(lambda: CURSOR_NAME in cursors.values and cursors.offset() == later + 1)
    finally:
        await channel.stop()
    assert (channel.ingesting, channel.status().connected) == (False, False)


async def test_messages_arrive_with_their_fields(fake: FakeTelegram, open_channel: OpenChannel):
    sink = Recorder()
    channel = await open_channel(sink)
    sent = await channel.send(part(str(GROUP), "I am the bot"))
    bot_mention = [{"type": "text_mention", "offset": 0, "length": 5, "user": fake.bot_user}]
    pushes = [
        fake.push_message(GROUP, "hello all", user_id=42, username="alice"),
        fake.push_message(42, "hi in private", user_id=42, chat_type="private"),
        fake.push_message(GROUP, "in a topic", user_id=42, chat_type="supergroup", thread_id=7),
        fake.push_message(GROUP, "😀 hey @Geode_Test_Bot, look", user_id=42),
        fake.push_message(GROUP, "ask @someone_else", user_id=42),
        fake.push_message(GROUP, "Geode, what now?", user_id=42, entities=bot_mention),
        fake.push_message(GROUP, "thanks!", user_id=42, reply_to=int(sent.message_id)),
        fake.push_message(GROUP, "beep", user_id=99, is_bot=True, username="other_bot"),
        fake.push_message(GROUP, "my own words", user_id=fake.bot_id, is_bot=True),
        fake.push_message(GROUP, "photo for @geode_test_bot", user_id=42, caption=True),
        fake.push_message(GROUP, "/status@geode_test_bot", user_id=42),
        fake.push_channel_post(-100777, "news"),
    ]
    got = {i.event_id: i for i in await sink.wait(len(pushes))}
    group, dm, topic, mention, other, text_mention, reply, bot, me, photo, cmd, post = (
        got[str(u)] for u in pushes
    )
    assert (group.channel, group.thread, group.user) == (str(GROUP), None, "42")
    assert (group.user_name, group.message_id, group.is_dm) == ("alice", "2", False)
    assert (group.mentions_bot, group.is_bot, group.is_self) == (False, False, False)
    assert group.ts == pytest.approx(time.time(), abs=60)
    assert (dm.channel, dm.is_dm) == ("42", True)
    # Telegram makes topic messages replies to the topic's creation message (the bot's here).
    assert (topic.thread, topic.mentions_bot) == ("7", False)
    assert (mention.mentions_bot, other.mentions_bot) == (True, False)
    addressed = [text_mention, reply, photo, cmd]
    assert [i.mentions_bot for i in addressed] == [True] * len(addressed)
    assert photo.text == "photo for @geode_test_bot"
    assert (bot.is_bot, bot.is_self, bot.user_name) == (True, False, "other_bot")
    assert (me.is_bot, me.is_self) == (True, True)
    assert (post.channel, post.user, post.is_bot) == ("-100777", "-100777", False)


async def test_offset_moves_only_after_the_sink_returned(
    fake: FakeTelegram, open_channel: OpenChannel
):
    sink, cursors = Recorder(), MemoryCursors()
    sink.gate = asyncio.Event()
    await open_channel(sink, cursors=cursors)
    first = fake.push_message(GROUP, "one", user_id=42)
    await sink.wait(1)
    await asyncio.sleep(0.2)  # time enough for a wrongly eager poller to confirm it
    assert fake.confirmed_offset <= first
    assert CURSOR_NAME not in cursors.values
    sink.gate.set()
    await fake.wait_for_confirmed(first + 1)
    assert cursors.offset() == first + 1


async def test_a_failing_sink_gets_the_same_update_again(
    fake: FakeTelegram, open_channel: OpenChannel, caplog: pytest.LogCaptureFixture
):
    sink = Recorder()
    sink.fake = fake
    channel = await open_channel(sink)
    first = fake.push_message(GROUP, "one", user_id=42)
    second = fake.push_message(GROUP, "two", user_id=42)
    sink.fail_on = {str(first)}
    await sink.wait(3)
    assert sink.ids() == [str(first), str(first), str(second)]
    # No update was ever confirmed before the sink had it.
    assert all(offset <= int(event) for event, offset in sink.offset_seen)
    await fake.wait_for_confirmed(second + 1)
    assert channel.status().counters["sink_errors"] == 1
    assert any("not committed" in r.getMessage() for r in caplog.records)


async def test_an_update_the_sdk_cannot_parse_is_skipped_not_repeated_forever(
    fake: FakeTelegram, open_channel: OpenChannel, caplog: pytest.LogCaptureFixture
):
    """PTB parses a getUpdates batch whole: one broken update fails all of them, every time."""
    sink, cursors = Recorder(), MemoryCursors()
    channel = await open_channel(sink, cursors=cursors)
    before = fake.push_message(GROUP, "before", user_id=42)
    broken = fake.push_update({"message": {"message_id": "x", "chat": "?", "text": 5}})
    after = fake.push_message(GROUP, "after", user_id=42)
    await fake.wait_for_confirmed(after + 1, timeout=10)
    await sink.wait(2)
    assert sink.ids() == [str(before), str(after)]
    assert channel.status().counters["skipped"] == 1
    assert cursors.offset() == after + 1
    assert any(f"update {broken} cannot be read" in r.getMessage() for r in caplog.records)


async def test_a_restart_resumes_after_the_committed_updates(
    fake: FakeTelegram, open_channel: OpenChannel
):
    cursors = MemoryCursors()
    first_run = Recorder()
    channel = await open_channel(first_run, cursors=cursors)
    done = [fake.push_message(GROUP, f"m{i}", user_id=42) for i in range(2)]
    await first_run.wait(2)
    await until(lambda: cursors.values.get(CURSOR_NAME) is not None and cursors.offset() > done[1])
    await channel.stop()
    # As if the crash came before the next getUpdates: Telegram still holds both.
    for update_id in done:
        fake.push_message(GROUP, "again", user_id=42, update_id=update_id)
    fresh = fake.push_message(GROUP, "new", user_id=42)
    second_run = Recorder()
    await open_channel(second_run, cursors=cursors)
    await second_run.wait(1)
    # A control update after them: delivered in update order, so once it arrived anything
    # the restart (wrongly) delivered again would have arrived too.
    control = fake.push_message(GROUP, "control", user_id=42)
    await second_run.wait(2)
    assert second_run.ids() == [str(fresh), str(control)]


async def test_a_batch_keeps_each_chats_order_and_confirms_only_what_was_taken(
    fake: FakeTelegram, open_channel: OpenChannel
):
    chat_a, chat_b, chat_c = GROUP, GROUP - 1, GROUP - 2
    ids = {
        text: fake.push_message(chat, text, user_id=42)
        for chat, text in [(chat_a, "a1"), (chat_b, "b1"), (chat_a, "a2"), (chat_b, "b2"),
                           (chat_c, "c1")]
    }  # fmt: skip
    release_a1 = asyncio.Event()
    events: list[str] = []
    fail_once = {"b2"}

    async def sink(inbound: Inbound) -> None:
        events.append(f"in {inbound.text}")
        if inbound.text == "a1":
            await release_a1.wait()
        if inbound.text == "b1":
            release_a1.set()  # a1 is still being taken while b1 is: chats go side by side
        if inbound.text in fail_once:
            fail_once.discard(inbound.text)
            raise RuntimeError("inbox unavailable")
        events.append(f"took {inbound.text}")

    cursors = MemoryCursors()
    await open_channel(sink, cursors=cursors)
    await until(lambda: "took b2" in events)
    # Within a chat, one after the other; the failed b2 holds back the confirmation of
    # everything after it (c1 comes again), not what came before.
    assert events.index("took a1") < events.index("in a2")
    assert events.index("took b1") < events.index("in b2")
    assert events.index("in b1") < events.index("took a1")
    assert events.count("in b2") == 2
    assert events.count("in c1") == 2
    await until(lambda: fake.confirmed_offset == ids["c1"] + 1)
    assert cursors.offset() == ids["c1"] + 1


async def test_a_week_old_cursor_is_not_trusted(fake: FakeTelegram, open_channel: OpenChannel):
    waiting = fake.push_message(GROUP, "sent while we were away", user_id=42)
    cursors = MemoryCursors()
    stale = {"offset": waiting + 500, "saved_at": time.time() - 8 * 86_400}
    cursors.values[CURSOR_NAME] = json.dumps(stale)
    sink = Recorder()
    await open_channel(sink, cursors=cursors)
    assert (await sink.wait(1))[0].event_id == str(waiting)


async def test_send_plain_html_reply_and_thread(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Recorder())
    fake.push_message(GROUP, "question", user_id=42, chat_type="supergroup")  # message 1
    one = await channel.send(part(str(GROUP), "plain words"))
    await channel.send(part(str(GROUP), "<b>bold</b> &amp; <code>x &lt; y</code>"))
    await channel.send(part(str(GROUP), "answer", reply_to="1", thread="7"))
    sent = await fake.wait_for_sent(GROUP, 3)
    assert one.message_id == str(sent[0].message_id)
    assert [(s.text, s.parse_mode) for s in sent[:2]] == [
        ("plain words", "HTML"),
        ("<b>bold</b> &amp; <code>x &lt; y</code>", "HTML"),
    ]
    assert (sent[2].reply_to_message_id, sent[2].allow_sending_without_reply) == (1, True)
    assert sent[2].thread_id == 7
    assert channel.status().counters["sent"] == 3


async def test_a_sent_answer_without_message_id_counts_as_sent(
    fake: FakeTelegram, open_channel: OpenChannel
):
    # ok=true means Telegram posted it: an unreadable id must not make the outbox send again.
    channel = await open_channel(Recorder())
    fake.answer_next("sendMessage", True)
    assert await channel.send(part(str(GROUP), "hi")) == SentPart("")
    fake.answer_next("sendMessage", {"message_id": "seven"})
    assert await channel.send(part(str(GROUP), "hi")) == SentPart("")
    assert fake.count("sendMessage") == 2
    assert channel.status().counters["sent"] == 2
    assert (await channel.send(part(str(GROUP), "hi"))).message_id == "1"


async def test_send_errors_are_classified(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Recorder())
    fake.fail_next("sendMessage", 429, "Too Many Requests: retry after 7", retry_after=7)
    with pytest.raises(ChannelError) as limited:
        await channel.send(part(str(GROUP), "hi"))
    assert limited.value.retry_after == 7.0
    assert not isinstance(limited.value, SendUnknown)
    fake.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
    with pytest.raises(ChannelError) as blocked:
        await channel.send(part("42", "hi"))
    assert blocked.value.permanent
    fake.fail_next("sendMessage", 400, "Bad Request: chat not found")
    with pytest.raises(ChannelError) as gone:
        await channel.send(part("43", "hi"))
    assert gone.value.permanent
    assert "chat not found" in str(gone.value).lower()
    # An ok=false answer with a 5xx is Telegram saying the method failed: retry, not unknown.
    fake.fail_next("sendMessage", 500, "Internal Server Error")
    with pytest.raises(ChannelError) as failed:
        await channel.send(part(str(GROUP), "hi"))
    assert not isinstance(failed.value, SendUnknown)
    assert not failed.value.permanent
    assert failed.value.retry_after is None
    assert fake.sent[GROUP] == []
    assert not isinstance(channel, Lookups)


async def test_a_refused_connection_is_not_an_unknown_outcome(fake: FakeTelegram):
    config = TelegramConfig(api_base_url="http://127.0.0.1:9/bot")
    channel = TelegramChannel(config, fake.token)
    try:
        with pytest.raises(ChannelError) as refused:
            await channel.send(part(str(GROUP), "hi"))
        assert not isinstance(refused.value, SendUnknown)
    finally:
        await channel.stop()


async def test_bad_entities_fall_back_to_plain_text(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Recorder())
    sent = await channel.send(part(str(GROUP), "<b>if a < b then</b> &amp; <i>done</i>"))
    [message] = await fake.wait_for_sent(GROUP, 1)
    assert (message.text, message.parse_mode) == ("if a < b then & done", None)
    assert sent.message_id == str(message.message_id)
    assert fake.count("sendMessage") == 2
    assert channel.status().counters["plain_fallbacks"] == 1


def test_html_to_plain_keeps_what_is_not_a_tag() -> None:
    assert html_to_plain('<a href="https://x.test">x</a> &lt;3 <i>a<b</i>') == "x <3 a<b"
    assert html_visible("<pre><code>a &amp; b</code></pre>") == "a & b"


async def test_a_long_reply_arrives_whole_and_in_order(
    fake: FakeTelegram, open_channel: OpenChannel
):
    channel = await open_channel(Recorder())
    lines = [f"{n:04d} **item** with `code` & <angle> text, padded out ..." for n in range(180)]
    markdown = "\n\n".join(lines)
    assert len(markdown) >= 10_000
    parts = channel.render(markdown)
    assert len(parts) >= 3
    for index, text in enumerate(parts):
        await channel.send(OutboundPart(Destination("telegram", str(GROUP)), text, "k", index))
    sent = await fake.wait_for_sent(GROUP, len(parts))
    assert all(s.parse_mode == "HTML" for s in sent)  # no part needed the plain fallback
    visible = "".join(html_visible(s.text) for s in sent)
    positions = [visible.find(f"{n:04d} item with code & <angle> text") for n in range(180)]
    assert -1 not in positions
    assert positions == sorted(positions)


async def test_polling_survives_a_502_and_a_409(fake: FakeTelegram, open_channel: OpenChannel):
    sink = Recorder()
    channel = await open_channel(sink)
    fake.fail_next("getUpdates", 502, "Bad Gateway")
    fake.push_message(GROUP, "wake the poll", user_id=42)
    await until(lambda: not channel.status().connected)
    assert "Bad Gateway" in channel.status().detail
    await until(lambda: channel.status().connected)
    polls = fake.count("getUpdates")
    # Another poller with our token: Telegram ends our waiting long poll with 409.
    await fake.wait_for_request("getUpdates", polls + 1)
    async with aiohttp.ClientSession() as http:
        url = f"{fake.api_base_url}{fake.token}/getUpdates"
        async with http.post(url, json={"timeout": 0}) as answer:
            assert answer.status == 200
    await until(lambda: "Conflict" in channel.status().detail)
    await until(lambda: channel.status().connected)
    fake.push_message(GROUP, "still here", user_id=42)
    assert [i.text for i in await sink.wait(2)] == ["wake the poll", "still here"]
    assert channel.status().counters["poll_errors"] == 2
    assert fake.conflicts == 1


async def test_stop_lets_a_running_sink_commit(fake: FakeTelegram, open_channel: OpenChannel):
    sink, cursors = Recorder(), MemoryCursors()
    sink.gate = asyncio.Event()
    channel = await open_channel(sink, cursors=cursors, poll_timeout_s=30)
    update = fake.push_message(GROUP, "one", user_id=42)
    await sink.wait(1)
    stopping = asyncio.create_task(channel.stop())
    await asyncio.sleep(0.1)
    assert not stopping.done()
    sink.gate.set()
    await stopping
    assert cursors.offset() == update + 1
    assert not channel.status().connected


async def test_stop_ends_the_long_poll_at_once(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Recorder(), poll_timeout_s=30)
    started = time.monotonic()
    await channel.stop()
    assert time.monotonic() - started < 2


async def test_typing_sends_the_action_and_swallows_errors(
    fake: FakeTelegram, open_channel: OpenChannel
):
    channel = await open_channel(Recorder())
    await channel.typing(Destination("telegram", str(GROUP), thread="7"))
    fake.fail_next("sendChatAction", 500, "Internal Server Error")
    await channel.typing(Destination("telegram", str(GROUP)))
    assert [(a.chat_id, a.action, a.thread_id) for a in fake.actions] == [(GROUP, "typing", 7)]


async def test_a_wrong_token_fails_start_without_showing_it(fake: FakeTelegram):
    wrong = "7000001234:AAHwrong-token_for-tests-0123456789abcdef"
    config = TelegramConfig(api_base_url=fake.api_base_url)
    channel = TelegramChannel(config, wrong)
    with pytest.raises(ChannelError) as rejected:
        await channel.start(Recorder())
    assert rejected.value.permanent
    assert wrong not in str(rejected.value)
    assert not channel.status().connected


async def test_a_failed_start_can_be_retried_on_the_same_channel(fake: FakeTelegram):
    channel = TelegramChannel(TelegramConfig(api_base_url=fake.api_base_url), fake.token)
    fake.fail_next("getMe", 500, "Internal Server Error")
    sink = Recorder()
    with pytest.raises(ChannelError) as failed:
        await channel.start(sink)
    assert not failed.value.permanent
    assert "Internal Server Error" in channel.status().detail
    try:
        await channel.start(sink)  # as the daemon's supervisor does
        fake.push_message(GROUP, "hello", user_id=42)
        await sink.wait(1)
    finally:
        await channel.stop()


async def test_the_token_never_reaches_the_logs(fake: FakeTelegram, open_channel: OpenChannel):
    """Through the daemon's own logging (geodebot.logs.setup), with every SDK logger turned up."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    names = ("telegram", "aiohttp")
    levels = {name: logging.getLogger(name).level for name in names}
    out = io.StringIO()
    setup_logging("debug", Redactor([fake.token]), stream=out)
    for name in names:  # as if an operator turned them all up
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        sink = Recorder()
        channel = await open_channel(sink)
        fake.push_message(GROUP, "hello", user_id=42)
        await sink.wait(1)
        await channel.send(part(str(GROUP), "<b>broken"))
        fake.fail_next("getUpdates", 502, "Bad Gateway")
        fake.push_message(GROUP, "again", user_id=42)
        await sink.wait(2)
        # A token the daemon never resolved is caught by the token patterns alone.
        await test_a_wrong_token_fails_start_without_showing_it(fake)
        await channel.stop()
    finally:
        root.handlers[:], root.level = saved
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    text = out.getvalue()
    assert "getUpdates" in text
    assert '"logger": "telegram.Bot"' in text
    wrong = "AAHwrong-token_for-tests-0123456789abcdef"
    for secret in (fake.token, fake.token.split(":")[1], wrong):
        assert secret not in text
