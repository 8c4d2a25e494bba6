"""Files in and out through ``geodebot serve`` on Telegram: the real daemon process,
python-telegram-bot against the fake Bot API (getFile, the file URL, sendPhoto and
sendDocument), the anthropic SDK against the fake model server.

One daemon serves every test of this file, each test in a chat (and session) of its own. See
tests/support/chat_e2e_telegram.py for the world and its model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.chat_e2e_telegram import SEND_FILE, Chat, ChatWorld, FilesModel, serving
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram, html_visible
from tests.support.files import b64, tiny_pdf, tiny_png

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCKS, TOO_BIG, SEND = -5101, -5102, -5103
CHATS = (
    Chat(BLOCKS),
    Chat(TOO_BIG),
    # Not streamed: the final answer is then a message of its own, after the upload.
    Chat(SEND, stream=False, tools=(SEND_FILE,), keys=f'preapproved = ["{SEND_FILE}"]\n'),
)
MB = 1000 * 1000


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    async with FakeTelegram() as telegram, FakeLLMServer() as llm:
        root = tmp_path_factory.mktemp("files-telegram")
        world = ChatWorld(telegram, llm, root, CHATS, model=FilesModel())
        # The file URLs carry the token in their path: serving checks the log never does.
        async with serving(world):
            yield world


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: ChatWorld) -> ChatWorld:
    if not shared.running():
        await shared.start()
    return shared


@pytest.fixture
def model(world: ChatWorld) -> FilesModel:
    assert isinstance(world.model, FilesModel)
    return world.model


def of_type(blocks: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [b for b in blocks if b.get("type") == kind]


async def test_an_image_and_a_pdf_reach_the_model_as_blocks(
    world: ChatWorld, model: FilesModel
) -> None:
    png, pdf = tiny_png(0x41), tiny_pdf("quarterly numbers")
    model.script("what is on this picture?", Reply("A grey pixel."))
    model.script("summarise this report", Reply("Quarterly numbers."))
    image_update = world.send(BLOCKS, png, "what is on this picture?", photo=True)
    pdf_update = world.send(
        BLOCKS, pdf, "summarise this report", name="q3.pdf", mime_type="application/pdf"
    )
    await world.showing(BLOCKS, "Quarterly numbers.")
    await world.showing(BLOCKS, "A grey pixel.")

    image_blocks = model.blocks("what is on this picture?")
    assert image_blocks[0] == {"type": "text", "text": "what is on this picture?"}
    [image] = of_type(image_blocks, "image")
    assert image["source"] == {"type": "base64", "media_type": "image/png", "data": b64(png)}
    assert of_type(image_blocks, "document") == []

    pdf_blocks = model.blocks("summarise this report")
    assert pdf_blocks[0] == {"type": "text", "text": "summarise this report"}
    [document] = of_type(pdf_blocks, "document")
    assert document["source"] == {
        "type": "base64",
        "media_type": "application/pdf",
        "data": b64(pdf),
    }
    # Each file was fetched once, and neither got a refusal.
    photo, report = (world.telegram.pushed_files[u] for u in (image_update, pdf_update))
    downloads = world.telegram.downloads
    assert (downloads[photo.file_id], downloads[report.file_id]) == (1, 1)
    messages = await world.control(BLOCKS)
    assert not [m for m in messages if "passed on" in html_visible(m.text)]


async def test_an_oversized_document_is_refused_unfetched_and_its_caption_answered(
    world: ChatWorld, model: FilesModel
) -> None:
    model.script("can you read the dump?", Reply("I could not open that one."))
    # Telegram declares 25 MB; the binding takes 20 (max_attachment_mb's default).
    update = world.send(
        TOO_BIG,
        b"%PDF-1.4 not really 25 MB",
        "can you read the dump?",
        name="core.dump.pdf",
        mime_type="application/pdf",
        size=25 * MB,
    )
    notice = await world.showing(TOO_BIG, "core.dump.pdf", part=True)
    await world.showing(TOO_BIG, "I could not open that one.")
    refused = html_visible(notice.text)
    assert refused.startswith("Not everything you sent was passed on")
    assert "limit" in refused
    stored = world.telegram.pushed_files[update]
    assert world.telegram.downloads[stored.file_id] == 0
    assert world.telegram.count("getFile") == sum(world.telegram.downloads.values())
    # The model heard of the file, by name, without its bytes.
    blocks = model.blocks("can you read the dump?")
    assert of_type(blocks, "document") == []
    assert any("core.dump.pdf" in b["text"] for b in of_type(blocks, "text"))
    messages = await world.control(TOO_BIG)
    assert len([m for m in messages if "core.dump.pdf" in m.text]) == 1  # one notice
    assert world.telegram.downloads[stored.file_id] == 0


async def test_send_file_uploads_a_workspace_file_once_before_the_answer(
    world: ChatWorld, model: FilesModel
) -> None:
    data = tiny_pdf("the weekly report")
    (world.workspace / "reports").mkdir(exist_ok=True)
    (world.workspace / "reports" / "weekly.pdf").write_bytes(data)
    call = Call(SEND_FILE, {"path": "reports/weekly.pdf", "caption": "This week's report"})
    model.script("send me the weekly report", Reply(tool_calls=[call]), Reply("Sent it."))
    question = world.ask(SEND, "send me the weekly report")
    answer = await world.showing(SEND, "Sent it.")
    [upload] = world.telegram.uploads_to(SEND)
    assert (upload.kind, upload.name, upload.data) == ("document", "weekly.pdf", data)
    assert html_visible(upload.caption) == "This week's report"
    asked = int(world.telegram.pushed[question]["message"]["message_id"])
    assert upload.reply_to_message_id == asked
    assert upload.message_id < answer.message_id
    assert model.rounds("send me the weekly report") == [0, 1]

    # Nothing more came: the file, the answer, then the control's answer.
    messages = await world.control(SEND)
    assert [m.message_id for m in messages[:2]] == [upload.message_id, answer.message_id]
    assert [m.text for m in messages[2:]] == [CONTROL_ANSWER]
    assert len(world.telegram.uploads_to(SEND)) == 1
    assert world.telegram.count("sendDocument") + world.telegram.count("sendPhoto") == 1
