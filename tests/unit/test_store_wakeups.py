"""Wake-ups between processes sharing a store (store/pg_wakeups.py): on PostgreSQL another
store's wake sets a listener's event at once; on SQLite, which one process uses, nothing
does. And a replica's pick-up loop (replicas/pickup.py) acts on a wake-up at once, not at its
next look of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from geodebot.replicas.leases import SessionLeases
from geodebot.replicas.pickup import PICKUP_TOPIC, SessionPickUps
from geodebot.store.postgres import PostgresStore
from geodebot.store.protocol import Store
from tests.support.postgres import Cluster, Place


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


async def test_a_wake_reaches_the_other_stores_listener_on_postgresql_only(
    place: Place, stores: tuple[Store, Store]
) -> None:
    one, other = stores
    async with one.wakeups("jobs") as woken:
        if place.kind == "sqlite":
            await other.wake("jobs")
            await asyncio.sleep(0.2)
            assert not woken.is_set()
            return
        # Set once when listening begins (what came before was not heard), then per wake.
        await asyncio.wait_for(woken.wait(), 10)
        assert woken.take() == (set(), True)  # it names nothing: look at everything
        await other.wake("jobs")
        await asyncio.wait_for(woken.wait(), 10)
        assert woken.take() == (set(), True)
        await other.wake("jobs", "session/ops")
        await other.wake("jobs", "session/dev")
        named: set[str] = set()
        while named != {"session/ops", "session/dev"}:
            await asyncio.wait_for(woken.wait(), 10)
            about, unnamed = woken.take()
            assert not unnamed
            named |= about
        await other.wake("other_topic")
        await asyncio.sleep(0.2)
        assert not woken.is_set()
    with pytest.raises(ValueError, match="lower-case"):
        await one.wake("Bad Topic; DROP TABLE inbox")


async def test_the_holder_takes_up_another_replicas_message_when_woken(
    postgres_cluster: Cluster,
) -> None:
    url = postgres_cluster.new_database(migrated=True)
    async with PostgresStore(url) as holder, PostgresStore(url) as other:
        leases = SessionLeases(holder, "web-1", ttl_s=30)
        assert await leases.hold("ops") is not None
        taken: list[str] = []
        arrived, looked = asyncio.Event(), asyncio.Event()

        async def take_up(session_id: str) -> int:
            taken.append(session_id)
            arrived.set()
            return 1

        waiting = holder.sessions_waiting

        async def look(replica: str) -> list[str]:
            found = await waiting(replica)
            looked.set()
            return found

        holder.sessions_waiting = look  # type: ignore[method-assign]
        # Its own looks an hour apart: after the first, only a wake-up makes it look again.
        pickups = SessionPickUps(holder, leases, take_up, lambda: None, poll_s=3600)
        running = asyncio.create_task(pickups.run())
        try:
            await asyncio.wait_for(looked.wait(), 10)
            looked.clear()
            await asyncio.wait_for(looked.wait(), 10)  # the look of the listener's start
            assert not taken
            # Another replica takes in a message of the session held here, and wakes it.
            await other.inbox_add(
                platform="slack", event_id="Ev1", session_id="ops", channel="C1", thread=None,
                user="U1", text="hello", message_id="1.0001", pickup="web-2",
            )  # fmt: skip
            await other.wake(PICKUP_TOPIC)
            await asyncio.wait_for(arrived.wait(), 10)
            assert taken == ["ops"]
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_wake_about_a_session_is_taken_up_by_its_holder_alone_without_a_look(
    postgres_cluster: Cluster,
) -> None:
    url = postgres_cluster.new_database(migrated=True)
    async with (
        PostgresStore(url) as one,
        PostgresStore(url) as two,
        PostgresStore(url) as taker,
    ):
        looks: dict[str, int] = {"web-1": 0, "web-2": 0}
        taken: dict[str, list[str]] = {"web-1": [], "web-2": []}
        listening: dict[str, asyncio.Event] = {}
        arrived = asyncio.Event()
        runs = []
        for store, name in ((one, "web-1"), (two, "web-2")):
            leases = SessionLeases(store, name, ttl_s=30)
            if name == "web-1":
                assert await leases.hold("ops") is not None
            waiting = store.sessions_waiting
            listening[name] = asyncio.Event()

            async def look(replica: str, waiting: Any = waiting, name: str = name) -> list[str]:
                looks[name] += 1
                if looks[name] == 2:  # its first, then the one of the listener's start
                    listening[name].set()
                return list(await waiting(replica))

            async def take_up(session_id: str, name: str = name) -> int:
                taken[name].append(session_id)
                arrived.set()
                return 1

            store.sessions_waiting = look  # type: ignore[method-assign]
            pickups = SessionPickUps(store, leases, take_up, lambda: None, poll_s=3600)
            runs.append(asyncio.create_task(pickups.run()))
        try:
            for event in listening.values():
                await asyncio.wait_for(event.wait(), 10)
            # A third replica takes in a message of the session web-1 holds, and names it.
            await taker.inbox_add(
                platform="slack", event_id="Ev1", session_id="ops", channel="C1", thread=None,
                user="U1", text="hello", message_id="1.0001", pickup="web-3",
            )  # fmt: skip
            await taker.wake(PICKUP_TOPIC, "ops")
            await asyncio.wait_for(arrived.wait(), 10)
            # web-2 heard it too (web-2 sees itself as the only replica, so as the home of
            # everything: it tried to take the lease, which web-1 holds). Its try is over once
            # it is waiting again; a second wake-up, named, shows that it is.
            await taker.wake(PICKUP_TOPIC, "ops")
            while len(taken["web-1"]) < 2:
                await asyncio.wait_for(arrived.wait(), 10)
                arrived.clear()
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    assert taken == {"web-1": ["ops", "ops"], "web-2": []}
    assert looks == {"web-1": 2, "web-2": 2}  # no look at everything for a named wake-up
