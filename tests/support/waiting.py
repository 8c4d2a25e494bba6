"""Waiting in tests for state that offers no waiter of its own (a store's rows, a router's
queues): polled, with a timeout that says what was waited for."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(
    check: Callable[[], Awaitable[bool] | bool], what: str = "a condition", timeout: float = 20
) -> None:
    """Poll ``check`` (sync or async) every 50 ms until it holds."""
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
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None
