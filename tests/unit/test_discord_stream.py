"""Streamed replies on the Discord adapter: previews sent plain, edited in place, against
FakeDiscord with the real discord.py in between."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from geodebot.channels.base import ChannelError, Destination, OutboundPart
from geodebot.channels.discord import DiscordChannel
from geodebot.channels.discord.send import MAX_CHARS, nonce_for
from tests.support.fakes.discord_server import FakeDiscord
from tests.unit.test_discord_channel import TOKEN, USER, Cursors, Sink, make_channel

PREVIEW_KEY = "gb-preview-7"
FINAL_KEY = "gb-9-0"
# Markup cut anywhere, mentions and block syntax: a preview shows all of it as sent.
RAW = "**Deploy <@123> @everyone\n# step 1: `kubectl apply -f _x_ [cfg](http://e.x"


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as server:
        yield server


@pytest.fixture
async def chan(fake: FakeDiscord) -> AsyncIterator[DiscordChannel]:
    channel = make_channel(fake, Cursors())
    await channel.start(Sink())
    try:
        yield channel
    finally:
        await channel.stop()


def preview(fake: FakeDiscord, text: str, asked: str, edit_of: str | None = None) -> OutboundPart:
    dest = Destination("discord", fake.channel_id, reply_to=asked)
    return OutboundPart(dest, text, PREVIEW_KEY, edit_of=edit_of, plain=True)


def final(fake: FakeDiscord, text: str, asked: str, edit_of: str) -> OutboundPart:
    dest = Destination("discord", fake.channel_id, reply_to=asked)
    return OutboundPart(dest, text, FINAL_KEY, edit_of=edit_of)


async def test_preview_is_edited_in_place_then_replaced_by_the_answer(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    first = await chan.send(preview(fake, "Deploying", asked))
    again = await chan.send(preview(fake, "Deploying the", asked, edit_of=first.message_id))
    done = await chan.send(final(fake, "Deploying the **app**: done.", asked, first.message_id))
    assert again == done == first
    [posted] = fake.posted[fake.channel_id]  # one message, edited twice
    assert posted["id"] == first.message_id
    assert posted["message_reference"]["message_id"] == asked
    assert fake.texts(first.message_id) == [
        "Deploying",
        "Deploying the",
        "Deploying the **app**: done.",
    ]
    assert fake.message(first.message_id)["content"] == "Deploying the **app**: done."
    for edit in fake.edits:
        assert edit["id"] == first.message_id
        assert "components" not in edit["body"]  # a preview never gets buttons
        assert edit["body"]["allowed_mentions"]["parse"] == []


async def test_edit_of_a_deleted_message_sends_the_part_once_as_a_new_message(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    shown = await chan.send(preview(fake, "Deploying", asked))
    fake.delete_message(fake.channel_id, shown.message_id)
    answer = final(fake, "Deployed.", asked, shown.message_id)
    sent = await chan.send(answer)
    assert await chan.send(answer) == sent  # a retry of the same part: still one message
    assert sent.message_id != shown.message_id
    first, new = fake.posted[fake.channel_id]
    assert first["id"] == shown.message_id
    assert new["id"] == sent.message_id
    assert new["content"] == "Deployed."
    assert new["nonce"] == nonce_for(FINAL_KEY)
    assert new["message_reference"]["message_id"] == asked
    assert [m["id"] for m in fake.history[fake.channel_id]] == [asked, sent.message_id]


async def test_edit_of_someone_elses_message_is_a_permanent_error(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    with pytest.raises(ChannelError) as refused:
        await chan.send(final(fake, "Deployed.", asked, edit_of=asked))
    assert refused.value.permanent
    assert not fake.posted[fake.channel_id]  # nothing sent in its place
    assert fake.texts(asked) == ["deploy?"]


async def test_plain_preview_arrives_literally_and_pings_nobody(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    shown = await chan.send(preview(fake, RAW, asked))
    await chan.send(preview(fake, RAW + " more", asked, edit_of=shown.message_id))
    [posted] = fake.posted[fake.channel_id]
    assert fake.texts(shown.message_id) == [RAW, RAW + " more"]  # no escaping, no conversion
    assert posted["allowed_mentions"]["parse"] == []
    assert posted["allowed_mentions"]["replied_user"] is False  # not even the asker
    [edit] = fake.edits
    assert edit["body"]["allowed_mentions"]["parse"] == []


async def test_a_part_over_the_limit_is_refused_before_any_request(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    shown = await chan.send(preview(fake, "Deploying", asked))
    long = "x" * (MAX_CHARS + 1)
    for too_long in (
        preview(fake, long, asked),
        preview(fake, long, asked, edit_of=shown.message_id),
        final(fake, long, asked, shown.message_id),
    ):
        with pytest.raises(ChannelError) as refused:
            await chan.send(too_long)
        assert refused.value.permanent
    assert fake.texts(shown.message_id) == ["Deploying"]
    assert len(fake.posted[fake.channel_id]) == 1
    assert not fake.edits


async def test_long_rate_limit_on_an_edit_is_a_channel_error_with_retry_after(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    shown = await chan.send(preview(fake, "Deploying", asked))
    fake.fail_edits(1, retry_after=45)  # over max_ratelimit_timeout: discord.py does not wait
    started = time.monotonic()
    with pytest.raises(ChannelError) as limited:
        await chan.send(preview(fake, "Deploying the", asked, edit_of=shown.message_id))
    assert time.monotonic() - started < 5
    assert limited.value.retry_after == 45
    assert not limited.value.permanent
    assert fake.limited_edits == [shown.message_id]
    assert fake.texts(shown.message_id) == ["Deploying"]
    assert len(fake.posted[fake.channel_id]) == 1  # a rate limit is no reason for a new one


async def test_short_rate_limits_on_an_edit_are_retried_then_handed_over(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    asked = fake.push_message(fake.channel_id, "deploy?", author_id=USER)
    shown = await chan.send(preview(fake, "Deploying", asked))
    fake.fail_edits(2, retry_after=0.05)
    await chan.send(preview(fake, "Deploying the", asked, edit_of=shown.message_id))
    assert fake.texts(shown.message_id) == ["Deploying", "Deploying the"]
    # discord.py gives up after 5 tries; the 429 then says how long to wait (Retry-After).
    fake.fail_edits(5, retry_after=0.05)
    with pytest.raises(ChannelError) as limited:
        await chan.send(final(fake, "Deployed.", asked, shown.message_id))
    assert limited.value.retry_after == 1
    assert fake.limited_edits == [shown.message_id] * 7
    assert fake.texts(shown.message_id) == ["Deploying", "Deploying the"]
    await chan.send(final(fake, "Deployed.", asked, shown.message_id))
    assert fake.texts(shown.message_id)[-1] == "Deployed."
    assert len(fake.posted[fake.channel_id]) == 1
