"""The PostgreSQL store's group commit (store/postgres_commit.py): writes asked for together
share one transaction, yet each is still its own unit; the fencing check covers the group;
and the holder's lease renewal never waits behind its own writes, while a takeover does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest

from geodebot.store.postgres import PostgresStore
from geodebot.store.records import Fenced, StoreError
from geodebot.store.rows import Body, Tx
from tests.support.postgres import Cluster, waiting_for_a_lock

_SESSION = "INSERT INTO sessions (id, mode, created_at, updated_at) VALUES (?, 'channel', 0, 0)"
# The top transaction's id, also from inside a savepoint.
_XID = "SELECT pg_current_xact_id()::text"


@pytest.fixture
async def url(postgres_cluster: Cluster) -> str:
    return postgres_cluster.new_database(migrated=True)


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(url) as opened:
        yield opened


def adds(session: str) -> Body[str]:
    async def body(db: Tx) -> str:
        await db.run(_SESSION, (session,))
        row = await db.one(_XID)
        return str(row[0])

    return body


async def sessions(store: PostgresStore) -> list[str]:
    rows = await store._read(
        "reading sessions", lambda db: db.all("SELECT id FROM sessions ORDER BY created_at, id")
    )
    return [row[0] for row in rows]


async def test_writes_asked_together_share_one_transaction_and_fail_alone(
    store: PostgresStore,
) -> None:
    async def refuses(db: Tx) -> None:
        await db.run(_SESSION, ("refused",))
        raise StoreError("refusing the change")

    async def breaks(db: Tx) -> None:
        await db.run(_SESSION, ("s1",))  # already written by the first write: a conflict

    writes = [
        store._write("s1", adds("s1")),
        store._write("refused", refuses),
        store._write("conflict", breaks),
        store._write("s2", adds("s2")),
    ]
    first, refused, conflict, last = await asyncio.gather(*writes, return_exceptions=True)
    assert first == last  # one transaction: the same id
    assert isinstance(refused, StoreError)
    assert str(refused) == "refusing the change"  # the body's own error, as it raised it
    assert isinstance(conflict, StoreError)
    assert "conflict failed: duplicate key" in str(conflict)
    # Each failed write rolled back only itself.
    assert await sessions(store) == ["s1", "s2"]
    # Asked for one after another: transactions of their own.
    alone = [await store._write(f"a{i}", adds(f"a{i}")) for i in range(2)]
    assert alone[0] != alone[1]


async def test_a_group_whose_transaction_is_lost_runs_each_write_again_alone(
    store: PostgresStore,
) -> None:
    runs: list[str] = []

    def once_lost(session: str, lose: bool) -> Body[str]:
        async def body(db: Tx) -> str:
            runs.append(session)
            await db.run(_SESSION, (session,))
            if lose and runs.count(session) == 1:
                raise psycopg.errors.SerializationFailure("could not serialize access")
            return session

        return body

    done = await asyncio.gather(
        store._write("x", once_lost("x", False)),
        store._write("y", once_lost("y", True)),
        store._write("z", once_lost("z", False)),
    )
    assert list(done) == ["x", "y", "z"]
    # The group ran up to the failure, then every write again in its own transaction.
    assert runs == ["x", "y", "x", "y", "z"]
    assert await sessions(store) == ["x", "y", "z"]


async def test_a_group_under_a_lease_taken_over_commits_nothing(url: str) -> None:
    async with PostgresStore(url) as one, PostgresStore(url) as other:
        mine = await one.lease_acquire("daemon", "web-1", 60)
        one.fence(mine)
        await one.lease_release(mine)
        theirs = await other.lease_acquire("daemon", "web-2", 60)
        assert theirs.epoch == 2
        refused = await asyncio.gather(
            *(one._write(s, adds(s)) for s in ("p", "q", "r")),
            return_exceptions=True,
        )
        assert all(isinstance(r, Fenced) for r in refused), refused
        assert len({id(r) for r in refused}) == 3  # each caller its own exception
        assert "held by 'web-2' (epoch 2)" in str(refused[0])
        assert await sessions(other) == []


async def test_a_write_in_flight_holds_up_a_takeover_but_not_the_holders_renewal(
    url: str,
) -> None:
    async with PostgresStore(url) as one, PostgresStore(url) as other:
        mine = await one.lease_acquire("daemon", "web-1", 0.5)
        one.fence(mine)
        inside, finish = asyncio.Event(), asyncio.Event()

        async def slow(db: Tx) -> str:
            await db.run(_SESSION, ("slow",))
            inside.set()
            await finish.wait()
            return "slow"

        writing = asyncio.ensure_future(one._write("a slow write", slow))
        await inside.wait()
        # The holder renews while its own write is in flight.
        renewed = await asyncio.wait_for(one.lease_renew(mine, 0.5), 5)
        assert renewed is not None
        # Once it expires, a takeover waits for the write in flight...
        for _ in range(200):
            lease = await other.lease("daemon")
            assert lease is not None
            if lease.remaining_s <= 0:
                break
            await asyncio.sleep(0.05)
        taking = asyncio.ensure_future(other.lease_acquire("daemon", "web-2", 60))
        await waiting_for_a_lock(url)
        assert not taking.done()
        # ...which commits, as it was under a lease still held; the takeover follows it.
        finish.set()
        assert await writing == "slow"
        theirs = await taking
        assert (theirs.holder, theirs.epoch) == ("web-2", 2)
        assert await sessions(other) == ["slow"]
        with pytest.raises(Fenced):
            await one._write("too late", adds("late"))
