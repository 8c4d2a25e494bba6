"""The daemon's lease (replicas/daemon_lease.py) on both stores: a member waits and takes over
once the leader lets go or stops renewing, and a leader that stalled past its deadline loses
the lease and commits nothing under it."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import pytest

from geodebot.app.daemon import _lead, _Shared
from geodebot.replicas.daemon_lease import LEASE_NAME, MEMBER_MARK, DaemonLease
from geodebot.replicas.leases import SessionLeases
from geodebot.store.protocol import Store
from geodebot.store.records import Fenced, Lease
from tests.support.postgres import Place

TTL = 0.6


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


def keeper(store: Store, replica: str, lost: list[str], ttl: float = TTL) -> DaemonLease:
    return DaemonLease(store, replica, ttl_s=ttl, on_lost=lost.append)


async def test_a_member_takes_over_when_the_leader_lets_go(
    stores: tuple[Store, Store], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="geodebot.replicas.daemon_lease")
    one, other = stores
    lost: list[str] = []
    first, second = keeper(one, "web-1", lost), keeper(other, "web-2", lost)
    held = await first.acquire()
    assert (held.holder, held.epoch) == ("web-1", 1)
    assert first.valid()
    seen: list[Lease] = []
    async with first:
        waiting = asyncio.create_task(second.acquire(seen.append))
        # Renewed while held: the member is still waiting after several times the TTL.
        await asyncio.sleep(TTL * 3)
        assert not waiting.done()
        assert [(lease.holder, lease.epoch) for lease in seen] == [("web-1", 1)]
        assert any(MEMBER_MARK in r.getMessage() for r in caplog.records)
    # Let go on leaving: taken over well before the lease would have expired.
    taken = await asyncio.wait_for(waiting, TTL)
    assert (taken.holder, taken.epoch) == ("web-2", 2)
    assert second.valid()
    assert not lost
    async with second:
        await other.ensure_session("served", "channel")


async def test_replicas_say_what_they_are_and_leave_when_they_stop(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    first, second = keeper(one, "web-1", []), keeper(other, "web-2", [])
    await first.acquire()
    async with first:
        waiting = asyncio.create_task(second.acquire())
        async with asyncio.timeout(5):
            while True:
                peers = [(p["id"], p["role"], p["silent"]) for p in await first.peers()]
                if peers == [("web-2", "member", False)]:
                    break
                await asyncio.sleep(0.02)
        [leader] = await second.peers()
        assert (leader["id"], leader["role"], leader["pid"]) == ("web-1", "leader", os.getpid())
    await asyncio.wait_for(waiting, TTL)
    # web-1 removed itself on its way out; web-2 says at once that it leads now.
    assert await second.peers() == []
    assert [(r.replica_id, r.role) for r in await one.replicas()] == [("web-2", "leader")]
    await second.leave()
    assert await one.replicas() == []


async def test_a_holder_that_stalls_loses_the_lease_and_writes_nothing(
    stores: tuple[Store, Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    one, other = stores
    lost: list[str] = []
    first = keeper(one, "web-1", lost)
    held = await first.acquire()
    # The holder's renewals hang (a paused process, a cut network) until released.
    resume = asyncio.Event()
    renew = one.lease_renew

    async def stalled(lease: Lease, ttl_s: float) -> Lease | None:
        await resume.wait()
        return await renew(lease, ttl_s)

    monkeypatch.setattr(one, "lease_renew", stalled)
    async with first:
        taken = await asyncio.wait_for(keeper(other, "web-2", []).acquire(), TTL * 10)
        assert (taken.holder, taken.epoch) == ("web-2", 2)
        # Past its own deadline the holder knows it may have lost the lease.
        assert not first.valid()
        with pytest.raises(Fenced), one.fenced(held):
            await one.ensure_session("late", "channel")
        resume.set()
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(TTL / 10)
    assert len(lost) == 1
    assert lost[0].startswith(("not renewed within", "taken over by web-2"))
    assert await other.get_session("late") is None
    current = await other.lease(LEASE_NAME)
    assert current is not None
    assert (current.holder, current.epoch) == ("web-2", 2)


async def test_a_holder_paused_past_its_deadline_knows_before_it_acts(
    stores: tuple[Store, Store],
) -> None:
    one, _ = stores
    now = [100.0]
    lost: list[str] = []
    first = DaemonLease(one, "web-1", ttl_s=30.0, on_lost=lost.append, clock=lambda: now[0])
    await first.acquire()
    assert first.valid()
    now[0] += 29.0
    assert first.valid()
    now[0] += 2.0  # the process did not run for a while: its deadline passed meanwhile
    assert not first.valid()


async def test_a_takeover_that_waited_renews_at_once_instead_of_losing_the_lease(
    stores: tuple[Store, Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    one, _ = stores
    lost: list[str] = []
    ttl = 0.9
    taker = keeper(one, "web-2", lost, ttl=ttl)
    acquire = one.lease_acquire

    async def waited(name: str, holder: str, ttl_s: float) -> Lease:
        # The takeover's UPDATE waits on the row lock of a holder paused mid-transaction
        # until the database ends that transaction: most of the TTL goes by before the lease
        # is taken (and counted from then in the database).
        await asyncio.sleep(ttl * 0.7)
        return await acquire(name, holder, ttl_s)

    monkeypatch.setattr(one, "lease_acquire", waited)
    await taker.acquire()
    async with taker:
        # Past the deadline counted from before the request: still held, renewed meanwhile.
        await asyncio.sleep(ttl * 1.2)
        assert not lost
        assert taker.valid()
        await one.ensure_session("served", "channel")


async def test_a_leader_whose_leading_fails_stops_the_replica(
    stores: tuple[Store, Store], caplog: pytest.LogCaptureFixture
) -> None:
    # Paused just after it took the lease, the leader resumes to find it taken over: its
    # first write as the leader is refused. Leading ends, and with it the lease's renewal,
    # so the replica must stop, not run on taking in as a leader that no longer is one.
    one, _ = stores
    stops: list[str] = []
    lease = keeper(one, "web-1", [])
    shared = _Shared(lease, SessionLeases(one, "web-1", ttl_s=TTL), stops.append)

    class RefusedIngest:
        async def start_ingest(self) -> None:
            raise Fenced("writes of 'web-1' under lease 'daemon' (epoch 1) refused")

    caplog.set_level(logging.ERROR, logger="geodebot.app.daemon")
    await asyncio.wait_for(_lead(shared, one, RefusedIngest()), 10)  # type: ignore[arg-type]
    assert len(stops) == 1
    assert stops[0].startswith("leading failed: writes of 'web-1' under lease 'daemon'")
    assert any("leading failed" in r.getMessage() for r in caplog.records)
    assert lease.lease is None  # left: the renewal stopped with it
