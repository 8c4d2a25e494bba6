"""Dead letters: which rows count, the operator's one decision on each, the unanswered count,
and the feed that hands replays to a running daemon, over real SQLite stores."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sqlite3
import time
from collections.abc import AsyncIterator

import pytest

from geodebot.channels.base import ChannelError
from geodebot.chat.deadletters import DeadLetters, ReplayFeed, parse_id
from geodebot.chat.outbox import OutboxSender, _Later
from geodebot.chat.ownership import LocalOwner
from geodebot.store.records import ApprovalRecord, InboxRow, NewOutbound, OutboxRow, StoreError
from geodebot.store.sqlite import SQLiteStore
from geodebot.testing import MemoryChannel


@pytest.fixture
async def store(tmp_path: pathlib.Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "geodebot.db") as opened:
        yield opened


def raw(store: SQLiteStore) -> contextlib.closing[sqlite3.Connection]:
    return contextlib.closing(sqlite3.connect(store.path, isolation_level=None))


_events = iter(range(1, 1_000_000))


async def message(store: SQLiteStore, text: str = "hello") -> InboxRow:
    n = next(_events)
    row, new = await store.inbox_add(
        platform="telegram",
        event_id=f"e{n}",
        session_id="telegram:42",
        channel="42",
        thread=None,
        user="u1",
        text=text,
        message_id=f"m{n}",
    )
    assert new
    return row


def reply_to(row: InboxRow, text: str = "the answer") -> NewOutbound:
    return NewOutbound(
        session_id=row.session_id,
        platform=row.platform,
        channel=row.channel,
        thread=row.thread,
        reply_to=row.message_id,
        text=text,
    )


async def answered(store: SQLiteStore, text: str = "hello") -> tuple[InboxRow, OutboxRow]:
    row = await message(store, text)
    finished, outbound = await store.inbox_finish(row.id, "done", reply=reply_to(row))
    assert outbound is not None
    return finished, outbound


async def given_up(store: SQLiteStore, error: str = "403: bot was blocked") -> OutboxRow:
    """A reply whose part 0 the platform refused for good, as the sender leaves it."""
    _, outbound = await answered(store)
    await store.outbox_begin_part(outbound.id, 0)
    return await store.outbox_finish(outbound.id, "failed", error=error)


async def sent(store: SQLiteStore, outbound: OutboxRow) -> OutboxRow:
    await store.outbox_begin_part(outbound.id, 0)
    return await store.outbox_part_sent(outbound.id, 0, "tg-1", last=True)


async def ids(store: SQLiteStore, **kwargs: object) -> list[str]:
    return [letter.id for letter in await store.deadletters(**kwargs)]  # type: ignore[arg-type]


# -- which rows count ------------------------------------------------------------------------
async def test_a_reply_the_sender_gave_up_on_is_listed_with_its_error(store: SQLiteStore) -> None:
    failed = await given_up(store, "403: bot was blocked by the user")
    _, delivered = await answered(store)
    await sent(store, delivered)
    await store.outbox_add(reply_to(await message(store)))  # pending: still being sent

    [letter] = await store.deadletters()
    assert letter.id == f"out-{failed.id}"
    assert letter.kind == "outbox"
    assert letter.dead
    assert letter.error == "403: bot was blocked by the user"
    assert letter.decision is None
    assert isinstance(letter.row, OutboxRow)
    assert letter.row.text == "the answer"
    assert await store.deadletter_count() == 1


async def test_an_accepted_message_finished_without_any_reply_row_is_listed(
    store: SQLiteStore,
) -> None:
    lost = await message(store, "lost")
    await store.inbox_finish(lost.id, "done", detail="completed")
    crashed = await message(store, "crashed")
    await store.inbox_finish(crashed.id, "failed", detail="internal_error")

    listed = await store.deadletters()
    assert {letter.id for letter in listed} == {f"in-{lost.id}", f"in-{crashed.id}"}
    by_id = {letter.id: letter for letter in listed}
    assert by_id[f"in-{crashed.id}"].error == "internal_error"
    assert by_id[f"in-{lost.id}"].row.text == "lost"


async def test_rows_answered_dropped_recorded_or_unfinished_are_not_dead_letters(
    store: SQLiteStore,
) -> None:
    await answered(store)  # a reply row, pending: the sender's
    # A failed turn whose failure notice is its one reply.
    noticed = await message(store)
    await store.inbox_finish(noticed.id, "failed", detail="internal_error", reply=reply_to(noticed))
    # Dropped on purpose, with or without a notice.
    throttled = await message(store)
    await store.inbox_finish(throttled.id, "dropped", detail="throttled")
    busy = await message(store)
    await store.inbox_finish(busy.id, "dropped", detail="busy", reply=reply_to(busy))
    # Unfinished: a daemon answers them.
    await message(store)
    running = await message(store)
    await store.inbox_start(running.id)
    # A relayed "notify" message: recorded in its session, answered by nobody.
    notify = await message(store)
    with raw(store) as db:
        db.execute("UPDATE inbox SET relay_intent = 'notify' WHERE id = ?", (notify.id,))
    await store.inbox_finish(notify.id, "done", detail="relay_notify")

    assert await store.deadletters() == []
    assert await store.deadletter_count() == 0
    for row_id in (noticed.id, throttled.id, busy.id, running.id, notify.id):
        letter = await store.deadletter_get("inbox", row_id)
        assert letter is not None
        assert not letter.dead


async def test_a_message_whose_reply_failed_is_listed_once_as_the_reply(
    store: SQLiteStore,
) -> None:
    failed = await given_up(store)
    assert await ids(store) == [f"out-{failed.id}"]
    inbox = await store.deadletter_get("inbox", failed.inbox_id or 0)
    assert inbox is not None
    assert not inbox.dead


async def test_the_list_pages_most_recently_dead_first(store: SQLiteStore) -> None:
    rows = [await given_up(store, f"error {n}") for n in range(5)]
    with raw(store) as db:
        for n, row in enumerate(rows):
            db.execute("UPDATE outbox SET updated_at = ? WHERE id = ?", (1000.0 + n, row.id))
    newest_first = [f"out-{row.id}" for row in reversed(rows)]
    assert await ids(store) == newest_first
    assert await ids(store, limit=2) == newest_first[:2]
    assert await ids(store, limit=2, offset=2) == newest_first[2:4]
    assert await ids(store, limit=2, offset=4) == newest_first[4:]
    with pytest.raises(StoreError):
        await store.deadletters(limit=-1)


# -- replay and discard ----------------------------------------------------------------------
async def test_replaying_a_reply_makes_it_pending_with_its_sent_parts_kept(
    store: SQLiteStore,
) -> None:
    _, outbound = await answered(store)
    # Part 0 went out; part 1 was refused for good.
    await store.outbox_begin_part(outbound.id, 0)
    await store.outbox_part_sent(outbound.id, 0, "tg-0")
    await store.outbox_begin_part(outbound.id, 1)
    await store.outbox_note_blind_resend(outbound.id)
    await store.outbox_finish(outbound.id, "failed", error="400: chat not found")

    done = await store.deadletter_replay("outbox", outbound.id, by="alice", via="cli")

    assert done.result == "decided"
    assert done.decision is not None
    assert (done.decision.action, done.decision.by, done.decision.via) == ("replay", "alice", "cli")
    assert done.decision.detail == "400: chat not found"
    row = await store.get_outbox(outbound.id)
    assert row == done.row
    assert row is not None
    assert row.status == "pending"
    assert row.error == ""
    assert row.sent_parts == {0: "tg-0"}
    # Looked up first where the platform can say, and one blind resend allowed again.
    assert row.in_flight == 1
    assert row.blind_resends == 0
    assert [r.id for r in await store.outbox_pending()] == [outbound.id]
    assert await store.deadletters() == []


async def test_a_dead_letter_is_decided_once_and_the_first_decision_wins(
    store: SQLiteStore,
) -> None:
    failed = await given_up(store)
    first = await store.deadletter_replay("outbox", failed.id, by="alice", via="console")
    # Failing again after the replay: still decided, so neither replayed nor discarded again.
    await store.outbox_finish(failed.id, "failed", error="403 again")

    again = await store.deadletter_replay("outbox", failed.id, by="bob", via="cli")
    discard = await store.deadletter_discard("outbox", failed.id, by="bob", via="cli")

    for late in (again, discard):
        assert late.result == "already_decided"
        assert late.decision == first.decision
        assert late.row is not None
        assert late.row.status == "failed"
    assert await store.deadletters() == []
    [shown] = await store.deadletters(decided=True)
    assert shown.id == f"out-{failed.id}"
    assert shown.decision == first.decision
    with raw(store) as db:
        assert db.execute("SELECT COUNT(*) FROM deadletter_decisions").fetchone() == (1,)


async def test_discard_leaves_the_row_as_it_is_and_off_the_list(store: SQLiteStore) -> None:
    failed = await given_up(store)
    done = await store.deadletter_discard("outbox", failed.id, by="alice", via="cli")
    assert done.result == "decided"
    assert done.decision is not None
    assert done.decision.action == "discard"
    assert done.row == await store.get_outbox(failed.id)
    assert done.row is not None
    assert done.row.status == "failed"
    assert await store.outbox_pending() == []
    assert await store.deadletters() == []
    assert await store.deadletter_count() == 0
    letter = await store.deadletter_get("outbox", failed.id)
    assert letter is not None
    assert letter.dead
    assert letter.decision == done.decision
    replay = await store.deadletter_replay("outbox", failed.id, by="bob", via="cli")
    assert replay.result == "already_decided"
    assert await store.outbox_pending() == []


async def test_rows_that_are_no_dead_letters_or_do_not_exist_are_refused(
    store: SQLiteStore,
) -> None:
    _, outbound = await answered(store)
    delivered = await sent(store, outbound)
    refused = await store.deadletter_replay("outbox", delivered.id, by="alice", via="cli")
    assert refused.result == "not_dead"
    assert refused.row == delivered
    unknown = await store.deadletter_discard("inbox", 999, by="alice", via="cli")
    assert unknown.result == "unknown"
    assert unknown.row is None
    assert await store.deadletter_get("outbox", 999) is None
    with raw(store) as db:
        assert db.execute("SELECT COUNT(*) FROM deadletter_decisions").fetchone() == (0,)
    with pytest.raises(StoreError):
        await store.deadletter_replay("outbox", delivered.id, by="", via="cli")
    with pytest.raises(StoreError):
        await store.deadletter_replay("outbox", delivered.id, by="a", via="web")  # type: ignore[arg-type]


async def test_replaying_a_message_runs_its_turn_again_and_it_gets_one_reply(
    store: SQLiteStore,
) -> None:
    row = await message(store)
    await store.inbox_finish(row.id, "failed", detail="internal_error")

    done = await store.deadletter_replay("inbox", row.id, by="alice", via="cli")

    assert done.result == "decided"
    assert done.decision is not None
    assert done.decision.detail == "internal_error"
    assert isinstance(done.row, InboxRow)
    assert (done.row.status, done.row.detail, done.row.finished_at) == ("pending", "", None)
    assert [r.id for r in await store.inbox_unfinished()] == [row.id]
    # The normal path: started, finished with its reply (once; a second finish is refused).
    await store.inbox_start(row.id)
    _, outbound = await store.inbox_finish(row.id, "done", reply=reply_to(row))
    assert outbound is not None
    assert outbound.inbox_id == row.id
    with pytest.raises(StoreError):
        await store.inbox_finish(row.id, "done", reply=reply_to(row))
    assert await store.deadletters(decided=True) == []


async def test_two_processes_replaying_at_once_replay_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "geodebot.db"
    async with SQLiteStore(path) as one, SQLiteStore(path) as two:
        failed = await given_up(one)
        results = await asyncio.gather(
            one.deadletter_replay("outbox", failed.id, by="alice", via="cli"),
            two.deadletter_replay("outbox", failed.id, by="bob", via="console"),
            two.deadletter_discard("outbox", failed.id, by="carol", via="console"),
        )
        assert sorted(r.result for r in results) == [
            "already_decided",
            "already_decided",
            "decided",
        ]
        decisions = {r.decision for r in results}
        assert len(decisions) == 1


async def test_the_revision_grows_with_each_decision(store: SQLiteStore) -> None:
    assert await store.deadletters_revision() == 0
    a, b = await given_up(store), await given_up(store)
    await store.deadletter_replay("outbox", a.id, by="alice", via="cli")
    first = await store.deadletters_revision()
    await store.deadletter_discard("outbox", b.id, by="alice", via="cli")
    assert await store.deadletters_revision() > first > 0
    decisions = await store.deadletter_decisions(after=first)
    assert [(d.row_id, d.action) for d in decisions] == [(b.id, "discard")]


# -- unanswered messages ---------------------------------------------------------------------
async def test_unanswered_counts_unfinished_messages_older_than_the_alert(
    store: SQLiteStore,
) -> None:
    now = time.time()
    old_pending, old_running, fresh, old_done = [await message(store) for _ in range(4)]
    await store.inbox_start(old_running.id)
    await store.inbox_finish(old_done.id, "done", reply=reply_to(old_done))
    with raw(store) as db:
        for row, age in ((old_pending, 400), (old_running, 900), (old_done, 1000), (fresh, 10)):
            db.execute("UPDATE inbox SET received_at = ? WHERE id = ?", (now - age, row.id))

    late = await store.inbox_unanswered(300)
    assert late.count == 2
    assert late.oldest_age_s is not None
    assert 900 <= late.oldest_age_s < 960
    assert (await store.inbox_unanswered(1)).count == 3
    # Waiting for a person's approval is not being left unanswered, until it is decided.
    await store.ensure_session(old_running.session_id, "daemon")
    approval, _ = await store.approval_open(
        ApprovalRecord(
            id="ap1",
            session_id=old_running.session_id,
            turn_id=old_running.turn_id,
            call_id="toolu_1",
            tool="write_file",
            safety="write",
            call_sha256="cd" * 32,
            summary="{}",
            origin="telegram:42",
            approvers=("4242",),
            status="pending",
            created_at=now,
            expires_at=now + 900,
        )
    )
    waiting = await store.inbox_unanswered(300)
    assert waiting.count == 1
    assert waiting.oldest_age_s is not None
    assert 400 <= waiting.oldest_age_s < 460
    await store.approval_decide(approval.id, True, by="4242", via="chat")
    assert (await store.inbox_unanswered(300)).count == 2
    none = await store.inbox_unanswered(3600)
    assert (none.count, none.oldest_age_s) == (0, None)


# -- the service -----------------------------------------------------------------------------
def test_ids_name_the_row() -> None:
    assert parse_id("in-12") == ("inbox", 12)
    assert parse_id(" out-5 ") == ("outbox", 5)
    for bad in ("out-0", "out-", "in-1x", "12", "msg-3", "out--2", "in-01"):
        assert parse_id(bad) is None


async def test_the_service_says_what_each_decision_came_to(store: SQLiteStore) -> None:
    handed: list[InboxRow | OutboxRow] = []
    letters = DeadLetters(store, on_replayed=handed.append)
    failed, other = await given_up(store), await given_up(store)

    [listed, _] = await letters.list()
    assert listed.id == f"out-{other.id}"
    assert await letters.count() == 2
    shown = await letters.show(f"out-{failed.id}")
    assert shown is not None
    assert shown.dead
    assert await letters.show("out-999") is None
    assert await letters.show("nonsense") is None

    replayed = await letters.replay(f"out-{failed.id}", by="alice", via="console")
    assert (replayed.ok, replayed.result) == (True, "replayed")
    assert replayed.message() == f"out-{failed.id} replayed: it is sent again"
    assert [row.id for row in handed] == [failed.id]
    assert handed[0].status == "pending"

    again = await letters.replay(f"out-{failed.id}", by="bob", via="cli")
    assert (again.ok, again.result) == (False, "already_decided")
    assert again.message().startswith(f"out-{failed.id} was already replayed by alice via console")
    discarded = await letters.discard(f"out-{other.id}", by="bob", via="cli")
    assert (discarded.ok, discarded.result) == (True, "discarded")
    assert len(handed) == 1  # a discard hands nothing over

    _, outbound = await answered(store)
    not_dead = await letters.replay(f"out-{outbound.id}", by="bob", via="cli")
    assert (not_dead.ok, not_dead.result) == (False, "not_dead")
    assert "is not a dead letter" in not_dead.message()
    for unknown_id in ("out-999", "x-1"):
        unknown = await letters.discard(unknown_id, by="bob", via="cli")
        assert (unknown.ok, unknown.result) == (False, "unknown")
        assert unknown.message().startswith(f"no dead letter {unknown_id}")
    assert len(handed) == 1


class _Daemon:
    """What a daemon gives the feed: its router's take and its outbox's submit."""

    def __init__(self, *, bound: bool = True) -> None:
        self.bound = bound
        self.taken: list[InboxRow] = []
        self.submitted: list[OutboxRow] = []
        self.got_one = asyncio.Event()

    def take(self, row: InboxRow) -> bool:
        if self.bound:
            self.taken.append(row)
        return self.bound

    def submit(self, row: OutboxRow) -> None:
        self.submitted.append(row)
        self.got_one.set()


async def test_the_feed_hands_over_replays_made_by_another_process(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "geodebot.db"
    async with SQLiteStore(path) as daemon_store, SQLiteStore(path) as cli_store:
        before = await given_up(daemon_store)
        await cli_store.deadletter_replay("outbox", before.id, by="alice", via="cli")
        daemon = _Daemon()
        feed = ReplayFeed(daemon_store, daemon.take, daemon.submit)
        # Replayed before the start: the daemon's start-up reads it as a pending row.
        await feed.start()
        assert await feed.poll() == 0

        reply = await given_up(daemon_store)
        lost = await message(daemon_store)
        await daemon_store.inbox_finish(lost.id, "done", detail="completed")
        discarded = await given_up(daemon_store)
        cli = DeadLetters(cli_store)
        assert (await cli.replay(f"out-{reply.id}", by="alice", via="cli")).ok
        assert (await cli.replay(f"in-{lost.id}", by="alice", via="cli")).ok
        assert (await cli.discard(f"out-{discarded.id}", by="alice", via="cli")).ok

        assert await feed.poll() == 2
        assert [(r.id, r.status) for r in daemon.submitted] == [(reply.id, "pending")]
        assert [(r.id, r.status) for r in daemon.taken] == [(lost.id, "pending")]
        assert await feed.poll() == 0  # each once

        # A row sent since its replay is not handed over (a console replay that the
        # daemon's outbox already delivered, say).
        third = await given_up(daemon_store)
        await cli_store.deadletter_replay("outbox", third.id, by="alice", via="cli")
        await sent(daemon_store, third)
        assert await feed.poll() == 0
        assert len(daemon.submitted) == 1


async def test_a_replay_made_in_the_daemon_wakes_the_feed_at_once(store: SQLiteStore) -> None:
    daemon = _Daemon()
    # A poll far slower than the test: only the wake-up can explain a quick handover.
    feed = ReplayFeed(store, daemon.take, daemon.submit, poll_s=3600)
    letters = DeadLetters(store, on_replayed=feed.replayed)
    await feed.start()
    task = asyncio.create_task(feed.run())
    try:
        failed = await given_up(store)
        assert (await letters.replay(f"out-{failed.id}", by="alice", via="console")).ok
        async with asyncio.timeout(10):
            await daemon.got_one.wait()
        assert [r.id for r in daemon.submitted] == [failed.id]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_replayed_message_whose_chat_is_unbound_is_dropped(store: SQLiteStore) -> None:
    daemon = _Daemon(bound=False)
    feed = ReplayFeed(store, daemon.take, daemon.submit)
    await feed.start()
    row = await message(store)
    await store.inbox_finish(row.id, "failed", detail="internal_error")
    await store.deadletter_replay("inbox", row.id, by="alice", via="cli")
    assert await feed.poll() == 0
    dropped = await store.get_inbox(row.id)
    assert dropped is not None
    assert (dropped.status, dropped.detail) == ("dropped", "binding removed")


# -- with the outbox sender ------------------------------------------------------------------
async def replay_to(sender: OutboxSender, store: SQLiteStore, outbox_id: int) -> DeadLetters:
    """Replay a dead outbox row as alice from the console, and hand it to ``sender`` as the
    daemon's feed would."""
    replayed: list[InboxRow | OutboxRow] = []
    letters = DeadLetters(store, on_replayed=replayed.append)
    assert (await letters.replay(f"out-{outbox_id}", by="alice", via="console")).ok
    [again] = replayed
    assert isinstance(again, OutboxRow)
    await sender.deliver(again)
    return letters


async def test_a_replayed_reply_sends_only_the_parts_that_did_not_go(store: SQLiteStore) -> None:
    chat = MemoryChannel(limit=10)
    sender = OutboxSender(
        store,
        {"telegram": chat},
        owner=LocalOwner(),
    )
    row = await message(store)
    _, outbound = await store.inbox_finish(row.id, "done", reply=reply_to(row, "a" * 10 + "b" * 10))
    assert outbound is not None
    # Part 0 went out before; the platform refuses part 1 for good.
    await store.outbox_begin_part(outbound.id, 0)
    half_sent = await store.outbox_part_sent(outbound.id, 0, "earlier")
    chat.fail_next(ChannelError("403: bot was blocked", permanent=True))
    await sender.deliver(half_sent)
    failed = await store.get_outbox(outbound.id)
    assert failed is not None
    assert (failed.status, failed.error) == ("failed", "403: bot was blocked")
    # Refused, not an open outcome: nothing to look up, no blind resend to spend.
    assert failed.in_flight is None
    assert chat.texts() == []

    letters = await replay_to(sender, store, outbound.id)

    assert chat.texts() == ["b" * 10]
    done = await store.get_outbox(outbound.id)
    assert done is not None
    assert (done.status, done.blind_resends) == ("sent", 0)
    assert sorted(done.sent_parts) == [0, 1]
    assert not (await letters.replay(f"out-{outbound.id}", by="bob", via="cli")).ok
    assert chat.texts() == ["b" * 10]


async def test_the_sender_tells_of_each_row_it_gives_up_on_or_sends_in_the_end(
    store: SQLiteStore,
) -> None:
    """What shows dead letters (the console's open pages) hears of a new one, and of a
    replayed one that went out, from the sender itself."""
    chat = MemoryChannel(limit=10)
    finished: list[OutboxRow] = []
    sender = OutboxSender(
        store,
        {"telegram": chat},
        on_finished=finished.append,
        owner=LocalOwner(),
    )
    _, outbound = await answered(store)
    chat.fail_next(ChannelError("403: bot was blocked", permanent=True))
    await sender.deliver(outbound)
    [failed] = finished
    assert (failed.id, failed.status, failed.error) == (
        outbound.id,
        "failed",
        "403: bot was blocked",
    )

    await replay_to(sender, store, outbound.id)
    assert chat.texts() == ["the answer"]
    assert [(row.id, row.status) for row in finished] == [
        (outbound.id, "failed"),
        (outbound.id, "sent"),
    ]
    # A row left pending (the platform unwell for now) is not finished: nobody is told.
    _, later = await answered(store)
    chat.fail_next(*[ChannelError("502: bad gateway")] * 10)

    async def no_pause(seconds: float) -> None:
        await asyncio.sleep(0)

    sender = OutboxSender(
        store,
        {"telegram": chat},
        sleep=no_pause,
        on_finished=finished.append,
        owner=LocalOwner(),
    )
    with pytest.raises(_Later):  # the chat is tried again on a later pass
        await sender.deliver(later)
    pending = await store.get_outbox(later.id)
    assert pending is not None
    assert pending.status == "pending"
    assert len(finished) == 2


async def test_messages_left_without_a_reply_in_an_older_database_are_found(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "geodebot.db"
    async with SQLiteStore(path) as store:
        _, answered_reply = await answered(store)
        lost = await message(store)
        notify = await message(store)
        unfinished = await message(store)
    # The database as it was before migration 0012 (and the ones after it), with rows its
    # code left: a message finished without a reply, a relayed "notify" message, an
    # answered and an open one.
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.executescript(
            "DROP TABLE memory_fts; DROP TABLE memory_items; DROP TABLE memory_projects; "
            "ALTER TABLE outbox DROP COLUMN speech; ALTER TABLE outbox DROP COLUMN spoken; "
            "ALTER TABLE model_calls DROP COLUMN audio_seconds; "
            "ALTER TABLE model_calls DROP COLUMN spoken_chars; "
            "DROP TABLE pairings; DROP TABLE stored_bindings; "
            "DELETE FROM cursors WHERE name = 'stored_bindings'; "
            "DROP TABLE leases; DROP TABLE replicas; "
            "DROP INDEX inbox_pickup; ALTER TABLE inbox DROP COLUMN pickup; "
            "DROP TABLE deadletter_decisions; DROP INDEX inbox_no_reply; "
            "ALTER TABLE inbox DROP COLUMN no_reply; ALTER TABLE job_fires DROP COLUMN replica; "
            "DELETE FROM schema_migrations WHERE version >= 12;"
        )
        db.execute(
            "UPDATE inbox SET status = 'failed', detail = 'internal_error' WHERE id = ?",
            (lost.id,),
        )
        db.execute(
            "UPDATE inbox SET status = 'done', relay_intent = 'notify' WHERE id = ?", (notify.id,)
        )
    async with SQLiteStore(path) as store:
        assert await store.schema_version() >= 12
        assert await ids(store) == [f"in-{lost.id}"]
        for row_id in (answered_reply.inbox_id or 0, notify.id, unfinished.id):
            letter = await store.deadletter_get("inbox", row_id)
            assert letter is not None
            assert not letter.dead
