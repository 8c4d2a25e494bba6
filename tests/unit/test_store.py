"""Both stores against real databases: a file in a temp dir, a database of a throwaway
PostgreSQL cluster (tests/support/postgres.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import stat
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geodebot.store.protocol import Store
from geodebot.store.records import (
    ContextRow,
    MessageRecord,
    NewMessage,
    StoreError,
    ToolBatchRecord,
)
from geodebot.store.rows import dumps
from geodebot.store.schema import load_migrations, split_statements
from geodebot.store.sqlite import SQLiteStore
from tests.support.postgres import Cluster, Place


def msg(text: str, *, role: str = "user", turn: str = "t1") -> NewMessage:
    return NewMessage(role=role, content={"role": role, "text": text}, turn_id=turn)


def summary(text: str, covers_to: int | None, *, covers_from: int | None = 1) -> NewMessage:
    return NewMessage(
        role="user",
        content={"text": text},
        turn_id="t-sum",
        kind="summary",
        covers_from=covers_from,
        covers_to=covers_to,
    )


def batch(batch_id: str, session_id: str, *, round_: int = 0, at: float = 1.0) -> ToolBatchRecord:
    return ToolBatchRecord(
        id=batch_id,
        session_id=session_id,
        turn_id="t1",
        round=round_,
        status="proposed",
        calls=[{"type": "tool_use", "id": f"{batch_id}-c", "name": "ping", "input": {}}],
        results=[],
        created_at=at,
        finished_at=None,
    )


def file_mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def set_file_mode(path: pathlib.Path, mode: int) -> None:
    path.chmod(mode)


def texts(records: list[MessageRecord]) -> list[str]:
    return [r.content["text"] for r in records]


@pytest.fixture
def db_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "missing" / "dir" / "geodebot.db"


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as s:
        await s.ensure_session("ops", "channel")
        yield s


# -- schema and file ------------------------------------------------------------------------
async def test_migrations_applied_and_version_reported(place: Place) -> None:
    place.unmigrated()
    newest = load_migrations()[-1][0]
    async with place.store() as s:
        assert await s.schema_version() == newest >= 1
        assert s.version_found == 0
    names = place.names()
    versions = [r[0] for r in place.rows("SELECT version FROM schema_migrations ORDER BY 1")]
    if place.kind == "sqlite":
        assert place.rows("PRAGMA journal_mode") == [("wal",)]
    assert {"sessions", "messages", "tool_batches", "timeline", "messages_by_kind"} <= names
    assert versions == [m[0] for m in load_migrations()]


async def test_reopen_keeps_version_and_data(place: Place) -> None:
    async with place.store() as s:
        await s.ensure_session("ops", "channel")
        await s.checkpoint("ops", messages=[msg("a"), msg("b")], state={"turns": 1})
        version = await s.schema_version()
    async with place.store() as s:
        assert await s.schema_version() == s.version_found == version
        record = await s.get_session("ops")
        assert record is not None
        assert record.state == {"turns": 1}
        assert texts(await s.load_context("ops")) == ["a", "b"]
        assert await s.checkpoint("ops", messages=[msg("c")]) == [3]
    assert place.rows("SELECT COUNT(*) FROM schema_migrations") == [(version,)]


async def test_new_migration_applies_on_reopen_and_failed_one_changes_nothing(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with place.store():
        pass
    base = load_migrations()
    v = base[-1][0]
    extra = (v + 1, "x_jobs.sql", "-- jobs\nCREATE TABLE jobs (id TEXT PRIMARY KEY);\n")
    broken = (v + 2, "y_broken.sql", "CREATE TABLE half (id TEXT);\nCREATE TABLE oops (;\n")
    monkeypatch.setattr(place.module, "load_migrations", lambda: [*base, extra, broken])
    with pytest.raises(StoreError, match=r"applying migration y_broken\.sql failed"):
        await place.store().open()
    monkeypatch.setattr(place.module, "load_migrations", lambda: [*base, extra])
    async with place.store() as s:
        # The failed open applied ``extra`` in its own transaction before ``broken`` failed.
        assert (s.version_found, await s.schema_version()) == (v + 1, v + 1)
    names = place.names()
    assert "jobs" in names
    assert "half" not in names
    # The code that knew only ``base`` must not touch what a newer one migrated.
    monkeypatch.setattr(place.module, "load_migrations", lambda: base)
    with pytest.raises(StoreError, match=rf"version {v + 1}, newer than the {v} this geodebot"):
        await place.store().open()


def test_split_statements_keeps_trigger_bodies_whole() -> None:
    script = (
        "-- header\nCREATE TABLE a (x INTEGER);\n"
        "CREATE TRIGGER t BEFORE INSERT ON a BEGIN\n  SELECT 1;\n  SELECT 2;\nEND;\n-- tail\n"
    )
    parts = split_statements(script)
    assert len(parts) == 3
    assert parts[1].startswith("CREATE TRIGGER")
    assert parts[1].endswith("END;")


async def test_file_is_private(db_path: pathlib.Path) -> None:  # SQLite's own
    async with SQLiteStore(db_path) as s:
        await s.ensure_session("ops", "channel")
        assert file_mode(db_path) == 0o600
        assert file_mode(db_path.with_name(db_path.name + "-wal")) == 0o600
    set_file_mode(db_path, 0o644)
    async with SQLiteStore(db_path):
        assert file_mode(db_path) == 0o600


async def test_closed_store_raises_store_error(place: Place) -> None:
    s = place.store()
    with pytest.raises(StoreError, match="not open"):
        await s.get_session("ops")
    with pytest.raises(StoreError, match="not open"):
        await s.ensure_session("ops", "channel")


def test_sqlite_synchronous_is_checked(db_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        SQLiteStore(db_path, synchronous="FULL; DROP TABLE sessions")


# -- sessions -------------------------------------------------------------------------------
async def test_ensure_get_list_sessions(store: Store) -> None:
    first = await store.ensure_session("ops", "headless")
    assert (first.generation, first.mode, first.state, first.guards) == (1, "channel", {}, {})
    assert await store.get_session("nope") is None
    await store.ensure_session("dev", "channel")
    assert [r.id for r in await store.list_sessions()] == ["dev", "ops"]
    await store.checkpoint("ops", state={"x": 1})
    assert [r.id for r in await store.list_sessions()] == ["ops", "dev"]
    again = await store.get_session("ops")
    assert again is not None
    assert again.updated_at >= first.updated_at
    assert again.created_at == first.created_at


async def test_ensure_session_is_race_safe(store: Store) -> None:
    records = await asyncio.gather(*(store.ensure_session("new", "channel") for _ in range(20)))
    assert {(r.id, r.generation, r.created_at) for r in records} == {
        ("new", 1, records[0].created_at)
    }


async def test_reset_hides_history_clears_state_and_abandons_batches(
    store: Store, place: Place
) -> None:
    await store.checkpoint(
        "ops",
        messages=[msg("old")],
        state={"s": 1},
        guards={"rounds": 3},
        propose_batch=batch("b1", "ops"),
    )
    record = await store.reset_session("ops")
    assert (record.generation, record.state, record.guards) == (2, {}, {})
    assert await store.load_context("ops") == []
    assert await store.load_messages("ops") == []
    assert await store.pending_batches("ops") == []
    assert place.rows("SELECT status FROM tool_batches") == [("abandoned",)]
    assert await store.checkpoint("ops", messages=[msg("new")]) == [2]
    context = await store.load_context("ops")
    assert [(r.seq, r.generation) for r in context] == [(2, 2)]
    with pytest.raises(StoreError, match="reset of session 'ghost' failed"):
        await store.reset_session("ghost")


# -- checkpoints ----------------------------------------------------------------------------
async def test_checkpoint_assigns_increasing_seqs_and_replaces_state(store: Store) -> None:
    assert await store.checkpoint("ops", messages=[msg("a"), msg("b")], state={"n": 1}) == [1, 2]
    assert await store.checkpoint("ops", guards={"rounds": 1}) == []
    assert await store.checkpoint("ops", messages=[msg("c")]) == [3]
    record = await store.get_session("ops")
    assert record is not None
    assert (record.state, record.guards) == ({"n": 1}, {"rounds": 1})
    assert [r.seq for r in await store.load_messages("ops")] == [1, 2, 3]
    page = await store.load_messages("ops", after_seq=1, limit=1)
    assert [(r.seq, r.content["text"], r.role) for r in page] == [(2, "b", "user")]


async def test_checkpoint_is_all_or_nothing(store: Store, place: Place) -> None:
    await store.checkpoint("ops", messages=[msg("a"), msg("b")], state={"v": 1})
    place.fail("tool_batches")
    with pytest.raises(StoreError, match="checkpoint of session 'ops' failed: disk full"):
        await store.checkpoint(
            "ops",
            messages=[msg("c"), msg("d")],
            state={"v": 2},
            propose_batch=batch("b1", "ops"),
            timeline=[("t1", "round", {})],
        )
    assert texts(await store.load_messages("ops")) == ["a", "b"]
    record = await store.get_session("ops")
    assert record is not None
    assert record.state == {"v": 1}
    assert await store.timeline("ops") == []
    place.heal("tool_batches")
    assert await store.checkpoint("ops", messages=[msg("c")]) == [3]


async def test_checkpoint_errors_write_nothing(store: Store, place: Place) -> None:
    with pytest.raises(StoreError, match="checkpoint of session 'ghost' failed"):
        await store.checkpoint("ghost", messages=[msg("a")], timeline=[(None, "k", {})])
    with pytest.raises(StoreError, match="no tool batch 'nope'"):
        await store.checkpoint("ops", messages=[msg("a")], finish_batch=("nope", [], "done"))
    with pytest.raises(StoreError, match="not JSON-serialisable"):
        await store.checkpoint("ops", messages=[msg("a")], state={"bad": object()})
    assert await store.load_messages("ops") == []
    assert await store.checkpoint("ops", messages=[msg("a")]) == [1]
    assert place.rows("SELECT COUNT(*) FROM timeline") == [(0,)]


async def test_pending_batches_follow_propose_and_finish(store: Store, place: Place) -> None:
    await store.checkpoint("ops", propose_batch=batch("b2", "ops", round_=1, at=2.0))
    await store.checkpoint("ops", propose_batch=batch("b1", "ops", round_=0, at=1.0))
    pending = await store.pending_batches("ops")
    assert [b.id for b in pending] == ["b1", "b2"]
    assert pending[0].calls == batch("b1", "ops").calls
    assert pending[0].results == []
    results = [{"type": "tool_result", "tool_use_id": "b1-c", "content": "pong"}]
    await store.checkpoint("ops", finish_batch=("b1", results, "done"))
    assert [b.id for b in await store.pending_batches("ops")] == ["b2"]
    [row] = place.rows("SELECT status, results, finished_at FROM tool_batches WHERE id = 'b1'")
    assert row[0] == "done"
    assert '"pong"' in row[1]
    assert row[2] is not None


async def test_open_session_reads_what_the_separate_calls_read(store: Store) -> None:
    """One transaction for a turn's start: the row (made if missing), a switch, the batches."""
    fresh = await store.open_session("new", "daemon", switch="computer_use")
    assert fresh.record == await store.get_session("new")
    assert (fresh.record.mode, fresh.switch, fresh.pending) == ("daemon", None, [])
    await store.checkpoint("ops", messages=[msg("a")], propose_batch=batch("b1", "ops"))
    await store.set_switch("computer_use", True, by="operator")
    opened = await store.open_session("ops", "daemon", switch="computer_use")
    assert opened.record == await store.get_session("ops")
    assert opened.record.mode == "channel"  # an existing session keeps its mode
    assert opened.record.next_seq == 2
    assert opened.switch == await store.get_switch("computer_use")
    assert opened.pending == await store.pending_batches("ops")
    assert [b.id for b in opened.pending] == ["b1"]


# -- context --------------------------------------------------------------------------------
async def test_load_context_without_summary_is_every_message(store: Store) -> None:
    await store.checkpoint("ops", messages=[msg("a"), msg("b", role="assistant")])
    context = await store.load_context("ops")
    assert [(r.seq, r.role, r.kind) for r in context] == [
        (1, "user", "message"),
        (2, "assistant", "message"),
    ]


async def test_load_context_uses_only_the_newest_summary(store: Store) -> None:
    await store.checkpoint("ops", messages=[msg(x) for x in "abcdef"])  # seqs 1..6
    await store.checkpoint("ops", messages=[summary("S1", 2)])  # seq 7
    assert texts(await store.load_context("ops")) == ["S1", "c", "d", "e", "f"]
    await store.checkpoint("ops", messages=[msg("g")])  # 8
    await store.checkpoint("ops", messages=[summary("S2", 5, covers_from=3)])  # 9
    await store.checkpoint("ops", messages=[msg("h")])  # 10
    context = await store.load_context("ops")
    assert texts(context) == ["S2", "f", "g", "h"]
    assert [r.seq for r in context] == [9, 6, 8, 10]
    assert (context[0].covers_from, context[0].covers_to) == (3, 5)
    assert len(await store.load_messages("ops")) == 10
    assert await store.load_context_json("ops") == [as_json_row(r) for r in context]


def as_json_row(record: MessageRecord) -> ContextRow:
    """The row load_context_json gives for a record of load_context."""
    content = json.dumps(record.content, ensure_ascii=False, separators=(",", ":"))
    return ContextRow(record.seq, record.kind, record.covers_from, content)


async def test_load_context_json_gives_each_content_as_the_text_stored(store: Store) -> None:
    content = {"role": "user", "content": [{"type": "text", "text": 'Wörter "quoted"\n\u2028'}]}
    await store.checkpoint("ops", messages=[NewMessage("user", content, "t1")])
    [row] = await store.load_context_json("ops")
    assert row == ContextRow(1, "message", None, dumps(content))
    assert (row.seq, row.kind, row.covers_from) == (1, "message", None)
    assert json.loads(row.content) == content


# -- timeline -------------------------------------------------------------------------------
async def test_timeline_append_and_read(store: Store) -> None:
    await store.ensure_session("dev", "channel")
    first = await store.append_timeline("ops", "t1", "turn.start", {"who": "ünïcode"})
    other = await store.append_timeline("dev", None, "turn.start", {})
    await store.checkpoint("ops", timeline=[("t1", "round", {"n": 1}), ("t1", "round", {"n": 2})])
    events = await store.timeline("ops")
    assert first < other < events[1].id < events[2].id
    assert [(e.kind, e.data) for e in events] == [
        ("turn.start", {"who": "ünïcode"}),
        ("round", {"n": 1}),
        ("round", {"n": 2}),
    ]
    assert [e.data for e in await store.timeline("ops", after_id=events[1].id)] == [{"n": 2}]
    assert len(await store.timeline("ops", limit=2)) == 2
    with pytest.raises(StoreError, match="timeline append to session 'ghost'"):
        await store.append_timeline("ghost", None, "x", {})


# -- concurrency and model ------------------------------------------------------------------
async def test_concurrent_checkpoints_get_unique_dense_seqs(store: Store) -> None:
    sessions = ["s0", "s1", "s2", "s3"]
    for sid in sessions:
        await store.ensure_session(sid, "channel")

    async def turn(sid: str, n: int) -> list[int]:
        await asyncio.sleep(0)
        return await store.checkpoint(sid, messages=[msg(f"{n}.{i}") for i in range(3)])

    jobs = [(sid, n) for n in range(25) for sid in sessions]
    results = await asyncio.gather(*(turn(sid, n) for sid, n in jobs))
    for seqs in results:
        assert seqs == list(range(seqs[0], seqs[0] + 3))
    for sid in sessions:
        stored = [r.seq for r in await store.load_messages(sid)]
        assert stored == list(range(1, 76))


async def test_cancelled_checkpoint_leaves_no_partial_write(store: Store) -> None:
    # Cancel at successively later points so some land inside the open transaction.
    for delay in range(12):
        task = asyncio.create_task(
            store.checkpoint("ops", messages=[msg("x"), msg("y")], timeline=[(None, "k", {})])
        )
        for _ in range(delay):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        seqs = [r.seq for r in await store.load_messages("ops")]
        assert len(seqs) % 2 == 0
        assert seqs == list(range(1, len(seqs) + 1))
        assert len(await store.timeline("ops")) == len(seqs) // 2
    assert await store.checkpoint("ops", messages=[msg("z")]) == [len(seqs) + 1]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, list[Any]]]:
    item = st.one_of(st.just("m"), st.just("s-none"), st.integers(min_value=0, max_value=40))
    op = st.one_of(
        st.tuples(st.just("append"), st.lists(item, max_size=4)),
        st.tuples(st.just("reset"), st.just([])),
    )
    return draw(st.lists(op, max_size=12))


def model_context(rows: list[dict[str, Any]], generation: int) -> list[int]:
    current = [r for r in rows if r["gen"] == generation]
    summaries = [r for r in current if r["kind"] == "summary"]
    if not summaries:
        return [r["seq"] for r in current]
    newest = summaries[-1]
    upto = newest["seq"] if newest["covers_to"] is None else newest["covers_to"]
    rest = [r["seq"] for r in current if r["kind"] == "message" and r["seq"] > upto]
    return [newest["seq"], *rest]


async def run_against_model(made: Store, ops: list[tuple[str, list[Any]]]) -> None:
    rows: list[dict[str, Any]] = []
    generation, next_seq = 1, 1
    async with made as s:  # type: ignore[attr-defined]  # both stores are context managers
        await s.ensure_session("m", "channel")
        for name, items in ops:
            if name == "reset":
                generation = (await s.reset_session("m")).generation
                continue
            new: list[NewMessage] = []
            for k, item in enumerate(items):
                seq = next_seq + k
                if item == "m":
                    new.append(msg(str(seq)))
                    rows.append({"seq": seq, "gen": generation, "kind": "message"})
                else:
                    covers = None if item == "s-none" else item % seq
                    new.append(summary(str(seq), covers))
                    rows.append(
                        {"seq": seq, "gen": generation, "kind": "summary", "covers_to": covers}
                    )
            expected = list(range(next_seq, next_seq + len(items)))
            assert await s.checkpoint("m", messages=new) == expected
            next_seq += len(items)
            context = await s.load_context("m")
            assert [r.seq for r in context] == model_context(rows, generation)
            assert await s.load_context_json("m") == [as_json_row(r) for r in context]
        all_current = [r["seq"] for r in rows if r["gen"] == generation]
        assert [r.seq for r in await s.load_messages("m")] == all_current


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations())
def test_load_context_matches_model(ops: list[tuple[str, list[Any]]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        made = SQLiteStore(pathlib.Path(tmp) / "model.db", synchronous="OFF")
        asyncio.run(run_against_model(made, ops))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations())
def test_load_context_matches_model_on_postgres(
    postgres_cluster: Cluster, ops: list[tuple[str, list[Any]]]
) -> None:
    from geodebot.store.postgres import PostgresStore

    made = PostgresStore(postgres_cluster.new_database(migrated=True))
    asyncio.run(run_against_model(made, ops))
