"""Waiting in tests for state that offers no waiter of its own (a store's rows, a router's
queues): polled, with a timeout that says what was waited for."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path

from geodebot.store.records import FireRecord
from geodebot.store.sqlite import SQLiteStore


async def until(
    check: Callable[[], Awaitable[bool] | bool],
    what: str | Callable[[], str] = "a condition",
    timeout: float = 20,
) -> None:
    """Poll ``check`` (sync or async) every 50 ms until it holds; ``what`` may be a function,
    asked on a timeout (to say what was seen last)."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                result = check()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        said = what() if callable(what) else what
        raise AssertionError(f"timed out after {timeout:g} s waiting for {said}") from None


async def fires_when(
    db: Path, job_id: str, predicate: Callable[[list[FireRecord]], bool], timeout: float = 20
) -> list[FireRecord]:
    """The job's fires, oldest first, once ``predicate`` holds of them, read from the SQLite
    store at ``db`` (a daemon's, from outside); a timeout lists the rows it saw last."""
    rows: list[FireRecord] = []

    async def holds() -> bool:
        async with SQLiteStore(db) as store:
            rows[:] = reversed(await store.fire_history(job_id))
        return predicate(rows)

    def seen() -> str:
        fires = [(f.id, f.cause, f.outcome, f.scheduled_ms, f.reason) for f in rows]
        return f"the fires of job {job_id!r} to come to pass; the last seen: {fires}"

    await until(holds, seen, timeout)
    return rows
