"""The heap keeper: full collections skip what start-up made and what survived the last one,
and a sweep reclaims a cycle that formed among frozen objects."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import platform
import sys
import weakref
from collections.abc import AsyncIterator, Callable

import pytest

from geodebot.ops.heap import HeapKeeper, _malloc_trim, trim_malloc


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@contextlib.asynccontextmanager
async def running(keeper: HeapKeeper) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(keeper.run())
    try:
        await asyncio.sleep(0)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert gc.get_freeze_count() == 0  # the daemon's heap is given back as it was


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_start_up_and_each_full_collections_survivors_are_frozen() -> None:
    keeper = HeapKeeper(busy=lambda: False)
    async with running(keeper):
        start_up = gc.get_freeze_count()
        assert start_up > 0
        made_since = [Node() for _ in range(5000)]
        gc.collect()  # a full collection, as the collector makes one by itself
        await until(lambda: gc.get_freeze_count() >= start_up + len(made_since))
        assert made_since


async def test_a_cycle_among_frozen_objects_is_reclaimed_by_the_next_sweep() -> None:
    keeper = HeapKeeper(busy=lambda: False, sweep_s=3600)
    async with running(keeper):
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        gc.collect()
        await until(lambda: not keeper._collected)  # frozen with the collection's survivors
        gc.freeze()
        del a, b
        gc.collect()
        assert alive() is not None  # a frozen cycle: full collections skip it
        keeper.sweep()
        assert alive() is None
        assert keeper.sweeps == 1


@pytest.mark.parametrize("busy", [True, False])
async def test_a_sweep_waits_for_a_moment_without_turns(busy: bool) -> None:
    keeper = HeapKeeper(busy=lambda: busy, sweep_s=0.05, tick_s=0.01)
    async with running(keeper):
        await until(lambda: keeper.ticks >= 20)
    assert (keeper.sweeps > 0) is (not busy)


def test_the_c_allocators_free_memory_can_be_given_back() -> None:
    # glibc (where the daemon runs) has malloc_trim; elsewhere trim_malloc is False, not an error.
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert _malloc_trim() is not None
    else:
        assert _malloc_trim() is None
        assert trim_malloc() is False
