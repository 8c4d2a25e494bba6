"""Two stores on one database race for the same rows, as two processes (later two replicas)
would: every claim has exactly one winner. On PostgreSQL each store has its own connection
pool, so the racing transactions really run at once; on SQLite they are serialised by the
database's write lock, and the same outcomes hold."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import (
    ModelCall,
    NewOutbound,
    RelayDelivery,
    RelayedMessage,
    RelayInFlight,
    SpendCharge,
    StoreError,
)
from tests.support.postgres import Place
from tests.unit.test_store_approvals import request
from tests.unit.test_store_jobs import record

ROUNDS = 8


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        await one.ensure_session("ops", "channel")
        yield one, other


async def outcomes(attempts: list[Awaitable[Any]]) -> tuple[list[Any], list[BaseException]]:
    """What each attempt returned, and what the refused ones raised."""
    done = await asyncio.gather(*attempts, return_exceptions=True)
    for result in done:
        if isinstance(result, BaseException) and not isinstance(result, StoreError):
            raise result
    return (
        [r for r in done if not isinstance(r, BaseException)],
        [r for r in done if isinstance(r, BaseException)],
    )


def reply(text: str) -> NewOutbound:
    return NewOutbound("telegram:42", "telegram", "42", None, "m-1", text)


async def inbox_row(store: Store, event: str) -> int:
    row, _ = await store.inbox_add(
        platform="telegram",
        event_id=event,
        session_id="telegram:42",
        channel="42",
        thread=None,
        user="u1",
        text="hello",
        message_id=f"m-{event}",
    )
    return row.id


async def test_one_finish_of_an_inbox_row_and_one_reply(stores: tuple[Store, Store]) -> None:
    one, other = stores
    for n in range(ROUNDS):
        row_id = await inbox_row(one, f"e{n}")
        attempts = [
            store.inbox_finish(row_id, "done", reply=reply(f"{n}:{k}"), begin_first_part=True)
            for k, store in enumerate([one, other, one, other])
        ]
        won, refused = await outcomes(attempts)
        assert len(won) == 1
        assert all("already 'done'" in str(e) for e in refused)
        [(_, outbound)] = won
        assert outbound is not None
        assert [r.id for r in await other.outbox_pending() if r.inbox_id == row_id] == [outbound.id]


async def test_one_claim_of_a_fire_and_one_run_of_a_job(stores: tuple[Store, Store]) -> None:
    one, other = stores
    await one.jobs_sync_config([record("a")])
    for n in range(ROUNDS):
        claims = [store.fire_claim("a", 1_000 * n, "schedule") for store in (one, other) * 3]
        won, refused = await outcomes(claims)
        assert refused == []
        assert [started for _, started in won].count(True) == (1 if n == 0 else 0)
        assert len({fire.id for fire, _ in won if fire is not None}) == 1
    # Different fires of one job at once: one runs, the others find it running.
    claims = [store.fire_claim("a", 50_000 + k, "catch-up") for k, store in enumerate([one, other])]
    won, _ = await outcomes(claims)
    fires = await one.fire_history("a")
    assert [f.outcome for f in fires].count("running") == 1


async def test_one_part_in_flight_and_one_finish_of_an_outbox_row(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    for _ in range(ROUNDS):
        row = await one.outbox_add(reply("two parts"))
        won, refused = await outcomes(
            [one.outbox_begin_part(row.id, 0), other.outbox_begin_part(row.id, 1)]
        )
        assert len(won) == 1
        assert "still unknown" in str(refused[0])
        finishes = [store.outbox_finish(row.id, "failed", error="x") for store in (one, other)]
        won, refused = await outcomes(finishes)
        assert len(won) == 1
        assert "only a pending row can finish" in str(refused[0])


async def test_one_decision_of_an_approval(stores: tuple[Store, Store]) -> None:
    one, other = stores
    for n in range(ROUNDS):
        await one.approval_open(request(f"a{n}"))
        presses = [
            store.approval_decide(f"a{n}", k % 2 == 0, by="4242", via="chat", now=200.0)
            for k, store in enumerate([one, other, one, other])
        ]
        won, _ = await outcomes([*presses, other.approval_expire(f"a{n}", now=200.0)])
        decided = [w for w in won[:4] if w[1]]
        final = await one.get_approval(f"a{n}")
        assert final is not None
        if decided:
            assert len(decided) == 1
            assert final == decided[0][0]
        else:
            assert final.status == "expired"
        events = [e.kind for e in await one.timeline("ops") if e.data.get("approval") == f"a{n}"]
        assert len(events) == 2  # requested, then decided or expired: once


async def test_one_decision_of_a_dead_letter(stores: tuple[Store, Store]) -> None:
    one, other = stores
    for n in range(ROUNDS):
        row_id = await inbox_row(one, f"dead{n}")
        await one.inbox_finish(row_id, "failed", detail="model down")
        decisions = [
            store.deadletter_replay("inbox", row_id, by="op", via="cli")
            if k % 2
            else store.deadletter_discard("inbox", row_id, by="op", via="console")
            for k, store in enumerate([one, other, one, other])
        ]
        won, refused = await outcomes(decisions)
        assert refused == []
        assert [d.result for d in won].count("decided") == 1
        assert [d.result for d in won].count("already_decided") == 3
    assert await one.deadletter_count() == 0


async def test_two_reservations_never_both_take_the_last_of_a_budget(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    budget = SpendCharge("daemon", "2026-12-03", "tokens", 1_000)
    calls = [
        ModelCall(f"mc-{n}", "2026-12-03", 1.0, "s", None, None, None, None, "reserved", 300)
        for n in range(8)
    ]
    won, refused = await outcomes(
        [(one if n % 2 else other).spend_reserve(c, [budget]) for n, c in enumerate(calls)]
    )
    assert refused == []
    assert [r is None for r in won].count(True) == 3
    assert (await one.spend_used([("daemon", "2026-12-03")]))[("daemon", "2026-12-03")] == 900


async def test_two_deliveries_never_both_take_the_last_place_in_flight(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    message = RelayedMessage("telegram", "42", None, "u1", "hi")
    attempts = []
    for n, store in enumerate([one, other, one, other]):
        delivery = RelayDelivery(
            *(f"d{n}", "ops", "telegram:42", "p", "u1", "t1", f"k{n}", "notify", "fire"),
            *("delivered", "", "00" * 32, {"references": {}}, 1.0),
        )
        post = dataclasses.replace(reply(f"relayed {n}"), kind="relay")
        attempts.append(store.relay_deliver(delivery, post, message, max_in_flight=1))
    won, refused = await outcomes(attempts)
    assert len(won) == 1
    assert all(isinstance(e, RelayInFlight) for e in refused)
    assert await other.relay_in_flight("ops") == 1


async def test_replicas_starting_at_once_sync_and_name_the_jobs_without_failing(
    stores: tuple[Store, Store],
) -> None:
    """Every replica's scheduler syncs the config's jobs and names the bindings of older
    rows when it starts: started together, neither fails (no unique violation, no deadlock
    left unretried) and the rows end as one start alone leaves them."""
    one, other = stores
    jobs = [record(f"j{n:03d}") for n in range(300)]
    synced, refused = await outcomes([store.jobs_sync_config(jobs) for store in (one, other) * 2])
    assert refused == []
    assert synced.count(True) == 1
    assert len(await other.job_list()) == 300
    # Older rows without a binding, named by both at once, in opposite orders (the writes of
    # each store share transactions: rows locked in opposite orders).
    unnamed = [record(f"old{n:03d}", origin="chat") for n in range(40)]
    for job in unnamed:
        await one.job_add(job)
    ids = [job.id for job in unnamed]
    named, refused = await outcomes(
        [
            *(one.job_set_delivery(i, "telegram:c1", creator="binding:telegram:c1") for i in ids),
            *(
                other.job_set_delivery(i, "telegram:c1", creator="binding:telegram:c1")
                for i in reversed(ids)
            ),
        ]
    )
    assert refused == []
    assert named.count(True) == len(ids)
    assert not any(job.id in ids for job in await one.jobs_without_binding())
    changed = [dataclasses.replace(job, prompt="new") for job in jobs[:10]]
    synced, refused = await outcomes(
        [one.jobs_sync_config(changed), other.jobs_sync_config(changed)]
    )
    assert refused == []
    assert synced.count(True) == 1
    assert [j.id for j in await one.job_list() if j.origin == "config"] == [j.id for j in changed]


async def test_a_missed_fire_is_recorded_once_and_a_delivery_settled_once(
    stores: tuple[Store, Store],
) -> None:
    """Every replica catches up at its start and settles deliveries at each poll: a missed
    fire's row is written by one of them, and each fire is settled (told of) by one."""
    one, other = stores
    for n in range(ROUNDS):
        skips = [store.fire_skip("a", n, "catch-up", "missed") for store in (one, other) * 2]
        recorded, refused = await outcomes(skips)
        assert refused == []
        assert len([fire for fire in recorded if fire is not None]) == 1
    delivering = []
    for n in range(ROUNDS):
        fire, _ = await one.fire_claim(f"s{n}", 1_000, "schedule", replica="one")
        message = NewOutbound(f"job:s{n}", "telegram", "42", None, None, "result", kind="job")
        done = await one.fire_finish(fire.id, started_at=1.0, result=message)
        assert done.outbox_id is not None
        await one.outbox_finish(done.outbox_id, "sent")
        delivering.append(done.id)
    settled, refused = await outcomes([store.fires_settle() for store in (one, other) * 2])
    assert refused == []
    told = [fire.id for fires in settled for fire in fires]
    assert sorted(told) == sorted(delivering)
    assert {f.outcome for f in await other.fire_history("s0")} == {"ok"}
