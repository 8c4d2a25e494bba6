"""Effect receipts and operator switches of both stores, against real databases."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import EffectReceipt, NewMessage, OperatorSwitch, StoreError
from geodebot.store.schema import load_migrations
from tests.support.postgres import Place


def receipt(
    rid: str, *, key: str | None = None, session: str = "ops", at: float = 1.0
) -> EffectReceipt:
    return EffectReceipt(
        id=rid,
        key=key if key is not None else f"key-{rid}",
        session_id=session,
        turn_id="t1",
        call_id=f"toolu_{rid}",
        tool="write_file",
        effect="mutate",
        arguments_sha256="ab" * 32,
        status="admitted",
        admitted_at=at,
    )


def receipt_rows(place: Place) -> list[tuple[object, ...]]:
    """What a second, plain connection reads: only what the store actually committed."""
    return place.rows("SELECT * FROM effect_receipts ORDER BY id")


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:
        await s.ensure_session("ops", "channel")
        await s.ensure_session("dev", "channel")
        yield s


# -- admission ------------------------------------------------------------------------------
async def test_admit_then_duplicate_key_returns_existing_and_inserts_nothing(
    store: Store,
    place: Place,
) -> None:
    first = receipt("r1")
    stored, inserted = await store.admit_receipt(first)
    assert inserted
    assert stored == first
    again, inserted = await store.admit_receipt(receipt("r2", key=first.key, at=5.0))
    assert not inserted
    assert again == first
    assert await store.get_receipt("r2") is None
    assert await store.find_receipt(first.key) == first
    assert await store.find_receipt("nope") is None
    assert [row[0] for row in receipt_rows(place)] == ["r1"]


async def test_admit_rejects_what_it_cannot_admit_and_writes_nothing(
    store: Store, place: Place
) -> None:
    await store.admit_receipt(receipt("r1"))
    before = receipt_rows(place)
    not_fresh = dataclasses.replace(receipt("r2"), status="committed")
    with pytest.raises(StoreError, match="only a fresh, admitted receipt"):
        await store.admit_receipt(not_fresh)
    with pytest.raises(StoreError, match="admission of receipt 'r3' failed"):
        await store.admit_receipt(receipt("r3", session="ghost"))
    with pytest.raises(StoreError, match=r"(?i)unique"):
        await store.admit_receipt(receipt("r1", key="another-key"))
    assert receipt_rows(place) == before


# -- finishing ------------------------------------------------------------------------------
async def test_finish_committed_and_failed(store: Store) -> None:
    await store.admit_receipt(receipt("ok"))
    await store.admit_receipt(receipt("bad"))
    long_result = "é" * 100_000
    done = await store.finish_receipt("ok", "committed", {"result": long_result, "is_error": False})
    failed = await store.finish_receipt("bad", "failed", {"result": "boom", "is_error": True})
    assert (done.status, done.outcome) == ("committed", {"result": long_result, "is_error": False})
    assert (failed.status, failed.outcome["is_error"]) == ("failed", True)
    assert done.finished_at is not None
    assert done.finished_at >= done.admitted_at
    assert await store.get_receipt("ok") == done
    assert await store.get_receipt("bad") == failed


async def test_finish_only_an_admitted_receipt(store: Store, place: Place) -> None:
    await store.admit_receipt(receipt("r1"))
    await store.admit_receipt(receipt("r2"))
    first = await store.finish_receipt("r1", "committed", {"result": "a", "is_error": False})
    [swept] = await store.mark_admitted_uncertain("deadline")
    assert swept.id == "r2"
    before = receipt_rows(place)
    with pytest.raises(StoreError, match="already 'committed'"):
        await store.finish_receipt("r1", "failed", {"result": "late", "is_error": True})
    with pytest.raises(StoreError, match="already 'uncertain'"):
        await store.finish_receipt("r2", "committed", {"result": "late", "is_error": False})
    with pytest.raises(StoreError, match="no such receipt"):
        await store.finish_receipt("ghost", "committed", {})
    with pytest.raises(StoreError, match="status must be one of"):
        await store.finish_receipt("r1", "admitted", {})  # type: ignore[arg-type]  # an invalid status on purpose
    with pytest.raises(StoreError, match="not JSON-serialisable"):
        await store.finish_receipt("r1", "failed", {"result": object()})
    assert receipt_rows(place) == before
    assert await store.get_receipt("r1") == first


# -- crash and sweep ------------------------------------------------------------------------
async def test_receipt_left_admitted_by_a_closed_store_becomes_uncertain(
    place: Place,
) -> None:
    async with place.store() as s:
        await s.ensure_session("ops", "channel")
        await s.admit_receipt(receipt("done", at=1.0))
        await s.finish_receipt("done", "committed", {"result": "ok", "is_error": False})
        await s.admit_receipt(receipt("inflight", at=2.0))
        # Closed with the call still admitted, as a killed daemon leaves it.
    async with place.store() as s:
        committed = await s.get_receipt("done")
        swept = await s.mark_admitted_uncertain("restart")
        assert [r.id for r in swept] == ["inflight"]
        assert (swept[0].status, swept[0].outcome) == ("uncertain", {"reason": "restart"})
        assert swept[0].finished_at is not None
        assert await s.get_receipt("inflight") == swept[0]
        assert await s.get_receipt("done") == committed
        assert await s.mark_admitted_uncertain("restart") == []


async def test_receipt_survives_a_real_kill(place: Place) -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, signal
        from geodebot.store import EffectReceipt
        {opening}

        async def main() -> None:
            await store.open()
            await store.ensure_session("ops", "channel")
            await store.admit_receipt(EffectReceipt(
                id="r1", key="k1", session_id="ops", turn_id="t1", call_id="c1",
                tool="send", effect="communicate", arguments_sha256="0" * 64,
                status="admitted", admitted_at=1.0,
            ))
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
        """
    ).format(opening=place.opening())
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await child.wait() == -signal.SIGKILL
    async with place.store() as s:
        [swept] = await s.mark_admitted_uncertain("restart")
    assert (swept.id, swept.status, swept.effect) == ("r1", "uncertain", "communicate")


async def test_sweep_of_one_session_leaves_the_others(store: Store) -> None:
    await store.admit_receipt(receipt("o1", session="ops"))
    await store.admit_receipt(receipt("d1", session="dev"))
    assert [r.id for r in await store.mark_admitted_uncertain("cut", session_id="ops")] == ["o1"]
    dev = await store.get_receipt("d1")
    assert dev is not None
    assert dev.status == "admitted"


# -- resolution -----------------------------------------------------------------------------
async def test_resolve_uncertain_receipts_once_with_a_timeline_event(store: Store) -> None:
    for rid in ("a", "b"):
        await store.admit_receipt(receipt(rid))
    await store.mark_admitted_uncertain("restart")
    done = await store.resolve_receipt("a", "done", by="alice")
    failed = await store.resolve_receipt("b", "failed", by="bob")
    assert (done.status, done.resolution, done.resolved_by) == ("uncertain", "done", "alice")
    assert (failed.resolution, failed.resolved_by) == ("failed", "bob")
    assert done.resolved_at is not None
    assert done.outcome == {"reason": "restart"}
    assert await store.get_receipt("a") == done
    events = await store.timeline("ops")
    assert [(e.kind, e.turn_id, e.data) for e in events] == [
        ("receipt_resolved", "t1", {"receipt": "a", "resolution": "done", "by": "alice"}),
        ("receipt_resolved", "t1", {"receipt": "b", "resolution": "failed", "by": "bob"}),
    ]
    with pytest.raises(StoreError, match="already resolved as 'done' by 'alice'"):
        await store.resolve_receipt("a", "failed", by="mallory")
    assert await store.get_receipt("a") == done
    assert len(await store.timeline("ops")) == 2


async def test_only_uncertain_receipts_can_be_resolved(store: Store, place: Place) -> None:
    await store.admit_receipt(receipt("c"))
    await store.finish_receipt("c", "committed", {"result": "ok", "is_error": False})
    await store.admit_receipt(receipt("running"))
    await store.admit_receipt(receipt("u"))
    await store.finish_receipt("u", "uncertain", {"reason": "deadline"})
    before = receipt_rows(place)
    with pytest.raises(StoreError, match="it is 'committed'; only an uncertain receipt"):
        await store.resolve_receipt("c", "done", by="alice")
    with pytest.raises(StoreError, match="it is 'admitted'"):
        await store.resolve_receipt("running", "done", by="alice")
    with pytest.raises(StoreError, match="no such receipt"):
        await store.resolve_receipt("ghost", "done", by="alice")
    with pytest.raises(StoreError, match="resolution must be one of"):
        await store.resolve_receipt("u", "maybe", by="alice")  # type: ignore[arg-type]  # an invalid resolution on purpose
    with pytest.raises(StoreError, match="must be named"):
        await store.resolve_receipt("u", "done", by="")
    assert receipt_rows(place) == before
    assert await store.timeline("ops") == []


async def test_resolution_and_its_event_are_one_transaction(store: Store, place: Place) -> None:
    await store.admit_receipt(receipt("u"))
    await store.mark_admitted_uncertain("restart")
    place.fail("timeline")
    with pytest.raises(StoreError, match="resolving receipt 'u' as 'done' failed: disk full"):
        await store.resolve_receipt("u", "done", by="alice")
    unresolved = await store.get_receipt("u")
    assert unresolved is not None
    assert unresolved.resolution is None
    place.heal("timeline")
    assert (await store.resolve_receipt("u", "done", by="alice")).resolution == "done"


# -- listing --------------------------------------------------------------------------------
async def test_list_receipts_filters_and_orders(store: Store) -> None:
    # Admission order is admitted_at then id, not insertion order.
    await store.admit_receipt(receipt("o3", session="ops", at=3.0))
    await store.admit_receipt(receipt("o1", session="ops", at=1.0))
    await store.admit_receipt(receipt("d2", session="dev", at=2.0))
    await store.admit_receipt(receipt("o2b", session="ops", at=2.0))
    await store.finish_receipt("o3", "committed", {"result": "ok", "is_error": False})
    await store.mark_admitted_uncertain("restart")
    await store.resolve_receipt("o1", "done", by="alice")

    async def ids(**filters: object) -> list[str]:
        return [r.id for r in await store.list_receipts(**filters)]  # type: ignore[arg-type]  # parametrized filters

    assert await ids() == ["o1", "d2", "o2b", "o3"]
    assert await ids(status="uncertain") == ["o1", "d2", "o2b"]
    assert await ids(status="committed") == ["o3"]
    assert await ids(status="admitted") == []
    assert await ids(session_id="ops") == ["o1", "o2b", "o3"]
    assert await ids(session_id="ops", status="uncertain") == ["o1", "o2b"]
    assert await ids(unresolved_only=True) == ["d2", "o2b"]
    assert await ids(unresolved_only=True, session_id="ops") == ["o2b"]
    assert await ids(limit=2) == ["o1", "d2"]
    assert await ids(limit=0) == []
    with pytest.raises(ValueError, match="negative"):
        await store.list_receipts(limit=-1)


# -- concurrency ----------------------------------------------------------------------------
async def test_concurrent_admits_of_one_key_insert_exactly_one(store: Store, place: Place) -> None:
    # A second store on the same file is a second connection, as another process would be.
    async with place.store() as other:
        attempts = [
            (store if n % 2 else other).admit_receipt(receipt(f"r{n}", key="same", at=float(n)))
            for n in range(40)
        ]
        results = await asyncio.gather(*attempts)
    winners = [r for r, inserted in results if inserted]
    assert len(winners) == 1
    assert all(r == winners[0] for r, _ in results)
    assert len(receipt_rows(place)) == 1


# -- switches -------------------------------------------------------------------------------
def test_switch_active_follows_enabled_and_expiry() -> None:
    on = OperatorSwitch("computer_use", True, "alice", 10.0, expires_at=20.0)
    assert on.active(10.0)
    assert on.active(19.999)
    assert not on.active(20.0)
    assert not on.active(25.0)
    assert OperatorSwitch("computer_use", True, "alice", 10.0).active(1e12)
    assert not OperatorSwitch("computer_use", False, "alice", 10.0).active(10.0)


async def test_switches_with_history_survive_reopen(place: Place) -> None:
    async with place.store() as s:
        assert await s.get_switch("computer_use") is None
        assert await s.switch_history("computer_use") == []
        first = await s.set_switch("computer_use", True, by="alice", expires_at=1e12, reason="demo")
        second = await s.set_switch("computer_use", False, by="bob")
        await s.set_switch("other", True, by="carol")
        assert (first.enabled, first.set_by, first.expires_at, first.reason) == (
            True,
            "alice",
            1e12,
            "demo",
        )
        assert first.active(first.set_at)
        assert await s.get_switch("computer_use") == second
        with pytest.raises(StoreError, match="must be named"):
            await s.set_switch("computer_use", True, by="")
    async with place.store() as s:
        current = await s.get_switch("computer_use")
        assert current == second
        assert current is not None
        assert not current.active(current.set_at)
        assert await s.switch_history("computer_use") == [second, first]
        assert await s.switch_history("computer_use", limit=1) == [second]
        assert [h.set_by for h in await s.switch_history("other")] == ["carol"]


# -- schema ---------------------------------------------------------------------------------
async def test_version_one_database_upgrades_with_its_data(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    place.unmigrated()
    migrations = load_migrations()
    assert [m[0] for m in migrations[:2]] == [1, 2]
    assert migrations[1][1] == "0002_receipts_switches.sql"
    monkeypatch.setattr(place.module, "load_migrations", lambda: migrations[:1])
    async with place.store() as s:
        assert await s.schema_version() == 1
        await s.ensure_session("ops", "channel")
        message = NewMessage(role="user", content={"text": "hello"}, turn_id="t1")
        await s.checkpoint("ops", messages=[message], state={"turns": 1})
        with pytest.raises(
            StoreError,
            match=r'no such table: effect_receipts|relation "effect_receipts" does not exist',
        ):
            await s.admit_receipt(receipt("r1"))
    monkeypatch.undo()
    async with place.store() as s:
        assert await s.schema_version() == migrations[-1][0] >= 2
        session = await s.get_session("ops")
        assert session is not None
        assert session.state == {"turns": 1}
        assert [m.content["text"] for m in await s.load_context("ops")] == ["hello"]
        assert (await s.admit_receipt(receipt("r1")))[1]
        await s.set_switch("computer_use", True, by="alice")
    versions = [r[0] for r in place.rows("SELECT version FROM schema_migrations ORDER BY 1")]
    names = place.names()
    assert versions == [m[0] for m in migrations]
    assert {
        "effect_receipts",
        "effect_receipts_by_status",
        "effect_receipts_by_session",
        "operator_switches",
        "operator_switch_history",
    } <= names
