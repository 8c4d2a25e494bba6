"""Group commit: concurrent writes share transactions, yet each is still its own unit; writes
run on the event loop's thread and never make it wait."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from geodebot.store import sqlite as sqlite_store
from geodebot.store.records import StoreError
from geodebot.store.sqlite import SQLiteStore
from tests.support.disk import Disk


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "g.db") as opened:
        await opened._transact(
            "creating the probe table",
            lambda db: db.execute("CREATE TABLE probe (k TEXT PRIMARY KEY, v INTEGER NOT NULL)"),
        )
        yield opened


def insert(key: str, value: int = 0) -> Callable[[sqlite3.Connection], str]:
    def fn(db: sqlite3.Connection) -> str:
        db.execute("INSERT INTO probe (k, v) VALUES (?, ?)", (key, value))
        return key

    return fn


async def rows(store: SQLiteStore) -> list[tuple[str, int]]:
    def read(db: sqlite3.Connection) -> list[tuple[str, int]]:
        return [tuple(r) for r in db.execute("SELECT k, v FROM probe ORDER BY rowid")]

    return await store._query("reading probes", read)


def traced(store: SQLiteStore) -> list[str]:
    """The statements the store's write connection runs from now on."""
    seen: list[str] = []
    assert store._commits is not None
    store._commits.connection.set_trace_callback(seen.append)
    return seen


async def test_concurrent_writes_share_transactions_in_order(store: SQLiteStore):
    seen = traced(store)
    keys = [f"k{i}" for i in range(40)]
    results = await asyncio.gather(*(store._transact(k, insert(k)) for k in keys))
    assert results == keys
    assert [k for k, _ in await rows(store)] == keys  # committed in the order asked
    # Asked for in one pass of the loop: one transaction, one commit.
    assert seen.count("BEGIN IMMEDIATE") == 1
    assert seen.count("COMMIT") == 1
    # One at a time, each its own.
    seen.clear()
    for key in ("x", "y"):
        await store._transact(key, insert(key))
    assert seen.count("COMMIT") == 2
    assert not any(sql.startswith("SAVEPOINT") for sql in seen)


async def test_a_failing_write_rolls_back_only_itself(store: SQLiteStore):
    def half_then_fail(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO probe (k, v) VALUES ('half', 1)")
        db.execute("INSERT INTO probe (k, v) VALUES ('dup', 1)")  # 'dup' is already there

    def refuse(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO probe (k, v) VALUES ('refused', 1)")
        raise StoreError("no, thanks")

    await store._transact("dup", insert("dup"))
    outcomes = await asyncio.gather(
        store._transact("a", insert("a")),
        store._transact("adding half", half_then_fail),
        store._transact("b", insert("b")),
        store._transact("refusing", refuse),
        store._transact("c", insert("c")),
        return_exceptions=True,
    )
    assert outcomes[0::2] == ["a", "b", "c"]
    assert isinstance(outcomes[1], StoreError)
    assert str(outcomes[1]).startswith("adding half failed: UNIQUE constraint failed")
    assert isinstance(outcomes[1].__cause__, sqlite3.IntegrityError)
    assert isinstance(outcomes[3], StoreError)
    assert str(outcomes[3]) == "no, thanks"
    assert [k for k, _ in await rows(store)] == ["dup", "a", "b", "c"]


async def test_a_bug_in_a_write_reaches_its_caller_as_it_is(store: SQLiteStore):
    def buggy(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO probe (k, v) VALUES ('bug', 1)")
        raise ZeroDivisionError("oops")

    outcomes = await asyncio.gather(
        store._transact("bug", buggy), store._transact("ok", insert("ok")), return_exceptions=True
    )
    assert isinstance(outcomes[0], ZeroDivisionError)
    assert outcomes[1] == "ok"
    assert await rows(store) == [("ok", 0)]


async def test_when_the_whole_transaction_is_lost_every_write_in_it_fails(store: SQLiteStore):
    # What SQLite does by itself on a full disk or an I/O error, done here by hand.
    def lose_everything(db: sqlite3.Connection) -> None:
        db.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    assert await store._transact("lead", insert("lead")) == "lead"
    outcomes = await asyncio.gather(
        store._transact("before", insert("before")),  # one group, lost as a whole
        store._transact("losing", lose_everything),
        store._transact("after", insert("after")),
        return_exceptions=True,
    )
    assert [type(o) for o in outcomes] == [StoreError] * 3
    assert str(outcomes[0]) == "before failed: database or disk is full"
    assert str(outcomes[2]) == "after failed: database or disk is full"
    assert await rows(store) == [("lead", 0)]
    # The store carries on.
    assert await store._transact("next", insert("next")) == "next"


async def test_a_cancelled_caller_still_gets_its_write_committed(store: SQLiteStore):
    task = asyncio.create_task(store._transact("kept", insert("kept")))
    await asyncio.sleep(0)  # queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store._commits.flush()
    assert await rows(store) == [("kept", 0)]


async def test_close_commits_the_writes_already_asked_for(tmp_path: Path):
    store = SQLiteStore(tmp_path / "c.db")
    await store.open()
    await store._transact("table", lambda db: db.execute("CREATE TABLE probe (k TEXT, v INT)"))
    pending = [asyncio.create_task(store._transact(k, insert(k))) for k in ("x", "y")]
    await asyncio.sleep(0)
    await store.close()
    assert [t.result() for t in pending] == ["x", "y"]
    with pytest.raises(StoreError, match="not open"):
        await store._transact("late", insert("late"))
    async with SQLiteStore(tmp_path / "c.db") as reopened:
        assert [k for k, _ in await rows(reopened)] == ["x", "y"]


async def held(store: SQLiteStore, disk: Disk, key: str) -> asyncio.Task[str]:
    """A durable insert of ``key``: committed, and its sync under way, held by ``disk``."""
    disk.go.clear()
    write = asyncio.create_task(store._transact(key, insert(key), durable=True))
    await disk.sync_started()
    return write


async def test_the_writer_commits_at_normal_and_never_switches_the_level(store: SQLiteStore):
    assert store._commits is not None
    conn = store._commits.connection
    seen = traced(store)
    await store._transact("relaxed", insert("relaxed"))
    await store._transact("durable", insert("durable"), durable=True)
    assert not [sql for sql in seen if "synchronous" in sql]
    # sqlite's numbers: 1 NORMAL. The store's level (FULL) is kept by syncing the log.
    assert int(conn.execute("PRAGMA synchronous").fetchone()[0]) == 1


async def test_a_durable_write_returns_once_the_log_is_synced_after_its_commit(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    durable = await held(store, disk, "durable")
    # Committed (a reader sees it) but not yet on disk: its caller waits, the loop does not.
    assert await rows(store) == [("durable", 0)]
    assert await store._transact("plain", insert("plain")) == "plain"
    assert not durable.done()
    disk.go.set()
    assert await asyncio.wait_for(durable, 5) == "durable"
    # The log itself, not the database file (which a checkpoint syncs).
    assert disk.synced == [f"{store.path}-wal"]


async def test_durable_writes_asked_for_during_a_sync_share_the_next_one(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    first = await held(store, disk, "first")
    # Committed after the running sync began: it cannot cover them.
    later = [
        asyncio.create_task(store._transact(k, insert(k), durable=True)) for k in ("a", "b", "c")
    ]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in (first, *later))
    disk.go.set()
    assert await asyncio.wait_for(asyncio.gather(first, *later), 5) == ["first", "a", "b", "c"]
    assert len(disk.synced) == 2


async def test_sync_waits_for_what_was_committed_without_a_sync_and_only_that(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    await store._transact("plain", insert("plain"))
    assert disk.synced == []
    disk.go.clear()
    waiting = asyncio.create_task(store.sync())
    await disk.sync_started()
    await asyncio.sleep(0.02)
    assert not waiting.done()
    disk.go.set()
    await asyncio.wait_for(waiting, 5)
    await store.sync()  # nothing new since
    assert len(disk.synced) == 1


async def waiting_for_company(store: SQLiteStore, disk: Disk) -> asyncio.Task[None]:
    """A commit, and a sync of it with 30 s to spare (what the router asks for before a
    platform's ack), not started yet."""
    await store._transact("plain", insert("plain"))
    acked = asyncio.create_task(store.sync(within_s=30))
    await asyncio.sleep(0.05)
    assert disk.synced == []
    assert not acked.done()
    return acked


async def test_a_sync_with_time_to_spare_is_shared_with_the_durable_write_that_follows(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    acked = await waiting_for_company(store, disk)
    # A durable write (the turn's answer) starts it at once: one sync for both.
    assert await store._transact("durable", insert("durable"), durable=True) == "durable"
    await asyncio.wait_for(acked, 5)
    assert len(disk.synced) == 1


async def test_a_sync_with_time_to_spare_starts_by_itself_when_the_time_is_up(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    await store._transact("plain", insert("plain"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(store.sync(within_s=0.2), 5)
    assert loop.time() - started >= 0.2
    assert len(disk.synced) == 1


async def test_close_runs_a_sync_that_was_waiting_for_company(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    acked = await waiting_for_company(store, disk)
    await asyncio.wait_for(store.close(), 5)
    await asyncio.wait_for(acked, 1)
    assert len(disk.synced) == 1


async def test_a_failed_sync_fails_its_writes_and_every_durable_write_after_it(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    disk = Disk(monkeypatch)
    broken: list[StoreError] = []
    store.on_broken(broken.append)
    disk.error = OSError(errno.EIO, "Input/output error")
    with pytest.raises(StoreError, match="doomed failed: syncing the store's log to disk failed"):
        await store._transact("doomed", insert("doomed"), durable=True)
    # The owner is told, once: the daemon stops (tests/faults/test_store_sync_failure.py).
    assert [str(e) for e in broken] == [
        "syncing the store's log to disk failed: [Errno 5] Input/output error"
    ]
    disk.error = None  # the disk answers again: the pages it dropped are lost all the same
    with pytest.raises(StoreError, match="later failed: syncing the store's log"):
        await store._transact("later", insert("later"), durable=True)
    with pytest.raises(StoreError, match="syncing the store's log to disk failed"):
        await store.sync()
    assert len(disk.synced) == 1
    assert len(broken) == 1
    # Asked after the store broke: told at once.
    late: list[StoreError] = []
    store.on_broken(late.append)
    assert late == broken


async def test_without_the_log_sync_commits_are_made_at_the_store_level(tmp_path: Path):
    async with SQLiteStore(tmp_path / "off.db", synchronous="OFF") as opened:
        assert opened._commits is not None
        conn = opened._commits.connection
        assert int(conn.execute("PRAGMA synchronous").fetchone()[0]) == 0
        assert opened._commits._log is None
        await opened.sync()


async def test_a_database_another_process_holds_is_waited_for_without_stopping_the_loop(
    store: SQLiteStore,
):
    # An operator's command holds the write lock for a while: the daemon's write waits for
    # it, and the event loop keeps running meanwhile.
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    write = asyncio.create_task(store._transact("waiting", insert("waiting")))
    started = time.monotonic()
    for _ in range(20):
        await asyncio.sleep(0.01)
    # A write that waited for the lock on the loop's thread would have held these pauses
    # up for the whole busy timeout (5 s).
    assert time.monotonic() - started < 1.0
    assert not write.done()
    holder.execute("COMMIT")
    holder.close()
    assert await asyncio.wait_for(write, 2) == "waiting"
    assert await rows(store) == [("waiting", 0)]


async def test_a_lock_held_past_the_busy_timeout_fails_the_write(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    assert store._commits is not None
    monkeypatch.setattr(store._commits, "_busy_timeout_s", 0.2)
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match="stuck failed: database is locked"):
            await asyncio.wait_for(store._transact("stuck", insert("stuck")), 5)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert await store._transact("after", insert("after")) == "after"


async def test_the_log_is_checkpointed_off_the_loop(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    assert store._commits is not None
    assert store._db is not None
    on_writer: list[tuple[str, str]] = []
    store._commits.connection.set_trace_callback(
        lambda sql: on_writer.append((threading.current_thread().name, sql))
    )
    on_thread: list[str] = []
    await store._db.set_trace_callback(on_thread.append)
    monkeypatch.setattr(store._commits, "_checkpoint_every", 5)
    monkeypatch.setattr(store._commits, "_commits", 0)
    for i in range(10):
        await store._transact(f"c{i}", insert(f"c{i}"))
        if store._checkpointing is not None:
            await store._checkpointing  # one at a time: a later one would be skipped
    # Every fifth commit, by the reading connection's thread; nothing was written while it
    # ran, so the write connection has nothing to finish (it never checkpoints on the loop:
    # its own automatic checkpoints are off).
    assert on_thread.count("PRAGMA wal_checkpoint(PASSIVE)") == 2
    assert not any("checkpoint" in sql.lower() for _, sql in on_writer)
    assert store._commits.connection.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0


async def test_a_checkpoint_written_beside_is_finished_between_writes_off_the_loop(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    assert store._commits is not None
    on_writer: list[tuple[str, str]] = []
    store._commits.connection.set_trace_callback(
        lambda sql: on_writer.append((threading.current_thread().name, sql))
    )
    loop = asyncio.get_running_loop()
    real = sqlite_store._checkpoint_passive
    beside: list[asyncio.Future[str]] = []

    def bulk_then_a_write(db: sqlite3.Connection) -> None:
        real(db)
        if threading.current_thread().name.startswith("geodebot-store-lent"):
            return
        # A write committed after the bulk pass copied the log, before it returns.
        done = threading.Event()

        def write() -> None:
            beside.append(asyncio.ensure_future(store._transact("beside", insert("beside"))))
            beside[0].add_done_callback(lambda _: done.set())

        loop.call_soon_threadsafe(write)
        assert done.wait(5)

    monkeypatch.setattr(sqlite_store, "_checkpoint_passive", bulk_then_a_write)
    monkeypatch.setattr(store._commits, "_checkpoint_every", 1)
    await store._transact("first", insert("first"))
    assert store._checkpointing is not None
    await store._checkpointing
    assert await beside[0] == "beside"
    finishing = [t for t, sql in on_writer if "checkpoint" in sql.lower()]
    assert finishing == ["geodebot-store-lent_0"]


async def test_under_steady_writes_the_log_starts_again_instead_of_growing(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    """A checkpoint beside the writes leaves the log with pages it has not copied (the
    writes made meanwhile), and only a log wholly copied starts again from its beginning:
    the end of each checkpoint is made between two writes."""
    assert store._commits is not None
    monkeypatch.setattr(store._commits, "_checkpoint_every", 10)
    log_file = store.path.with_name(store.path.name + "-wal")

    def restarts() -> int:
        # The log's header counts the times it started again (its checkpoint sequence number).
        return int(struct.unpack(">I", log_file.read_bytes()[12:16])[0])

    before, largest = restarts(), 0

    async def writer(n: int) -> None:
        nonlocal largest
        for i in range(300):
            await store._transact(f"w{n}.{i}", insert(f"w{n}.{i}" + "x" * 3000))
            largest = max(largest, log_file.stat().st_size)

    # Four writers keep a write in every pass of the loop while a checkpoint runs.
    await asyncio.gather(*(writer(n) for n in range(4)))
    written = 1200 * 3000
    assert restarts() - before >= 5, f"the log started again {restarts() - before} times"
    # The keys alone are written twice (table and index); without the ending between two
    # writes the log grows to seven times this. With it, the log's largest size is what the
    # writes add during the slowest checkpoint (a sync of the database file): about twice
    # this on an idle machine, more when other processes load the disk. Half of the growth
    # without the ending is a bound that load does not reach, and the log without the ending
    # always passes.
    assert largest < 3.5 * written, (
        f"the log grew to {largest} bytes for {written} written "
        f"(it started again {restarts() - before} times)"
    )
    assert len(await rows(store)) == 1200


class Borrower:
    """Borrows the store's write connection (GroupCommit.between_writes) and keeps it, on
    its thread, until ``give_back`` is set; then runs ``then`` on it."""

    def __init__(self, store: SQLiteStore) -> None:
        assert store._commits is not None
        self.commits = store._commits
        self.give_back = threading.Event()
        self._lent_out = threading.Event()

    async def borrow(self, then: Callable[[sqlite3.Connection], Any]) -> asyncio.Task[Any]:
        def borrowed(db: sqlite3.Connection) -> Any:
            self._lent_out.set()
            self.give_back.wait(5)
            return then(db)

        task = asyncio.create_task(self.commits.between_writes("borrowing", borrowed))
        await asyncio.to_thread(self._lent_out.wait, 5)
        return task


async def test_writes_wait_while_the_connection_is_lent_and_commit_when_it_is_back(
    store: SQLiteStore,
):
    borrower = Borrower(store)
    count = "SELECT COUNT(*) FROM probe"
    borrowing = await borrower.borrow(lambda db: db.execute(count).fetchone()[0])
    writes = [asyncio.create_task(store._transact(f"k{i}", insert(f"k{i}"))) for i in range(3)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in writes)
    with pytest.raises(StoreError, match="lent already"):
        await borrower.commits.between_writes("again", lambda db: None)
    borrower.give_back.set()
    assert await borrowing == 0
    assert await asyncio.gather(*writes) == ["k0", "k1", "k2"]
    assert [k for k, _ in await rows(store)] == ["k0", "k1", "k2"]


async def test_close_waits_for_a_lent_connection(tmp_path: Path):
    store = SQLiteStore(tmp_path / "lent.db")
    await store.open()
    borrower = Borrower(store)
    checkpoint = "PRAGMA wal_checkpoint(PASSIVE)"
    borrowing = await borrower.borrow(lambda db: db.execute(checkpoint).fetchall())
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0.05)
    assert not closing.done()
    borrower.give_back.set()
    await closing
    await borrowing  # the borrower's statement ran on the open connection


async def test_an_unexpected_failure_of_a_group_fails_its_writes_and_the_next_go_on(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
):
    assert store._commits is not None
    real = store._commits._commit
    calls = 0

    def broken_once(batch: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the group commit")
        return real(batch)

    monkeypatch.setattr(store._commits, "_commit", broken_once)
    outcomes = await asyncio.wait_for(
        asyncio.gather(
            store._transact("a", insert("a")),
            store._transact("b", insert("b")),
            return_exceptions=True,
        ),
        5,
    )
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    assert await asyncio.wait_for(store._transact("c", insert("c")), 5) == "c"
    await asyncio.wait_for(store._commits.flush(), 5)
    assert await rows(store) == [("c", 0)]
