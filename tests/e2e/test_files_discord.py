"""Files in and out on Discord, through ``geodebot serve``: the real daemon process,
discord.py against the fake Discord (REST, gateway and its CDN for attachments), the
anthropic SDK against the fake model server.

One daemon serves every test of this file; each test talks in a channel and session of its
own (FILE_CHANNELS in tests/support/chat_e2e_discord.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.support.chat_e2e_discord import (
    ALICE,
    FILE_CHANNELS,
    MAX_ATTACHMENT_MB,
    SEND_FILE,
    TOKEN,
    ChatWorld,
    FilesGuild,
    tool_results,
    user_blocks,
)
from tests.support.config import TEST_KEY
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.discord_server import Json
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.files import b64, tiny_pdf, tiny_png

pytestmark = pytest.mark.asyncio(loop_scope="module")

MB = 1000 * 1000


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    tmp = tmp_path_factory.mktemp("files-discord")
    async with FilesGuild(token=TOKEN) as discord, FakeLLMServer() as llm:
        world = ChatWorld.create_files(tmp, discord, llm)
        await world.start()
        try:
            yield world
        finally:
            code = await world.daemon.stop()
            text = world.daemon.text()
            assert code == 0, text[-3000:]
            assert "Traceback" not in text
            assert TOKEN not in text
            assert TEST_KEY not in text
            # Attachment URLs are signed: the CDN never saw the bot's token, nor any other.
            assert set(discord.cdn_authorization) <= {None}


async def settled(world: ChatWorld, channel: str, answer: str) -> list[str]:
    """The texts of the bot's messages in ``channel`` once ``answer`` is among them and a
    control message after it was answered too (so nothing more is still to come)."""
    await world.until(
        lambda: any(m["content"] == answer for m in world.answers(channel)),
        f"the answer in {channel}",
    )
    await world.control(channel)
    texts = [str(m["content"]) for m in world.answers(channel)]
    assert texts[-1] == CONTROL_ANSWER
    return texts[:-1]


def blocks_of(world: ChatWorld, prompt: str) -> list[Json]:
    """The user message's blocks in the first model request of the turn for ``prompt``."""
    requests = world.requests_for(prompt)
    assert requests, f"no model request carries {prompt!r}"
    return user_blocks(requests[0], prompt)


async def test_an_image_and_a_pdf_reach_the_model_as_blocks(world: ChatWorld) -> None:
    channel, discord = FILE_CHANNELS["files-in"], world.discord
    png, pdf = tiny_png(0x11), tiny_pdf("quarterly numbers")
    shot = discord.attachment(channel, "shot.png", png)
    report = discord.attachment(channel, "report.pdf", pdf)
    prompt = world.model.add("what do these two show?", Reply("a grey pixel and a report"))
    discord.push_message(channel, prompt, author_id=ALICE, attachments=[shot, report])

    assert await settled(world, channel, "a grey pixel and a report") == [
        "a grey pixel and a report"
    ]
    blocks = blocks_of(world, prompt)
    assert blocks[0] == {"type": "text", "text": prompt}  # the caption first, then the files
    image = {"type": "base64", "media_type": "image/png", "data": b64(png)}
    document = {"type": "base64", "media_type": "application/pdf", "data": b64(pdf)}
    assert [b["source"] for b in blocks if b["type"] == "image"] == [image]
    assert [b["source"] for b in blocks if b["type"] == "document"] == [document]
    assert (discord.downloads[shot["id"]], discord.downloads[report["id"]]) == (1, 1)
    assert discord.cdn_authorization == [None, None]  # signed URLs: no token sent


async def test_an_oversized_attachment_is_refused_unread_and_the_text_still_runs(
    world: ChatWorld,
) -> None:
    channel, discord = FILE_CHANNELS["oversize"], world.discord
    # Discord declares 25 MB; the fake needs no such body, as nothing may fetch it.
    big = discord.attachment(channel, "big.pdf", tiny_pdf("big"), size=25 * MB)
    prompt = world.model.add("here is the big dump, and: what time is it?", Reply("noon"))
    discord.push_message(channel, prompt, author_id=ALICE, attachments=[big])

    texts = await settled(world, channel, "noon")
    [refusal] = [t for t in texts if "big.pdf" in t]
    assert "passed on" in refusal
    assert f"limit of {MAX_ATTACHMENT_MB} MB" in refusal
    assert sorted(texts) == sorted([refusal, "noon"])  # one refusal, one answer
    assert discord.downloads[big["id"]] == 0
    blocks = blocks_of(world, prompt)
    assert not [b for b in blocks if b["type"] in ("image", "document")]
    assert [b for b in blocks if b["type"] == "text" and "big.pdf" in b["text"]]


async def test_send_file_uploads_a_workspace_file_once_before_the_answer(
    world: ChatWorld,
) -> None:
    channel, discord = FILE_CHANNELS["send-file"], world.discord
    data = tiny_pdf("sent by the agent")
    (world.workspace / "out").mkdir()
    (world.workspace / "out" / "summary.pdf").write_bytes(data)
    call = Call(SEND_FILE, {"path": "out/summary.pdf", "caption": "the summary"}, id="toolu_f1")
    prompt = world.model.add("send me the summary", Reply(tool_calls=[call]), Reply("sent it"))
    discord.push_message(channel, prompt, author_id=ALICE)

    await settled(world, channel, "sent it")
    [upload] = [u for u in discord.uploads if u.channel_id == channel]
    assert (upload.name, upload.data, upload.content) == ("summary.pdf", data, "the summary")
    # The file came before the answer's final text (a streamed preview may be older).
    [answer] = [m for m in world.answers(channel) if m["content"] == "sent it"]
    final_at = next(r.at for r in discord.revisions[answer["id"]] if r.text == "sent it")
    assert discord.revisions[upload.message_id][0].at < final_at
    [result] = tool_results(world.requests_for(prompt)[-1])
    assert "summary.pdf" in result
    assert "error" not in result.lower()
