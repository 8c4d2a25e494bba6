"""Approval requests in both stores, against real databases: asked once, decided once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import ApprovalRecord, StoreError
from tests.support.postgres import Place


def request(
    rid: str, *, call: str | None = None, at: float = 100.0, ttl: float = 900.0
) -> ApprovalRecord:
    return ApprovalRecord(
        id=rid,
        session_id="ops",
        turn_id="t-inbox-1",
        call_id=call if call is not None else f"toolu_{rid}",
        tool="write_file",
        safety="write",
        call_sha256="cd" * 32,
        summary='{"path": "notes.md", "content": "…"}',
        origin="telegram:100",
        approvers=("4242", "5151"),
        status="pending",
        created_at=at,
        expires_at=at + ttl,
    )


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:
        await s.ensure_session("ops", "channel")
        yield s


async def events(store: Store) -> list[tuple[str, dict[str, object]]]:
    return [
        (e.kind, dict(e.data))
        for e in await store.timeline("ops")
        if e.kind.startswith("approval_")
    ]


async def test_a_request_is_opened_once_per_call_and_found_again(store: Store) -> None:
    first, opened = await store.approval_open(request("a1"))
    assert opened
    assert (first.status, first.approvers, first.card) == ("pending", ["4242", "5151"], {})
    # The same call asked again (a turn resumed after a restart) finds the first request.
    again, opened = await store.approval_open(request("a2", call="toolu_a1", at=500.0))
    assert not opened
    assert again == first
    assert await store.get_approval("a2") is None
    assert await store.approvals_pending() == [first]
    assert await store.approvals_pending(session_id="dev") == []
    assert [kind for kind, _ in await events(store)] == ["approval_requested"]


async def test_the_first_decision_wins_and_later_presses_change_nothing(
    store: Store,
) -> None:
    await store.approval_open(request("a1"))
    decided, won = await store.approval_decide("a1", True, by="4242", via="chat", now=200.0)
    assert won
    assert decided is not None
    assert (decided.status, decided.decided_by, decided.decided_via, decided.decided_at) == (
        "approved",
        "4242",
        "chat",
        200.0,
    )
    for approved, by in ((False, "5151"), (True, "4242")):
        current, won = await store.approval_decide("a1", approved, by=by, via="console", now=201.0)
        assert not won
        assert current == decided
    assert await store.approvals_pending() == []
    kinds = await events(store)
    assert [kind for kind, _ in kinds] == ["approval_requested", "approval_decided"]
    assert kinds[1][1] == {
        "approval": "a1",
        "call": "toolu_a1",
        "tool": "write_file",
        "call_sha256": "cd" * 32,
        "status": "approved",
        "by": "4242",
        "via": "chat",
    }


async def test_concurrent_presses_decide_exactly_once(store: Store) -> None:
    await store.approval_open(request("a1"))
    results = await asyncio.gather(
        *(
            store.approval_decide("a1", index % 2 == 0, by=f"u{index}", via="chat", now=150.0)
            for index in range(20)
        )
    )
    winners = [row for row, won in results if won]
    assert len(winners) == 1
    assert all(row == winners[0] for row, _ in results)


async def test_a_press_after_the_expiry_expires_the_request_instead(store: Store) -> None:
    await store.approval_open(request("a1", ttl=60.0))
    late, won = await store.approval_decide("a1", True, by="4242", via="chat", now=160.0)
    assert not won
    assert late is not None
    assert (late.status, late.decided_by, late.decided_at) == ("expired", None, 160.0)
    again, won = await store.approval_decide("a1", True, by="4242", via="chat", now=100.0)
    assert (again, won) == (late, False)
    assert [kind for kind, _ in await events(store)] == ["approval_requested", "approval_expired"]


async def test_an_asker_who_stops_waiting_expires_only_a_pending_request(
    store: Store,
) -> None:
    await store.approval_open(request("waited"))
    await store.approval_open(request("decided"))
    await store.approval_decide("decided", True, by="4242", via="console", now=120.0)
    expired = await store.approval_expire("waited", now=130.0)
    assert expired is not None
    assert (expired.status, expired.decided_at, expired.decided_by) == ("expired", 130.0, None)
    # A decision that came first stands; a second expiry changes nothing.
    kept = await store.approval_expire("decided", now=130.0)
    assert kept is not None
    assert (kept.status, kept.decided_by) == ("approved", "4242")
    assert await store.approval_expire("waited", now=140.0) == expired
    assert await store.approval_expire("nope") is None
    late, won = await store.approval_decide("waited", True, by="4242", via="chat", now=131.0)
    assert (late, won) == (expired, False)


async def test_an_unknown_id_is_no_decision(store: Store) -> None:
    assert await store.approval_decide("forged", True, by="4242", via="chat") == (None, False)


async def test_bad_requests_and_decisions_are_refused_and_write_nothing(
    store: Store,
) -> None:
    with pytest.raises(StoreError, match="no approvers"):
        await store.approval_open(dataclasses.replace(request("a1"), approvers=()))
    with pytest.raises(StoreError, match="must be pending"):
        await store.approval_open(dataclasses.replace(request("a1"), status="approved"))
    with pytest.raises(StoreError, match=r"sessions|FOREIGN KEY"):
        await store.approval_open(dataclasses.replace(request("a1"), session_id="nobody"))
    await store.approval_open(request("a1"))
    with pytest.raises(StoreError, match="must be named"):
        await store.approval_decide("a1", True, by="", via="chat")
    with pytest.raises(StoreError, match="via must be one of"):
        await store.approval_decide("a1", True, by="4242", via="email")
    current = await store.get_approval("a1")
    assert current is not None
    assert current.status == "pending"


async def test_a_pending_request_survives_a_restart_and_is_decided_after(
    place: Place,
) -> None:
    async with place.store() as store:
        await store.ensure_session("ops", "channel")
        await store.approval_open(request("a1"))
    async with place.store() as store:
        assert [r.id for r in await store.approvals_pending()] == ["a1"]
        decided, won = await store.approval_decide("a1", True, by="5151", via="chat", now=300.0)
        assert won
        assert decided is not None
        assert decided.status == "approved"


async def test_a_decided_row_cannot_lose_its_decision_time(place: Place) -> None:
    async with place.store() as store:
        await store.ensure_session("ops", "channel")
        await store.approval_open(request("a1"))
        await store.approval_decide("a1", True, by="4242", via="chat", now=200.0)
    with pytest.raises(place.integrity_error):
        place.execute("UPDATE approval_requests SET decided_at = NULL WHERE id = 'a1'")
