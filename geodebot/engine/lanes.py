"""Lanes: one turn at a time per session, and a global cap on turns running at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Lanes:
    def __init__(self, max_concurrent: int) -> None:
        self._global = asyncio.Semaphore(max_concurrent)
        # Locks are dropped when nobody holds or waits for them, so a daemon that has seen
        # millions of session ids does not keep a lock for each.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._max = max_concurrent

    @asynccontextmanager
    async def slot(self, session_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock, self._global:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users <= 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    def busy_sessions(self) -> int:
        return len(self._locks)
