"""Voice on the Discord adapter: voice messages and audio attachments in (duration, voice),
their download, and spoken answers out as an .ogg upload; against FakeDiscord with the real
discord.py in between. One fake and one started channel serve the whole module."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from geodebot.channels.base import Destination, InboundFile, OutboundFile, OutboundPart
from geodebot.channels.discord import DiscordChannel
from geodebot.channels.discord.files import voice_name
from geodebot.channels.discord.inbound import seconds
from tests.support.fakes.discord_server import VOICE_MESSAGE, FakeDiscord
from tests.unit.test_discord_channel import TOKEN, USER, Cursors, Sink, make_channel, until

# The shared channel lives on the module's loop; so do the tests (the pure ones too, which
# the module mark would otherwise warn about).
pytestmark = pytest.mark.asyncio(loop_scope="module")

MB = 1000 * 1000
# Opaque to the adapter: only the voice stage decodes audio.
OGG = b"OggS\x00\x02" + bytes(range(256)) * 8


class World:
    def __init__(self, fake: FakeDiscord, chan: DiscordChannel, sink: Sink) -> None:
        self.fake, self.chan, self.sink = fake, chan, sink

    async def file_of(self, mid: str) -> InboundFile:
        """The one file of message ``mid``, as the adapter delivered it."""
        await until(lambda: mid in self.sink.ids())
        [inbound] = [i for i in self.sink.got if i.event_id == mid]
        [file] = inbound.files
        return file


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world() -> AsyncIterator[World]:
    async with FakeDiscord(token=TOKEN) as fake:
        sink = Sink()
        chan = make_channel(fake, Cursors())
        await chan.start(sink)
        try:
            yield World(fake, chan, sink)
        finally:
            await chan.stop()


def spoken(dest: Destination, path: Path, name: str, caption: str, key: str) -> OutboundPart:
    """A spoken answer (OGG/Opus at ``path``) as the outbox hands it to the channel."""
    file = OutboundFile(path, name, "audio/ogg", path.stat().st_size, voice=True)
    return OutboundPart(dest, caption, key, file=file)


async def test_a_voice_message_is_a_voice_file_with_its_duration(world: World) -> None:
    fake = world.fake
    mid = fake.push_voice_message(fake.channel_id, OGG, author_id=USER, duration_secs=4.25)
    [attachment] = fake.message(mid)["attachments"]
    assert fake.message(mid)["flags"] == VOICE_MESSAGE
    file = await world.file_of(mid)
    assert file == InboundFile(
        str(attachment["url"]),
        "voice-message.ogg",
        "audio/ogg",
        len(OGG),
        duration=4.25,
        voice=True,
    )
    assert InboundFile.from_json(file.to_json()) == file  # as the inbox row keeps it
    assert not fake.downloads[attachment["id"]]  # announced, not fetched, on the way in
    assert await world.chan.download(file, MB) == OGG
    assert fake.downloads[attachment["id"]] == 1
    assert fake.cdn_authorization[-1] is None


async def test_an_attached_audio_file_is_no_voice_note(world: World) -> None:
    fake = world.fake
    mp3 = fake.attachment(fake.channel_id, "song.mp3", b"ID3" + b"\x00" * 64)
    plain = fake.push_message(fake.channel_id, "listen", author_id=USER, attachments=[mp3])
    file = await world.file_of(plain)
    assert (file.media_type, file.duration, file.voice) == ("audio/mpeg", 0.0, False)
    assert set(file.to_json()) == {"ref", "name", "media_type", "size"}

    # An audio file Discord gave a length to keeps it; without the flag it is still no note.
    timed = fake.attachment(fake.channel_id, "memo.ogg", OGG, duration_secs=12)
    mid = fake.push_message(fake.channel_id, "", author_id=USER, attachments=[timed])
    file = await world.file_of(mid)
    assert (file.media_type, file.duration, file.voice) == ("audio/ogg", 12.0, False)
    assert await world.chan.download(file, MB) == OGG


async def test_the_voice_flag_on_a_message_without_audio_makes_no_voice_note(
    world: World,
) -> None:
    fake = world.fake
    doc = fake.attachment(fake.channel_id, "notes.txt", b"text")
    mid = fake.push_message(
        fake.channel_id, "", author_id=USER, attachments=[doc], flags=VOICE_MESSAGE
    )
    file = await world.file_of(mid)
    assert (file.name, file.duration, file.voice) == ("notes.txt", 0.0, False)


@pytest.mark.parametrize(
    "duration", [None, "3.5", "abc", -2.0, 0, True, float("nan"), float("inf"), [1], {}]
)
async def test_a_missing_or_malformed_duration_is_unknown(world: World, duration: Any) -> None:
    fake = world.fake
    mid = fake.push_voice_message(fake.channel_id, OGG, author_id=USER, duration_secs=duration)
    file = await world.file_of(mid)
    assert (file.duration, file.voice) == (0.0, True)  # still a voice note, of unknown length


async def test_a_voice_message_missed_while_down_arrives_from_history(world: World) -> None:
    fake = world.fake
    before = fake.push_message(fake.channel_id, "before", author_id=USER)
    missed = fake.push_voice_message(fake.channel_id, OGG, author_id=USER, duration_secs=7.5)
    cursors = Cursors()
    cursors.values[f"discord:last:{fake.channel_id}"] = before
    sink = Sink()
    late = make_channel(fake, cursors)
    await late.start(sink)  # its READY catches up from the cursor
    try:
        await until(lambda: missed in sink.ids())
        [inbound] = [i for i in sink.got if i.event_id == missed]
        [file] = inbound.files
        assert (file.name, file.duration, file.voice) == ("voice-message.ogg", 7.5, True)
    finally:
        await late.stop()


async def test_a_spoken_answer_is_uploaded_as_ogg_audio(world: World, tmp_path: Path) -> None:
    fake = world.fake
    path = tmp_path / "tts-output.bin"
    path.write_bytes(OGG)
    asked = fake.push_voice_message(fake.channel_id, OGG, author_id=USER)
    cases = [
        ("answer.ogg", "", "answer.ogg", None),
        ("reply.opus", "The short version.", "reply.ogg", "The short version."),
        ("", "", "answer.ogg", None),
    ]
    for n, (name, caption, uploaded, content) in enumerate(cases):
        dest = Destination("discord", fake.channel_id, reply_to=asked if n == 0 else None)
        sent = await world.chan.send(spoken(dest, path, name, caption, f"gb-voice-{n}"))
        [upload] = [u for u in fake.uploads if u.message_id == sent.message_id]
        assert (upload.name, upload.content_type, upload.size) == (uploaded, "audio/ogg", len(OGG))
        assert (upload.data, upload.content) == (OGG, content)
        assert upload.sent_type == "application/octet-stream"  # discord.py's, for any file
        message = fake.message(sent.message_id)
        assert message["flags"] == 0  # an attachment, not Discord's own voice message
        [attachment] = message["attachments"]
        assert (attachment["filename"], attachment["content_type"]) == (uploaded, "audio/ogg")
        if n == 0:
            assert upload.reference is not None
            assert upload.reference["message_id"] == asked


async def test_voice_names_end_in_ogg() -> None:
    assert voice_name("answer.ogg") == "answer.ogg"
    assert voice_name("Answer.OGG") == "Answer.OGG"
    assert voice_name("reply.opus") == "reply.ogg"
    assert voice_name("reply.oga") == "reply.ogg"
    assert voice_name("speech") == "speech.ogg"
    assert voice_name("speech.mp3") == "speech.mp3.ogg"
    assert voice_name("") == voice_name(" ") == voice_name(".") == "answer.ogg"


async def test_seconds_takes_positive_finite_numbers_only() -> None:
    assert seconds(2.5) == 2.5
    assert seconds(3) == 3.0
    for bad in (None, 0, -1, True, False, "2", math.nan, math.inf, -math.inf, b"1"):
        assert seconds(bad) == 0.0, bad
