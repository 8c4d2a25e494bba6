"""Files in and out without a platform SDK: the router's checks, the file store, what the
model is sent, and send_file through the outbox.

The chat side is geodebot.testing.MemoryChannel; the model side is the real anthropic (or
openai) SDK against the fake model server, whose recorded request bodies show what the model
was given.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.channels.base import UPLOAD_LIMITS, ChannelError, Inbound, InboundFile
from geodebot.chat.attachments import Attachments, safe_name, sniff
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.ownership import LocalOwner
from geodebot.chat.router import ChatRouter
from geodebot.chat.send_file import send_file_spec
from geodebot.config.schema import BindingConfig
from geodebot.engine.attachments import FILES_SHOWN, FileView
from geodebot.engine.compaction import ContextItem
from geodebot.engine.llm.anthropic_json import MessageJSON
from geodebot.engine.llm.types import FileBlock, Message, TextBlock
from geodebot.engine.modes import Mode
from geodebot.engine.tools.spec import ToolCallContext, ToolError
from geodebot.store.files import FileStore
from geodebot.store.records import AttachedFile, NewOutbound, StoredFile, StoreError
from geodebot.store.sqlite import SQLiteStore
from geodebot.testing import MemoryChannel
from tests.support.app import open_app
from tests.support.chat import chat_pipeline
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.files import b64, tiny_pdf, tiny_png
from tests.support.scheduler_world import job, scheduler_world

ids = itertools.count(5000)

BINDINGS = [
    {
        "platform": "telegram",
        "channel": "c1",
        "session": "s1",
        "allowed_users": ["u1"],
        "max_attachment_mb": 1,
        "tools": ["send_file"],
        "preapproved": ["send_file"],
    },
    {
        "platform": "telegram",
        "channel": "c2",
        "session": "s2",
        "allowed_users": ["u1"],
        "attachments": False,
    },
]


def message(text: str, *files: InboundFile, channel: str = "c1") -> Inbound:
    n = next(ids)
    return Inbound(
        platform="telegram",
        event_id=str(n),
        channel=channel,
        thread=None,
        user="u1",
        text=text,
        message_id=f"m{n}",
        files=files,
    )


@dataclass
class World:
    app: App
    router: ChatRouter
    chat: MemoryChannel
    llm: FakeLLMServer
    workspace: Path

    def offer(
        self, ref: str, data: bytes, name: str, media_type: str, size: int = 0
    ) -> InboundFile:
        """A file the platform holds, as it would describe it."""
        self.chat.files[ref] = data
        return InboundFile(ref, name, media_type, size or len(data))

    async def texts(self, n: int, channel: str | None = None) -> list[str]:
        async with asyncio.timeout(20):
            return await self.chat.wait_sent(n, channel)

    def user_content(self, request: int = -1) -> list[dict[str, Any]]:
        """The content blocks of the last user message of a recorded model request."""
        body = self.llm.requests[request].json
        users = [m for m in body["messages"] if m["role"] == "user"]
        content = users[-1]["content"]
        return [{"type": "text", "text": content}] if isinstance(content, str) else content


@asynccontextmanager
async def world(
    tmp_path: Path, llm: FakeLLMServer, *, provider: str = "anthropic"
) -> AsyncIterator[World]:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = with_sections(
        make_config(tmp_path, llm, provider=provider),
        bindings=BINDINGS,
        tools={
            "ipc_tools": ["get_time"],
            "headless_tools": ["get_time"],
            "workspace": str(workspace),
        },
    )
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        await app.load_models()
        assert app.files is not None
        chat = MemoryChannel("telegram")
        chat_path = chat_pipeline(
            app, {"telegram": chat}, streams=False, max_chars={"telegram": 4000}
        )
        await chat.start(chat_path.router.accept, chat_path.approvals.press)
        async with chat_path:
            yield World(app, chat_path.router, chat, llm, workspace)


# -- files in -----------------------------------------------------------------------------


async def test_an_image_and_a_pdf_reach_the_model_as_blocks_and_the_history_keeps_references(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("a grey dot and a report"))
    png, pdf = tiny_png(), tiny_pdf("quarterly")
    async with world(tmp_path, llm_server) as w:
        await w.chat.deliver(
            message(
                "what are these?",
                w.offer("f-png", png, "dot.png", "image/png"),
                w.offer("f-pdf", pdf, "report.pdf", "application/pdf"),
            )
        )
        assert await w.texts(1) == ["a grey dot and a report"]
        content = w.user_content()
        assert content[0] == {"type": "text", "text": "what are these?"}
        assert content[1] == {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": b64(png)},
        }
        assert content[2]["type"] == "document"
        assert content[2]["source"] == {
            "type": "base64",
            "media_type": "application/pdf",
            "data": b64(pdf),
        }
        assert w.chat.downloads == {"f-png": 1, "f-pdf": 1}
        # Stored once by content hash; the history holds the digest, never the bytes.
        assert w.app.files is not None
        for data in (png, pdf):
            digest = hashlib.sha256(data).hexdigest()
            assert w.app.files.read(digest) == data
        records = await w.app.services.store.load_context("s1")
        stored = records[0].content["content"]
        assert stored[1] == {
            "type": "file",
            "sha256": hashlib.sha256(png).hexdigest(),
            "media_type": "image/png",
            "name": "dot.png",
            "size": len(png),
        }
        assert b64(png) not in str(records)
        assert b64(pdf) not in str(records)


async def test_the_openai_adapter_sends_images_as_data_urls_and_pdfs_as_file_parts(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("seen"))
    png, pdf = tiny_png(3), tiny_pdf()
    async with world(tmp_path, llm_server, provider="openai-compatible") as w:
        await w.chat.deliver(
            message(
                "look",
                w.offer("p", png, "a.png", "image/png"),
                w.offer("d", pdf, "b.pdf", "application/pdf"),
                w.offer("z", b"PK\x03\x04", "c.zip", "application/zip"),
            )
        )
        assert (await w.texts(2))[1] == "seen"
        content = w.user_content()
        assert len(content) == 4
        assert content[0] == {"type": "text", "text": "look"}
        # The note about the refused file is a part of its own, after the files.
        assert content[3]["type"] == "text"
        assert content[3]["text"].startswith("[the user sent c.zip (application/zip, 4 bytes)")
        assert content[1] == {
            "type": "image_url",
            "image_url": {"url": f"data:image/png;base64,{b64(png)}"},
        }
        assert content[2] == {
            "type": "file",
            "file": {"filename": "b.pdf", "file_data": f"data:application/pdf;base64,{b64(pdf)}"},
        }


async def test_refused_files_get_one_notice_no_download_and_the_text_still_runs(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("answered the text"))
    async with world(tmp_path, llm_server) as w:
        huge = w.offer("big", b"%PDF-1.4 small", "big.pdf", "application/pdf", size=25_000_000)
        archive = w.offer("zip", b"PK\x03\x04", "logs.zip", "application/zip")
        fake_png = w.offer("fake", b"not an image at all \x00\x01", "cat.png", "image/png")
        text = w.offer("txt", b"line one\nline two\n", "notes.log", "")
        await w.chat.deliver(message("summarise", huge, archive, fake_png, text))
        sent = await w.texts(2)
        notice, answer = sent
        assert notice.startswith("Not everything you sent was passed on:")
        assert "`big.pdf`: 25.0 MB, over this chat's limit of 1 MB" in notice
        assert "`logs.zip`: its type (application/zip) is not one I take" in notice
        assert "`cat.png`: its content is not an image, a PDF or text" in notice
        assert "notes.log" not in notice
        assert answer == "answered the text"
        # Refused on what the platform said: never fetched.
        assert w.chat.downloads == {"fake": 1, "txt": 1}
        content = w.user_content()
        assert content[0]["text"] == "summarise"
        notes = [b["text"] for b in content[1:]]
        assert notes[0].startswith("[the user sent big.pdf (application/pdf, 25.0 MB)")
        assert "not passed on" in notes[1]
        assert "logs.zip" in notes[1]
        assert "cat.png" in notes[2]
        assert "not an image" in notes[2]
        assert notes[3] == "[file notes.log]\nline one\nline two\n"


async def test_a_chat_without_attachments_names_the_files_and_fetches_nothing(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("ok"))
    async with world(tmp_path, llm_server) as w:
        png = w.offer("p", tiny_png(), "dot.png", "image/png")
        await w.chat.deliver(message("", png, channel="c2"))
        notice, answer = await w.texts(2, "c2")
        assert "`dot.png`: this chat does not take files" in notice
        assert answer == "ok"
        assert w.chat.downloads == {}


async def test_a_recovered_turn_neither_downloads_again_nor_repeats_its_notice(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite")
    async with store:
        files = FileStore(tmp_path / "files")
        chat = MemoryChannel("telegram")
        chat.files["p"] = tiny_png()
        binding = BindingConfig(platform="telegram", channel="c1", session="s1")
        described = [
            InboundFile("p", "dot.png", "image/png", 67).to_json(),
            InboundFile("z", "x.zip", "application/zip", 4).to_json(),
        ]
        row, _ = await store.inbox_add(
            platform="telegram", event_id="e1", session_id="s1", channel="c1", thread=None,
            user="u1", text="hi", message_id="m1", files=described,
        )  # fmt: skip
        attachments = Attachments(store, files, {"telegram": chat})
        first, notice = await attachments.blocks(row, binding)
        assert notice is not None
        assert notice.kind == "notice"
        assert "x.zip" in notice.text
        # The turn was cut short: the row is read again, as a restart reads it.
        again = await store.get_inbox(row.id)
        assert again is not None
        assert again.attached is not None
        second, repeat = await attachments.blocks(again, binding)
        assert repeat is None
        assert second == first
        assert chat.downloads == {"p": 1}
        assert (await store.outbox_counts())["pending"] == 1
        # A second record of the same row (two writers racing) changes nothing either.
        raced, none = await store.inbox_attached(row.id, [AttachedFile("other", "", 0, None, "x")])
        assert none is None
        assert raced.attached == again.attached


class _BrokenDownloads(MemoryChannel):
    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        raise RuntimeError("a bug in an adapter")


async def test_a_download_that_fails_unexpectedly_costs_the_file_not_the_message(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite")
    async with store:
        attachments = Attachments(
            store, FileStore(tmp_path / "files"), {"telegram": _BrokenDownloads("telegram")}
        )
        row, _ = await store.inbox_add(
            platform="telegram", event_id="e1", session_id="s1", channel="c1", thread=None,
            user="u1", text="look", message_id="m1",
            files=[InboundFile("p", "dot.png", "image/png", 67).to_json()],
        )  # fmt: skip
        binding = BindingConfig(platform="telegram", channel="c1", session="s1")
        blocks, notice = await attachments.blocks(row, binding)
        assert notice is not None
        assert "`dot.png`: the platform did not hand it over" in notice.text
        [note] = blocks
        assert isinstance(note, TextBlock)
        assert "dot.png" in note.text
        assert "not passed on" in note.text


async def test_a_download_refused_for_a_passing_reason_is_tried_again(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite")
    async with store:
        chat = MemoryChannel("telegram")
        chat.files["p"] = tiny_png()
        chat.fail_next(ChannelError("429", retry_after=0.01), ChannelError("502"))
        attachments = Attachments(store, FileStore(tmp_path / "files"), {"telegram": chat})
        row, _ = await store.inbox_add(
            platform="telegram", event_id="e1", session_id="s1", channel="c1", thread=None,
            user="u1", text="look", message_id="m1",
            files=[InboundFile("p", "dot.png", "image/png", 67).to_json()],
        )  # fmt: skip
        binding = BindingConfig(platform="telegram", channel="c1", session="s1")
        [block], notice = await attachments.blocks(row, binding)
        assert notice is None
        assert isinstance(block, FileBlock)
        assert chat.downloads == {"p": 1}
        # A permanent refusal is not asked again.
        chat.fail_next(ChannelError("gone", permanent=True))
        row2, _ = await store.inbox_add(
            platform="telegram", event_id="e2", session_id="s1", channel="c1", thread=None,
            user="u1", text="again", message_id="m2",
            files=[InboundFile("p", "dot.png", "image/png", 67).to_json()],
        )  # fmt: skip
        _, refused = await attachments.blocks(row2, binding)
        assert refused is not None
        assert "did not hand it over" in refused.text
        assert chat.downloads == {"p": 1}


def test_sniffing_trusts_the_bytes_not_the_name() -> None:
    assert sniff(tiny_png()) == "image/png"
    assert sniff(b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert sniff(b"GIF89a....") == "image/gif"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff(tiny_pdf()) == "application/pdf"
    assert sniff("plain text, ünïcode".encode()) == "text/plain"
    assert sniff(b"\x00\x01\x02") is None
    assert sniff(b"\xc3\x28 invalid utf-8") is None
    assert safe_name("a\nb]\x07c[d.txt") == "a b c d.txt"
    assert safe_name("") == "file"
    assert len(safe_name("x" * 500)) == 120


# -- the file store and what each model call is shown -------------------------------------


def test_the_file_store_keeps_one_copy_per_content_and_refuses_bad_digests(
    tmp_path: Path,
) -> None:
    files = FileStore(tmp_path / "files")
    one = files.put(b"same bytes", name="a.txt", media_type="text/plain")
    two = files.put(b"same bytes", name="b.txt", media_type="text/plain")
    assert one.sha256 == two.sha256
    assert (one.name, two.name) == ("a.txt", "b.txt")
    assert len([p for p in (tmp_path / "files").rglob("*") if p.is_file()]) == 1
    assert files.read(one.sha256) == b"same bytes"
    with pytest.raises(StoreError, match="not a SHA-256 digest"):
        files.path("../../etc/passwd")
    files.path(one.sha256).write_bytes(b"changed on disk")
    with pytest.raises(StoreError, match="does not match its digest"):
        files.read(one.sha256)


async def test_only_the_newest_files_are_shown_and_a_missing_copy_is_named(
    tmp_path: Path,
) -> None:
    files = FileStore(tmp_path / "files")
    view = FileView(files)
    items: list[ContextItem] = []
    for n in range(FILES_SHOWN + 2):
        stored = files.put(tiny_png(n), name=f"p{n}.png", media_type="image/png")
        block = FileBlock(stored.sha256, "image/png", stored.name, stored.size)
        items.append(ContextItem(n, Message("user", (TextBlock(f"picture {n}"), block))))
    gone = FileBlock("ab" * 32, "image/png", "gone.png", 10)
    items.append(ContextItem(99, Message("user", (gone,))))
    shown = await view.view(items)
    blocks = [item.message.content[-1] for item in shown]
    assert isinstance(blocks[-1], TextBlock)
    assert "gone.png" in blocks[-1].text
    assert "missing" in blocks[-1].text
    # The newest FILES_SHOWN (the missing one counts) carry their bytes; older are named.
    with_data = [b for b in blocks if isinstance(b, FileBlock) and b.data]
    assert len(with_data) == FILES_SHOWN - 1
    # An older one stays a reference, which the adapters name in one line.
    assert isinstance(blocks[0], FileBlock)
    assert blocks[0].data == ""
    assert blocks[0].name == "p0.png"
    assert shown[0] is items[0]
    *_, (_, _, encoded) = MessageJSON()(shown[0].message)
    assert json.loads(encoded) == {
        "type": "text",
        "text": f"[file p0.png (image/png, {len(tiny_png(0))} bytes) not shown here]",
    }
    assert base64.b64decode(with_data[-1].data) == tiny_png(FILES_SHOWN + 1)
    # The next round sees the very same objects: nothing is read or encoded again.
    again = await view.view(items)
    assert all(a.message is b.message for a, b in zip(shown, again, strict=True))
    # What is hashed and measured is the reference, not the bytes.
    assert shown[-2].canonical == items[-2].canonical


# -- files out ----------------------------------------------------------------------------


async def test_send_file_uploads_a_workspace_file_once_before_the_answer(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    report = tiny_pdf("report")
    llm_server.script(
        Reply(tool_calls=[Call("send_file", {"path": "out/report.pdf", "caption": "the report"})]),
        Reply("sent it"),
    )
    async with world(tmp_path, llm_server) as w:
        (w.workspace / "out").mkdir()
        (w.workspace / "out" / "report.pdf").write_bytes(report)
        inbound = message("send me the report")
        await w.chat.deliver(inbound)
        assert await w.texts(2) == ["the report", "sent it"]
        upload = w.chat.sent[0]
        assert upload.file is not None
        assert (upload.file.name, upload.file.media_type) == ("report.pdf", "application/pdf")
        assert upload.destination.reply_to == inbound.message_id
        assert list(w.chat.uploads.values()) == [report]
        assert w.chat.sent[1].file is None
        result = w.llm.requests[1].json["messages"][-1]["content"][0]
        assert result["type"] == "tool_result"
        assert not result.get("is_error")
        assert "report.pdf" in result["content"]
        assert "queued" in result["content"]
        receipts = await w.app.services.store.list_receipts()
        assert [(r.tool, r.status) for r in receipts] == [("send_file", "committed")]


@pytest.mark.parametrize(
    ("path", "setup", "error"),
    [
        ("../outside.txt", None, "'..' is not allowed"),
        ("/etc/hostname", None, "absolute paths are refused"),
        ("link.txt", "symlink", "outside the workspace"),
        ("empty.txt", "empty", "is empty"),
        ("nothing.txt", None, "no such file"),
    ],
)
async def test_send_file_refuses_what_it_must_not_send(
    tmp_path: Path, llm_server: FakeLLMServer, path: str, setup: str | None, error: str
) -> None:
    llm_server.script(Reply(tool_calls=[Call("send_file", {"path": path})]), Reply("could not"))
    async with world(tmp_path, llm_server) as w:
        if setup == "symlink":
            secret = tmp_path / "secret.txt"
            secret.write_text("secret")
            (w.workspace / "link.txt").symlink_to(secret)
        elif setup == "empty":
            (w.workspace / "empty.txt").write_bytes(b"")
        await w.chat.deliver(message("send it"))
        assert await w.texts(1) == ["could not"]
        result = w.llm.requests[1].json["messages"][-1]["content"][0]
        assert result["is_error"] is True
        assert error in result["content"]
        assert w.chat.uploads == {}


async def test_send_file_refuses_a_file_over_the_platform_limit(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("send_file", {"path": "big.bin"})]), Reply("no"))
    async with world(tmp_path, llm_server) as w:
        with (w.workspace / "big.bin").open("wb") as out:
            out.truncate(UPLOAD_LIMITS["telegram"] + 1)
        await w.chat.deliver(message("send it"))
        assert await w.texts(1) == ["no"]
        result = w.llm.requests[1].json["messages"][-1]["content"][0]
        assert result["is_error"] is True
        assert "upload limit of 50.0 MB" in result["content"]
        assert not list((tmp_path / "var" / "files").rglob("*"))


async def test_a_file_row_whose_stored_copy_is_gone_fails_with_a_reason(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "db.sqlite")
    async with store:
        files = FileStore(tmp_path / "files")
        chat = MemoryChannel("telegram")
        outbox = OutboxSender(
            store,
            {"telegram": chat},
            files=files,
            owner=LocalOwner(),
        )
        kept = files.put(b"hello", name="h.txt", media_type="text/plain")
        lost = StoredFile("cd" * 32, "lost.txt", "text/plain", 3)
        for stored in (kept, lost):
            await store.outbox_add(
                NewOutbound("s1", "telegram", "c1", None, None, "", kind="file", file=stored)
            )
        for row in await store.outbox_pending():
            await outbox.deliver(row)
        assert list(chat.uploads.values()) == [b"hello"]
        rows = [await store.get_outbox(n) for n in (1, 2)]
        assert [r.status for r in rows if r is not None] == ["sent", "failed"]
        assert rows[1] is not None
        assert "lost.txt is gone" in rows[1].error


async def test_a_job_sends_its_file_where_its_result_goes_before_the_result(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(
        Reply(tool_calls=[Call("send_file", {"path": "daily.csv", "caption": "today"})]),
        Reply("Report attached."),
    )
    llm_server.default = Reply("Nothing new.")
    jobs = [job(every="1s", tools=["send_file"])]
    async with scheduler_world(tmp_path, llm_server, jobs) as sw:
        workspace = sw.config.workspace
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "daily.csv").write_text("day,deploys\nmon,3\n")
        await sw.start_scheduler()
        texts = await sw.sent(2)
        assert texts[0] == "today"
        assert "Report attached." in texts[1]
        upload = sw.chat.sent[0]
        assert upload.file is not None
        assert (upload.destination.channel, upload.file.name) == ("c1", "daily.csv")
        assert upload.file.media_type == "text/csv"
        assert list(sw.chat.uploads.values()) == [b"day,deploys\nmon,3\n"]


async def test_send_file_without_a_chat_is_a_clear_tool_error(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    spec = send_file_spec(tmp_path, FileStore(tmp_path / "files"))
    for mode in (Mode.IPC, Mode.HEADLESS):
        with pytest.raises(ToolError, match="there is no chat here"):
            await spec.handler({"path": "a.txt"}, ToolCallContext("s", "t", mode))
    assert not (tmp_path / "files").exists()
