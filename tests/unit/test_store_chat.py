"""Chat inbox, outbox and cursors, against both stores (a real database file or database)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Awaitable

import pytest

from geodebot.store import sqlite_sync
from geodebot.store.protocol import Store
from geodebot.store.records import InboxEnding, InboxRow, NewMessage, NewOutbound, StoreError
from geodebot.store.sqlite import SQLiteStore
from tests.support.postgres import Place


def table(place: Place, name: str) -> list[tuple[object, ...]]:
    """What a second, plain connection reads: only what the store actually committed."""
    return place.rows(f"SELECT * FROM {name} ORDER BY 1")


async def add(
    store: Store,
    event_id: str,
    *,
    platform: str = "telegram",
    cursor: tuple[str, str] | None = None,
    durable: bool = True,
) -> tuple[InboxRow, bool]:
    return await store.inbox_add(
        platform=platform,
        event_id=event_id,
        session_id=f"{platform}:42",
        channel="42",
        thread=None,
        user="u1",
        text=f"hello {event_id}",
        message_id=f"m-{event_id}",
        cursor=cursor,
        durable=durable,
    )


def reply(
    text: str = "pong", *, platform: str = "telegram", kind: str = "reply", channel: str = "42"
) -> NewOutbound:
    return NewOutbound(
        session_id=f"{platform}:{channel}",
        platform=platform,
        channel=channel,
        thread="t9",
        reply_to="m-1",
        text=text,
        kind=kind,
    )


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:
        yield s


# -- inbox: adding --------------------------------------------------------------------------
async def test_add_then_duplicate_returns_existing_and_inserts_nothing(
    store: Store, place: Place
) -> None:
    first, inserted = await add(store, "1")
    assert inserted
    assert (first.platform, first.event_id, first.session_id, first.channel) == (
        "telegram",
        "1",
        "telegram:42",
        "42",
    )
    assert (first.thread, first.user, first.text, first.message_id) == (
        None,
        "u1",
        "hello 1",
        "m-1",
    )
    assert (first.status, first.attempts, first.detail, first.finished_at) == (
        "pending",
        0,
        "",
        None,
    )
    again, inserted = await add(store, "1")
    assert not inserted
    assert again == first
    # The same event id on another platform is another event.
    other, inserted = await add(store, "1", platform="slack")
    assert inserted
    assert other.id > first.id
    assert await store.get_inbox(first.id) == first
    assert await store.find_inbox("telegram", "1") == first
    assert await store.find_inbox("telegram", "2") is None
    assert await store.get_inbox(999) is None
    assert len(table(place, "inbox")) == 2


async def test_add_rejects_an_empty_event_id(store: Store, place: Place) -> None:
    with pytest.raises(StoreError, match="must not be empty"):
        await add(store, "")
    assert table(place, "inbox") == []


async def test_concurrent_duplicates_insert_exactly_one(store: Store, place: Place) -> None:
    # A second store on the same file is a second connection, as another process would be.
    async with place.store() as other:
        attempts = [add(store if n % 2 else other, f"e{n % 3}") for n in range(60)]
        results = await asyncio.gather(*attempts)
    for event in ("e0", "e1", "e2"):
        mine = [(row, new) for row, new in results if row.event_id == event]
        assert [new for _, new in mine].count(True) == 1
        assert len({row for row, _ in mine}) == 1
    assert len(table(place, "inbox")) == 3


# -- inbox: start and finish ----------------------------------------------------------------
async def test_start_and_finish_transitions(store: Store) -> None:
    row, _ = await add(store, "1")
    started = await store.inbox_start(row.id)
    assert (started.status, started.attempts) == ("running", 1)
    # Started again, as after a restart: still running, one more attempt.
    again = await store.inbox_start(row.id)
    assert (again.status, again.attempts) == ("running", 2)
    done, outbound = await store.inbox_finish(row.id, "done", detail="ok")
    assert outbound is None
    assert (done.status, done.detail, done.attempts) == ("done", "ok", 2)
    assert done.finished_at is not None
    assert done.finished_at >= done.received_at
    assert await store.get_inbox(row.id) == done
    # A pending row may be finished without ever starting (dropped, ignored).
    pending, _ = await add(store, "2")
    dropped, _ = await store.inbox_finish(pending.id, "dropped", detail="binding removed")
    assert (dropped.status, dropped.attempts) == ("dropped", 0)


async def test_illegal_transitions_raise_and_write_nothing(store: Store, place: Place) -> None:
    row, _ = await add(store, "1")
    await store.inbox_finish(row.id, "failed", detail="model down")
    other, _ = await add(store, "2")
    before = table(place, "inbox")
    with pytest.raises(
        StoreError, match="it is already 'failed'; only an unfinished row can start"
    ):
        await store.inbox_start(row.id)
    with pytest.raises(StoreError, match="it is already 'failed'; only an unfinished row can fin"):
        await store.inbox_finish(row.id, "done", reply=reply())
    with pytest.raises(StoreError, match="no such inbox row"):
        await store.inbox_start(999)
    with pytest.raises(StoreError, match="no such inbox row"):
        await store.inbox_finish(999, "done")
    with pytest.raises(StoreError, match="status must be one of"):
        await store.inbox_finish(other.id, "running")  # type: ignore[arg-type]  # an invalid status on purpose
    assert table(place, "inbox") == before
    assert await store.get_inbox(other.id) == other
    assert table(place, "outbox") == []


async def test_finish_with_reply_writes_both(store: Store) -> None:
    row, _ = await add(store, "1")
    await store.inbox_start(row.id)
    done, outbound = await store.inbox_finish(row.id, "done", reply=reply("**pong**"))
    assert done.status == "done"
    assert outbound is not None
    assert outbound.inbox_id == row.id
    assert (outbound.session_id, outbound.platform, outbound.channel) == (
        "telegram:42",
        "telegram",
        "42",
    )
    assert (outbound.thread, outbound.reply_to, outbound.text, outbound.kind) == (
        "t9",
        "m-1",
        "**pong**",
        "reply",
    )
    assert (outbound.status, outbound.sent_parts, outbound.in_flight) == ("pending", {}, None)
    assert (outbound.attempts, outbound.blind_resends, outbound.error) == (0, 0, "")
    assert outbound.created_at == outbound.updated_at == done.finished_at
    assert await store.get_outbox(outbound.id) == outbound
    assert await store.outbox_pending() == [outbound]


async def test_finish_can_begin_the_replys_first_part_in_the_same_commit(
    store: Store,
) -> None:
    row, _ = await add(store, "1")
    _, plain = await store.inbox_finish(row.id, "done", reply=reply("one"))
    assert plain is not None
    assert (plain.in_flight, plain.attempts) == (None, 0)
    row2, _ = await add(store, "2")
    _, begun = await store.inbox_finish(row2.id, "done", reply=reply("two"), begin_first_part=True)
    assert begun is not None
    assert (begun.in_flight, begun.attempts, begun.sent_parts) == (0, 1, {})
    assert await store.get_outbox(begun.id) == begun
    # As after outbox_begin_part: part 0 can be recorded as sent, and no other part begins.
    with pytest.raises(StoreError, match="still unknown"):
        await store.outbox_begin_part(begun.id, 1)
    sent = await store.outbox_part_sent(begun.id, 0, "m1", last=True)
    assert sent.status == "sent"
    # Without a reply there is nothing to begin.
    row3, _ = await add(store, "3")
    assert (await store.inbox_finish(row3.id, "dropped", begin_first_part=True))[1] is None


async def test_finish_with_reply_writes_neither_when_the_reply_fails(
    store: Store, place: Place
) -> None:
    row, _ = await add(store, "1")
    running = await store.inbox_start(row.id)
    place.fail("outbox")
    with pytest.raises(StoreError, match=f"finishing inbox row {row.id} as 'done' failed: disk"):
        await store.inbox_finish(row.id, "done", reply=reply())
    assert await store.get_inbox(row.id) == running
    assert await store.inbox_unfinished() == [running]
    assert table(place, "outbox") == []
    place.heal("outbox")
    done, outbound = await store.inbox_finish(row.id, "done", reply=reply())
    assert done.status == "done"
    assert outbound is not None
    assert [r.id for r in await store.outbox_pending()] == [outbound.id]


async def test_an_inbox_row_has_at_most_one_reply(store: Store, place: Place) -> None:
    row, _ = await add(store, "1")
    await store.inbox_finish(row.id, "done", reply=reply("first"))
    with pytest.raises(StoreError, match="already 'done'"):
        await store.inbox_finish(row.id, "done", reply=reply("second"))
    # The schema holds the line too, not just the status guard.
    with pytest.raises(place.integrity_error, match=r"(?i)unique"):
        place.execute(
            "INSERT INTO outbox (inbox_id, session_id, platform, channel, text, kind, status, "
            "created_at, updated_at) VALUES (?, 's', 'telegram', '42', 'x', 'reply', "
            "'pending', 0, 0)",
            (row.id,),
        )
    assert [r.text for r in await store.outbox_pending()] == ["first"]


async def test_a_turns_last_checkpoint_and_its_inbox_rows_end_commit_together(
    store: Store,
) -> None:
    row, _ = await add(store, "1")
    await store.inbox_start(row.id)
    session = await store.ensure_session("telegram:42", "daemon")
    ending = InboxEnding(row.id, "done", "completed", reply("**pong**"), begin_first_part=True)
    user = NewMessage("user", {"role": "user", "content": []}, "t1")
    answer = NewMessage("assistant", {"role": "assistant", "content": []}, "t1")
    seqs, (done, outbound) = await store.checkpoint_ending(
        "telegram:42",
        ending,
        messages=[user, answer],
        state={"last_turn_id": "t1"},
        guards={"open_turn": None},
        timeline=[("t1", "turn_finished", {"outcome": "completed"})],
    )
    assert seqs == [session.next_seq, session.next_seq + 1]
    assert (done.status, done.detail) == ("done", "completed")
    assert outbound is not None
    assert (outbound.inbox_id, outbound.text, outbound.in_flight) == (row.id, "**pong**", 0)
    assert await store.get_outbox(outbound.id) == outbound
    assert [r.role for r in await store.load_context("telegram:42")] == ["user", "assistant"]
    after = await store.get_session("telegram:42")
    assert after is not None
    assert (after.state, after.guards) == ({"last_turn_id": "t1"}, {"open_turn": None})
    assert [e.kind for e in await store.timeline("telegram:42")] == ["turn_finished"]


@pytest.mark.parametrize("failing", ["ending", "checkpoint"])
async def test_a_failed_part_of_a_turns_end_writes_neither(
    store: Store, failing: str, place: Place
) -> None:
    row, _ = await add(store, "1")
    running = await store.inbox_start(row.id)
    before = await store.ensure_session("telegram:42", "daemon")
    place.fail("outbox" if failing == "ending" else "messages")
    ending = InboxEnding(row.id, "done", "completed", reply(), begin_first_part=True)
    with pytest.raises(StoreError, match="disk full"):
        await store.checkpoint_ending(
            "telegram:42",
            ending,
            messages=[NewMessage("assistant", {"role": "assistant", "content": []}, "t1")],
            state={"last_turn_id": "t1"},
        )
    assert await store.get_inbox(row.id) == running
    assert table(place, "outbox") == []
    assert await store.load_context("telegram:42") == []
    assert await store.get_session("telegram:42") == before
    # A finished row cannot end a second time: the checkpoint with it is refused whole.
    place.heal("outbox" if failing == "ending" else "messages")
    await store.inbox_finish(row.id, "failed", detail="stopped")
    with pytest.raises(StoreError, match="already 'failed'"):
        await store.checkpoint_ending(
            "telegram:42",
            ending,
            messages=[NewMessage("assistant", {"role": "assistant", "content": []}, "t1")],
        )
    assert await store.load_context("telegram:42") == []


# -- inbox: crash and restart ---------------------------------------------------------------
async def test_started_row_left_by_a_closed_store_is_unfinished_after_reopen(
    place: Place,
) -> None:
    async with place.store() as s:
        done, _ = await add(s, "1")
        await s.inbox_finish(done.id, "done")
        running, _ = await add(s, "2")
        await s.inbox_start(running.id)
        waiting, _ = await add(s, "3")
        # Closed mid-turn, as a killed daemon leaves it.
    async with place.store() as s:
        unfinished = await s.inbox_unfinished()
        assert [(r.event_id, r.status, r.attempts) for r in unfinished] == [
            ("2", "running", 1),
            ("3", "pending", 0),
        ]
        assert unfinished[1] == waiting
        retried = await s.inbox_start(running.id)
        assert (retried.status, retried.attempts) == ("running", 2)
        # The platform redelivers the event it never saw acknowledged: still one row.
        assert await add(s, "2") == (retried, False)


async def test_counts(store: Store) -> None:
    assert await store.inbox_counts() == dict.fromkeys(
        ("pending", "running", "done", "failed", "dropped"), 0
    )
    assert await store.outbox_counts() == {"pending": 0, "sent": 0, "failed": 0}
    rows = [(await add(store, str(n)))[0] for n in range(6)]
    await store.inbox_start(rows[0].id)
    await store.inbox_start(rows[1].id)
    await store.inbox_finish(rows[1].id, "done", reply=reply())
    await store.inbox_finish(rows[2].id, "failed")
    await store.inbox_finish(rows[3].id, "dropped")
    await store.inbox_finish(rows[4].id, "dropped")
    sent = await store.outbox_add(reply(kind="notice"))
    await store.outbox_finish(sent.id, "sent")
    failed = await store.outbox_add(reply(kind="job"))
    await store.outbox_finish(failed.id, "failed", error="chat gone")
    await store.outbox_add(reply(kind="job"))
    assert await store.inbox_counts() == {
        "pending": 1,
        "running": 1,
        "done": 1,
        "failed": 1,
        "dropped": 2,
    }
    assert await store.outbox_counts() == {"pending": 2, "sent": 1, "failed": 1}


# -- outbox ---------------------------------------------------------------------------------
async def test_outbox_pending_in_id_order_and_by_platform(store: Store) -> None:
    a = await store.outbox_add(reply("a", platform="slack", kind="notice"))
    b = await store.outbox_add(reply("b", platform="telegram", kind="job"))
    c = await store.outbox_add(reply("c", platform="slack"))
    d = await store.outbox_add(reply("d", platform="discord"))
    assert a.id < b.id < c.id < d.id
    assert (a.inbox_id, a.kind, b.kind) == (None, "notice", "job")
    await store.outbox_finish(c.id, "sent")
    assert [r.text for r in await store.outbox_pending()] == ["a", "b", "d"]
    assert [r.text for r in await store.outbox_pending(platform="slack")] == ["a"]
    assert await store.outbox_pending(platform="discord") == [d]
    assert await store.outbox_pending(platform="irc") == []


async def test_part_progress_survives_reopen(place: Place) -> None:
    async with place.store() as s:
        row = await s.outbox_add(reply("long answer"))
        first = await s.outbox_begin_part(row.id, 0)
        assert (first.in_flight, first.attempts, first.sent_parts) == (0, 1, {})
        assert first.updated_at >= row.updated_at
        sent = await s.outbox_part_sent(row.id, 0, "tg-100")
        assert (sent.in_flight, sent.sent_parts) == (None, {0: "tg-100"})
        await s.outbox_begin_part(row.id, 1)
        # Crash while part 1's request is out.
    async with place.store() as s:
        [left] = await s.outbox_pending()
        assert (left.id, left.in_flight, left.attempts, left.sent_parts) == (
            row.id,
            1,
            2,
            {0: "tg-100"},
        )
        # The lookup found it: the unknown outcome becomes a sent part.
        found = await s.outbox_part_sent(row.id, 1, "tg-101")
        assert (found.in_flight, found.sent_parts) == (None, {0: "tg-100", 1: "tg-101"})
        done = await s.outbox_finish(row.id, "sent")
    async with place.store() as s:
        assert await s.get_outbox(row.id) == done
        assert done.status == "sent"
        assert done.sent_parts == {0: "tg-100", 1: "tg-101"}
        assert await s.outbox_pending() == []


async def test_part_guards(store: Store) -> None:
    row = await store.outbox_add(reply())
    await store.outbox_begin_part(row.id, 0)
    with pytest.raises(StoreError, match="the outcome of part 0 is still unknown"):
        await store.outbox_begin_part(row.id, 1)
    retry = await store.outbox_begin_part(row.id, 0)
    assert (retry.in_flight, retry.attempts) == (0, 2)
    sent = await store.outbox_part_sent(row.id, 0, "m0")
    assert await store.outbox_part_sent(row.id, 0, "m0") == sent
    with pytest.raises(StoreError, match="already sent as 'm0'"):
        await store.outbox_part_sent(row.id, 0, "m0-bis")
    with pytest.raises(StoreError, match="that part is already sent"):
        await store.outbox_begin_part(row.id, 0)
    with pytest.raises(StoreError, match="must not be negative"):
        await store.outbox_begin_part(row.id, -1)
    with pytest.raises(StoreError, match="no such outbox row"):
        await store.outbox_begin_part(999, 0)
    assert await store.get_outbox(row.id) == sent
    finished = await store.outbox_finish(row.id, "failed", error="chat gone")
    assert (finished.status, finished.error) == ("failed", "chat gone")
    with pytest.raises(StoreError, match="it is already 'failed'"):
        await store.outbox_begin_part(row.id, 1)
    with pytest.raises(StoreError, match="it is already 'failed'"):
        await store.outbox_part_sent(row.id, 1, "m1")
    with pytest.raises(StoreError, match="it is 'failed'; only a pending row can finish"):
        await store.outbox_finish(row.id, "sent")
    with pytest.raises(StoreError, match="no such outbox row"):
        await store.outbox_finish(999, "sent")
    with pytest.raises(StoreError, match="status must be one of"):
        await store.outbox_finish(row.id, "pending")  # type: ignore[arg-type]  # an invalid status on purpose
    assert await store.get_outbox(row.id) == finished


async def test_unsent_part_and_blind_resends(place: Place) -> None:
    async with place.store() as s:
        row = await s.outbox_add(reply())
        assert await s.outbox_part_unsent(row.id, 0) == row
        with pytest.raises(StoreError, match="no part is in flight"):
            await s.outbox_note_blind_resend(row.id)
        await s.outbox_begin_part(row.id, 0)
        with pytest.raises(StoreError, match="part 0 is in flight"):
            await s.outbox_part_unsent(row.id, 1)
        # A rate limit: the part was definitely not sent, so its outcome is known again.
        cleared = await s.outbox_part_unsent(row.id, 0)
        assert (cleared.in_flight, cleared.attempts) == (None, 1)
        await s.outbox_begin_part(row.id, 0)
    async with place.store() as s:
        noted = await s.outbox_note_blind_resend(row.id)
        assert (noted.in_flight, noted.blind_resends) == (0, 1)
    async with place.store() as s:
        again = await s.get_outbox(row.id)
        assert again == noted
        await s.outbox_part_sent(row.id, 0, "m0")
        with pytest.raises(StoreError, match="it is already sent"):
            await s.outbox_part_unsent(row.id, 0)


# -- cursors --------------------------------------------------------------------------------
async def test_cursors_survive_reopen(place: Place) -> None:
    async with place.store() as s:
        assert await s.get_cursor("telegram.offset") is None
        await s.set_cursor("telegram.offset", "100")
        await s.set_cursor("telegram.offset", "101")
        await s.set_cursor("discord.last:42", "1234567890123456789")
    async with place.store() as s:
        assert await s.get_cursor("telegram.offset") == "101"
        assert await s.get_cursor("discord.last:42") == "1234567890123456789"


async def test_cursor_moves_with_the_inbox_row_or_not_at_all(store: Store, place: Place) -> None:
    await store.set_cursor("telegram.offset", "10")
    row, inserted = await add(store, "10", cursor=("telegram.offset", "11"))
    assert inserted
    assert await store.get_cursor("telegram.offset") == "11"
    place.fail("inbox")
    with pytest.raises(StoreError, match="adding event '11' of 'telegram' to the inbox failed"):
        await add(store, "11", cursor=("telegram.offset", "12"))
    assert await store.get_cursor("telegram.offset") == "11"
    assert await store.find_inbox("telegram", "11") is None
    place.heal("inbox")
    # A failing cursor write takes the row down with it.
    place.fail("cursors")
    with pytest.raises(StoreError, match="disk full"):
        await add(store, "11", cursor=("telegram.fresh", "12"))
    assert await store.find_inbox("telegram", "11") is None
    place.heal("cursors")
    # A redelivered update is already committed, so the offset may move past it.
    again, inserted = await add(store, "10", cursor=("telegram.offset", "11"))
    assert (again, inserted) == (row, False)
    assert await store.get_cursor("telegram.offset") == "11"
    assert [r.event_id for r in await store.inbox_unfinished()] == ["10"]


# -- schema ---------------------------------------------------------------------------------
async def test_schema_has_the_chat_tables(store: Store, place: Place) -> None:
    names = place.names()
    assert {"inbox", "inbox_by_status", "outbox", "outbox_by_status", "cursors"} <= names
    assert await store.schema_version() >= 3


# -- durability -----------------------------------------------------------------------------
async def test_commits_the_outside_acts_on_are_synced_and_the_rest_are_not(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inbox adds (before the ack) and part begins (before the send) return once the log is
    synced; the bookkeeping in between does not sync, the next sync covers it. An inbox add
    whose caller syncs later (the router, while the turn starts) does not either."""
    synced: list[int] = []
    monkeypatch.setattr(sqlite_sync, "_fdatasync", synced.append)
    async with SQLiteStore(tmp_path / "geodebot.db", synchronous="FULL") as s:

        async def syncs_of(step: Awaitable[object]) -> int:
            before = len(synced)
            await step
            return len(synced) - before

        opened = len(synced)  # one sync per migration applied
        row, _ = await add(s, "1")
        assert len(synced) - opened == 1
        assert await syncs_of(s.inbox_start(row.id)) == 0
        _, out = await s.inbox_finish(row.id, "done", reply=reply())
        assert out is not None
        assert await syncs_of(s.outbox_begin_part(out.id, 0)) == 1
        assert await syncs_of(s.outbox_part_sent(out.id, 0, "m1", last=True)) == 0
        assert await syncs_of(add(s, "2")) == 1
        assert await syncs_of(add(s, "3", durable=False)) == 0
        assert await syncs_of(s.sync()) == 1
        assert await syncs_of(s.sync()) == 0
        finished = await s.get_outbox(out.id)
        assert finished is not None
        assert finished.status == "sent"
