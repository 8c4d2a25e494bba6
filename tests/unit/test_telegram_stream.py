"""Streamed replies on the Telegram adapter: a preview sent and edited as plain text, the final
answer as an edit of it, against the fake Bot API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from geodebot.channels.base import (
    ChannelError,
    Destination,
    Inbound,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.telegram import TelegramChannel
from geodebot.config.schema import TelegramConfig
from tests.support.fakes.telegram_server import FakeTelegram, html_visible

GROUP = -1001234
ALICE = 4242
NO_PREVIEW = {"is_disabled": True}
OpenChannel = Callable[[], Awaitable[TelegramChannel]]


async def ignore(inbound: Inbound) -> None:
    """The inbox: these tests only send."""


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def channel(fake: FakeTelegram) -> AsyncIterator[TelegramChannel]:
    config = TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=2)
    opened = TelegramChannel(config, fake.token)
    await opened.start(ignore)
    try:
        yield opened
    finally:
        await opened.stop()


def part(text: str, *, edit_of: str | None = None, plain: bool = False) -> OutboundPart:
    # A reply to message 1, the question (pushed by each test).
    dest = Destination("telegram", str(GROUP), reply_to="1")
    return OutboundPart(dest, text, "gb-7-0", edit_of=edit_of, plain=plain)


def question(fake: FakeTelegram) -> None:
    fake.push_message(GROUP, "what is up?", user_id=ALICE, chat_type="supergroup")


async def test_the_final_answer_edits_the_preview_into_html(
    fake: FakeTelegram, channel: TelegramChannel
):
    question(fake)
    preview = await channel.send(part("The **answer** so f", plain=True))
    final = await channel.send(
        part("The <b>answer</b> so far &amp; more", edit_of=preview.message_id)
    )
    assert final == preview == SentPart("2")
    [message] = fake.sent[GROUP]  # one message in the chat
    assert message.reply_to_message_id == 1
    first, last = fake.history(GROUP, 2)
    assert (first.text, first.parse_mode) == ("The **answer** so f", None)
    assert (last.text, last.parse_mode) == ("The <b>answer</b> so far &amp; more", "HTML")
    assert html_visible(last.text) == "The answer so far & more"
    assert last.link_preview_options is None  # a final answer may show its links' previews
    # Repeated (after a crash, say): Telegram answers "not modified", which is success.
    again = await channel.send(part(last.text, edit_of=preview.message_id))
    assert again == preview
    assert fake.count("editMessageText") == 2
    assert len(fake.history(GROUP, 2)) == 2
    counters = channel.status().counters
    assert (counters["sent"], counters["send_errors"]) == (3, 0)


async def test_an_edit_of_a_deleted_preview_arrives_as_a_new_message(
    fake: FakeTelegram, channel: TelegramChannel
):
    question(fake)
    preview = await channel.send(part("Thinking", plain=True))
    fake.delete_message(GROUP, int(preview.message_id))
    final = await channel.send(part("<i>Done</i>.", edit_of=preview.message_id))
    assert final == SentPart("3")
    assert fake.count("editMessageText") == 1  # tried, refused as not found
    assert fake.edits == []
    _, answer = fake.sent[GROUP]
    assert (answer.message_id, answer.text, answer.parse_mode) == (3, "<i>Done</i>.", "HTML")
    assert answer.reply_to_message_id == 1
    # A preview the chat lost likewise starts a new one: the next edit goes there.
    fake.delete_message(GROUP, 3)
    later = await channel.send(part("Thinking more", edit_of="3", plain=True))
    assert later == SentPart("4")
    assert fake.shown(GROUP, 4).parse_mode is None


async def test_an_id_that_is_no_message_id_sends_the_part_anew(
    fake: FakeTelegram, channel: TelegramChannel
):
    sent = await channel.send(part("Answer", edit_of="not-a-number"))
    assert sent == SentPart("1")
    assert fake.count("editMessageText") == 0
    assert [m.text for m in fake.sent[GROUP]] == ["Answer"]


async def test_a_plain_preview_shows_its_text_literally_with_no_link_preview(
    fake: FakeTelegram, channel: TelegramChannel
):
    question(fake)
    # Cut mid-answer: an open tag, a bare "<" and "&" would all be refused as HTML.
    cut = "See <b>https://example.org & the **notes** <i"
    sent = await channel.send(part(cut, plain=True))
    [message] = fake.sent[GROUP]
    assert (message.text, message.parse_mode) == (cut, None)
    assert message.link_preview_options == NO_PREVIEW
    longer = cut + "> and 1 < 2"
    await channel.send(part(longer, edit_of=sent.message_id, plain=True))
    shown = fake.shown(GROUP, int(sent.message_id))
    assert (shown.text, shown.parse_mode) == (longer, None)
    assert shown.link_preview_options == NO_PREVIEW
    assert channel.status().counters["plain_fallbacks"] == 0


async def test_a_final_edit_refused_as_html_is_made_as_plain_text(
    fake: FakeTelegram, channel: TelegramChannel
):
    preview = await channel.send(part("so far", plain=True))
    await channel.send(part("<b>bold</b> <blink>x</blink>", edit_of=preview.message_id))
    shown = fake.shown(GROUP, int(preview.message_id))
    assert (shown.text, shown.parse_mode) == ("bold <blink>x</blink>", None)
    assert len(fake.sent[GROUP]) == 1
    assert channel.status().counters["plain_fallbacks"] == 1


async def test_a_rate_limited_edit_raises_with_retry_after_and_changes_nothing(
    fake: FakeTelegram, channel: TelegramChannel
):
    preview = await channel.send(part("so far", plain=True))
    fake.fail_edits(2, retry_after=3)
    for edit in (part("so far and", edit_of="1", plain=True), part("Done", edit_of="1")):
        with pytest.raises(ChannelError) as limited:
            await channel.send(edit)
        assert limited.value.retry_after == 3.0
        assert not limited.value.permanent
        assert not isinstance(limited.value, SendUnknown)
    assert fake.history(GROUP, int(preview.message_id))[-1].text == "so far"
    assert len(fake.sent[GROUP]) == 1  # a rate limit is not a reason to post anew
    assert await channel.send(part("Done", edit_of="1")) == preview
    assert fake.shown(GROUP, 1).text == "Done"
    assert channel.status().counters["send_errors"] == 2


async def test_other_edit_errors_map_like_sends_and_post_nothing(
    fake: FakeTelegram, channel: TelegramChannel
):
    await channel.send(part("so far", plain=True))
    fake.fail_next("editMessageText", 403, "Forbidden: bot was kicked from the supergroup chat")
    with pytest.raises(ChannelError) as kicked:
        await channel.send(part("Done", edit_of="1"))
    assert kicked.value.permanent
    with pytest.raises(ChannelError) as too_long:
        await channel.send(part("x" * 5000, edit_of="1"))
    assert too_long.value.permanent
    assert "too long" in str(too_long.value).lower()
    fake.fail_next("editMessageText", 502, "Bad Gateway")
    with pytest.raises(ChannelError) as unwell:
        await channel.send(part("Done", edit_of="1"))
    assert not unwell.value.permanent
    assert unwell.value.retry_after is None
    assert [m.text for m in fake.sent[GROUP]] == ["so far"]
    assert fake.edits == []
