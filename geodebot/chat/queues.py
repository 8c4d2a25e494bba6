"""Per-session queues: a chat's messages are worked one at a time, in arrival order.

Each session with work has a bounded queue and one worker task; different sessions run
concurrently (the engine's lanes cap how many turns run at once). Nothing about a session
is held once its queue is empty. The running item's task is kept so ``/stop`` can cancel it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


@dataclass(slots=True)
class SessionQueue(Generic[Item]):
    items: collections.deque[Item] = field(default_factory=collections.deque)
    worker: asyncio.Task[None] | None = None
    running: asyncio.Task[None] | None = None
    stop_requested: bool = False
    abandoned: bool = False

    @property
    def busy(self) -> bool:
        return self.running is not None and not self.running.done()


class SessionQueues(Generic[Item]):
    """``work`` runs each item in a task of its own; when it raises, ``failed`` settles the
    item, and ``stopped`` does for an item whose run :meth:`stop_running` cancelled."""

    def __init__(
        self,
        limit: int,
        work: Callable[[Item], Coroutine[Any, Any, None]],
        stopped: Callable[[Item], Awaitable[None]],
        failed: Callable[[Item, Exception], Awaitable[None]],
    ) -> None:
        self._limit = limit
        self._work = work
        self._stopped = stopped
        self._failed = failed
        self._queues: dict[str, SessionQueue[Item]] = {}
        self._closing = False

    @property
    def closing(self) -> bool:
        """:meth:`close` was called: nothing new starts."""
        return self._closing

    def get(self, session_id: str) -> SessionQueue[Item] | None:
        return self._queues.get(session_id)

    def offer(self, session_id: str, item: Item) -> bool:
        """Queue ``item`` behind the session's earlier ones; False when the queue is full."""
        queue = self._queues.setdefault(session_id, SessionQueue())
        if len(queue.items) >= self._limit:
            return False
        queue.items.append(item)
        if queue.worker is None or queue.worker.done():
            queue.worker = asyncio.create_task(self._drain(session_id, queue))
        return True

    def stop_running(self, session_id: str) -> bool:
        """Cancel the session's running item, if any; whether there was one."""
        queue = self._queues.get(session_id)
        if queue is None or queue.running is None or queue.running.done():
            return False
        queue.stop_requested = True
        queue.running.cancel()
        return True

    def abandon(self, session_id: str) -> list[Item]:
        """Drop the session's queued items and cancel its running one, settling none of them
        (neither ``stopped`` nor ``failed``): they are another's to finish now. The queued
        items dropped."""
        queue = self._queues.get(session_id)
        if queue is None:
            return []
        dropped = list(queue.items)
        queue.items.clear()
        if queue.running is not None and not queue.running.done():
            queue.abandoned = True
            queue.running.cancel()
        return dropped

    def load(self) -> tuple[int, int]:
        """(items running, items queued behind them), over every session."""
        queues = self._queues.values()
        running = sum(1 for queue in queues if queue.running is not None)
        return running, sum(len(queue.items) for queue in queues)

    async def close(self, grace_s: float) -> None:
        """Start nothing new; give running items ``grace_s``, then cancel them."""
        self._closing = True
        workers = [queue.worker for queue in self._queues.values() if queue.worker is not None]
        if not workers:
            return
        done, pending = await asyncio.wait(workers, timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            # A failure that could not be recorded while closing (the store refusing writes):
            # the item stays unfinished in the store, for the next start.
            if not task.cancelled() and (error := task.exception()) is not None:
                log.warning("a session's queue stopped on: %s", error)

    async def _drain(self, session_id: str, queue: SessionQueue[Item]) -> None:
        try:
            while queue.items and not self._closing:
                item = queue.items.popleft()
                queue.stop_requested = False
                queue.running = asyncio.create_task(self._work(item))
                try:
                    await queue.running
                except asyncio.CancelledError:
                    if queue.abandoned:
                        # Items offered since (the session came back) still run.
                        queue.abandoned = False
                        continue
                    if not queue.stop_requested:
                        raise
                    await self._stopped(item)
                except Exception as exc:  # noqa: BLE001  # ``failed`` logs it and answers
                    await self._failed(item, exc)
                finally:
                    queue.running = None
        finally:
            if not queue.items and self._queues.get(session_id) is queue:
                del self._queues[session_id]
