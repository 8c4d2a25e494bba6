"""Lanes: one turn per session, a global cap, and a place given up while a person decides."""

from __future__ import annotations

import asyncio

from geodebot.engine.lanes import Lanes


async def test_a_released_place_goes_to_another_session_and_comes_back() -> None:
    lanes = Lanes(1)
    order: list[str] = []
    waiting, decided = asyncio.Event(), asyncio.Event()

    async def parked() -> None:
        async with lanes.slot("a") as slot:
            async with slot.released():
                waiting.set()
                await decided.wait()
            order.append("a resumed")

    async def other() -> None:
        async with lanes.slot("b"):
            order.append("b ran")

    first = asyncio.create_task(parked())
    await waiting.wait()
    await asyncio.wait_for(other(), 5)
    decided.set()
    await asyncio.wait_for(first, 5)
    assert order == ["b ran", "a resumed"]


async def test_a_turn_cancelled_while_waiting_for_its_place_gives_nothing_back() -> None:
    """Cancelled while it waits to get its place back, the turn holds none, so it must not
    release one on the way out: the cap stays at its size."""
    lanes = Lanes(1)
    waiting, busy, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def parked() -> None:
        async with lanes.slot("a") as slot, slot.released():
            waiting.set()
            await busy.wait()  # returns while b holds the only place

    async def holder() -> None:
        async with lanes.slot("b"):
            busy.set()
            await done.wait()

    first = asyncio.create_task(parked())
    await waiting.wait()
    second = asyncio.create_task(holder())
    await busy.wait()
    await asyncio.sleep(0)  # a now waits for its place back
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    done.set()
    await second
    # Exactly one place again: two sessions cannot both be inside.
    inside: list[str] = []

    async def enter(name: str) -> None:
        async with lanes.slot(name):
            inside.append(name)
            await asyncio.sleep(0.05)
            assert len(inside) == 1
            inside.remove(name)

    await asyncio.wait_for(asyncio.gather(enter("c"), enter("d")), 5)
