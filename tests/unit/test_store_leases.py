"""Leases and fencing (store/leases.py), on both stores: one holder at a time, a takeover
only after expiry with a higher epoch, and a store that lost its lease commits nothing; the
writes of one context fenced by the lease of their own work, and many leases claimed,
renewed and let go at once (on PostgreSQL, without waiting for another claimer's locks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from geodebot.store.postgres import PostgresStore
from geodebot.store.protocol import Store
from geodebot.store.records import Fenced, Lease, NewOutbound
from geodebot.store.rows import Body, Tx
from tests.support.postgres import Cluster, Place, waiting_for_a_lock

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


# -- fencing by the lease of the work a write belongs to ---------------------------------------

_SESSION = "INSERT INTO sessions (id, mode, created_at, updated_at) VALUES (?, 'channel', 0, 0)"


async def sessions(store: Store) -> list[str]:
    return sorted(s.id for s in await store.list_sessions())


async def test_a_fenced_block_writes_only_while_its_lease_holds(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    mine = await one.lease_acquire("session:a", "web-1", SHORT)
    go = asyncio.Event()

    async def later(session_id: str) -> None:
        await go.wait()
        await one.ensure_session(session_id, "channel")

    made_outside = asyncio.create_task(later("task-made-outside"))
    with one.fenced(mine):
        await one.ensure_session("held", "channel")  # held: the write goes through
        made_inside = asyncio.create_task(later("task-made-inside"))
    await expired(other, "session:a")
    theirs = await other.lease_acquire("session:a", "web-2", LONG)
    assert theirs.epoch == 2
    go.set()
    # The task made inside the block carries its lease; the one made outside does not.
    with pytest.raises(Fenced, match=r"lease 'session:a' \(epoch 1\).*'web-2' \(epoch 2\)"):
        await made_inside
    await made_outside
    with one.fenced(mine):
        with pytest.raises(Fenced):
            await one.ensure_session("late", "channel")
        # Reads, and the leases' own writes, are never fenced.
        assert await one.get_session("held") is not None
        assert (await one.lease_acquire("session:b", "web-1", LONG)).holder == "web-1"
    await one.ensure_session("after-the-block", "channel")  # outside it: written freely
    assert await sessions(other) == ["after-the-block", "held", "task-made-outside"]


async def test_a_fenced_block_is_checked_against_the_process_lease_too(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    daemon = await one.lease_acquire(NAME, "web-1", SHORT)
    session = await one.lease_acquire("session:a", "web-1", LONG)
    one.fence(daemon)
    with one.fenced(session):
        await one.ensure_session("both-held", "channel")
        await expired(other)
        await other.lease_acquire(NAME, "web-2", LONG)
        with pytest.raises(Fenced, match="lease 'daemon'"):
            await one.ensure_session("process-lease-lost", "channel")
    one.fence(None)
    with one.fenced(session):
        await one.ensure_session("session-lease-held", "channel")
    assert await sessions(other) == ["both-held", "session-lease-held"]


def adds(place: Place, session_id: str) -> Body[str]:
    """A write adding a session; what names its transaction (PostgreSQL's id for it)."""

    async def body(db: Tx) -> str:
        await db.run(_SESSION, (session_id,))
        if place.kind == "sqlite":
            return "the one write transaction"  # counted by its trace, below
        row = await db.one("SELECT pg_current_xact_id()::text")
        return str(row[0])

    return body


async def test_in_one_group_commit_only_the_write_whose_lease_is_lost_is_refused(
    place: Place, stores: tuple[Store, Store]
) -> None:
    one, other = stores
    kept = await one.lease_acquire("session:kept", "web-1", LONG)
    lost = await one.lease_acquire("session:lost", "web-1", SHORT)
    await expired(other, "session:lost")
    await other.lease_acquire("session:lost", "web-2", LONG)
    begun: list[str] = []
    if place.kind == "sqlite":
        commits: Any = one._commits  # type: ignore[attr-defined]
        commits.connection.set_trace_callback(begun.append)

    async def under(lease: Lease, session_id: str) -> str:
        with one.fenced(lease):
            written: str = await one._write(  # type: ignore[attr-defined]
                f"adding session {session_id}", adds(place, session_id)
            )
            return written

    first, refused, last = await asyncio.gather(
        under(kept, "kept-1"), under(lost, "lost"), under(kept, "kept-2"), return_exceptions=True
    )
    assert isinstance(refused, Fenced), refused
    assert "'session:lost' (epoch 1)" in str(refused)
    # The three shared one transaction: the refused write undid only itself.
    assert first == last
    assert isinstance(first, str)
    if place.kind == "sqlite":
        assert begun.count("BEGIN IMMEDIATE") == 1, begun
    assert await sessions(other) == ["kept-1", "kept-2"]


# -- many leases at once ---------------------------------------------------------------------


def names_of(leases: list[Lease]) -> list[str]:
    return [lease.name for lease in leases]


async def test_many_leases_are_taken_renewed_and_let_go_together(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    a, b, c = "session:a", "session:b", "session:c"
    taken = await one.lease_acquire_many("web-1", [b, a, a], LONG)
    assert [(x.name, x.holder, x.epoch) for x in taken] == [(a, "web-1", 1), (b, "web-1", 1)]
    assert all(x.remaining_s == pytest.approx(LONG, abs=1.0) for x in taken)
    # Another holder gets only what nobody holds.
    assert names_of(await other.lease_acquire_many("web-2", [b, c], LONG)) == [c]
    # Its own are renewed: the same epoch, acquired when first taken, expiring later.
    again = await one.lease_acquire_many("web-1", [a, b, c], LONG)
    assert [(x.name, x.epoch, x.acquired_at) for x in again] == [
        (x.name, x.epoch, x.acquired_at) for x in taken
    ]
    assert all(n.expires_at >= o.expires_at for n, o in zip(again, taken, strict=True))
    renewed = await one.lease_renew_many("web-1", [c, b, a, "session:none"], LONG)
    assert [(x.name, x.holder, x.epoch) for x in renewed] == [(a, "web-1", 1), (b, "web-1", 1)]
    assert names_of(await one.leases_held("web-1")) == [a, b]
    assert names_of(await one.leases_held("web-2", "session:")) == [c]
    assert await one.leases_held("web-2", "channel:") == []
    # Let go: only what is still its own.
    assert await one.lease_release_many("web-1", [a, c]) == 1
    assert await one.lease_release_many("web-1", [a]) == 0
    assert names_of(await one.leases_held("web-1")) == [b]
    # A released lease is taken over at once, with a higher epoch; its old holder lost it.
    [theirs] = await other.lease_acquire_many("web-2", [a], LONG)
    assert (theirs.holder, theirs.epoch) == ("web-2", 2)
    assert names_of(await one.lease_renew_many("web-1", [a, b], LONG)) == [b]
    # Nothing asked, nothing done; a lease takes a positive time.
    assert await one.lease_acquire_many("web-1", [], LONG) == []
    assert await one.lease_renew_many("web-1", [], LONG) == []
    assert await one.lease_release_many("web-1", []) == 0
    with pytest.raises(ValueError, match="positive"):
        await one.lease_acquire_many("web-1", [a], 0)
    with pytest.raises(ValueError, match="positive"):
        await one.lease_renew_many("web-1", [a], -1)


async def test_expired_leases_are_taken_over_in_bulk_unless_renewed_by_their_holder(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    x, y, z = "session:x", "session:y", "session:z"
    first = await one.lease_acquire_many("web-1", [x, y, z], SHORT)
    for name in (x, y, z):
        await expired(other, name)
    assert await one.leases_held("web-1") == []  # expired: held no more
    # Its holder may still renew an expired lease nobody took: the epoch stays.
    [kept] = await one.lease_renew_many("web-1", [x], LONG)
    assert (kept.name, kept.epoch, kept.acquired_at) == (x, 1, first[0].acquired_at)
    [own] = await one.lease_acquire_many("web-1", [z], LONG)
    assert (own.name, own.epoch) == (z, 1)
    # The others' expired one is taken over, with a higher epoch.
    [taken] = await other.lease_acquire_many("web-2", [x, y, z], LONG)
    assert (taken.name, taken.holder, taken.epoch) == (y, "web-2", 2)
    assert taken.acquired_at > first[1].acquired_at
    assert names_of(await one.lease_renew_many("web-1", [x, y, z], LONG)) == [x, z]
    assert [(lease.name, lease.holder, lease.epoch) for lease in await one.leases()] == [
        (x, "web-1", 1),
        (y, "web-2", 2),
        (z, "web-1", 1),
    ]


async def test_leases_held_match_the_prefix_exactly(stores: tuple[Store, Store]) -> None:
    one, _ = stores
    names = ["a_b:1", "axb:1", "A_b:2", "a%b", "azzb", "a\\b", "ab"]
    await one.lease_acquire_many("web-1", names, LONG)
    assert names_of(await one.leases_held("web-1", "a_b")) == ["a_b:1"]
    assert names_of(await one.leases_held("web-1", "a%")) == ["a%b"]
    assert names_of(await one.leases_held("web-1", "a\\")) == ["a\\b"]
    assert names_of(await one.leases_held("web-1", "A")) == ["A_b:2"]
    assert len(await one.leases_held("web-1")) == len(names)
    assert await one.leases_held("web-2") == []


def reply(session_id: str) -> NewOutbound:
    return NewOutbound(session_id, "telegram", "42", None, None, "an answer")


async def test_sessions_waiting_are_those_with_work_nobody_else_does_oldest_first(
    place: Place, stores: tuple[Store, Store]
) -> None:
    one, other = stores

    async def inbox(session_id: str, at: float) -> int:
        row, _ = await one.inbox_add(
            platform="telegram",
            event_id=f"e-{session_id}-{at}",
            session_id=session_id,
            channel="42",
            thread=None,
            message_id="m",
            user="u",
            text="hello",
        )
        place.execute("UPDATE inbox SET received_at = ? WHERE id = ?", (at, row.id))
        return row.id

    async def outbox(session_id: str, at: float) -> int:
        row = await one.outbox_add(reply(session_id))
        place.execute("UPDATE outbox SET created_at = ? WHERE id = ?", (at, row.id))
        return row.id

    assert await one.sessions_waiting("web-1") == []
    await inbox("pending", 10)
    await one.inbox_start(await inbox("running", 20))
    await one.inbox_finish(await inbox("done", 1), "done")
    await outbox("outbox", 5)
    await one.outbox_finish(await outbox("sent", 2), "sent")
    await one.inbox_finish(await inbox("old-done-new-reply", 3), "failed")
    await outbox("old-done-new-reply", 30)
    for session_id, at in (("theirs", 4), ("mine", 40), ("expired", 50)):
        await inbox(session_id, at)
    await inbox("mine", 6)  # its oldest row counts
    await other.lease_acquire("session:theirs", "web-2", LONG)
    await one.lease_acquire("session:mine", "web-1", LONG)
    await other.lease_acquire("session:expired", "web-2", SHORT)
    await expired(one, "session:expired")
    assert await one.sessions_waiting("web-1") == [
        "outbox",
        "mine",
        "pending",
        "running",
        "old-done-new-reply",
        "expired",
    ]
    assert await other.sessions_waiting("web-2") == [
        "theirs",
        "outbox",
        "pending",
        "running",
        "old-done-new-reply",
        "expired",
    ]


# -- PostgreSQL: replicas claiming the same leases at once ------------------------------------


@pytest.fixture
async def two_replicas(postgres_cluster: Cluster) -> AsyncIterator[tuple[str, Store, Store]]:
    url = postgres_cluster.new_database(migrated=True)
    async with PostgresStore(url) as one, PostgresStore(url) as other:
        yield url, one, other


async def test_replicas_claiming_the_same_leases_at_once_share_them_out(
    two_replicas: tuple[str, Store, Store],
) -> None:
    _, one, other = two_replicas
    names = [f"session:{i:02}" for i in range(40)]
    await one.lease_acquire_many("gone", names[::2], SHORT)  # half exist, expired
    for name in names[::2]:
        await expired(one, name)
    for _ in range(3):  # claimed afresh each round, by whoever gets there
        mine, theirs = await asyncio.gather(
            one.lease_acquire_many("web-1", names, LONG),
            other.lease_acquire_many("web-2", names, LONG),
        )
        assert not set(names_of(mine)) & set(names_of(theirs))
        assert sorted(names_of(mine) + names_of(theirs)) == names
        held = {lease.name: (lease.holder, lease.epoch) for lease in await one.leases()}
        for lease in mine + theirs:
            assert held[lease.name] == (lease.holder, lease.epoch)
            assert lease.epoch == (2 if lease.name in names[::2] else 1)


async def test_a_claim_skips_a_lease_row_another_transaction_has_locked(
    two_replicas: tuple[str, Store, Store],
) -> None:
    url, one, other = two_replicas
    names = ["session:claimed", "session:writing", "session:free"]
    await other.lease_acquire_many("gone", names, SHORT)
    for name in names:
        await expired(one, name)
    async with await psycopg.AsyncConnection.connect(url) as side:
        # Another claimer's transaction, and a write of the old holder in flight (its
        # fencing check), each holding a row.
        await side.execute("SELECT 1 FROM leases WHERE name = 'session:claimed' FOR UPDATE")
        await side.execute("SELECT 1 FROM leases WHERE name = 'session:writing' FOR KEY SHARE")
        claim = asyncio.ensure_future(one.lease_acquire_many("web-1", names, LONG))
        # Without SKIP LOCKED the claim would wait for the side transaction, which never
        # ends by itself: ended after a while, so such a claim fails here, not hangs.
        await asyncio.wait([claim], timeout=30)
        waited = not claim.done()
        await side.rollback()
        assert not waited, "the claim waited for another transaction's locks"
        assert [(x.name, x.epoch) for x in await claim] == [("session:free", 2)]
    got = await one.lease_acquire_many("web-1", names, LONG)
    assert [(x.name, x.epoch) for x in got] == [
        ("session:claimed", 2),
        ("session:free", 2),
        ("session:writing", 2),
    ]


async def test_a_lease_inserted_by_a_bulk_claim_meanwhile_is_not_taken_twice(
    two_replicas: tuple[str, Store, Store],
) -> None:
    url, one, _ = two_replicas
    async with await psycopg.AsyncConnection.connect(url) as side:
        # A bulk claim takes no named lock: its insert, not committed yet, is all there is.
        await side.execute(
            "INSERT INTO leases (name, holder, epoch, expires_at, acquired_at) "
            "VALUES ('session:a', 'web-2', 1, EXTRACT(EPOCH FROM now()) + 60, 0)"
        )
        taking = asyncio.ensure_future(one.lease_acquire("session:a", "web-1", LONG))
        await waiting_for_a_lock(url)
        await side.commit()
    lease = await taking
    assert (lease.name, lease.holder, lease.epoch) == ("session:a", "web-2", 1)
