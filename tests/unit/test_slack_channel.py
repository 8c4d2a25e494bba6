"""The Slack adapter against FakeSlack: real slack-bolt and slack_sdk, real HTTP and websocket."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from geodebot.channels.base import (
    ChannelError,
    Destination,
    Inbound,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.slack import SlackChannel
from geodebot.channels.slack.inbound import to_inbound
from geodebot.config.schema import SlackConfig
from tests.support.fakes.slack_server import FakeSlack, Fault

CHANNEL = "C0CHAN001"
DM = "D0DM00001"
ALICE = "UALICE001"


class Sink:
    """Records what the adapter commits; can hold the commit open or make it fail."""

    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.fail_next = 0
        self.failed = asyncio.Event()
        self.returned_at = 0.0
        self._arrived = asyncio.Condition()

    async def __call__(self, inbound: Inbound) -> None:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            self.failed.set()
            raise RuntimeError("inbox unavailable")
        async with self._arrived:
            self.inbound.append(inbound)
            self.returned_at = time.monotonic()
            self._arrived.notify_all()

    async def wait_for(self, count: int) -> list[Inbound]:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: len(self.inbound) >= count)
        return self.inbound


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as srv:
        yield srv


def make_channel(fake: FakeSlack, **kw: Any) -> SlackChannel:
    config = SlackConfig(api_base_url=fake.api_base_url)
    return SlackChannel(
        config, bot_token=fake.bot_token, app_token=fake.app_token, ping_interval_s=2.0, **kw
    )


@pytest.fixture
async def sink() -> Sink:
    return Sink()


@pytest.fixture
async def channel(fake: FakeSlack, sink: Sink) -> AsyncIterator[SlackChannel]:
    ch = make_channel(fake, request_timeout_s=1.0)
    await ch.start(sink)
    yield ch
    await ch.stop()


async def deliver(fake: FakeSlack, event: dict[str, Any], **kw: Any) -> str:
    """Push ``event`` and wait until the adapter acked it."""
    envelope = await fake.push_event(event, **kw)
    await fake.wait_for_ack(envelope)
    return envelope


def part(channel: str, key: str, text: str = "hi", **dest: Any) -> OutboundPart:
    return OutboundPart(Destination("slack", channel, **dest), text, key)


# -- receiving --------------------------------------------------------------------------------
async def test_start_authenticates_and_connects(fake: FakeSlack, channel: SlackChannel) -> None:
    status = channel.status()
    assert status.connected
    assert status.platform == "slack"
    assert channel.bot_user_id == fake.bot_user_id
    assert [c.token for c in fake.calls_to("apps.connections.open")] == [fake.app_token]
    assert fake.calls_to("auth.test")[0].token == fake.bot_token
    assert fake.open_sockets == 1


async def test_channel_message_arrives_as_inbound(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    event = fake.message_event(CHANNEL, ALICE, "deploy status?", ts="1700000000.000100")
    await deliver(fake, event, event_id="Ev0TOPLEVEL")
    [got] = await sink.wait_for(1)
    assert got == Inbound(
        platform="slack",
        event_id="Ev0TOPLEVEL",
        channel=CHANNEL,
        thread=None,
        user=ALICE,
        text="deploy status?",
        message_id="1700000000.000100",
        ts=1700000000.0001,
    )


async def test_thread_dm_mention_and_other_bot(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    mention = f"<@{fake.bot_user_id}> restart it"
    await deliver(fake, fake.message_event(CHANNEL, ALICE, mention, thread_ts="1700.000001"))
    await deliver(fake, fake.message_event(DM, ALICE, "hello", channel_type="im"))
    await deliver(fake, fake.message_event(CHANNEL, "UOTHERBOT", "beep", bot_id="BOTHER001"))
    legacy = fake.message_event(CHANNEL, "", "legacy", bot_id="BOTHER002", subtype="bot_message")
    await deliver(fake, legacy)
    threaded, dm, bot, legacy_bot = await sink.wait_for(4)
    assert (threaded.thread, threaded.mentions_bot, threaded.is_dm) == ("1700.000001", True, False)
    assert (dm.is_dm, dm.thread, dm.mentions_bot) == (True, None, False)
    assert (bot.is_bot, bot.is_self, bot.user) == (True, False, "UOTHERBOT")
    assert (legacy_bot.is_bot, legacy_bot.user) == (True, "BOTHER002")


async def test_own_messages_and_edits_are_acked_but_not_delivered(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    own = fake.message_event(CHANNEL, fake.bot_user_id, "my answer", bot_id=fake.bot_id)
    edited = fake.message_event(CHANNEL, ALICE, "", subtype="message_changed")
    joined = fake.message_event(CHANNEL, ALICE, "has joined", subtype="channel_join")
    for event in (own, edited, joined):
        await deliver(fake, event)
    await deliver(fake, {"type": "reaction_added", "user": ALICE, "reaction": "eyes"})
    await deliver(fake, fake.message_event(CHANNEL, ALICE, "real"))
    assert [i.text for i in await sink.wait_for(1)] == ["real"]


def mention_pair(fake: FakeSlack) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``message`` and ``app_mention`` events Slack sends for one post mentioning the bot."""
    text = f"<@{fake.bot_user_id}> ping"
    message = fake.message_event(CHANNEL, ALICE, text, ts="1700000001.000200")
    mention = {k: v for k, v in message.items() if k != "channel_type"} | {"type": "app_mention"}
    return message, mention


async def test_mention_and_message_of_one_post_deliver_once(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    message, mention = mention_pair(fake)
    await deliver(fake, mention, event_id="Ev0MENTION")
    await deliver(fake, message, event_id="Ev0MESSAGE")
    # A repeat of the delivering event still goes through: dropping it is the daemon's job.
    await deliver(fake, mention, event_id="Ev0MENTION", retry_attempt=1)
    got = await sink.wait_for(2)
    assert [(i.event_id, i.mentions_bot) for i in got] == [("Ev0MENTION", True)] * 2
    assert channel.status().counters["duplicates"] == 1


async def test_a_failed_claim_lets_the_twin_event_deliver(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    message, mention = mention_pair(fake)
    sink.fail_next = 1
    await fake.push_event(mention, event_id="Ev0MENTION")
    async with asyncio.timeout(5):
        await sink.failed.wait()
    await deliver(fake, message, event_id="Ev0MESSAGE")
    await deliver(fake, mention, event_id="Ev0MENTION", retry_attempt=1)
    assert [i.event_id for i in await sink.wait_for(1)] == ["Ev0MESSAGE"]


async def test_ack_waits_for_the_sink(fake: FakeSlack, channel: SlackChannel, sink: Sink) -> None:
    sink.gate = asyncio.Event()
    envelope = await fake.push_event(fake.message_event(CHANNEL, ALICE, "slow commit"))
    async with asyncio.timeout(5):
        await sink.entered.wait()
    await asyncio.sleep(0.3)
    assert not fake.acked(envelope)
    sink.gate.set()
    ack = await fake.wait_for_ack(envelope)
    assert ack.at >= sink.returned_at > 0


async def test_failing_sink_is_not_acked_and_the_redelivery_arrives(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    sink.fail_next = 1
    event = fake.message_event(CHANNEL, ALICE, "commit me")
    first = await fake.push_event(event, event_id="Ev0REDELIVER")
    async with asyncio.timeout(5):
        await sink.entered.wait()
    assert not fake.acked(first)
    assert sink.inbound == []
    # The redelivery is the control: acked once committed, after the first envelope was
    # handled; the first stays unacked (checked again below).
    await deliver(fake, event, event_id="Ev0REDELIVER", retry_attempt=1)
    [got] = await sink.wait_for(1)
    assert (got.event_id, got.text) == ("Ev0REDELIVER", "commit me")
    assert not fake.acked(first)
    assert channel.status().counters["sink_errors"] == 1


async def test_reconnects_after_the_socket_closes(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    await fake.disconnect_clients()
    await fake.wait_for_connections(2)
    await deliver(fake, fake.message_event(CHANNEL, ALICE, "after close"))
    await fake.send_disconnect("refresh_requested")
    await fake.wait_for_connections(3)
    await deliver(fake, fake.message_event(CHANNEL, ALICE, "after refresh"))
    assert [i.text for i in await sink.wait_for(2)] == ["after close", "after refresh"]
    assert len(fake.calls_to("apps.connections.open")) == 3
    assert channel.status().connected


async def test_reconnects_after_the_connection_dies_silently(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    await fake.disconnect_clients(abort=True)
    # No close frame: the SDK's session monitor notices within a ping interval (2 s here).
    await fake.wait_for_connections(2, timeout=10)
    await deliver(fake, fake.message_event(CHANNEL, ALICE, "after a cut"))
    assert [i.text for i in await sink.wait_for(1)] == ["after a cut"]


async def test_stop_closes_everything(fake: FakeSlack, sink: Sink) -> None:
    ch = make_channel(fake)
    await ch.start(sink)
    await ch.stop()
    assert not ch.status().connected
    await fake.wait_for_no_sockets()
    with pytest.raises(ChannelError):
        await ch.send(part(CHANNEL, "k"))


async def test_stop_cuts_off_a_stuck_sink_without_acking(fake: FakeSlack, sink: Sink) -> None:
    ch = make_channel(fake, stop_grace_s=0.2)
    await ch.start(sink)
    sink.gate = asyncio.Event()  # never set: the inbox hangs
    envelope = await fake.push_event(fake.message_event(CHANNEL, ALICE, "stuck"))
    async with asyncio.timeout(5):
        await sink.entered.wait()
    async with asyncio.timeout(3):
        await ch.stop()
    assert not fake.acked(envelope)
    assert sink.inbound == []


async def test_bad_app_token_fails_start(fake: FakeSlack, sink: Sink) -> None:
    config = SlackConfig(api_base_url=fake.api_base_url)
    ch = SlackChannel(config, bot_token=fake.bot_token, app_token="xapp-wrong-token-000000")
    with pytest.raises(ChannelError) as info:
        await ch.start(sink)
    assert info.value.permanent
    assert not ch.status().connected


# -- sending ----------------------------------------------------------------------------------
async def test_send_threads_the_reply_and_tags_it(fake: FakeSlack, channel: SlackChannel) -> None:
    sent = await channel.send(part(CHANNEL, "gb-1-0", "in thread", reply_to="1700.000009"))
    await channel.send(part(CHANNEL, "gb-2-0", "deeper", thread="1700.000001", reply_to="1700.5"))
    await channel.send(part(DM, "gb-3-0", "dm answer", reply_to="1700.000010"))
    first, second = fake.posted[CHANNEL]
    assert sent == SentPart(first.ts)
    assert (first.thread_ts, first.text) == ("1700.000009", "in thread")
    assert first.metadata == {"event_type": "geodebot_outbox", "event_payload": {"key": "gb-1-0"}}
    assert second.thread_ts == "1700.000001"
    assert fake.posted[DM][0].thread_ts is None


async def test_rate_limit_carries_retry_after(fake: FakeSlack, channel: SlackChannel) -> None:
    fake.fail("chat.postMessage", status=429, error="ratelimited", retry_after=7)
    with pytest.raises(ChannelError) as info:
        await channel.send(part(CHANNEL, "gb-4-0"))
    assert info.value.retry_after == 7.0
    assert not info.value.permanent
    assert not isinstance(info.value, SendUnknown)
    assert len(fake.calls_to("chat.postMessage")) == 1  # the SDK did not retry by itself
    assert fake.posted[CHANNEL] == []


@pytest.mark.parametrize(
    ("fault", "permanent", "unknown"),
    [
        (Fault("channel_not_found"), True, False),
        (Fault("not_in_channel"), True, False),
        (Fault("is_archived"), True, False),
        (Fault("service_unavailable"), False, False),
        (Fault("internal_error"), False, True),
        (Fault(drop=True), False, True),
        (Fault(delay=2.0, error="late"), False, True),
    ],
    ids=["not-found", "not-in", "archived", "unavailable", "internal", "dropped", "timeout"],
)
async def test_send_errors(
    fake: FakeSlack, channel: SlackChannel, fault: Fault, permanent: bool, unknown: bool
) -> None:
    fake.fail("chat.postMessage", fault)
    with pytest.raises(ChannelError) as info:
        await channel.send(part(CHANNEL, "gb-5-0"))
    assert info.value.permanent is permanent
    assert isinstance(info.value, SendUnknown) is unknown
    assert len(fake.calls_to("chat.postMessage")) == 1


async def test_message_too_long_is_permanent(fake: FakeSlack, channel: SlackChannel) -> None:
    with pytest.raises(ChannelError) as info:
        await channel.send(part(CHANNEL, "gb-6-0", "x" * 40_001))
    assert info.value.permanent


async def test_find_sent_by_key(fake: FakeSlack, channel: SlackChannel) -> None:
    top = await channel.send(part(CHANNEL, "gb-7-0", "top"))
    for n in range(5):
        await deliver(fake, fake.message_event(CHANNEL, ALICE, f"chatter {n}"))
    reply = await channel.send(part(CHANNEL, "gb-8-0", "reply", reply_to=top.message_id))
    assert await channel.find_sent(part(CHANNEL, "gb-7-0")) == top
    assert await channel.find_sent(part(CHANNEL, "gb-8-0", reply_to=top.message_id)) == reply
    assert await channel.find_sent(part(CHANNEL, "gb-9-0")) is None
    assert await channel.find_sent(part(CHANNEL, "gb-9-0", reply_to=top.message_id)) is None
    assert await channel.find_sent(part(CHANNEL, "gb-9-0", reply_to="1.000001")) is None


async def test_lost_response_is_unknown_then_found(fake: FakeSlack, channel: SlackChannel) -> None:
    fake.fail("chat.postMessage", drop=True, after_commit=True)
    lost = part(CHANNEL, "gb-10-0", "did it arrive?")
    with pytest.raises(SendUnknown):
        await channel.send(lost)
    found = await channel.find_sent(lost)
    assert found == SentPart(fake.posted[CHANNEL][0].ts)


async def test_long_reply_arrives_complete_and_in_order(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    lines = [f"line {n:04d} of the report, plain words only" for n in range(240)]
    markdown = "\n".join(lines)
    assert len(markdown) > 10_000
    texts = channel.render(markdown)
    assert len(texts) >= 3
    assert max(len(t) for t in texts) <= 4000
    for index, text in enumerate(texts):
        await channel.send(OutboundPart(Destination("slack", CHANNEL), text, f"gb-11-{index}"))
    posted = "\n".join(p.text for p in fake.posted[CHANNEL])
    assert [int(n) for n in re.findall(r"line (\d{4})", posted)] == list(range(240))


# -- logs -------------------------------------------------------------------------------------
async def test_tokens_never_reach_the_logs(
    fake: FakeSlack, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ch = make_channel(fake)
    await ch.start(sink)
    try:
        await deliver(fake, fake.message_event(CHANNEL, ALICE, "hello"))
        await ch.send(part(CHANNEL, "gb-12-0"))
        fake.fail("chat.postMessage", status=429, error="ratelimited", retry_after=1)
        with pytest.raises(ChannelError):
            await ch.send(part(CHANNEL, "gb-12-1"))
        await ch.find_sent(part(CHANNEL, "gb-12-0"))
        await fake.disconnect_clients()
        await fake.wait_for_connections(2)
    finally:
        await ch.stop()
    assert caplog.records  # DEBUG logging was really on
    assert fake.bot_token not in caplog.text
    assert fake.app_token not in caplog.text


# -- to_inbound -------------------------------------------------------------------------------
def body(**event: Any) -> dict[str, Any]:
    base = {"type": "message", "channel": CHANNEL, "user": ALICE, "text": "x", "ts": "5.000001"}
    return {"type": "event_callback", "event_id": "Ev1", "event": base | event}


@pytest.mark.parametrize(
    "subtype", ["message_changed", "message_deleted", "channel_join", "message_replied"]
)
def test_to_inbound_skips_non_conversational_subtypes(subtype: str) -> None:
    assert to_inbound(body(subtype=subtype), "UBOT") is None


def test_to_inbound_fields() -> None:
    legacy = to_inbound(body(text="hi <@UBOT|geode>"), "UBOT")
    assert legacy is not None
    assert legacy.mentions_bot
    own = to_inbound(body(user="UBOT", bot_id="BME"), "UBOT", "BME")
    assert own is not None
    assert (own.is_self, own.is_bot) == (True, True)
    other = to_inbound(body(user="UOTHER", bot_id="BOTHER"), "UBOT", "BME")
    assert other is not None
    assert (other.is_self, other.is_bot) == (False, True)
    named = to_inbound(body(user_profile={"display_name": "alice"}), "UBOT")
    assert named is not None
    assert named.user_name == "alice"
    assert to_inbound(body(hidden=True), "UBOT") is None
    assert to_inbound({"type": "event_callback", "event": {"type": "reaction_added"}}, "U") is None


# -- slash commands ---------------------------------------------------------------------------
async def test_a_slash_command_is_committed_then_acked(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    sink.gate = asyncio.Event()
    envelope = await fake.push_command(
        "/status", channel=CHANNEL, user=ALICE, trigger_id="123.456.abc"
    )
    await sink.entered.wait()
    await asyncio.sleep(0.1)
    assert not fake.acked(envelope)  # not before the commit
    sink.gate.set()
    ack = await fake.wait_for_ack(envelope)
    assert ack.at >= sink.returned_at
    [got] = sink.inbound
    assert (got.event_id, got.channel, got.thread, got.user, got.text) == (
        "command:123.456.abc",
        CHANNEL,
        None,
        ALICE,
        "/status",
    )
    assert got.mentions_bot
    assert not got.is_bot


async def test_a_command_that_is_not_ours_is_acked_and_dropped(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    envelope = await fake.push_command("/deploy", "prod", channel=CHANNEL, user=ALICE)
    await fake.wait_for_ack(envelope)
    ours = await fake.push_command("/reset", channel=DM, user=ALICE)
    await fake.wait_for_ack(ours)
    [got] = await sink.wait_for(1)
    assert (got.text, got.is_dm) == ("/reset", True)
    assert channel.status().counters["ignored"] >= 1


async def test_a_failed_commit_leaves_the_command_unacked(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    sink.fail_next = 1
    envelope = await fake.push_command("/help", channel=CHANNEL, user=ALICE)
    await sink.failed.wait()
    # A control: the next command is committed and acked, after the first was handled.
    control = await fake.push_command("/status", channel=CHANNEL, user=ALICE)
    await fake.wait_for_ack(control)
    assert not fake.acked(envelope)
