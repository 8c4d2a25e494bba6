"""Files in and out on Slack: the adapter against FakeSlack through real slack-bolt and
slack_sdk (file shares arrive over Socket Mode, downloads and uploads over real HTTP)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yarl

from geodebot.channels.base import (
    ChannelError,
    Destination,
    FileTooLarge,
    Inbound,
    InboundFile,
    OutboundFile,
    OutboundPart,
    SendUnknown,
)
from geodebot.channels.slack import SlackChannel
from geodebot.channels.slack.files import file_host_allowed
from geodebot.channels.slack.inbound import files_of, to_inbound
from geodebot.config.schema import SlackConfig
from tests.support.fakes.slack_server import FakeSlack
from tests.support.files import tiny_pdf, tiny_png

CHANNEL = "C0FILES01"
ALICE = "UALICE001"


class Sink:
    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, inbound: Inbound) -> None:
        async with self._arrived:
            self.inbound.append(inbound)
            self._arrived.notify_all()

    async def wait_for(self, count: int) -> list[Inbound]:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: len(self.inbound) >= count)
        return self.inbound


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as srv:
        yield srv


@pytest.fixture
async def sink() -> Sink:
    return Sink()


@pytest.fixture
async def channel(fake: FakeSlack, sink: Sink) -> AsyncIterator[SlackChannel]:
    config = SlackConfig(api_base_url=fake.api_base_url)
    ch = SlackChannel(
        config,
        bot_token=fake.bot_token,
        app_token=fake.app_token,
        ping_interval_s=2.0,
        request_timeout_s=1.0,
    )
    await ch.start(sink)
    yield ch
    await ch.stop()


def inbound_file(file: dict[str, Any]) -> InboundFile:
    [got] = files_of({"files": [file]})
    return got


def file_part(path: Path, text: str, *, key: str = "gb-file-1", **dest: Any) -> OutboundPart:
    file = OutboundFile(path, path.name, "application/pdf", path.stat().st_size)
    return OutboundPart(Destination("slack", CHANNEL, **dest), text, key, file=file)


# -- files in: the event ------------------------------------------------------------------------
async def test_a_file_share_arrives_with_its_files_and_nothing_downloaded(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    png = fake.add_file(tiny_png(), "shot.png", "image/png")
    pdf = fake.add_file(tiny_pdf(), "report.pdf", "application/pdf", size=25_000_000)
    event = fake.file_message_event(CHANNEL, ALICE, "what is this?", [png, pdf])
    envelope = await fake.push_event(event, event_id="Ev0FILES")
    await fake.wait_for_ack(envelope)
    [got] = await sink.wait_for(1)
    assert got.text == "what is this?"
    assert got.event_id == "Ev0FILES"
    assert got.files == (
        InboundFile(png["url_private_download"], "shot.png", "image/png", len(tiny_png())),
        InboundFile(pdf["url_private_download"], "report.pdf", "application/pdf", 25_000_000),
    )
    assert sum(fake.downloads.values()) == 0


async def test_a_file_without_text_or_subtype_arrives_with_an_empty_caption(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    png = fake.add_file(tiny_png(), "shot.png", "image/png")
    event = fake.message_event(CHANNEL, ALICE, "")
    event["files"] = [png]
    envelope = await fake.push_event(event)
    await fake.wait_for_ack(envelope)
    [got] = await sink.wait_for(1)
    assert got.text == ""
    assert [f.name for f in got.files] == ["shot.png"]


def test_files_without_content_or_url_are_left_out() -> None:
    url = "https://files.slack.com/files-pri/T1-F1/download/a.txt"
    files = [
        {"id": "F1", "name": "a.txt", "mimetype": "text/plain", "size": 3, "url_private": url},
        {"id": "F2", "mode": "tombstone"},
        {"id": "F3", "mode": "hidden_by_limit", "url_private": url, "name": "old.txt"},
        {"id": "F4", "name": "nourl.txt", "mimetype": "text/plain", "size": 3},
        {"id": "F5", "file_access": "check_file_info"},  # a Slack Connect file: no URL
        "not a file",
        {"id": "F6", "url_private_download": url, "size": True, "mimetype": 7},
    ]
    assert files_of({"files": files}) == (
        InboundFile(url, "a.txt", "text/plain", 3),
        InboundFile(url, "F6", "", 0),
    )
    event = {"type": "message", "subtype": "file_share", "channel": "C1", "user": ALICE}
    body: dict[str, Any] = {"event_id": "Ev1", "event": {**event, "ts": "1.0", "files": files}}
    inbound = to_inbound(body, "UBOT")
    assert inbound is not None
    assert len(inbound.files) == 2
    # Other subtypes still do not pass, files or not.
    body["event"]["subtype"] = "message_changed"
    assert to_inbound(body, "UBOT") is None


# -- files in: the download ---------------------------------------------------------------------
async def test_download_fetches_the_bytes_with_the_bot_token(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    data = tiny_pdf("the report")
    pdf = fake.add_file(data, "report.pdf", "application/pdf")
    assert await channel.download(inbound_file(pdf), 1_000_000) == data
    assert [(r.file_id, r.token) for r in fake.file_requests] == [(pdf["id"], fake.bot_token)]
    assert channel.status().counters["downloads"] == 1


async def test_a_large_file_chunked_downloads_whole(fake: FakeSlack, channel: SlackChannel) -> None:
    data = bytes(range(256)) * 1000
    big = fake.add_file(data, "blob.bin", "application/octet-stream", chunked=True)
    assert await channel.download(inbound_file(big), len(data)) == data


async def test_an_announced_length_over_the_cap_stops_before_reading(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    data = b"x" * 5000
    # The event says 10 bytes; the answer's Content-Length tells the truth.
    small = fake.add_file(data, "lies.txt", "text/plain", size=10)
    with pytest.raises(FileTooLarge) as caught:
        await channel.download(inbound_file(small), 1000)
    assert caught.value.limit == 1000
    assert caught.value.size == 5000  # from the header: nothing was read to learn it


async def test_a_body_over_the_cap_stops_while_reading(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    data = b"y" * 200_000
    big = fake.add_file(data, "stream.txt", "text/plain", size=10, chunked=True)
    with pytest.raises(FileTooLarge) as caught:
        await channel.download(inbound_file(big), 50_000)
    assert caught.value.limit == 50_000
    assert caught.value.size is None  # nothing announced it


async def test_another_host_gets_no_request_and_no_token(
    fake: FakeSlack, channel: SlackChannel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with FakeSlack(bot_token=fake.bot_token) as other:
        theirs = other.add_file(tiny_png(), "bait.png", "image/png")
        with pytest.raises(ChannelError) as caught:
            await channel.download(inbound_file(theirs), 1_000_000)
        assert caught.value.permanent
        assert other.file_requests == []
        assert fake.file_requests == []
        # A redirect from Slack's host to another one is refused the same way.
        hop = fake.add_file(b"", "hop.png", "image/png", redirect_to=theirs["url_private"])
        with pytest.raises(ChannelError) as caught:
            await channel.download(inbound_file(hop), 1_000_000)
        assert caught.value.permanent
        assert other.file_requests == []
        assert [r.file_id for r in fake.file_requests] == [hop["id"]]
    assert fake.bot_token not in caplog.text


async def test_a_redirect_on_the_same_host_is_followed(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    data = tiny_png(3)
    target = fake.add_file(data, "real.png", "image/png")
    hop = fake.add_file(b"", "hop.png", "image/png", redirect_to=target["url_private_download"])
    assert await channel.download(inbound_file(hop), 1_000_000) == data
    assert [r.token for r in fake.file_requests] == [fake.bot_token] * 2


def test_only_slacks_file_host_and_the_api_host_get_the_token() -> None:
    api = yarl.URL("http://127.0.0.1:8123/api/")
    allowed = [
        "https://files.slack.com/files-pri/T1-F1/download/a.png",
        "https://FILES.slack.com:443/files-pri/T1-F1/a.png",
        "http://127.0.0.1:8123/files-pri/T1-F1/a.png",
    ]
    refused = [
        "http://files.slack.com/files-pri/T1-F1/a.png",  # not https
        "https://files.slack.com:8443/files-pri/T1-F1/a.png",
        "https://files.slack.com.example.org/a.png",
        "https://evil.example/files.slack.com/a.png",
        "https://files.slack.com@evil.example/a.png",
        "https://x:y@files.slack.com/a.png",
        "https://127.0.0.1:8123/a.png",  # another scheme
        "http://127.0.0.1:8124/a.png",  # another port
        "http://localhost:8123/a.png",  # another name
        "/files-pri/T1-F1/a.png",
    ]
    assert [u for u in allowed if file_host_allowed(yarl.URL(u), api)] == allowed
    assert [u for u in refused if file_host_allowed(yarl.URL(u), api)] == []
    default = yarl.URL("https://slack.com/api/")
    assert file_host_allowed(yarl.URL(allowed[0]), default)
    assert not file_host_allowed(yarl.URL(allowed[2]), default)


async def test_a_sign_in_page_instead_of_the_file_is_a_permanent_error(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    png = fake.add_file(tiny_png(), "shot.png", "image/png")
    fake.files_readable = False  # a token without files:read
    with pytest.raises(ChannelError) as caught:
        await channel.download(inbound_file(png), 1_000_000)
    assert caught.value.permanent
    assert "files:read" in str(caught.value)
    assert fake.downloads_of(png) == 1


async def test_a_gone_file_is_a_permanent_error(fake: FakeSlack, channel: SlackChannel) -> None:
    png = fake.add_file(tiny_png(), "shot.png", "image/png")
    del fake.files[png["id"]]
    with pytest.raises(ChannelError) as caught:
        await channel.download(inbound_file(png), 1_000_000)
    assert caught.value.permanent
    assert "404" in str(caught.value)


# -- files out ------------------------------------------------------------------------------------
async def test_upload_shares_the_file_with_its_caption_in_the_thread(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(tiny_pdf("weekly"))
    thread = "1700000000.000100"
    sent = await channel.send(file_part(path, "Here is *the* report", thread=thread))
    [upload] = fake.uploads
    assert (upload.channel, upload.thread_ts, upload.name) == (CHANNEL, thread, "report.pdf")
    assert upload.data == path.read_bytes()
    assert upload.initial_comment == "Here is *the* report"
    assert sent.message_id == upload.ts
    [message] = fake.posted[CHANNEL]
    assert message.ts == upload.ts
    assert message.thread_ts == thread
    assert [f["id"] for f in message.files or []] == [upload.file_id]
    # The upload URL never got the token (it needs none).
    assert [c.method for c in fake.calls if c.method.startswith("files.")] == [
        "files.getUploadURLExternal",
        "files.completeUploadExternal",
    ]
    assert fake.upload_posts == 1
    assert channel.status().counters["uploads"] == 1


async def test_upload_without_a_caption_or_a_share_ts_answers_the_file_id(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    fake.upload_shares_in_answer = False
    path = tmp_path / "notes.txt"
    path.write_text("notes\n")
    sent = await channel.send(file_part(path, ""))
    [upload] = fake.uploads
    assert upload.initial_comment is None
    assert upload.thread_ts is None
    assert sent.message_id == upload.file_id


async def test_429_on_an_upload_step_is_a_rate_limit_and_nothing_is_shared(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(tiny_pdf())
    part = file_part(path, "caption")
    for method in ("files.getUploadURLExternal", "files.completeUploadExternal", "upload"):
        fake.fail(method, status=429, error="ratelimited", retry_after=7)
        with pytest.raises(ChannelError) as caught:
            await channel.send(part)
        assert caught.value.retry_after == 7, method
        assert not isinstance(caught.value, SendUnknown)
        assert not caught.value.permanent
        assert fake.uploads == []
    await channel.send(part)
    assert len(fake.uploads) == 1


async def test_upload_errors_before_the_share_are_never_unknown(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(tiny_pdf())
    part = file_part(path, "")
    fake.fail("upload", status=503)
    with pytest.raises(ChannelError) as caught:
        await channel.send(part)
    assert not isinstance(caught.value, SendUnknown)
    assert not caught.value.permanent
    fake.fail("files.getUploadURLExternal", delay=2.0)  # past the 1 s request timeout
    with pytest.raises(ChannelError) as caught:
        await channel.send(part)
    assert not isinstance(caught.value, SendUnknown)
    assert not caught.value.permanent
    fake.fail("files.completeUploadExternal", error="channel_not_found")
    with pytest.raises(ChannelError) as caught:
        await channel.send(part)
    assert caught.value.permanent
    assert fake.uploads == []


async def test_a_timeout_on_the_share_is_unknown_and_cannot_be_looked_up(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(tiny_pdf())
    part = file_part(path, "")
    fake.fail("files.completeUploadExternal", delay=2.0)
    with pytest.raises(SendUnknown):
        await channel.send(part)
    with pytest.raises(NotImplementedError):
        await channel.find_sent(part)


async def test_a_missing_file_is_a_permanent_error(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "gone.pdf"
    path.write_bytes(b"%PDF")
    part = file_part(path, "")
    path.unlink()
    with pytest.raises(ChannelError) as caught:
        await channel.send(part)
    assert caught.value.permanent
    assert fake.calls_to("files.getUploadURLExternal") == []


# -- voice notes and spoken answers --------------------------------------------------------------
VOICE_OGG = b"OggS\x00\x02" + bytes(range(256)) * 8


async def test_a_voice_clip_arrives_over_socket_mode_and_downloads_whole(
    fake: FakeSlack, channel: SlackChannel, sink: Sink
) -> None:
    clip = fake.add_audio_clip(VOICE_OGG, 3200)
    memo = fake.add_file(VOICE_OGG, "memo.mp3", "audio/mpeg")
    png = fake.add_file(tiny_png(), "shot.png", "image/png")
    event = fake.file_message_event(CHANNEL, ALICE, "", [clip, memo, png])
    envelope = await fake.push_event(event, event_id="Ev0VOICE")
    await fake.wait_for_ack(envelope)
    [got] = await sink.wait_for(1)
    assert got.text == ""
    assert got.files == (
        InboundFile(
            clip["url_private_download"],
            "audio_message.webm",
            "audio/webm",
            len(VOICE_OGG),
            duration=3.2,
            voice=True,
        ),
        InboundFile(memo["url_private_download"], "memo.mp3", "audio/mpeg", len(VOICE_OGG)),
        InboundFile(png["url_private_download"], "shot.png", "image/png", len(tiny_png())),
    )
    assert sum(fake.downloads.values()) == 0  # announced, not fetched
    assert await channel.download(got.files[0], 1_000_000) == VOICE_OGG
    assert [(r.file_id, r.token) for r in fake.file_requests] == [(clip["id"], fake.bot_token)]


async def test_a_voice_answer_is_uploaded_as_an_audio_file(
    fake: FakeSlack, channel: SlackChannel, tmp_path: Path
) -> None:
    path = tmp_path / "answer.ogg"
    path.write_bytes(VOICE_OGG)
    file = OutboundFile(path, "answer.ogg", "audio/ogg", len(VOICE_OGG), voice=True)
    thread = "1700000000.000100"
    part = OutboundPart(Destination("slack", CHANNEL, thread=thread), "", "gb-voice-1", file=file)
    sent = await channel.send(part)
    [upload] = fake.uploads
    assert (upload.name, upload.size, upload.data) == ("answer.ogg", len(VOICE_OGG), VOICE_OGG)
    assert (upload.filetype, upload.mimetype) == ("ogg", "audio/ogg")
    assert (upload.channel, upload.thread_ts, upload.initial_comment) == (CHANNEL, thread, None)
    assert sent.message_id == upload.ts
    [message] = fake.posted[CHANNEL]
    assert [(f["name"], f["mimetype"]) for f in message.files or []] == [
        ("answer.ogg", "audio/ogg")
    ]
    assert [c.method for c in fake.calls if c.method.startswith("files.")] == [
        "files.getUploadURLExternal",
        "files.completeUploadExternal",
    ]
    [ticket] = fake.calls_to("files.getUploadURLExternal")
    assert ticket.args["filename"] == "answer.ogg"
    assert channel.status().counters["uploads"] == 1
