"""Lanes: one turn at a time per session, and a global cap on turns running at once; and
the one grace period running turns get when the daemon stops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any


class Lanes:
    def __init__(self, max_concurrent: int) -> None:
        self._global = asyncio.Semaphore(max_concurrent)
        # Locks are dropped when nobody holds or waits for them, so a daemon that has seen
        # millions of session ids does not keep a lock for each.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def slot(self, session_id: str) -> AsyncIterator[Slot]:
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                await self._global.acquire()
                slot = Slot(self._global)
                try:
                    yield slot
                finally:
                    if slot.holding:
                        self._global.release()
        finally:
            lock, users = self._locks[session_id]
            if users <= 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)


class Slot:
    """A running turn's place under the global cap."""

    def __init__(self, cap: asyncio.Semaphore) -> None:
        self._cap = cap
        self.holding = True

    @asynccontextmanager
    async def released(self) -> AsyncIterator[None]:
        """Give the place up while the turn waits for a person, so turns parked on a
        decision cannot starve the others; the session keeps its lock. Waits for a place
        again after (a cancelled wait leaves nothing to give back)."""
        self._cap.release()
        self.holding = False
        try:
            yield
        finally:
            await self._cap.acquire()
            self.holding = True


class Grace:
    """A grace period shared by whoever drains turns at shutdown (the job scheduler, then the
    chat router): its clock starts at the first ask, so together they get it once."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._deadline: float | None = None

    def left(self) -> float:
        now = self._clock()
        if self._deadline is None:
            self._deadline = now + self.seconds
        return max(0.0, self._deadline - now)

    def end_now(self) -> None:
        """No grace after all: whoever asks from now on gets none (work that can no longer
        finish, say: this replica lost the daemon's lease and can commit nothing)."""
        self._deadline = self._clock()


async def cancel_and_wait(task: asyncio.Task[Any], *, again_every_s: float = 1.0) -> None:
    """Cancel ``task`` and wait until it has ended, its outcome retrieved.

    It is cancelled again every ``again_every_s`` while it still runs: on Python 3.11 a
    cancellation that arrives just as a timeout-guarded wait inside a driver completes can be
    lost (``asyncio.wait_for``), and a loop that lost it runs on and keeps a shutdown waiting
    forever (seen: the job scheduler's store poll, as a replica stopped)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_every_s)
    await asyncio.gather(task, return_exceptions=True)
