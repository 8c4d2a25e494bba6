"""The Discord adapter against FakeDiscord, with the real discord.py in between."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    ChannelError,
    Destination,
    Inbound,
    OutboundPart,
    SendUnknown,
)
from geodebot.channels.discord import DiscordChannel
from geodebot.channels.discord.send import nonce_for
from geodebot.config.schema import DiscordConfig
from tests.support.fakes.discord_server import MESSAGE_CONTENT_INTENT, FakeDiscord

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.fake-token-for-tests-0123456789abcdef"
USER = "700000000000000001"
OTHER_BOT = "700000000000000002"
DM = "800000000000000001"


class Cursors:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def get_cursor(self, name: str) -> str | None:
        return self.values.get(name)

    async def set_cursor(self, name: str, value: str) -> None:
        self.values[name] = value


class Sink:
    def __init__(self) -> None:
        self.got: list[Inbound] = []
        self.fail_next = 0

    async def __call__(self, inbound: Inbound) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("inbox unavailable")
        self.got.append(inbound)

    def ids(self) -> list[str]:
        return [i.event_id for i in self.got if not i.is_self]


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as server:
        yield server


def make_channel(
    fake: FakeDiscord, cursors: Cursors | None = None, *, ingest_later: bool = False
) -> DiscordChannel:
    config = DiscordConfig(api_base_url=fake.api_base_url, gateway_url=fake.gateway_url)
    return DiscordChannel(
        config,
        TOKEN,
        bound_channels=[fake.channel_id],
        cursor_store=cursors,
        ingest_later=ingest_later,
    )


@pytest.fixture
async def sink() -> Sink:
    return Sink()


@pytest.fixture
async def chan(fake: FakeDiscord, sink: Sink) -> AsyncIterator[DiscordChannel]:
    channel = make_channel(fake, Cursors())
    await channel.start(sink)
    try:
        yield channel
    finally:
        await channel.stop()


def part(fake: FakeDiscord, text: str, key: str = "gb-1-0", **dest: str) -> OutboundPart:
    return OutboundPart(Destination("discord", fake.channel_id, **dest), text, key)


async def test_start_is_ready_with_intents_and_commands(fake: FakeDiscord, sink: Sink) -> None:
    channel = make_channel(fake)
    started = time.monotonic()
    await channel.start(sink)
    try:
        assert time.monotonic() - started < 5
        assert channel.status().connected
        assert fake.identify_count == 1
        assert fake.intents is not None
        assert fake.intents & MESSAGE_CONTENT_INTENT
        assert [c["name"] for c in fake.commands[-1]] == [c.name for c in CHAT_COMMANDS]
        # Reached through our client only: the SDK's process-wide defaults are untouched.
        # (Imported here: the adapter's import already silenced discord.py's audioop warning.)
        from discord.gateway import DiscordWebSocket
        from discord.http import Route

        assert Route.BASE == "https://discord.com/api/v10"
        assert str(DiscordWebSocket.DEFAULT_GATEWAY) == "wss://gateway.discord.gg/"
    finally:
        await channel.stop()
    assert not channel.status().connected


async def test_bad_token_is_a_clear_permanent_error(fake: FakeDiscord, sink: Sink) -> None:
    config = DiscordConfig(api_base_url=fake.api_base_url, gateway_url=fake.gateway_url)
    channel = DiscordChannel(config, "wrong")
    with pytest.raises(ChannelError, match="token was rejected") as info:
        await channel.start(sink)
    assert info.value.permanent


async def test_inbound_fields(fake: FakeDiscord, chan: DiscordChannel, sink: Sink) -> None:
    mention = fake.push_message(fake.channel_id, "<@bot> hi", author_id=USER, mentions_bot=True)
    other = fake.push_message(fake.channel_id, "beep", author_id=OTHER_BOT, bot=True)
    own = fake.push_message(fake.channel_id, "mine", author_id=fake.bot_id)
    dm = fake.push_message(DM, "psst", author_id=USER)
    threaded = fake.push_message(fake.thread_id, "in thread", author_id=USER)
    await until(lambda: len(sink.got) == 5)
    by_id = {i.event_id: i for i in sink.got}

    first = by_id[mention]
    assert (first.platform, first.channel, first.thread) == ("discord", fake.channel_id, None)
    assert (first.user, first.text, first.message_id) == (USER, "<@bot> hi", mention)
    flags = ("mentions_bot", "is_bot", "is_self", "is_dm")
    assert [getattr(first, f) for f in flags] == [True, False, False, False]
    assert [getattr(by_id[other], f) for f in flags] == [False, True, False, False]
    assert [getattr(by_id[own], f) for f in flags] == [False, True, True, False]
    assert [getattr(by_id[dm], f) for f in flags] == [False, False, False, True]
    assert (by_id[dm].channel, by_id[dm].text) == (DM, "psst")
    assert (by_id[threaded].channel, by_id[threaded].thread) == (fake.channel_id, fake.thread_id)
    # Unmentioned guild text arrives only because the client asked for MESSAGE_CONTENT.
    assert by_id[other].text == "beep"


async def test_send_replies_with_reference_and_nonce(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "status?", author_id=USER)
    sent = await chan.send(part(fake, "all good", reply_to=asked))
    [posted] = fake.posted[fake.channel_id]
    assert posted["id"] == sent.message_id
    assert posted["content"] == "all good"
    assert posted["nonce"] == nonce_for("gb-1-0")
    assert len(posted["nonce"]) <= 25
    assert posted["message_reference"]["message_id"] == asked
    assert posted["message_reference"]["fail_if_not_exists"] is False
    assert posted["allowed_mentions"]["parse"] == []
    assert posted["allowed_mentions"]["replied_user"] is True


async def test_same_part_twice_is_one_message(fake: FakeDiscord, chan: DiscordChannel) -> None:
    first = await chan.send(part(fake, "once"))
    again = await chan.send(part(fake, "once"))
    assert first == again
    assert len(fake.posted[fake.channel_id]) == 1


async def test_rate_limit_is_waited_out(fake: FakeDiscord, chan: DiscordChannel) -> None:
    fake.fail_next_post(429, retry_after=0.6)
    started = time.monotonic()
    await chan.send(part(fake, "after the wait"))
    assert time.monotonic() - started >= 0.5
    assert [p["content"] for p in fake.posted[fake.channel_id]] == ["after the wait"]


async def test_long_rate_limit_is_handed_to_the_outbox(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    fake.fail_next_post(429, retry_after=45)  # over max_ratelimit_timeout: no 45 s sleep here
    started = time.monotonic()
    with pytest.raises(ChannelError) as limited:
        await chan.send(part(fake, "later"))
    assert time.monotonic() - started < 5
    assert limited.value.retry_after == 45
    assert not fake.posted[fake.channel_id]


async def test_server_errors_and_rejections(fake: FakeDiscord, chan: DiscordChannel) -> None:
    fake.fail_next_post(500)  # discord.py retries this one itself, under the same nonce
    await chan.send(part(fake, "retried", key="gb-2-0"))
    fake.fail_next_post(503)
    with pytest.raises(ChannelError) as unwell:
        await chan.send(part(fake, "x", key="gb-3-0"))
    assert not unwell.value.permanent
    assert not isinstance(unwell.value, SendUnknown)
    fake.fail_next_post(403)
    with pytest.raises(ChannelError) as forbidden:
        await chan.send(part(fake, "x", key="gb-4-0"))
    assert forbidden.value.permanent
    assert [p["content"] for p in fake.posted[fake.channel_id]] == ["retried"]


async def test_long_reply_is_split_and_never_oversent(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    text = "\n".join(f"line {n:04d} " + "lorem ipsum dolor sit amet " * 3 for n in range(110))
    assert len(text) > 10_000
    parts = chan.render(text)
    assert len(parts) > 1
    assert all(len(p) <= 2000 for p in parts)
    for index, chunk in enumerate(parts):
        await chan.send(
            OutboundPart(Destination("discord", fake.channel_id), chunk, f"gb-5-{index}")
        )
    assert [p["content"] for p in fake.posted[fake.channel_id]] == parts
    for n in range(110):
        assert sum(f"line {n:04d} " in p for p in parts) == 1
    with pytest.raises(ChannelError) as too_long:
        await chan.send(part(fake, "x" * 2001, key="gb-6-0"))
    assert too_long.value.permanent
    assert len(fake.posted[fake.channel_id]) == len(parts)


@pytest.mark.parametrize("nonce_visible", [True, False])
async def test_unknown_outcome_is_reconciled(
    fake: FakeDiscord, chan: DiscordChannel, nonce_visible: bool
) -> None:
    fake.nonce_visible_s = 300.0 if nonce_visible else 0.0
    fake.fail_next_post(0, created=True)  # created, but the answer is lost
    lost = part(fake, "did it land?", key="gb-7-0")
    with pytest.raises(SendUnknown):
        await chan.send(lost)
    found = await chan.find_sent(lost)
    [posted] = fake.posted[fake.channel_id]
    assert found is not None
    assert found.message_id == posted["id"]


async def test_reconnects_after_gateway_drop(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    await fake.drop_gateway()
    await until(lambda: fake.resume_count >= 1 and chan.status().connected)
    mid = fake.push_message(fake.channel_id, "still there?", author_id=USER)
    await until(lambda: mid in sink.ids())
    assert fake.identify_count == 1


async def test_catch_up_after_restart(fake: FakeDiscord, sink: Sink) -> None:
    cursors = Cursors()
    channel = make_channel(fake, cursors)
    await channel.start(sink)
    seen = fake.push_message(fake.channel_id, "before", author_id=USER)
    await until(lambda: cursors.values.get(f"discord:last:{fake.channel_id}") == seen)
    await channel.stop()

    missed = [
        fake.push_message(fake.channel_id, f"while down {n}", author_id=USER) for n in range(3)
    ]
    elsewhere = fake.push_message(DM, "unbound", author_id=USER)
    again = make_channel(fake, cursors)
    await again.start(sink)
    try:
        await until(lambda: all(m in sink.ids() for m in missed))
        assert sink.ids() == [seen, *missed]
        assert elsewhere not in sink.ids()
        assert cursors.values[f"discord:last:{fake.channel_id}"] == missed[-1]
    finally:
        await again.stop()


async def test_first_run_marks_its_place_so_a_message_missed_before_any_other_is_caught_up(
    fake: FakeDiscord, sink: Sink
) -> None:
    old = fake.push_message(fake.channel_id, "from before geodebot", author_id=USER)
    cursors = Cursors()
    channel = make_channel(fake, cursors)
    await channel.start(sink)
    # Down (a crash) before any message arrived: the first run's place is already saved.
    await until(lambda: cursors.values.get(f"discord:last:{fake.channel_id}") == old)
    await channel.stop()
    missed = fake.push_message(fake.channel_id, "while down", author_id=USER)
    again = make_channel(fake, cursors)
    await again.start(sink)
    try:
        await until(lambda: missed in sink.ids())
        assert sink.ids() == [missed]
    finally:
        await again.stop()


async def test_first_run_place_is_saved_before_the_bot_shows_as_online(
    fake: FakeDiscord, sink: Sink
) -> None:
    # A crash right after the gateway connected must not leave the next start without a
    # place: what was sent to the online bot meanwhile is owed an answer.
    old = fake.push_message(fake.channel_id, "from before geodebot", author_id=USER)
    identified_at_save: list[int] = []

    class Watching(Cursors):
        async def set_cursor(self, name: str, value: str) -> None:
            identified_at_save.append(fake.identify_count)
            await super().set_cursor(name, value)

    cursors = Watching()
    channel = make_channel(fake, cursors)
    before = fake.identify_count
    await channel.start(sink)
    try:
        assert cursors.values[f"discord:last:{fake.channel_id}"] == old
        assert identified_at_save[0] == before  # saved before the gateway's IDENTIFY
        assert sink.ids() == []
    finally:
        await channel.stop()


async def test_taking_in_later_sends_at_once_and_catches_up_when_told(
    fake: FakeDiscord, sink: Sink
) -> None:
    # Another replica owned the gateway and had taken in up to here.
    cursors, cursor = Cursors(), f"discord:last:{fake.channel_id}"
    cursors.values[cursor] = fake.push_message(fake.channel_id, "taken in", author_id=USER)
    channel = make_channel(fake, cursors, ingest_later=True)
    await channel.start(sink)
    try:
        sent = await channel.send(part(fake, "from a replica that only sends"))
        assert [m["id"] for m in fake.posted[fake.channel_id]] == [sent.message_id]
        meanwhile = fake.push_message(fake.channel_id, "while it only sends", author_id=USER)
        assert (fake.gateway_connects, fake.identify_count, fake.commands) == (0, 0, [])
        status = channel.status()
        assert (status.connected, status.detail, channel.ingesting) == (True, SENDING_ONLY, False)
        assert sink.got == []

        await asyncio.gather(channel.start_ingest(), channel.start_ingest())
        await channel.start_ingest()
        assert channel.ingesting
        assert (channel.status().connected, channel.status().detail) == (True, "")
        assert (fake.gateway_connects, fake.identify_count, len(fake.commands)) == (1, 1, 1)
        await until(lambda: meanwhile in sink.ids())
        live = fake.push_message(fake.channel_id, "once it takes in", author_id=USER)
        await until(lambda: live in sink.ids())
        assert sink.ids() == [meanwhile, live]
        assert cursors.values[cursor] == live
    finally:
        await channel.stop()
    assert not channel.ingesting


async def test_a_failed_take_in_leaves_it_sending_and_may_be_tried_again(
    fake: FakeDiscord, sink: Sink
) -> None:
    channel = make_channel(fake, Cursors(), ingest_later=True)
    await channel.start(sink)
    try:
        fake.refuse_identifies = 1
        with pytest.raises(ChannelError, match="gateway did not become ready"):
            await channel.start_ingest()
        assert not channel.ingesting
        status = channel.status()
        assert status.connected
        assert "gateway did not become ready" in status.detail
        sent = await channel.send(part(fake, "still sends"))
        assert [m["id"] for m in fake.posted[fake.channel_id]] == [sent.message_id]
        await channel.start_ingest()
        assert channel.ingesting
        assert (channel.status().connected, fake.identify_count) == (True, 2)
        live = fake.push_message(fake.channel_id, "taken in", author_id=USER)
        await until(lambda: live in sink.ids())
    finally:
        await channel.stop()


async def test_failed_commit_is_caught_up(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    sink.fail_next = 1
    lost = fake.push_message(fake.channel_id, "first", author_id=USER)
    later = fake.push_message(fake.channel_id, "second", author_id=USER)
    await until(lambda: lost in sink.ids() and later in sink.ids(), within=10)
    assert chan.status().counters["caught_up"] >= 1


async def test_slash_command_is_deferred_and_answered(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    iid = fake.push_interaction(fake.channel_id, "status", user_id=USER)
    await until(lambda: iid in sink.ids())  # answered at once: the ack may still be in flight
    [inbound] = [i for i in sink.got if i.event_id == iid]
    assert (inbound.text, inbound.channel, inbound.user) == ("/status", fake.channel_id, USER)
    sent = await chan.send(part(fake, "queue empty", key="gb-8-0", reply_to=iid))
    assert fake.interaction_replies[iid] == "queue empty"
    assert sent.message_id == iid
    assert fake.callbacks == [(iid, 5)]
    assert not fake.posted[fake.channel_id]


async def test_typing_and_no_token_in_logs(
    fake: FakeDiscord, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    channel = make_channel(fake, Cursors())
    await channel.start(sink)
    try:
        await channel.typing(Destination("discord", fake.channel_id))
        fake.push_message(fake.channel_id, "hello", author_id=USER)
        await until(lambda: len(sink.got) == 1)
        await channel.send(part(fake, "hi"))
    finally:
        await channel.stop()
    assert fake.typing == [fake.channel_id]
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "discord" in logged  # the SDK did log at DEBUG
    assert TOKEN not in logged
