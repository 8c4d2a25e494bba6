"""The store methods the other store test files do not call, once each on both stores: dead
letter listings, the relay's rows and reads, spend records and reports, and the smaller inbox,
approval, job and timeline calls. (Their behaviour in full is tested through the features
that use them: test_deadletters.py, test_relay.py, test_spend.py.)"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from geodebot.store.protocol import Store
from geodebot.store.records import (
    AttachedFile,
    ModelCall,
    NewMessage,
    RelayDelivery,
    RelayedMessage,
    RelayRead,
    SpendCharge,
)
from tests.support.postgres import Place
from tests.unit.test_store_approvals import request
from tests.unit.test_store_jobs import record
from tests.unit.test_store_races import inbox_row, reply


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:  # type: ignore[attr-defined]
        await s.ensure_session("ops", "channel")
        yield s


async def test_dead_letters_are_listed_counted_decided_and_read_back(store: Store) -> None:
    answered = await inbox_row(store, "1")
    await store.inbox_finish(answered, "done", reply=reply("pong"))
    dead = await inbox_row(store, "2")
    await store.inbox_finish(dead, "failed", detail="model down")
    waiting = await inbox_row(store, "3")
    assert [(d.row.id, d.dead) for d in await store.deadletters()] == [(dead, True)]
    letter = await store.deadletter_get("inbox", dead)
    assert letter is not None
    assert (letter.dead, letter.decision) == (True, None)
    assert await store.deadletters_revision() == 0
    decided = await store.deadletter_discard("inbox", dead, by="op", via="cli")
    assert decided.result == "decided"
    assert await store.deadletters() == []
    assert [d.row.id for d in await store.deadletters(decided=True)] == [dead]
    [decision] = await store.deadletter_decisions()
    assert (decision.kind, decision.row_id, decision.action, decision.detail) == (
        "inbox",
        dead,
        "discard",
        "model down",
    )
    assert await store.deadletters_revision() == decision.seq
    assert await store.deadletter_decisions(after=decision.seq) == []
    unanswered = await store.inbox_unanswered(0.0)
    assert unanswered.count == 1
    assert unanswered.oldest_age_s is not None
    assert (await store.inbox_unanswered(3600.0)).count == 0
    assert waiting > dead


async def test_inbox_preview_files_authorship_and_activity(store: Store) -> None:
    row_id = await inbox_row(store, "1")
    await store.inbox_start(row_id)
    await store.inbox_preview(row_id, "preview-1")
    refused = AttachedFile("a.exe", "application/octet-stream", 10, refusal="not allowed")
    row, notice = await store.inbox_attached(row_id, [refused], reply("no .exe, sorry"))
    assert (row.preview, row.attached) == ("preview-1", (refused,))
    assert notice is not None
    again, none = await store.inbox_attached(row_id, [], reply("twice"))
    assert (again.attached, none) == ((refused,), None)
    waiting = await inbox_row(store, "2")
    running, queued = await store.inbox_activity("telegram:42")
    assert (running.id if running else None, queued) == (row_id, 1)
    authored = await store.inbox_authored("telegram:42", "u1", "hello")
    assert authored is not None
    assert authored.id == waiting


async def test_approval_cards_jobs_and_the_newest_timeline(store: Store) -> None:
    await store.approval_open(request("a1"))
    placed = await store.approval_card("a1", {"platform": "telegram", "message": "9"})
    assert placed is not None
    assert placed.card == {"platform": "telegram", "message": "9"}
    assert await store.approval_card("nope", {}) is None
    newest = await store.timeline_newest("ops", limit=1)
    assert [e.kind for e in newest] == ["approval_requested"]
    assert await store.timeline_newest("ops", before_id=newest[0].id) == []

    await store.jobs_sync_config([record("a"), record("b")])
    skipped = await store.fire_skip("a", 1_000, "catch-up", "missed while down")
    assert skipped is not None
    assert skipped.outcome == "skipped-missed"
    assert await store.fire_skip("a", 1_000, "catch-up", "again") is None
    fire, started = await store.fire_claim("b", 2_000, "schedule")
    assert started
    assert fire is not None
    assert await store.fire_counts() == {"skipped-missed": 1, "running": 1}
    assert {job: f.id for job, f in (await store.fires_latest()).items()} == {
        "a": skipped.id,
        "b": fire.id,
    }
    assert await store.job_remove("a")
    assert not await store.job_remove("a")
    assert [j.id for j in await store.job_list()] == ["b"]


async def test_relay_rows_and_reads(store: Store) -> None:
    delivery = RelayDelivery(
        *("d1", "ops", "telegram:42", "p", "u1", "t1", "k1", "notify", "fire"),
        *("delivered", "", "00" * 32, {"references": {}}, 5.0),
    )
    post = dataclasses.replace(reply("relayed"), kind="relay")
    message = RelayedMessage("telegram", "42", None, "u1", "hi")
    stored, _, _, inbox = await store.relay_deliver(delivery, post, message, max_in_flight=3)
    assert inbox is not None
    refused = dataclasses.replace(
        delivery, id="d2", idem_key=None, state="refused", reason="closed", created_at=6.0
    )
    await store.relay_record(refused, on_target=True)
    assert await store.relay_get("d1") == stored
    assert await store.relay_find("ops", "k1") == stored
    assert [d.id for d in await store.relay_list()] == ["d2", "d1"]
    assert [d.id for d in await store.relay_list(session_id="telegram:42", limit=1)] == ["d2"]
    read = RelayRead("ops", "telegram:42", 0, "cap", None, "telegram", 7.0)
    await store.relay_mark_read(read)
    await store.relay_mark_read(dataclasses.replace(read, revision=1))
    assert await store.relay_last_read("ops", "telegram:42") == dataclasses.replace(
        read, revision=1
    )
    assert await store.relay_last_read("ops", "elsewhere") is None
    # The target recorded the source's own notify (its turn is named after the inbox row)
    # and one message of its own: only that one is news to the source.
    own = NewMessage("user", {"text": "hi"}, f"t-inbox-{inbox.id}")
    other = NewMessage("user", {"text": "else"}, "t-other")
    await store.checkpoint("telegram:42", messages=[own, other])
    assert await store.relay_foreign_changes("ops", "telegram:42", 0) == 1


async def test_spend_records_settles_lists_and_reports(store: Store) -> None:
    budget = SpendCharge("daemon", "2026-12-03", "tokens", 10_000)
    reserved = ModelCall(
        "mc-1", "2026-12-03", 1.0, "s", "t1", "telegram:1", None, None, "reserved", 500
    )
    assert await store.spend_reserve(reserved, [budget]) is None
    settled = dataclasses.replace(
        reserved, state="settled", input_tokens=100, output_tokens=50, cost_usd=0.25
    )
    assert await store.spend_settle(settled)
    assert not await store.spend_settle(settled)
    plain = ModelCall(
        "mc-2", "2026-12-04", 2.0, "s", "t2", None, "daily", "run-1", "settled", 0,
        input_tokens=10, output_tokens=5,
    )  # fmt: skip
    await store.spend_record(plain, [budget])
    assert await store.spend_used([("daemon", "2026-12-03")]) == {("daemon", "2026-12-03"): 165.0}
    assert [c.id for c in await store.model_calls()] == ["mc-2", "mc-1"]
    assert [c.id for c in await store.model_calls(session_id="s", limit=1)] == ["mc-2"]
    [everything] = await store.usage_report()
    assert (everything.key, everything.calls, everything.input_tokens) == ("all", 2, 110)
    assert (everything.cost_usd, everything.unpriced, everything.unsettled) == (0.25, 1, 0)
    by_job = {row.key: row.calls for row in await store.usage_report(by="job")}
    assert by_job == {"(none)": 1, "daily": 1}
    by_day = await store.usage_report(by="day", since_day="2026-12-04")
    assert [(row.key, row.output_tokens) for row in by_day] == [("2026-12-04", 5)]
