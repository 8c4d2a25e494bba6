"""Files in and out on Slack, end to end: ``geodebot serve`` as a real process against FakeSlack
(file shares over Socket Mode, downloads from its file URLs, external uploads) and the fake
model server.

One daemon serves every test of this file (tests/support/chat_e2e_slack.py); each test talks
in a channel bound to a session of its own. What a test says happened "exactly once" or
"never" is checked again after the daemon stopped (SIGTERM drains the outbox).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.chat_e2e_slack import (
    ChatWorld,
    FileScene,
    SceneModel,
    result_text,
    tool_results,
    unescape,
)
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.files import b64, tiny_pdf, tiny_png
from tests.support.slack_world import TimedCalls

pytestmark = pytest.mark.asyncio(loop_scope="module")

SEEN_TEXT = "A grey pixel and a one-page report."
BIG_TEXT = "I read your question; the file did not come through."
SENT_TEXT = "The report is in the thread."
CAPTION = "Weekly report"
BLOCKS = FileScene("blocks", "C0FILE001", Reply(SEEN_TEXT))
TOO_BIG = FileScene("too-big", "C0FILE002", Reply(BIG_TEXT))
SEND = FileScene("send", "C0FILE003", Reply(SENT_TEXT), send="out/report.pdf", caption=CAPTION)
SCENES = (BLOCKS, TOO_BIG, SEND)
REPORT = tiny_pdf("outgoing report")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    async with FakeSlack() as slack, FakeLLMServer() as llm:
        model = SceneModel()
        model.scenes = {scene.name: scene for scene in SCENES}
        llm.responder = model
        slack.calls = TimedCalls()
        world = ChatWorld(slack, llm, model, tmp_path_factory.mktemp("files-slack"), SCENES)
        world.write_config()
        (world.workspace / "out").mkdir()
        (world.workspace / "out" / "report.pdf").write_bytes(REPORT)
        await world.start()
        try:
            yield world
        finally:
            assert world.daemon is not None
            code = await world.daemon.stop()
            for daemon in world.daemons:
                await daemon.kill()  # one a failed test left behind
        assert code == 0, world.daemon.text()[-3000:]
        for check in world.afterwards:
            check()
        world.assert_clean_logs()


def user_blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The content blocks of a request's newest user message."""
    [*_, message] = [m for m in body["messages"] if m["role"] == "user"]
    content = message["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


async def test_an_image_and_a_pdf_reach_the_model_as_blocks(world: ChatWorld) -> None:
    png, pdf = tiny_png(0x40), tiny_pdf("inbound report")
    image = world.slack.add_file(png, "pixel.png", "image/png")
    document = world.slack.add_file(pdf, "report.pdf", "application/pdf")
    thread = await world.share(BLOCKS, "what are these?", [image, document])
    await world.answer(BLOCKS, thread, SEEN_TEXT)

    [body] = world.model.requests[BLOCKS.name]
    blocks = user_blocks(body)
    assert any("what are these?" in b.get("text", "") for b in blocks if b["type"] == "text")
    [image_block] = [b for b in blocks if b["type"] == "image"]
    assert image_block["source"] == {"type": "base64", "media_type": "image/png", "data": b64(png)}
    [document_block] = [b for b in blocks if b["type"] == "document"]
    assert document_block["source"] == {
        "type": "base64",
        "media_type": "application/pdf",
        "data": b64(pdf),
    }
    # Each file was fetched once, with the bot token.
    assert world.slack.downloads_of(image) == 1
    assert world.slack.downloads_of(document) == 1
    assert {r.token for r in world.slack.file_requests} == {world.slack.bot_token}

    def once_each() -> None:
        assert world.slack.downloads_of(image) == world.slack.downloads_of(document) == 1

    world.afterwards.append(once_each)


async def test_an_oversized_file_is_refused_unread_and_the_text_still_runs(
    world: ChatWorld,
) -> None:
    # Declared 25 MB (over the binding's default 20 MB); its bytes need not be that big.
    big = world.slack.add_file(tiny_pdf("big"), "big.pdf", "application/pdf", size=25_000_000)
    thread = await world.share(TOO_BIG, "please read the attached log", [big])
    await world.answer(TOO_BIG, thread, BIG_TEXT)

    def refusals() -> list[str]:
        texts = [unescape(p.text) for p in world.posts(TOO_BIG, thread)]
        return [t for t in texts if "big.pdf" in t and "limit" in t.lower()]

    await world.until(lambda: len(refusals()) == 1, lambda: f"one refusal; got {refusals()}")
    assert "passed on" in refusals()[0]
    assert world.slack.downloads_of(big) == 0
    [body] = world.model.requests[TOO_BIG.name]
    blocks = user_blocks(body)
    assert [b for b in blocks if b["type"] in ("image", "document")] == []
    texts = [b.get("text", "") for b in blocks if b["type"] == "text"]
    assert any("please read the attached log" in t for t in texts)
    assert any("big.pdf" in t for t in texts)  # the model is told what was not passed on

    def never() -> None:
        assert world.slack.downloads_of(big) == 0

    world.afterwards.append(never)


async def test_send_file_arrives_once_before_the_final_answer(world: ChatWorld) -> None:
    thread = await world.ask(SEND, "send me the weekly report")
    answer = await world.answer(SEND, thread, SENT_TEXT)

    slack = world.slack
    [upload] = slack.uploads
    assert upload.data == REPORT
    assert (upload.channel, upload.thread_ts, upload.name) == (SEND.channel, thread, "report.pdf")
    assert CAPTION in unescape(upload.initial_comment or "")
    assert slack.upload_posts == 1
    # The share came before the final answer showed (a preview before both may have become
    # the answer by an edit, so what counts is when the final text appeared).
    assert isinstance(slack.calls, TimedCalls)
    [shared_at] = slack.calls.times_of("files.completeUploadExternal")
    assert shared_at < answer.shown_at[answer.texts.index(SENT_TEXT)]
    # The model was told it was sent.
    [_, second] = world.model.requests[SEND.name]
    [result] = tool_results(second)
    assert not result.get("is_error"), result_text(result)

    def once() -> None:
        assert len(slack.uploads) == 1, slack.uploads
        assert slack.upload_posts == 1

    world.afterwards.append(once)
