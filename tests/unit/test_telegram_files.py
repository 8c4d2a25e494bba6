"""Files in and out of Telegram: the adapter through python-telegram-bot against the fake Bot
API (getFile, the file URL under file_base_url, sendPhoto and sendDocument as multipart)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from geodebot.channels.base import (
    TELEGRAM_PHOTO_LIMIT,
    ChannelError,
    Destination,
    FileTooLarge,
    Inbound,
    InboundFile,
    Lookups,
    OutboundFile,
    OutboundPart,
    SendUnknown,
)
from geodebot.channels.telegram import TelegramChannel
from geodebot.config.schema import TelegramConfig
from geodebot.logs.redact import MASK, Redactor
from tests.support.fakes.telegram_server import FakeTelegram, StoredFile, html_visible
from tests.support.files import tiny_pdf, tiny_png

GROUP = -1002468
KB = 1024


class Inbox:
    """The sink: keeps every Inbound it is handed."""

    def __init__(self) -> None:
        self.items: list[Inbound] = []
        self._changed = asyncio.Event()

    async def __call__(self, inbound: Inbound) -> None:
        self.items.append(inbound)
        self._changed.set()

    async def wait(self, n: int, within: float = 5.0) -> dict[str, Inbound]:
        async with asyncio.timeout(within):
            while len(self.items) < n:
                self._changed.clear()
                await self._changed.wait()
        return {i.event_id: i for i in self.items}


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def channel(fake: FakeTelegram) -> AsyncIterator[TelegramChannel]:
    """Not started: downloads and sends need no polling."""
    config = TelegramConfig(
        api_base_url=fake.api_base_url, file_base_url=fake.file_base_url, poll_timeout_s=1
    )
    channel = TelegramChannel(config, fake.token)
    yield channel
    await channel.stop()


def inbound_file(stored: StoredFile, size: int = 0) -> InboundFile:
    return InboundFile(stored.file_id, "f.bin", "application/octet-stream", size)


def file_part(
    path: Path, media_type: str, caption: str = "", *, size: int | None = None, **dest: str
) -> OutboundPart:
    file = OutboundFile(path, path.name, media_type, path.stat().st_size if size is None else size)
    return OutboundPart(
        Destination("telegram", str(GROUP), **dest), caption, key="gb-7-0", file=file
    )


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# -- in -------------------------------------------------------------------------------------


async def test_photos_and_documents_arrive_as_files_with_their_captions(fake: FakeTelegram):
    inbox = Inbox()
    channel = TelegramChannel(TelegramConfig(api_base_url=fake.api_base_url), fake.token)
    await channel.start(inbox)
    try:
        pdf = tiny_pdf("report")
        pushes = [
            fake.push_file(
                GROUP,
                pdf,
                user_id=42,
                name="report.pdf",
                mime_type="application/pdf",
                caption="read this @geode_test_bot",
            ),
            fake.push_file(GROUP, tiny_png(), user_id=42, photo=True),
            fake.push_file(GROUP, b"x" * 10, user_id=42, name="", mime_type="", hide_size=True),
            fake.push_message(GROUP, "just text", user_id=42),
        ]
        video = {"file_id": "vid1", "file_unique_id": "uv1", "width": 4, "height": 4}
        video.update(duration=1, mime_type="video/mp4", file_size=4096)
        sticker = {"file_id": "st1", "file_unique_id": "us1", "width": 4, "height": 4}
        sticker.update(type="regular", is_animated=False, is_video=False)
        sender = {"id": 42, "is_bot": False, "first_name": "Test"}
        chat = {"id": GROUP, "type": "group", "title": "files"}
        for n, media in enumerate(({"video": video}, {"sticker": sticker})):
            message = {"message_id": 900 + n, "date": 1, "chat": chat, "from": sender, **media}
            pushes.append(fake.push_update({"message": message}))
        got = await inbox.wait(5)
        await fake.wait_for_confirmed(pushes[-1] + 1)
        assert len(inbox.items) == 5  # the sticker has neither text nor a file: skipped
        document, photo, bare, text, clip = (got[str(u)] for u in pushes[:5])

        stored = fake.pushed_files[pushes[0]]
        assert document.files == (
            InboundFile(stored.file_id, "report.pdf", "application/pdf", len(pdf)),
        )
        assert (document.text, document.mentions_bot) == ("read this @geode_test_bot", True)

        big = fake.pushed_files[pushes[1]]  # Telegram lists the sizes smallest first
        name = f"photo-{big.file_unique_id}.jpg"
        assert photo.files == (InboundFile(big.file_id, name, "image/jpeg", len(tiny_png())),)
        assert photo.text == ""

        bare_id = fake.pushed_files[pushes[2]].file_id
        assert bare.files == (InboundFile(bare_id, "document", "", 0),)
        assert (text.files, text.text) == ((), "just text")
        assert clip.files == (InboundFile("vid1", "video-uv1.mp4", "video/mp4", 4096),)
        assert sum(fake.downloads.values()) == 0  # nothing is fetched on the way in
        assert fake.count("getFile") == 0
    finally:
        await channel.stop()


# -- downloads ------------------------------------------------------------------------------


async def test_a_download_returns_the_bytes_fetched_under_the_file_url(
    fake: FakeTelegram, channel: TelegramChannel, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    png = tiny_png(0x33)
    fake.push_file(GROUP, png, user_id=42, photo=True)
    [photo] = [f for f in fake.files.values() if f.data == png]
    assert await channel.download(inbound_file(photo, len(png)), 1000 * KB) == png
    assert fake.downloads[photo.file_id] == 1
    assert [p["file_id"] for m, p in fake.requests if m == "getfile"] == [photo.file_id]
    assert channel.status().counters["downloads"] == 1
    assert fake.token not in caplog.text


async def test_a_size_announced_over_the_limit_is_never_fetched(
    fake: FakeTelegram, channel: TelegramChannel
):
    fake.push_file(GROUP, b"%PDF-1.4 small bytes", user_id=42, size=5 * 1000 * 1000)
    [stored] = fake.pushed_files.values()
    # Announced by the message: not even getFile is asked.
    with pytest.raises(FileTooLarge) as by_message:
        await channel.download(inbound_file(stored, 5 * 1000 * 1000), 1000 * KB)
    assert (by_message.value.limit, by_message.value.size) == (1000 * KB, 5 * 1000 * 1000)
    assert fake.count("getFile") == 0
    # Announced by getFile (the message said nothing): refused before the fetch.
    with pytest.raises(FileTooLarge) as by_get_file:
        await channel.download(inbound_file(stored), 1000 * KB)
    assert by_get_file.value.size == 5 * 1000 * 1000
    assert fake.count("getFile") == 1
    assert fake.downloads[stored.file_id] == 0


async def test_over_the_bot_apis_20_mb_is_a_permanent_refusal(
    fake: FakeTelegram, channel: TelegramChannel
):
    fake.push_file(GROUP, b"tiny", user_id=42, size=25 * 1000 * 1000)
    [stored] = fake.pushed_files.values()
    with pytest.raises(ChannelError) as caught:
        await channel.download(inbound_file(stored), 100 * 1000 * 1000)
    assert caught.value.permanent
    assert "20 MB" in str(caught.value)
    assert fake.downloads[stored.file_id] == 0


@pytest.mark.parametrize("chunked", [True, False], ids=["streamed", "content-length"])
async def test_more_bytes_than_allowed_stop_the_download(
    fake: FakeTelegram, channel: TelegramChannel, chunked: bool
):
    # Telegram declared no size; the bytes tell (Content-Length, or as they arrive).
    data = bytes(range(256)) * (2 * KB)  # 512 KiB
    fake.push_file(GROUP, data, user_id=42, hide_size=True, chunked=chunked)
    [stored] = fake.pushed_files.values()
    with pytest.raises(FileTooLarge) as caught:
        await channel.download(inbound_file(stored), 100 * KB)
    assert caught.value.limit == 100 * KB
    assert fake.downloads[stored.file_id] == 1
    # The connection is still good for the next file.
    fake.push_file(GROUP, b"after", user_id=42, chunked=chunked)
    after = fake.pushed_files[max(fake.pushed_files)]
    assert await channel.download(inbound_file(after), 100 * KB) == b"after"


async def test_a_file_gone_is_a_permanent_error(fake: FakeTelegram, channel: TelegramChannel):
    fake.push_file(GROUP, b"soon gone", user_id=42)
    [stored] = fake.pushed_files.values()
    fake.forget_file(stored.file_id)
    with pytest.raises(ChannelError) as by_get_file:
        await channel.download(inbound_file(stored), 100 * KB)
    assert by_get_file.value.permanent
    assert "temporarily unavailable" in str(by_get_file.value)
    # getFile gave a path, but the file server no longer has it.
    fake.answer_next("getFile", {"file_id": stored.file_id, "file_path": "documents/nope"})
    with pytest.raises(ChannelError) as by_url:
        await channel.download(inbound_file(stored), 100 * KB)
    assert by_url.value.permanent
    assert "404" in str(by_url.value)
    assert fake.token not in str(by_get_file.value) + str(by_url.value)


@pytest.mark.parametrize("path", ["/var/lib/telegram-bot-api/x.pdf", "documents/../../botX"])
async def test_a_path_that_leaves_the_file_url_is_refused_unfetched(
    fake: FakeTelegram, channel: TelegramChannel, path: str
):
    fake.push_file(GROUP, b"bytes", user_id=42)
    [stored] = fake.pushed_files.values()
    fake.answer_next("getFile", {"file_id": stored.file_id, "file_path": path})
    with pytest.raises(ChannelError) as caught:
        await channel.download(inbound_file(stored), 100 * KB)
    assert caught.value.permanent
    assert sum(fake.downloads.values()) == 0


async def test_a_rate_limited_get_file_says_when_to_retry(
    fake: FakeTelegram, channel: TelegramChannel
):
    fake.push_file(GROUP, b"bytes", user_id=42)
    [stored] = fake.pushed_files.values()
    fake.fail_next("getFile", 429, "Too Many Requests: retry after 4", 4)
    with pytest.raises(ChannelError) as caught:
        await channel.download(inbound_file(stored), 100 * KB)
    assert (caught.value.retry_after, caught.value.permanent) == (4, False)


def test_file_urls_are_redacted_by_their_shape():
    token = "7000009876:AAHsecret-token_for-redaction-0123456789"
    url = f"https://api.telegram.org/file/bot{token}/documents/file_3.pdf"
    redacted = Redactor().redact(f"GET {url} failed")
    assert token not in redacted
    assert f"/file/bot{MASK}/documents/file_3.pdf" in redacted


# -- uploads --------------------------------------------------------------------------------


async def test_an_image_goes_as_a_photo_replying_in_its_topic(
    fake: FakeTelegram, channel: TelegramChannel, tmp_path: Path
):
    question = fake.push_message(GROUP, "draw it", user_id=42, chat_type="supergroup", thread_id=9)
    asked = int(fake.pushed[question]["message"]["message_id"])
    png = tiny_png(0x10)
    part = file_part(
        write(tmp_path, "chart.png", png),
        "image/png",
        "<b>the</b> chart",
        thread="9",
        reply_to=str(asked),
    )
    sent = await channel.send(part)
    [upload] = fake.uploads_to(GROUP)
    assert (upload.kind, upload.name, upload.data) == ("photo", "chart.png", png)
    assert (upload.caption, upload.parse_mode) == ("<b>the</b> chart", "HTML")
    assert (upload.reply_to_message_id, upload.thread_id) == (asked, 9)
    assert sent.message_id == str(upload.message_id)
    assert fake.shown(GROUP, upload.message_id).upload == upload
    assert channel.status().counters["uploads"] == 1


@pytest.mark.parametrize(
    ("name", "media_type", "size"),
    [
        ("report.pdf", "application/pdf", None),
        ("anim.gif", "image/gif", None),  # not a type sendPhoto takes
        ("huge.png", "image/png", TELEGRAM_PHOTO_LIMIT + 1),  # over the photo limit
    ],
)
async def test_anything_else_goes_as_a_document_under_its_name(
    fake: FakeTelegram,
    channel: TelegramChannel,
    tmp_path: Path,
    name: str,
    media_type: str,
    size: int | None,
):
    data = tiny_pdf("out") if name.endswith(".pdf") else tiny_png(0x20)
    await channel.send(file_part(write(tmp_path, name, data), media_type, size=size))
    [upload] = fake.uploads_to(GROUP)
    assert (upload.kind, upload.name, upload.data) == ("document", name, data)
    assert (upload.caption, upload.content_type) == ("", media_type)
    assert fake.count("sendPhoto") == 0


async def test_an_image_telegram_refuses_as_a_photo_goes_once_as_a_document(
    fake: FakeTelegram, channel: TelegramChannel, tmp_path: Path
):
    path = write(tmp_path, "fake.png", b"not really a png")
    await channel.send(file_part(path, "image/png", "see"))
    assert fake.count("sendPhoto") == 1
    [upload] = fake.uploads_to(GROUP)
    assert (upload.kind, upload.data, upload.caption) == ("document", b"not really a png", "see")


async def test_a_caption_is_sent_plain_when_refused_as_html_or_too_long(
    fake: FakeTelegram, channel: TelegramChannel, tmp_path: Path
):
    path = write(tmp_path, "a.pdf", tiny_pdf())
    await channel.send(file_part(path, "application/pdf", "1 <b>2 & 3</b>"))
    await channel.send(file_part(path, "application/pdf", "<i>" + "word " * 400 + "</i>"))
    broken, long = fake.uploads_to(GROUP)
    assert (broken.caption, broken.parse_mode) == ("1 2 & 3", None)
    assert long.parse_mode is None
    assert len(long.caption) == 1024
    assert long.caption.endswith("\u2026")
    assert html_visible(long.caption.removesuffix("\u2026")).startswith("word word")
    assert channel.status().counters["plain_fallbacks"] == 1


async def test_a_rate_limited_upload_is_retried_later_and_arrives_once(
    fake: FakeTelegram, channel: TelegramChannel, tmp_path: Path
):
    part = file_part(write(tmp_path, "r.pdf", tiny_pdf("r")), "application/pdf", "report")
    fake.fail_next("sendDocument", 429, "Too Many Requests: retry after 7", 7)
    with pytest.raises(ChannelError) as caught:
        await channel.send(part)
    assert type(caught.value) is ChannelError
    assert (caught.value.retry_after, caught.value.permanent) == (7, False)
    assert fake.uploads_to(GROUP) == []
    await channel.send(part)
    [upload] = fake.uploads_to(GROUP)
    assert upload.data == tiny_pdf("r")


async def test_upload_failures_map_like_text_sends(
    fake: FakeTelegram, channel: TelegramChannel, tmp_path: Path
):
    path = write(tmp_path, "r.pdf", tiny_pdf())
    fake.fail_next("sendDocument", 403, "Forbidden: bot was kicked from the group chat")
    with pytest.raises(ChannelError) as kicked:
        await channel.send(file_part(path, "application/pdf"))
    assert kicked.value.permanent
    fake.fail_next("sendDocument", 500, "Internal Server Error")
    with pytest.raises(ChannelError) as failed:
        await channel.send(file_part(path, "application/pdf"))
    assert not failed.value.permanent
    assert not isinstance(failed.value, SendUnknown)
    missing = file_part(path, "application/pdf")
    path.unlink()
    with pytest.raises(ChannelError) as gone:
        await channel.send(missing)
    assert gone.value.permanent
    assert fake.uploads_to(GROUP) == []


async def test_a_file_part_cannot_be_looked_up(channel: TelegramChannel, tmp_path: Path):
    assert not isinstance(channel, Lookups)
