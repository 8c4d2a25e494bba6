"""Streamed replies on the Slack adapter against FakeSlack, with the real slack_sdk: a part
with ``edit_of`` edits that message (chat.update), a deleted one is replaced by a new message,
and a ``plain`` part (a preview) arrives as written, never parsed into mentions or links."""

from __future__ import annotations

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
from geodebot.config.schema import SlackConfig
from tests.support.fakes.slack_server import FakeSlack, Fault

CHANNEL = "C0CHAN001"
ROOT = "1700000000.000100"  # the user's message the reply answers: its thread
# What the model may have written so far: a broadcast, a mention, a link, an entity, markup.
RAW = "<!here> ping <@U0ALICE1> see <https://evil.example|docs> & *bo"


async def _drop(inbound: Inbound) -> None:
    return None


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as srv:
        yield srv


@pytest.fixture
async def channel(fake: FakeSlack) -> AsyncIterator[SlackChannel]:
    config = SlackConfig(api_base_url=fake.api_base_url)
    ch = SlackChannel(
        config,
        bot_token=fake.bot_token,
        app_token=fake.app_token,
        ping_interval_s=2.0,
        request_timeout_s=1.0,
    )
    await ch.start(_drop)
    yield ch
    await ch.stop()


def part(text: str, key: str = "gb-1-0", **kw: Any) -> OutboundPart:
    return OutboundPart(Destination("slack", CHANNEL, reply_to=ROOT), text, key, **kw)


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


async def preview(channel: SlackChannel, text: str = "Thinking about it") -> str:
    sent = await channel.send(part(text, "gb-preview-1", plain=True))
    return sent.message_id


# -- editing ----------------------------------------------------------------------------------
async def test_an_edit_changes_the_message_in_place(fake: FakeSlack, channel: SlackChannel) -> None:
    ts = await preview(channel, "The answer so")
    again = await channel.send(part("The answer so far", "gb-preview-1", edit_of=ts, plain=True))
    final = "*The answer*, see <https://example.com/a|the docs>"
    done = await channel.send(part(final, edit_of=ts))

    assert again == done == SentPart(ts)
    [posted] = fake.posted[CHANNEL]  # one message, edited twice
    assert posted.thread_ts == ROOT
    assert posted.texts == ["The answer so", "The answer so far", final]
    assert posted.edits == 2
    # The rendered link survives the edit (chat.update would escape it without parse=none).
    message = fake.message(CHANNEL, ts)
    assert message is not None
    assert message["text"] == final
    # ... and the message now carries the final part's key, so a lookup finds the answer.
    assert message["metadata"]["event_payload"] == {"key": "gb-1-0"}
    assert await channel.find_sent(part(final)) == SentPart(ts)
    assert len(fake.calls_to("chat.postMessage")) == 1
    assert channel.status().counters["edited"] == 2


async def test_an_edit_of_a_deleted_message_is_posted_as_a_new_one(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    ts = await preview(channel)
    fake.delete_message(CHANNEL, ts)  # a person deleted the preview
    sent = await channel.send(part("The whole answer", edit_of=ts))

    old, new = fake.posted[CHANNEL]
    assert old.deleted
    assert sent == SentPart(new.ts)
    assert new.ts != ts
    assert (new.text, new.thread_ts) == ("The whole answer", ROOT)
    assert new.metadata == {"event_type": "geodebot_outbox", "event_payload": {"key": "gb-1-0"}}
    # Edited, found gone, looked for in the thread (an earlier replacement), posted.
    methods = [c.method for c in fake.calls][-3:]
    assert methods == ["chat.update", "conversations.replies", "chat.postMessage"]
    assert channel.status().counters["edits_gone"] == 1


async def test_a_deleted_message_gets_one_replacement_even_if_the_first_was_lost(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    ts = await preview(channel)
    fake.delete_message(CHANNEL, ts)
    # The replacement reaches Slack but its answer is lost: the outbox sends the edit again.
    fake.fail("chat.postMessage", drop=True, after_commit=True)
    with pytest.raises(SendUnknown):
        await channel.send(part("The whole answer", edit_of=ts))
    sent = await channel.send(part("The whole answer", edit_of=ts))

    _, replacement = fake.posted[CHANNEL]  # not a third message
    assert sent == SentPart(replacement.ts)
    assert replacement.text == "The whole answer"


async def test_a_message_that_is_not_ours_cannot_be_edited_and_is_posted_anew(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    # Slack answers cant_update_message (here: for a user's message) like for a deleted one.
    user_message = fake.message_event(CHANNEL, "U0ALICE1", "hello", ts="1700000001.000200")
    await fake.wait_for_ack(await fake.push_event(user_message))
    sent = await channel.send(part("answer", edit_of="1700000001.000200"))
    [posted] = fake.posted[CHANNEL]
    assert sent == SentPart(posted.ts)
    assert fake.message(CHANNEL, "1700000001.000200") == user_message  # untouched


# -- plain previews ---------------------------------------------------------------------------
async def test_a_plain_part_arrives_literally(fake: FakeSlack, channel: SlackChannel) -> None:
    ts = await preview(channel, RAW)
    [posted] = fake.posted[CHANNEL]
    # No raw < or >: nothing in it is a broadcast, a mention or a link ...
    assert "<" not in posted.text
    assert ">" not in posted.text
    # ... and a reader sees exactly what the model wrote, in plain text, no blocks.
    assert unescape(posted.text) == RAW
    assert posted.blocks is None
    [call] = fake.calls_to("chat.postMessage")
    assert "blocks" not in call.args

    await channel.send(part(RAW + "ld*", "gb-preview-1", edit_of=ts, plain=True))
    assert "<" not in posted.text
    assert unescape(posted.text) == RAW + "ld*"
    [edit] = fake.calls_to("chat.update")
    assert "blocks" not in edit.args


async def test_a_rendered_part_is_sent_as_rendered(fake: FakeSlack, channel: SlackChannel) -> None:
    # Not plain: the text is already the platform's markup and goes out unchanged.
    [text] = channel.render("**bold** and [docs](https://example.com/x)")
    await channel.send(part(text))
    [posted] = fake.posted[CHANNEL]
    assert posted.text == "*bold* and <https://example.com/x|docs>"


# -- errors -----------------------------------------------------------------------------------
async def test_a_rate_limited_edit_carries_retry_after(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    ts = await preview(channel, "before")
    fake.fail_edits(2, retry_after=4)
    for _ in range(2):
        with pytest.raises(ChannelError) as info:
            await channel.send(part("after", edit_of=ts))
        assert info.value.retry_after == 4.0
        assert not info.value.permanent
        assert not isinstance(info.value, SendUnknown)
    [posted] = fake.posted[CHANNEL]
    assert posted.texts == ["before"]  # unchanged, and not posted anew
    assert fake.edits_limited() == 2
    # The limit is over: the next edit goes through.
    assert await channel.send(part("after", edit_of=ts)) == SentPart(ts)
    assert posted.texts == ["before", "after"]
    assert len(fake.calls_to("chat.update")) == 3  # the SDK did not retry by itself


async def test_edits_are_rate_limited_for_a_while(fake: FakeSlack, channel: SlackChannel) -> None:
    ts = await preview(channel, "before")
    fake.fail_edits(retry_after=1, for_s=60)
    for _ in range(3):  # every edit within the window, however many
        with pytest.raises(ChannelError) as info:
            await channel.send(part("after", edit_of=ts))
        assert info.value.retry_after == 1.0
    fake.fail_edits(0)  # the window ends early
    assert await channel.send(part("after", edit_of=ts)) == SentPart(ts)
    assert fake.edits_limited() == 3


@pytest.mark.parametrize(
    ("fault", "permanent", "unknown"),
    [
        (Fault("channel_not_found"), True, False),
        (Fault("edit_window_closed"), True, False),
        (Fault("internal_error"), False, True),
        (Fault(drop=True), False, True),
        (Fault("service_unavailable"), False, False),
    ],
    ids=["not-found", "window-closed", "internal", "dropped", "unavailable"],
)
async def test_edit_errors_map_like_send_errors(
    fake: FakeSlack, channel: SlackChannel, fault: Fault, permanent: bool, unknown: bool
) -> None:
    ts = await preview(channel, "before")
    fake.fail("chat.update", fault)
    with pytest.raises(ChannelError) as info:
        await channel.send(part("after", edit_of=ts))
    assert info.value.permanent is permanent
    assert isinstance(info.value, SendUnknown) is unknown
    # Only a message that is gone is posted anew.
    assert len(fake.posted[CHANNEL]) == 1
