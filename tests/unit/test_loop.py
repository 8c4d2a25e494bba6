"""The agent loop through the real anthropic/openai SDKs against the fake model server."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from contextlib import AsyncExitStack, closing
from pathlib import Path
from typing import Any

import pytest

from geodebot.config.schema import DB_FILE
from geodebot.engine.compaction import SUMMARY_PREFIX
from geodebot.engine.loop import AgenticLoop
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, create_session
from tests.support.app import open_app
from tests.support.config import make_config
from tests.support.fakes.llm_server import Call, Error, FakeLLMServer, Hang, Reply
from tests.support.tools import marker_lines


def sent_messages(server: FakeLLMServer, index: int = -1) -> list[dict[str, Any]]:
    body = server.requests[index].json
    assert isinstance(body, dict)
    messages = body["messages"]
    assert isinstance(messages, list)
    return messages


def run_sql(path: Path, sql: str) -> None:
    """Change the database behind the store's back, as an operator or a failing disk would."""
    with closing(sqlite3.connect(path)) as db, db:
        db.execute(sql)


def tool_results_in(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            found += [b for b in content if b.get("type") == "tool_result"]
    return found


async def kinds(app_store: Any, session_id: str) -> list[str]:
    return [e.kind for e in await app_store.timeline(session_id)]


@pytest.mark.parametrize("provider", ["anthropic", "openai-compatible"])
async def test_text_turn_is_answered_and_checkpointed(
    tmp_path: Path, llm_server: FakeLLMServer, provider: str
) -> None:
    llm_server.script(Reply("Hello from the fake."))
    config = make_config(tmp_path, llm_server, provider=provider)
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        result = await app.run_turn(Mode.HEADLESS, SessionSpec("s1"), "hi")
        assert result.ok
        assert result.text == "Hello from the fake."
        store = app.services.store
        context = await store.load_context("s1")
        assert [r.role for r in context] == ["user", "assistant"]
        assert await kinds(store, "s1") == ["turn_started", "llm_call", "verify", "turn_finished"]
    body = llm_server.requests[0].json
    assert body["model"] == "model-under-test-1"
    assert "tools" not in body or body["tools"] in ([], None)


async def test_tool_round_trip_runs_the_tool_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    marker = tmp_path / "marker"
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "one"})]), Reply("Done."))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        spec = SessionSpec("tools", tools=("write_marker",), preapproved=("write_marker",))
        result = await app.run_turn(Mode.DAEMON, spec, "write one")
        assert result.ok, result
        assert result.text == "Done."
        assert await app.services.store.pending_batches("tools") == []
    assert marker_lines(marker) == ["write_marker:one"]
    results = tool_results_in(sent_messages(llm_server, 1))
    assert len(results) == 1
    assert "wrote 'one'" in json.dumps(results[0])
    assert [t["name"] for t in llm_server.requests[0].json["tools"]] == ["write_marker"]


async def test_unlisted_and_deny_listed_tools_never_run(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    marker = tmp_path / "marker"
    llm_server.script(
        Reply(
            tool_calls=[
                Call("write_marker", {"text": "not listed"}),
                Call("run_bash", {"text": "denied in daemon"}),
                Call("no_such_tool", {}),
            ]
        ),
        Reply("I could not do that."),
    )
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        # run_bash is listed, but DAEMON removes it; write_marker is not listed at all.
        spec = SessionSpec("deny", tools=("run_bash", "get_time"))
        result = await app.run_turn(Mode.DAEMON, spec, "try everything")
        assert result.ok
    assert marker_lines(marker) == []
    assert [t["name"] for t in llm_server.requests[0].json["tools"]] == ["get_time"]
    results = tool_results_in(sent_messages(llm_server, 1))
    assert len(results) == 3
    assert all(r.get("is_error") for r in results)


async def test_garbage_tool_arguments_get_an_error_result(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    marker = tmp_path / "marker"
    llm_server.script(
        Reply(
            tool_calls=[
                Call("write_marker", '{"text": "unterminated', id="c1"),
                Call("write_marker", "[1, 2, 3]", id="c2"),
                Call("write_marker", '{"text": 42}', id="c3"),
            ]
        ),
        Reply("Sorry."),
    )
    config = make_config(tmp_path, llm_server, provider="openai-compatible")
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, marker)
        spec = SessionSpec("garbage", tools=("write_marker",))
        result = await app.run_turn(Mode.DAEMON, spec, "go")
        assert result.ok
    assert marker_lines(marker) == []
    tool_messages = [m for m in sent_messages(llm_server, 1) if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["c1", "c2", "c3"]
    assert all("invalid arguments" in m["content"] for m in tool_messages)


async def test_overflow_compacts_once_and_retries(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = make_config(tmp_path, llm_server, budgets={"keep_recent_messages": 2})
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "m")
        for index in range(3):
            llm_server.script(Reply(f"answer {index}"))
            assert (await app.run_turn(Mode.IPC, SessionSpec("of"), f"q{index}")).ok
        llm_server.script(Error.context_overflow(), Reply("summary text"), Reply("fits now"))
        result = await app.run_turn(Mode.IPC, SessionSpec("of"), "q3")
        assert result.ok
        assert result.text == "fits now"
        context = await app.services.store.load_context("of")
        assert context[0].kind == "summary"


async def test_empty_allowlist_means_no_tools(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.script(Reply("ok"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        session = await create_session(Mode.IPC, SessionSpec("empty"), app.services)
        assert dict(session.plan.tools) == {}
        await AgenticLoop(session).arun("hi")
    assert not llm_server.requests[0].json.get("tools")


async def test_batch_that_cannot_be_saved_does_not_run(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    marker = tmp_path / "marker"
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "x"})]), Reply("after"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        await app.services.store.ensure_session("nosave", "daemon")
        # A real write failure inside SQLite, as a full disk would cause.
        run_sql(
            tmp_path / "var" / DB_FILE,
            "CREATE TRIGGER fail_batches BEFORE INSERT ON tool_batches "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END",
        )
        spec = SessionSpec("nosave", tools=("write_marker",), preapproved=("write_marker",))
        result = await app.run_turn(Mode.DAEMON, spec, "write")
        assert result.outcome == "store_error"
        assert marker_lines(marker) == []
        assert await app.services.store.pending_batches("nosave") == []
        run_sql(tmp_path / "var" / DB_FILE, "DROP TRIGGER fail_batches")
        # The proposal was never saved, so the session still reads as a valid history.
        again = await app.run_turn(Mode.DAEMON, spec, "hello again")
        assert again.ok
        assert again.text == "after"
    assert marker_lines(marker) == []


async def test_an_unsaved_user_message_leads_to_nothing(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # The message is saved by the turn's first checkpoint, after the model is first asked;
    # when that save fails, what the model answered is not acted on.
    marker = tmp_path / "marker"
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "x"})]), Reply("after"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        await app.services.store.ensure_session("unsaved", "daemon")
        run_sql(
            tmp_path / "var" / DB_FILE,
            "CREATE TRIGGER fail_user BEFORE INSERT ON messages WHEN NEW.role = 'user' "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END",
        )
        spec = SessionSpec("unsaved", tools=("write_marker",), preapproved=("write_marker",))
        result = await app.run_turn(Mode.DAEMON, spec, "write")
        assert result.outcome == "store_error"
        assert len(llm_server.requests) == 1  # the model was asked meanwhile
        assert marker_lines(marker) == []
        assert await app.services.store.load_context("unsaved") == []
        run_sql(tmp_path / "var" / DB_FILE, "DROP TRIGGER fail_user")
        again = await app.run_turn(Mode.DAEMON, spec, "hello again")
        assert again.ok
        assert again.text == "after"
        # The history holds the second message and its answer, in order.
        context = await app.services.store.load_context("unsaved")
        assert [(r.role, r.seq) for r in context] == [("user", 1), ("assistant", 2)]
    assert marker_lines(marker) == []


async def test_budget_cuts_off_a_model_that_never_answers(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Hang(), Reply("back again"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        # Loaded first, as the daemon does once ready: importing the SDK inside the turn
        # could use up the 1 s before the hanging request is even sent.
        await app.load_models()
        spec = SessionSpec("slow", time_budget_s=1.0)
        started = time.monotonic()
        result = await app.run_turn(Mode.DAEMON, spec, "hello?")
        elapsed = time.monotonic() - started
        assert len(llm_server.requests) == 1  # the model was asked, and never answered
        assert result.outcome == "budget"
        assert "time budget of 1 s" in result.text
        assert elapsed < 2.0, elapsed
        assert "budget_exhausted" in await kinds(app.services.store, "slow")
        follow = await app.run_turn(Mode.DAEMON, spec, "still there?")
        assert follow.ok
        assert follow.text == "back again"


async def test_budget_during_a_tool_closes_the_batch(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("wait_forever", {})]), Reply("recovered"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        await app.load_models()  # the SDK import must not use up the 0.5 s
        spec = SessionSpec("stuck", tools=("wait_forever",), time_budget_s=0.5)
        result = await app.run_turn(Mode.DAEMON, spec, "wait")
        assert len(llm_server.requests) == 1  # the tool call came, and the tool never ended
        assert result.outcome == "budget"
        assert await app.services.store.pending_batches("stuck") == []
        follow = await app.run_turn(Mode.DAEMON, spec, "and now?")
        assert follow.ok, follow
    results = tool_results_in(sent_messages(llm_server, 1))
    assert len(results) == 1
    assert results[0]["is_error"]
    assert "may or may not have acted" in json.dumps(results[0])


async def test_verify_repairs_an_empty_answer(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.script(Reply(""), Reply("Now with words."))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        result = await app.run_turn(Mode.IPC, SessionSpec("v"), "say something")
        assert result.ok
        assert result.text == "Now with words."
    assert len(llm_server.requests) == 2
    assert "empty" in json.dumps(sent_messages(llm_server, 1)[-1])


async def test_verify_gives_up_after_the_repair_budget(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(""), Reply(""), Reply(""), Reply("never reached"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        result = await app.run_turn(Mode.IPC, SessionSpec("v2"), "say something")
        assert result.outcome == "verify_failed"
    assert len(llm_server.requests) == 3  # the answer and two repairs


async def test_max_rounds_guard(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.default = Reply(tool_calls=[Call("get_time", {})])
    config = make_config(tmp_path, llm_server, budgets={"max_rounds": 3})
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "m")
        result = await app.run_turn(Mode.IPC, SessionSpec("loop", tools=("get_time",)), "go")
        assert result.outcome == "max_rounds"
        record = await app.services.store.get_session("loop")
        assert record is not None
        assert record.guards["consecutive_failures"] == 1
    assert len(llm_server.requests) == 3


@pytest.mark.parametrize(
    ("error", "needle", "attempts"),
    [
        (Error.unauthorized(), "API key", 1),
        # With nothing to compact, an overflow cannot be fixed by trying again.
        (Error.context_overflow(), "too long", 1),
        (Error.server(), "unavailable", 1),
    ],
)
async def test_model_errors_end_the_turn_readably(
    tmp_path: Path, llm_server: FakeLLMServer, error: Error, needle: str, attempts: int
) -> None:
    llm_server.script(*[error] * attempts)
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        result = await app.run_turn(Mode.DAEMON, SessionSpec("err"), "hi")
        assert result.outcome == "model_error"
        assert needle in result.text
        assert len(llm_server.requests) == attempts
        llm_server.script(Reply("fine now"))
        assert (await app.run_turn(Mode.DAEMON, SessionSpec("err"), "again")).ok


async def test_missing_key_names_the_variable(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GEODEBOT_TEST_API_KEY")
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        result = await app.run_turn(Mode.IPC, SessionSpec("nokey"), "hi")
    assert result.outcome == "model_error"
    assert "GEODEBOT_TEST_API_KEY" in result.text
    assert llm_server.requests == []


async def test_history_survives_a_restart(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.script(Reply("first answer"), Reply("second answer"))
    config = make_config(tmp_path, llm_server)
    for text in ("first question", "second question"):
        async with AsyncExitStack() as stack:
            app = await open_app(config, stack, tmp_path / "m")
            assert (await app.run_turn(Mode.IPC, SessionSpec("keep"), text)).ok
    sent = json.dumps(sent_messages(llm_server, 1))
    assert "first question" in sent
    assert "first answer" in sent
    assert "second question" in sent


async def test_compaction_replaces_old_history_with_a_summary(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = make_config(
        tmp_path,
        llm_server,
        model={"context_tokens": 1024},
        budgets={"keep_recent_messages": 2, "compact_at": 0.5},
    )
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "m")
        for index in range(3):
            llm_server.script(Reply(f"answer {index}"))
            assert (await app.run_turn(Mode.IPC, SessionSpec("long"), f"q{index} short")).ok
        assert len(llm_server.requests) == 3  # small history: no compaction yet
        llm_server.script(Reply("THE SUMMARY"), Reply("answer 3"))
        big = "q3 " + "lorem ipsum " * 200
        assert (await app.run_turn(Mode.IPC, SessionSpec("long"), big)).ok
        context = await app.services.store.load_context("long")
        assert context[0].kind == "summary"
        assert (context[0].covers_from, context[0].covers_to) == (1, 4)
        assert [r.kind for r in context[1:]] == ["message"] * 4
        assert "compaction" in await kinds(app.services.store, "long")
    summary_request = json.dumps(llm_server.requests[-2].json)
    assert "q0 short" in summary_request
    assert "answer 1" in summary_request
    last = json.dumps(sent_messages(llm_server))
    assert "THE SUMMARY" in last
    assert SUMMARY_PREFIX.strip() in last
    assert "q0 short" not in last
    assert "q1 short" not in last
    assert "q2 short" in last
    assert "lorem ipsum" in last


async def test_secrets_stay_out_of_ledger_timeline_and_logs(
    tmp_path: Path, llm_server: FakeLLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.support.config import TEST_KEY

    llm_server.script(Error(401, "authentication_error", f"invalid x-api-key: {TEST_KEY}"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        result = await app.run_turn(Mode.DAEMON, SessionSpec("sec"), "hi")
        assert result.outcome == "model_error"
        events = await app.services.store.timeline("sec")
    assert llm_server.requests, "the request reached the fake"
    assert TEST_KEY not in result.text
    assert TEST_KEY not in json.dumps([e.data for e in events])
    ledger = (tmp_path / "var" / "ledger.jsonl").read_text()
    assert "model_call" in ledger
    assert TEST_KEY not in ledger
    assert TEST_KEY not in caplog.text


async def test_concurrent_turns_in_one_session_run_one_at_a_time(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("ok")
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "m")
        results = await asyncio.gather(
            *(app.run_turn(Mode.IPC, SessionSpec("lane"), f"m{i}") for i in range(5))
        )
        assert all(r.ok for r in results)
        context = await app.services.store.load_context("lane")
    # Strict alternation proves no two turns interleaved their checkpoints.
    assert [r.role for r in context] == ["user", "assistant"] * 5


@pytest.mark.parametrize("provider", ["anthropic", "openai-compatible"])
async def test_the_result_carries_the_stop_reason_of_the_last_answer(
    tmp_path: Path, llm_server: FakeLLMServer, provider: str
) -> None:
    # A refusal after a tool round is the turn's refusal; a refusal that the model then
    # answered past (here: after a tool call it made anyway) is not.
    llm_server.script(
        Reply(tool_calls=[Call("write_marker", {"text": "one"})]),
        Reply("I can't help with that.", stop="refusal"),
        Reply("I won't.", tool_calls=[Call("write_marker", {"text": "two"})], stop="refusal"),
        Reply("Done after all."),
    )
    config = make_config(tmp_path, llm_server, provider=provider)
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        spec = SessionSpec("stops", tools=("write_marker",), preapproved=("write_marker",))
        refused = await app.run_turn(Mode.DAEMON, spec, "write one")
        assert (refused.ok, refused.stop_reason, refused.refused_by_model) == (
            True,
            "refusal",
            True,
        )
        answered = await app.run_turn(Mode.DAEMON, spec, "write two")
        assert (answered.ok, answered.stop_reason, answered.refused_by_model) == (
            True,
            "end_turn",
            False,
        )
    assert marker_lines(tmp_path / "marker") == ["write_marker:one", "write_marker:two"]
