"""Wake-ups between processes sharing a store (store/pg_wakeups.py): on PostgreSQL another
store's wake sets a listener's event at once; on SQLite, which one process uses, nothing
does. And the serving replica's pick-up loop (chat/pickup.py) acts on a wake-up at once, not
at its next look of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from geodebot.channels.base import Inbound
from geodebot.chat.bindings import BindingIndex
from geodebot.chat.pickup import PickUps, StandbyIngress
from geodebot.config.schema import BindingConfig
from geodebot.store.postgres import PostgresStore
from geodebot.store.protocol import Store
from geodebot.store.records import InboxRow
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
        woken.clear()
        await other.wake("jobs")
        await asyncio.wait_for(woken.wait(), 10)
        woken.clear()
        await other.wake("other_topic")
        await asyncio.sleep(0.2)
        assert not woken.is_set()
    with pytest.raises(ValueError, match="lower-case"):
        await one.wake("Bad Topic; DROP TABLE inbox")


async def test_the_serving_replica_takes_up_a_standbys_message_when_woken(
    postgres_cluster: Cluster,
) -> None:
    url = postgres_cluster.new_database(migrated=True)
    async with PostgresStore(url) as serving, PostgresStore(url) as standby:
        taken: list[InboxRow] = []
        arrived, looked = asyncio.Event(), asyncio.Event()

        async def pick_up(row: InboxRow) -> bool:
            taken.append(row)
            arrived.set()
            return True

        to_pick_up = serving.inbox_to_pick_up

        async def look() -> list[InboxRow]:
            rows = await to_pick_up()
            looked.set()
            return rows

        serving.inbox_to_pick_up = look  # type: ignore[method-assign]
        # Its own looks an hour apart: after the first, only a wake-up makes it look again.
        running = asyncio.create_task(PickUps(serving, pick_up, poll_s=3600).run())
        try:
            await asyncio.wait_for(looked.wait(), 10)
            looked.clear()
            await asyncio.wait_for(looked.wait(), 10)  # the look of the listener's start
            assert not taken
            binding = BindingConfig(
                platform="slack", channel="C1", session="ops", allowed_users=["*"]
            )
            ingress = StandbyIngress(standby, BindingIndex.of([binding]), "standby-1", {})
            await ingress.accept(Inbound("slack", "Ev1", "C1", None, "U1", "hello", "1.0001"))
            await asyncio.wait_for(arrived.wait(), 10)
            assert [(r.text, r.pickup) for r in taken] == [("hello", "standby-1")]
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
