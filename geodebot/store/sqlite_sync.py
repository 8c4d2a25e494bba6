"""Syncing the write-ahead log to disk off the event loop, shared by the commits that need it.

A durable commit (one something outside acts on next: a platform's ack, a send, a tool's
effect) must be on disk before its caller goes on. SQLite can do that itself, at
``synchronous=FULL``: the ``COMMIT`` then calls ``fsync`` on the log, on the event loop's
thread (see .sqlite_commit), which stops every chat for the millisecond or more the disk
takes, twice per turn, and switching the level between durable and other commits costs
statements of its own.

So the writer commits everything at NORMAL (in WAL mode: safe against a killed process, not
against a power cut), and this object makes a durable commit safe against a power cut too: it
syncs the log file on a thread of its own, and the durable writes' callers are told of their
commit only once a sync that started after it has finished. One sync covers everything
written to the log before it started, so the commits that ask while one is under way share
the next. Meanwhile the loop goes on: a chat's turn starts while its message's sync is still
on its way to the disk, and only the platform's ack waits for it (``Store.sync``), which may
even wait a few milliseconds for the turn's answer to share it.

A failed sync leaves the log in a state nobody can vouch for (the kernel may have dropped the
pages it could not write), so it fails the writes waiting for it, and every durable write
after it, and tells its owner (``on_failed``): the daemon stops at once and exits non-zero,
as PostgreSQL does after a failed fsync, and its restart recovers what is on disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import pathlib
from collections.abc import Callable

from geodebot.store.records import StoreError

__all__ = ["LogSync"]

log = logging.getLogger(__name__)

_fdatasync = getattr(os, "fdatasync", os.fsync)


class LogSync:
    """Syncs of the log of the database at ``db_path`` (``<db_path>-wal``), one at a time.

    Use from the event loop's thread only; the syncs themselves run on a thread of their own.
    """

    def __init__(
        self, db_path: pathlib.Path, *, on_failed: Callable[[StoreError], None] | None = None
    ) -> None:
        self._db_path = db_path
        # Told once, when the first sync fails.
        self._on_failed = on_failed
        self._wal_path = db_path.with_name(db_path.name + "-wal")
        self._fd: int | None = None  # the log's, opened by the first sync that finds it
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "geodebot-log-sync")
        # Something was committed since the last sync started.
        self._dirty = False
        self._running: asyncio.Future[None] | None = None
        # The round asked for while one runs; it starts when that one ends.
        self._next: asyncio.Future[None] | None = None
        # The round asked for with time to spare (see :meth:`sync`), not started yet.
        self._lingering: asyncio.Future[None] | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._failed: StoreError | None = None
        self._closed = False

    def committed(self) -> None:
        """The writer committed something (not yet on disk)."""
        self._dirty = True

    def request(self, *, within_s: float = 0.0) -> asyncio.Future[None]:
        """A future done once a sync that started after this call has finished, or failed
        with a StoreError if it (or an earlier one) could not sync. ``within_s``: the sync
        may start up to this much later, and serve the requests made meanwhile too."""
        loop = asyncio.get_running_loop()
        if self._failed is not None or self._closed:
            failed: asyncio.Future[None] = loop.create_future()
            failed.set_exception(self._failed or StoreError("syncing the store's log: closed"))
            return failed
        if self._running is not None:
            if self._next is None:
                self._next = loop.create_future()
            return self._next
        if within_s <= 0:
            return self._start(self._lingering or loop.create_future())
        if self._lingering is None:
            self._lingering = loop.create_future()
            self._linger_timer = loop.call_later(within_s, self._start_lingering)
        return self._lingering

    async def sync(self, *, within_s: float = 0.0) -> None:
        """Return once everything committed so far is on disk; ``within_s`` as in
        :meth:`request`."""
        if self._dirty:
            await asyncio.shield(self.request(within_s=within_s))
        elif self._running is not None:
            await asyncio.shield(self._running)
        elif self._failed is not None:
            raise self._failed

    async def close(self) -> None:
        """Wait for the syncs asked for, then release the thread and the file."""
        self._closed = True
        self._start_lingering()
        while self._running is not None:
            with contextlib.suppress(StoreError):
                await asyncio.shield(self._running)
        self._thread.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _start_lingering(self) -> None:
        if self._lingering is not None and self._running is None:
            self._start(self._lingering)

    def _start(self, done: asyncio.Future[None]) -> asyncio.Future[None]:
        if done is self._lingering:
            self._lingering = None
            assert self._linger_timer is not None
            self._linger_timer.cancel()
        self._dirty = False
        self._running = done
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._thread, self._sync_file)
        work.add_done_callback(lambda work: self._ended(done, work))
        return done

    def _ended(self, done: asyncio.Future[None], work: asyncio.Future[None]) -> None:
        error = work.exception() if not work.cancelled() else asyncio.CancelledError()
        if error is not None and self._failed is None:
            self._failed = StoreError(f"syncing the store's log to disk failed: {error}")
            self._failed.__cause__ = error
            log.critical("store: %s; no durable write succeeds until a restart", self._failed)
            if self._on_failed is not None:
                try:
                    self._on_failed(self._failed)
                except Exception:  # the failure is recorded and returned all the same
                    log.exception("store: telling of the failed sync failed")
        _settle(done, self._failed)
        self._running = None
        following, self._next = self._next, None
        if following is None:
            return
        if self._failed is not None:
            _settle(following, self._failed)
        else:
            self._start(following)

    def _sync_file(self) -> None:
        """On the sync thread: fdatasync the log. The log stays while any connection is open
        (the writer's is, for this object's life), so it is opened once; before it exists,
        everything committed is in the database file, which is synced instead."""
        if self._fd is None:
            try:
                self._fd = _open_synced(self._wal_path)
            except FileNotFoundError:
                fd = os.open(self._db_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    _fdatasync(fd)
                finally:
                    os.close(fd)
                return
        _fdatasync(self._fd)


def _open_synced(path: pathlib.Path) -> int:
    """``path`` opened for syncing, its directory synced once: a new file's name must
    survive a power cut as well as its content."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return fd


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)
