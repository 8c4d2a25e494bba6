"""The SQLite store's syncs of its log, seen and held by a test (geodebot.store.sqlite_sync)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from geodebot.store import sqlite_sync


class Disk:
    """Records the file of each log sync the store asks for; while ``go`` is clear, holds
    each one (on the sync's own thread) until it is set; raises ``error`` if set. Made on
    the event loop's thread, in the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[str] = []
        self.go = threading.Event()
        self.go.set()
        self.error: OSError | None = None
        self._loop = asyncio.get_running_loop()
        self._started = asyncio.Semaphore(0)
        monkeypatch.setattr(sqlite_sync, "_fdatasync", self._fdatasync)

    def _fdatasync(self, fd: int) -> None:
        self.synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        self._loop.call_soon_threadsafe(self._started.release)
        if not self.go.wait(10):
            raise TimeoutError("a test held a sync of the store's log for 10 s")
        if self.error is not None:
            raise self.error

    async def sync_started(self) -> None:
        """Wait (without a timeout of its own) until one more sync has started."""
        await self._started.acquire()
