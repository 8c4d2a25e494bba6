"""The replicas a database knows of (store/replicas.py), on both stores: each one's row says
its role and when it was last seen, by the database's clock; a stopped one is gone; one not
seen for an hour is pruned; a fenced store still records itself."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import Fenced, Lease
from geodebot.store.replicas import PRUNE_AFTER_S
from tests.support.postgres import Place


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


async def test_each_replica_is_listed_with_its_role_until_it_goes(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    assert await one.replicas() == []
    await one.replica_seen("web-1", role="standby", host="h1", pid=11)
    await other.replica_seen("web-2", role="serving", host="h2", pid=22)
    first = {r.replica_id: r for r in await other.replicas()}
    assert [(r.replica_id, r.role, r.host, r.pid) for r in first.values()] == [
        ("web-1", "standby", "h1", 11),
        ("web-2", "serving", "h2", 22),
    ]
    assert all(0 <= r.seen_s_ago < 30 for r in first.values())
    # Seen again in another role: the same row, its start kept, seen later.
    await one.replica_seen("web-1", role="serving", host="h1", pid=11)
    [again] = [r for r in await one.replicas() if r.replica_id == "web-1"]
    assert again.role == "serving"
    assert again.started_at == first["web-1"].started_at
    assert again.seen_at >= first["web-1"].seen_at
    await other.replica_gone("web-2")
    assert [r.replica_id for r in await one.replicas()] == ["web-1"]


async def test_a_replica_not_seen_for_an_hour_is_pruned(
    place: Place, stores: tuple[Store, Store]
) -> None:
    one, _ = stores
    await one.replica_seen("killed", role="serving", host="h", pid=1)
    place.execute(
        "UPDATE replicas SET seen_at = seen_at - ? WHERE replica_id = 'killed'",
        (PRUNE_AFTER_S + 60,),
    )
    [old] = await one.replicas()
    assert old.seen_s_ago > PRUNE_AFTER_S
    await one.replica_seen("web-3", role="standby", host="h", pid=3)
    assert [r.replica_id for r in await one.replicas()] == ["web-3"]


async def test_a_fenced_store_still_says_where_it_is(stores: tuple[Store, Store]) -> None:
    one, other = stores
    mine = await one.lease_acquire("daemon", "web-1", 0.2)
    one.fence(mine)
    taken: Lease | None = None
    while taken is None or taken.holder != "web-2":
        taken = await other.lease_acquire("daemon", "web-2", 60)
    with pytest.raises(Fenced):
        await one.ensure_session("s", "daemon")
    await one.replica_seen("web-1", role="serving", host="h", pid=1)
    assert [r.role for r in await other.replicas()] == ["serving"]
    await one.replica_gone("web-1")
    assert await other.replicas() == []
