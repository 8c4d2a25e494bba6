"""Leases and fencing (store/leases.py), on both stores: one holder at a time, a takeover
only after expiry with a higher epoch, and a store that lost its lease commits nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import Fenced, Lease
from tests.support.postgres import Place

NAME = "daemon"
# Long enough that a lease taken in a test does not expire before the test looks at it, on
# a busy machine; the expiry tests use SHORT and wait for the database to say it expired.
LONG = 60.0
SHORT = 0.3


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


async def expired(store: Store, name: str = NAME) -> Lease:
    """The lease once the database's clock has passed its expiry."""
    for _ in range(200):
        lease = await store.lease(name)
        assert lease is not None
        if lease.remaining_s <= 0:
            return lease
        await asyncio.sleep(min(0.05, lease.remaining_s + 0.01))
    raise AssertionError("the lease never expired")


async def test_a_held_lease_is_not_taken_and_a_released_one_is(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    mine = await one.lease_acquire(NAME, "web-1", LONG)
    assert (mine.holder, mine.epoch) == ("web-1", 1)
    assert mine.remaining_s == pytest.approx(LONG, abs=1.0)
    refused = await other.lease_acquire(NAME, "web-2", LONG)
    assert (refused.holder, refused.epoch) == ("web-1", 1)  # the lease as it stands
    renewed = await one.lease_renew(mine, LONG)
    assert renewed is not None
    assert renewed.epoch == 1
    assert renewed.expires_at >= mine.expires_at
    assert await one.lease_release(mine)
    assert not await one.lease_release(mine)  # already let go
    theirs = await other.lease_acquire(NAME, "web-2", LONG)
    assert (theirs.holder, theirs.epoch) == ("web-2", 2)
    assert await one.lease_renew(mine, LONG) is None  # taken over: not renewed
    assert [(lease.name, lease.holder, lease.epoch) for lease in await one.leases()] == [
        (NAME, "web-2", 2)
    ]


async def test_an_expired_lease_is_taken_over_with_a_higher_epoch(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    mine = await one.lease_acquire(NAME, "web-1", SHORT)
    assert (await other.lease_acquire(NAME, "web-2", LONG)).holder == "web-1"
    await expired(other)
    theirs = await other.lease_acquire(NAME, "web-2", LONG)
    assert (theirs.holder, theirs.epoch) == ("web-2", 2)
    assert await one.lease_renew(mine, LONG) is None
    again = await one.lease_acquire(NAME, "web-1", LONG)
    assert (again.holder, again.epoch) == ("web-2", 2)


async def test_a_holder_renewing_its_own_expired_lease_keeps_the_epoch(
    stores: tuple[Store, Store],
) -> None:
    one, _ = stores
    mine = await one.lease_acquire(NAME, "web-1", SHORT)
    await expired(one)
    # Nobody took it in between, so nothing it wrote needs fencing off.
    renewed = await one.lease_renew(mine, LONG)
    assert renewed is not None
    assert renewed.epoch == mine.epoch == 1
    assert (await one.lease_acquire(NAME, "web-1", LONG)).epoch == 1


async def test_a_store_that_lost_its_lease_commits_nothing(stores: tuple[Store, Store]) -> None:
    one, other = stores
    mine = await one.lease_acquire(NAME, "web-1", SHORT)
    one.fence(mine)
    await one.ensure_session("before", "channel")  # held: writes go through
    await expired(other)
    theirs = await other.lease_acquire(NAME, "web-2", LONG)
    other.fence(theirs)
    with pytest.raises(Fenced, match=r"held by 'web-2' \(epoch 2\) now"):
        await one.ensure_session("after", "channel")
    with pytest.raises(Fenced):
        await one.inbox_add(
            platform="telegram",
            event_id="e-1",
            session_id="after",
            channel="42",
            thread=None,
            message_id="m-1",
            user="u",
            text="hello",
        )
    assert await other.get_session("before") is not None
    assert await other.get_session("after") is None
    assert await other.inbox_unfinished() == []
    # Reads are not fenced, and the new holder writes.
    assert await one.get_session("before") is not None
    await other.ensure_session("after", "channel")
    # Told to write freely again (as a standby is, before it holds anything), it does.
    one.fence(None)
    await one.ensure_session("free", "channel")


async def test_of_many_candidates_for_an_expired_lease_exactly_one_takes_it(
    place: Place,
) -> None:
    async with place.store() as first:  # type: ignore[attr-defined]
        await first.lease_acquire(NAME, "old", SHORT)
        await expired(first)
    candidates = [place.store() for _ in range(4)]
    for store in candidates:
        await store.open()
    try:
        taken = await asyncio.gather(
            *(s.lease_acquire(NAME, f"web-{i}", LONG) for i, s in enumerate(candidates))
        )
    finally:
        for store in candidates:
            await store.close()
    winners = {(lease.holder, lease.epoch) for lease in taken}
    assert len(winners) == 1, winners
    ((holder, epoch),) = winners
    assert epoch == 2
    assert holder.startswith("web-")


async def test_a_lease_takes_a_positive_time(stores: tuple[Store, Store]) -> None:
    one, _ = stores
    with pytest.raises(ValueError, match="positive"):
        await one.lease_acquire(NAME, "web-1", 0)
