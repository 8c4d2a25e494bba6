"""Files in and out on the Discord adapter: attachments as Inbound files, downloads from the
(fake) CDN with a cap and without a token, uploads as one multipart message create; against
FakeDiscord with the real discord.py in between."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from geodebot.channels.base import (
    ChannelError,
    Destination,
    FileTooLarge,
    InboundFile,
    OutboundFile,
    OutboundPart,
    SendUnknown,
)
from geodebot.channels.discord import DiscordChannel
from geodebot.channels.discord.send import nonce_for
from tests.support.fakes.discord_server import FakeDiscord
from tests.support.files import tiny_pdf, tiny_png
from tests.unit.test_discord_channel import TOKEN, USER, Cursors, Sink, make_channel, until

MB = 1000 * 1000


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as server:
        yield server


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


@pytest.fixture
async def elsewhere() -> AsyncIterator[tuple[str, list[str]]]:
    """A server that is not Discord's (another port on 127.0.0.1): its root URL and the
    paths it was asked for."""
    asked: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(body=b"not from discord")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


async def received(
    fake: FakeDiscord, sink: Sink, attachments: list[dict[str, object]]
) -> InboundFile:
    """The one file of a message carrying ``attachments[0]``, as the adapter delivered it."""
    mid = fake.push_message(fake.channel_id, "", author_id=USER, attachments=attachments)
    await until(lambda: mid in sink.ids())
    [inbound] = [i for i in sink.got if i.event_id == mid]
    return inbound.files[0]


def upload_part(
    fake: FakeDiscord, path: Path, caption: str = "", key: str = "gb-f-0", **dest: str
) -> OutboundPart:
    file = OutboundFile(path, path.name, "application/octet-stream", path.stat().st_size)
    return OutboundPart(Destination("discord", fake.channel_id, **dest), caption, key, file=file)


async def test_attachments_arrive_as_files_and_nothing_is_downloaded(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    png = fake.attachment(fake.channel_id, "shot.png", tiny_png())
    pdf = fake.attachment(fake.channel_id, "report.pdf", tiny_pdf(), size=25 * MB)
    odd = fake.attachment(fake.channel_id, "blob", b"\x00\x01", content_type="")
    captioned = fake.push_message(
        fake.channel_id, "what is this?", author_id=USER, attachments=[png, pdf]
    )
    bare = fake.push_message(fake.channel_id, "", author_id=USER, attachments=[odd])
    plain = fake.push_message(fake.channel_id, "no files", author_id=USER)
    await until(lambda: len(sink.got) == 3)
    by_id = {i.event_id: i for i in sink.got}

    assert by_id[captioned].text == "what is this?"
    assert by_id[captioned].files == (
        InboundFile(str(png["url"]), "shot.png", "image/png", len(tiny_png())),
        InboundFile(str(pdf["url"]), "report.pdf", "application/pdf", 25 * MB),
    )
    assert (by_id[bare].text, by_id[bare].files) == (
        "",
        (InboundFile(str(odd["url"]), "blob", "", 2),),
    )
    assert by_id[plain].files == ()
    assert not fake.downloads  # the inbox commit never waits for a file


async def test_catch_up_after_restart_carries_the_attachments(
    fake: FakeDiscord, sink: Sink
) -> None:
    cursors = Cursors()
    channel = make_channel(fake, cursors)
    await channel.start(sink)
    seen = fake.push_message(fake.channel_id, "before", author_id=USER)
    await until(lambda: cursors.values.get(f"discord:last:{fake.channel_id}") == seen)
    await channel.stop()

    png = fake.attachment(fake.channel_id, "while-down.png", tiny_png(7))
    missed = fake.push_message(fake.channel_id, "look", author_id=USER, attachments=[png])
    again = make_channel(fake, cursors)
    await again.start(sink)
    try:
        await until(lambda: missed in sink.ids())
        [inbound] = [i for i in sink.got if i.event_id == missed]
        assert inbound.files == (
            InboundFile(str(png["url"]), "while-down.png", "image/png", len(tiny_png(7))),
        )
        assert await again.download(inbound.files[0], MB) == tiny_png(7)
    finally:
        await again.stop()


async def test_download_fetches_the_signed_url_without_the_token(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    pdf = fake.attachment(fake.channel_id, "report.pdf", tiny_pdf("q3"))
    file = await received(fake, sink, [pdf])
    assert await chan.download(file, MB) == tiny_pdf("q3")
    # The media proxy's URL is Discord's too, and streamed bodies are read whole.
    chunked = fake.attachment(fake.channel_id, "big.txt", b"x" * 100_000, chunked=True)
    proxied = InboundFile(str(chunked["proxy_url"]), "big.txt", "text/plain", 100_000)
    assert await chan.download(proxied, MB) == b"x" * 100_000
    assert fake.downloads == {pdf["id"]: 1, chunked["id"]: 1}
    assert fake.cdn_authorization == [None, None]  # a signed URL needs no token: none is sent
    assert chan.status().counters["downloaded"] == 2


async def test_a_file_announced_too_large_is_never_fetched(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink
) -> None:
    big = fake.attachment(fake.channel_id, "big.pdf", tiny_pdf(), size=25 * MB)
    file = await received(fake, sink, [big])
    with pytest.raises(FileTooLarge) as declared:
        await chan.download(file, 20 * MB)
    assert (declared.value.limit, declared.value.size) == (20 * MB, 25 * MB)
    assert fake.downloads[big["id"]] == 0


async def test_content_length_over_the_cap_stops_before_the_body(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    data = b"y" * 5000
    unsized = fake.attachment(fake.channel_id, "notes.txt", data, size=0)  # size not declared
    file = InboundFile(str(unsized["url"]), "notes.txt", "text/plain", 0)
    with pytest.raises(FileTooLarge) as announced:
        await chan.download(file, 1000)
    assert (announced.value.limit, announced.value.size) == (1000, 5000)  # the header's word


async def test_a_body_over_the_cap_stops_while_reading(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    data = b"z" * 200_000
    streamed = fake.attachment(fake.channel_id, "dump.log", data, size=10, chunked=True)
    # The declared size lies and no Content-Length comes: only the bytes tell.
    file = InboundFile(str(streamed["url"]), "dump.log", "text/plain", 10)
    with pytest.raises(FileTooLarge) as read:
        await chan.download(file, 50_000)
    assert (read.value.limit, read.value.size) == (50_000, None)
    assert fake.downloads[streamed["id"]] == 1
    assert await chan.download(file, 200_000) == data  # at the cap exactly: whole


async def test_foreign_hosts_are_refused_without_a_request(
    fake: FakeDiscord, chan: DiscordChannel, elsewhere: tuple[str, list[str]]
) -> None:
    root, asked = elsewhere
    real = fake.attachment(fake.channel_id, "a.png", tiny_png())
    path_and_query = str(real["url"])[len(fake.cdn_url) :]
    refs = [
        root + path_and_query,  # same host, another port
        "https://cdn.discordapp.com.evil.example" + path_and_query,
        "http://cdn.discordapp.com" + path_and_query,  # not https
        "https://cdn.discordapp.com:8443" + path_and_query,
        "https://user:pw@cdn.discordapp.com" + path_and_query,
        fake.cdn_url.replace("http://", "https://") + path_and_query,  # another scheme
        "file:///etc/passwd",
        "not a url",
    ]
    for ref in refs:
        with pytest.raises(ChannelError) as refused:
            await chan.download(InboundFile(ref, "a.png", "image/png", 10), MB)
        assert refused.value.permanent, ref
        assert not isinstance(refused.value, FileTooLarge)
    assert asked == []
    assert not fake.downloads
    assert fake.cdn_authorization == []


async def test_an_expired_or_forged_url_is_a_permanent_error(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    real = fake.attachment(fake.channel_id, "a.png", tiny_png())
    forged = str(real["url"]).replace("hm=", "hm=0")
    with pytest.raises(ChannelError) as gone:
        await chan.download(InboundFile(forged, "a.png", "image/png", 10), MB)
    assert gone.value.permanent
    assert "404" in str(gone.value)
    assert "hm=" not in str(gone.value)  # the signed URL stays out of errors and logs


async def test_upload_with_caption_replies_once_under_its_nonce(
    fake: FakeDiscord, chan: DiscordChannel, tmp_path: Path
) -> None:
    asked = fake.push_message(fake.channel_id, "send me the report", author_id=USER)
    path = tmp_path / "report.pdf"
    path.write_bytes(tiny_pdf("report"))
    part = upload_part(fake, path, "Here it is.", reply_to=asked)
    sent = await chan.send(part)
    again = await chan.send(part)  # a resend inside Discord's window: the same message
    assert again == sent
    [upload] = fake.uploads
    assert (upload.channel_id, upload.message_id) == (fake.channel_id, sent.message_id)
    assert (upload.name, upload.data, upload.content) == (
        "report.pdf",
        path.read_bytes(),
        "Here it is.",
    )
    assert upload.nonce == nonce_for(part.key)
    assert upload.reference is not None
    assert upload.reference["message_id"] == asked
    [posted] = fake.posted[fake.channel_id]
    assert posted["allowed_mentions"]["parse"] == []
    [attachment] = fake.message(sent.message_id)["attachments"]
    assert (attachment["filename"], attachment["size"]) == ("report.pdf", len(tiny_pdf("report")))


async def test_upload_without_caption_and_answering_a_slash_command(
    fake: FakeDiscord, chan: DiscordChannel, sink: Sink, tmp_path: Path
) -> None:
    path = tmp_path / "chart.png"
    path.write_bytes(tiny_png(3))
    iid = fake.push_interaction(fake.channel_id, "status", user_id=USER)
    await until(lambda: iid in sink.ids())
    await chan.send(upload_part(fake, path, reply_to=iid))
    [upload] = fake.uploads
    # No caption; no reference (an interaction is no message); its response left for the answer.
    assert (upload.content, upload.reference, upload.data) == (None, None, tiny_png(3))
    assert iid not in fake.interaction_replies


async def test_an_upload_whose_answer_was_lost_is_found_by_its_nonce(
    fake: FakeDiscord, chan: DiscordChannel, tmp_path: Path
) -> None:
    path = tmp_path / "out.txt"
    path.write_bytes(b"results\n")
    part = upload_part(fake, path, "done", key="gb-lost-0")
    fake.fail_next_post(0, created=True)  # created, but the answer never comes back
    with pytest.raises(SendUnknown):
        await chan.send(part)
    found = await chan.find_sent(part)
    [upload] = fake.uploads
    assert found is not None
    assert found.message_id == upload.message_id


async def test_a_rate_limited_upload_is_retried_whole(
    fake: FakeDiscord, chan: DiscordChannel, tmp_path: Path
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fake.fail_next_post(429, retry_after=0.2)  # with Via: discord.py waits and sends again
    await chan.send(upload_part(fake, path, "data", key="gb-429-0"))
    [upload] = fake.uploads
    assert upload.data == path.read_bytes()  # the file read again from its start


async def test_a_long_rate_limit_on_an_upload_goes_back_to_the_outbox(
    fake: FakeDiscord, chan: DiscordChannel, tmp_path: Path
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"later")
    fake.fail_next_post(429, retry_after=45)
    with pytest.raises(ChannelError) as limited:
        await chan.send(upload_part(fake, path, key="gb-429-1"))
    assert limited.value.retry_after == 45
    assert not limited.value.permanent
    assert fake.uploads == []


async def test_rejected_uploads_are_permanent(
    fake: FakeDiscord, chan: DiscordChannel, tmp_path: Path
) -> None:
    fake.upload_limit = 1000
    path = tmp_path / "big.bin"
    path.write_bytes(b"b" * 2000)
    with pytest.raises(ChannelError) as too_large:
        await chan.send(upload_part(fake, path, key="gb-big-0"))
    assert too_large.value.permanent
    assert "upload limit" in str(too_large.value)

    gone = upload_part(fake, path, key="gb-gone-0")
    path.unlink()
    with pytest.raises(ChannelError) as unreadable:
        await chan.send(gone)
    assert unreadable.value.permanent
    assert not isinstance(unreadable.value, SendUnknown)
    assert fake.uploads == []
    assert not fake.posted[fake.channel_id]
