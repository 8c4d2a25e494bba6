"""A replica's session leases (replicas/leases.py) on both stores: taken once, kept while work
runs however long, let go after lingering, lost to a takeover with the loss told, and
sessions spread by their home."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator

import pytest

from geodebot.replicas.leases import SessionLeases, lease_name
from geodebot.store.protocol import Store
from geodebot.store.records import Fenced
from tests.support.postgres import Place


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


async def test_work_keeps_a_session_past_its_linger_and_idle_ones_are_let_go(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    now = [1000.0]
    leases = SessionLeases(one, "web-1", ttl_s=30, linger_s=10, clock=lambda: now[0])
    busy, idle = await leases.hold("busy"), await leases.hold("idle")
    assert busy is not None
    assert idle is not None
    assert leases.taken == 2
    with leases.using("busy"):
        now[0] += 11  # past the linger: the idle one goes, the busy one stays
        await leases.renew()
        assert leases.held() == ["busy"]
        idle_now = await other.lease(lease_name("idle"))
        assert idle_now is not None
        assert idle_now.remaining_s <= 0  # let go, not left to expire
        now[0] += 20
        await leases.renew()
        assert leases.held() == ["busy"]
    # It lingers from when the work ended.
    now[0] += 5
    await leases.renew()
    assert leases.held() == ["busy"]
    now[0] += 6
    await leases.renew()
    assert leases.held() == []
    # Another replica takes it at once.
    taker = SessionLeases(other, "web-2", ttl_s=30)
    taken = await taker.hold("busy")
    assert taken is not None
    assert (taken.holder, taken.epoch) == ("web-2", 2)  # a new holder: the next epoch


async def test_a_session_taken_over_is_lost_told_and_fenced(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    now = [1000.0]
    lost: list[tuple[str, str]] = []
    leases = SessionLeases(one, "web-1", ttl_s=3, clock=lambda: now[0])
    leases.subscribe_lost(lambda sid, why: lost.append((sid, why)))
    leases.subscribe_in_use(lambda sid: True)
    lease = await leases.hold("s1")
    assert lease is not None
    # Its renewals stop (a paused process): past the TTL another replica takes it.
    now[0] += 4
    assert leases.lease("s1") is None  # past its own deadline, it knows before it acts
    await _expire(other, "s1")
    taker = SessionLeases(other, "web-2", ttl_s=3)
    taken = await taker.hold("s1")
    assert taken is not None
    assert (taken.holder, taken.epoch) == ("web-2", 2)
    await leases.renew()
    assert lost == [("s1", "not renewed within 3 s")]
    assert leases.held() == []
    with pytest.raises(Fenced), one.fenced(lease):
        await one.ensure_session("s1", "channel")
    assert await leases.hold("s1") is None


async def test_a_session_lost_here_is_not_taken_again_while_its_old_work_runs(
    stores: tuple[Store, Store],
) -> None:
    one, _ = stores
    now = [1000.0]
    leases = SessionLeases(one, "web-1", ttl_s=3, clock=lambda: now[0])
    assert await leases.hold("s1") is not None
    with leases.using("s1"):
        now[0] += 4  # its renewals stalled (a starved process): lost here
        await leases.renew()
        assert leases.held() == []
        # Nobody else took it, so the store would give it back at the same epoch, and the
        # stale work's writes would pass its fence: not until that work ended.
        assert await leases.hold("s1") is None
        assert await leases.hold_many(["s1"]) == {}
    again = await leases.hold("s1")
    assert again is not None
    assert again.holder == "web-1"


async def test_homes_spread_sessions_and_agree_between_replicas(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    for store, name in ((one, "web-1"), (other, "web-2")):
        await store.replica_seen(name, role="member", host="h", pid=1)
    first, second = SessionLeases(one, "web-1", ttl_s=30), SessionLeases(other, "web-2", ttl_s=30)
    assert first.home("s1") == "web-1"  # alone in its own view until it reads the replicas
    for leases in (first, second):
        await leases.refresh_members()
    sessions = [f"s{n}" for n in range(200)]
    homes = [first.home(sid) for sid in sessions]
    assert homes == [second.home(sid) for sid in sessions]
    counts = collections.Counter(homes)
    assert set(counts) == {"web-1", "web-2"}
    assert 70 <= counts["web-1"] <= 130
    # One claim for several sessions takes the free ones and skips one held elsewhere.
    assert await second.hold("s0") is not None
    held = await first.hold_many(["s0", "s1", "s2"])
    assert sorted(held) == ["s1", "s2"]
    assert first.held() == ["s1", "s2"]


async def _expire(store: Store, session_id: str) -> None:
    """Let a lease's time to live pass on the database's clock."""
    held = await store.lease(lease_name(session_id))
    assert held is not None
    released = await store.lease_release(held)
    assert released
