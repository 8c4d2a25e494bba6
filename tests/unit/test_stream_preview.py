"""The streamed preview on its own: pacing, progress lines, rate limits, the recorded id.

MemoryChannel is the chat and the real SQLite store keeps the preview's id; the turn is
played by calling the listener as the loop would. The whole path, through the model's stream
and the outbox's final edit, is in test_stream_replies.py and tests/e2e.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from geodebot.channels.base import ChannelError, Destination, OutboundPart, SentPart
from geodebot.channels.render import LIMITS
from geodebot.chat import stream
from geodebot.chat.stream import RETRYING_TEXT, EditPacer, StreamedReply
from geodebot.store.records import Fenced, InboxRow
from geodebot.store.sqlite import SQLiteStore
from geodebot.testing import MemoryChannel


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "db.sqlite") as opened:
        yield opened


async def inbox_row(store: SQLiteStore) -> InboxRow:
    row, _ = await store.inbox_add(
        platform="telegram",
        event_id="e1",
        session_id="s1",
        channel="c1",
        thread=None,
        user="u1",
        text="hello",
        message_id="m1",
    )
    return row


async def until(chat: MemoryChannel, predicate: Callable[[], object]) -> None:
    async with asyncio.timeout(10):
        await chat.wait_until(predicate)


async def test_an_answer_done_before_the_first_preview_shows_none(store: SQLiteStore) -> None:
    chat = MemoryChannel()
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(1.0), first_after_s=5.0)
    reply.round_started()
    reply.text("Quick ")
    reply.text("answer.")
    assert await reply.close() is None
    assert chat.sent == []


async def test_previews_are_one_message_edited_at_most_once_per_interval(
    store: SQLiteStore,
) -> None:
    chat = MemoryChannel()
    row = await inbox_row(store)
    interval = 0.2
    reply = StreamedReply(chat, store, row, EditPacer(interval), first_after_s=0.0)
    reply.round_started()
    loop = asyncio.get_running_loop()
    started = loop.time()
    words = [f"w{i} " for i in range(40)]
    for word in words:
        reply.text(word)
        await asyncio.sleep(0.025)
    await until(
        chat, lambda: chat.messages and next(iter(chat.messages.values())) == "".join(words).strip()
    )
    elapsed = loop.time() - started
    preview_id = await reply.close()
    # One message, edited; never more requests than one per interval (plus the first).
    assert len(chat.sent) == 1
    assert preview_id == chat.sent_ids[f"gb-preview-{row.id}"]
    requests = 1 + len(chat.edits)
    assert 2 <= requests <= elapsed / interval + 1
    assert all(p.plain and p.edit_of == preview_id for p in chat.edits)
    # Recorded with the inbox row: a resumed turn, and the reply, find it.
    stored = await store.get_inbox(row.id)
    assert stored is not None
    assert stored.preview == preview_id


async def test_tools_show_a_progress_line_and_a_broken_stream_says_so(store: SQLiteStore) -> None:
    chat = MemoryChannel()
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(0.0), first_after_s=0.0)
    reply.round_started()
    reply.text("Let me look.")
    reply.tools_started((("read_file", "notes/todo.md"), ("get_time", "")))
    await until(
        chat,
        lambda: (
            "Let me look.\n\n(running read_file notes/todo.md, get_time…)" in chat.messages.values()
        ),
    )
    reply.round_started()
    reply.text("Half an ans")
    await until(chat, lambda: "Half an ans" in chat.messages.values())
    reply.restarted("connection cut")
    await until(chat, lambda: RETRYING_TEXT in chat.messages.values())
    await reply.close()
    assert len(chat.sent) == 1


async def test_a_rate_limited_preview_is_skipped_and_close_does_not_wait_for_it(
    store: SQLiteStore,
) -> None:
    chat = MemoryChannel()
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(0.0), first_after_s=0.0)
    reply.round_started()
    reply.text("first")
    await until(chat, lambda: "first" in chat.messages.values())
    chat.fail_next(ChannelError("429", retry_after=30.0))
    reply.text(" second")
    await until(chat, lambda: not chat.failures)
    reply.text(" third")
    # The 429 said 30 s: nothing more is sent meanwhile, and closing is at once.
    async with asyncio.timeout(2):
        preview_id = await reply.close()
    assert list(chat.messages.values()) == ["first"]
    assert preview_id is not None


async def test_a_resumed_turn_edits_the_preview_it_showed_before(store: SQLiteStore) -> None:
    chat = MemoryChannel()
    row = await inbox_row(store)
    first = StreamedReply(chat, store, row, EditPacer(0.0), first_after_s=0.0)
    first.text("before the crash")
    await until(chat, lambda: chat.sent)
    await first.close()
    resumed_row = await store.get_inbox(row.id)
    assert resumed_row is not None
    again = StreamedReply(chat, store, resumed_row, EditPacer(0.0), first_after_s=5.0)
    again.text("after the restart")
    # No first-preview delay for a preview that exists: it is edited at once.
    await until(chat, lambda: "after the restart" in chat.messages.values())
    assert await again.close() == first.preview_id
    assert len(chat.sent) == 1


class SlowLinkChannel(MemoryChannel):
    """Every other request reaches the platform late, just before its answer comes back (a
    busy loop or a slow link held it), the others at once: the time each arrives is what the
    platform's limit counts."""

    def __init__(self, transit_s: float) -> None:
        super().__init__()
        self.transit_s = transit_s
        self.arrivals: list[float] = []

    async def send(self, part: OutboundPart) -> SentPart:
        if len(self.arrivals) % 2 == 0:
            await asyncio.sleep(self.transit_s)
        self.arrivals.append(asyncio.get_running_loop().time())
        return await super().send(part)


async def test_previews_arrive_an_interval_apart_however_long_each_took_to_arrive(
    store: SQLiteStore,
) -> None:
    chat = SlowLinkChannel(transit_s=0.15)
    interval = 0.2
    row = await inbox_row(store)
    reply = StreamedReply(chat, store, row, EditPacer(interval), first_after_s=0.0)
    reply.round_started()
    for i in range(30):
        reply.text(f"w{i} ")
        await asyncio.sleep(0.02)
    await until(chat, lambda: len(chat.arrivals) >= 4)
    await reply.close()
    gaps = [b - a for a, b in zip(chat.arrivals, chat.arrivals[1:], strict=False)]
    assert len(gaps) >= 2
    assert min(gaps) >= interval, gaps


class StuckChannel(MemoryChannel):
    """Its sends never return: an SDK waiting out rate limits on them, say."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = asyncio.Event()

    async def send(self, part: OutboundPart) -> SentPart:
        self.stuck.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_close_does_not_wait_long_for_a_stuck_preview(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "CLOSE_WAIT_S", 0.2)
    chat = StuckChannel()
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(0.0), first_after_s=0.0)
    reply.text("hello")
    async with asyncio.timeout(5):
        await chat.stuck.wait()
        assert await reply.close() is None


async def test_a_wait_for_a_person_is_shown_in_the_preview(store: SQLiteStore) -> None:
    chat = MemoryChannel()
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(0.0), first_after_s=0.0)
    reply.text("I will write it.")
    reply.tools_started((("write_file", "notes.md"),))
    reply.waiting("waiting for approval of write_file")
    await until(
        chat,
        lambda: (
            "I will write it.\n\n(waiting for approval of write_file)" in chat.messages.values()
        ),
    )
    await reply.close()


async def test_a_long_answer_previews_within_the_platforms_limit(store: SQLiteStore) -> None:
    chat = MemoryChannel(limit=LIMITS["telegram"])
    reply = StreamedReply(chat, store, await inbox_row(store), EditPacer(0.0), first_after_s=0.0)
    reply.text("x" * 10_000)
    await until(chat, lambda: chat.messages)
    reply.tools_started((("read_file", "y" * 200),))
    await until(chat, lambda: "(running" in next(iter(chat.messages.values())))
    await reply.close()
    [shown] = chat.messages.values()
    # Cut with a mark, the progress line still under it, the whole within the limit.
    assert shown.startswith("x" * 3000)
    assert "…\n\n(running read_file " in shown
    assert len(shown) <= LIMITS["telegram"]


def test_the_pace_is_per_chat_whatever_the_thread_and_discord_leaves_room_for_the_final() -> None:
    pacer = EditPacer(1.0)
    pacer.used(("slack", "C1"), now=100.0)
    # Every thread of the channel waits: Slack limits the channel.
    assert pacer.wait_s(("slack", "C1"), now=100.5) == 0.5
    assert pacer.wait_s(("slack", "C2"), now=100.5) == 0.0
    # Five edits per 5 s on Discord, the final answer's edit among them: previews come at
    # most four times in 5 s, whatever the configured interval.
    pacer.used(("discord", "D1"), now=100.0)
    assert pacer.wait_s(("discord", "D1"), now=100.0) == pytest.approx(1.3)
    previews, now = [], 0.0
    while now < 5.0:
        now += pacer.wait_s(("discord", "D2"), now)
        previews.append(now)
        pacer.used(("discord", "D2"), now)
    assert len([t for t in previews if t < 5.0]) == 4


async def test_a_replica_that_lost_its_lease_shows_no_preview(store: SQLiteStore) -> None:
    chat = MemoryChannel()
    held = [True]
    row = await inbox_row(store)
    reply = StreamedReply(
        chat, store, row, EditPacer(0.0), first_after_s=0.0, may_send=lambda _session: held[0]
    )
    reply.round_started()
    reply.text("first")
    await until(chat, lambda: "first" in chat.messages.values())
    # Paused past its lease, another replica answers now: nothing more goes out from here.
    held[0] = False
    reply.text(" and more")
    reply.tools_started((("read_file", "notes/todo.md"),))
    await reply.close()
    assert list(chat.messages.values()) == ["first"]
    assert chat.edits == []


async def test_a_preview_whose_record_is_fenced_is_deleted(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Paused between the lease check and the send, the replica posts its preview after
    # another replica took the session: the record is refused, and the new holder's answer
    # knows nothing of that message, so it is taken back instead of left as a second answer.
    chat = MemoryChannel()
    row = await inbox_row(store)

    async def refused(inbox_id: int, message_id: str) -> None:
        raise Fenced("writes of 'r1' under lease 'session:s1' (epoch 1) refused")

    monkeypatch.setattr(store, "inbox_preview", refused)
    reply = StreamedReply(chat, store, row, EditPacer(0.0), first_after_s=0.0)
    reply.round_started()
    reply.tools_started((("edit_file", "notes.log"),))
    await until(chat, lambda: chat.deleted)
    assert await reply.close() is None
    assert len(chat.sent) == 1
    assert chat.deleted == ["1"]
    assert chat.messages == {}
    stored = await store.get_inbox(row.id)
    assert stored is not None
    assert stored.preview == ""


@pytest.mark.parametrize("lookups", [True, False])
async def test_a_continued_turn_adopts_the_preview_shown_but_not_recorded_before(
    store: SQLiteStore, lookups: bool
) -> None:
    # The process that began the turn showed a preview and stopped before recording it. The
    # turn continued elsewhere finds it by its key (Slack, Discord) and goes on editing it,
    # so the answer replaces it; where the platform cannot look (Telegram), nothing is found.
    chat = MemoryChannel()
    chat.lookups_supported = lookups
    row = await inbox_row(store)
    dest = Destination("telegram", row.channel, row.thread, row.message_id)
    before = await chat.send(
        OutboundPart(dest, "(running edit_file notes.log…)", f"gb-preview-{row.id}", plain=True)
    )
    reply = StreamedReply(chat, store, row, EditPacer(0.0), first_after_s=5.0)
    await reply.adopt()
    stored = await store.get_inbox(row.id)
    assert stored is not None
    if not lookups:
        assert reply.preview_id is None
        assert stored.preview == ""
        return
    assert reply.preview_id == before.message_id
    assert stored.preview == before.message_id
    reply.round_started()
    reply.text("done")
    await until(chat, lambda: chat.messages.get(before.message_id) == "done")
    assert await reply.close() == before.message_id
    assert len(chat.sent) == 1  # edited, nothing new posted
