"""kill -9 between "batch saved" and "tools run": the restored session continues."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from geodebot.engine.loop import AgenticLoop
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, create_session
from tests.support.app import open_app
from tests.support.config import make_config
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.tools import marker_lines

ROOT = Path(__file__).resolve().parents[2]


async def crash_child(
    tmp_path: Path,
    server: FakeLLMServer,
    event: str = "batch_saved",
    tool: str = "write_marker",
    turn_id: str | None = None,
) -> Path:
    marker = tmp_path / "marker"
    config = make_config(tmp_path, server)
    config_json = json.dumps(config.model_dump(mode="json", exclude={"source"}))
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.crash_child",
        config_json,
        str(marker),
        event,
        tool,
        *([turn_id] if turn_id else []),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(child.communicate(), timeout=60)
    assert child.returncode == -signal.SIGKILL, stderr.decode()
    return marker


async def test_resume_runs_the_saved_batch_and_finishes_the_turn(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "once"}, id="toolu_1")]))
    marker = await crash_child(tmp_path, llm_server)
    assert marker_lines(marker) == [], "the tool must not have run before the kill"
    llm_server.script(Reply("Finished after the restart."))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        store = app.services.store
        pending = await store.pending_batches("crash")
        assert [b.status for b in pending] == ["proposed"]
        session = await create_session(
            Mode.DAEMON,
            SessionSpec("crash", tools=("write_marker",), preapproved=("write_marker",)),
            app.services,
        )
        result = await AgenticLoop(session).resume()
        assert result is not None
        assert result.ok, result
        assert result.text == "Finished after the restart."
        assert await store.pending_batches("crash") == []
        assert await AgenticLoop(session).resume() is None
        roles = [r.role for r in await store.load_context("crash")]
        assert roles == ["user", "assistant", "user", "assistant"]
        kinds = [e.kind for e in await store.timeline("crash")]
        assert "tool_batch_recovered" in kinds
        assert kinds[-1] == "turn_finished"
    assert marker_lines(marker) == ["write_marker:once"]
    resumed = json.dumps(llm_server.requests[-1].json["messages"])
    assert '"tool_use_id": "toolu_1"' in resumed


async def test_next_message_finishes_an_interrupted_batch_first(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "once"}, id="toolu_2")]))
    marker = await crash_child(tmp_path, llm_server)
    assert marker_lines(marker) == []
    llm_server.script(Reply("Both handled."))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        spec = SessionSpec("crash", tools=("write_marker",), preapproved=("write_marker",))
        result = await app.run_turn(Mode.DAEMON, spec, "and another thing")
        assert result.ok
        assert result.text == "Both handled."
        assert await app.services.store.pending_batches("crash") == []
    assert marker_lines(marker) == ["write_marker:once"]
    sent = llm_server.requests[-1].json["messages"]
    flat = json.dumps(sent)
    assert flat.index("toolu_2") < flat.index("and another thing")


async def test_crash_between_receipt_and_commit_is_uncertain_and_never_rerun(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("write_and_die", {"text": "x"}, id="toolu_9")]))
    marker = await crash_child(tmp_path, llm_server, event="none", tool="write_and_die")
    assert marker_lines(marker) == ["write_and_die:x"]
    llm_server.script(Reply("I will check with the operator."))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        store = app.services.store
        # What the daemon does at start: nothing admitted can still be running.
        swept = await store.mark_admitted_uncertain("restart")
        assert [r.tool for r in swept] == ["write_and_die"]
        spec = SessionSpec("crash", tools=("write_and_die",), preapproved=("write_and_die",))
        session = await create_session(Mode.DAEMON, spec, app.services)
        result = await AgenticLoop(session).resume()
        assert result is not None
        assert result.ok
        receipts = await store.list_receipts(status="uncertain", unresolved_only=True)
        assert [r.id for r in receipts] == [swept[0].id]
        events = [e for e in await store.timeline("crash") if e.kind == "tool_call"]
        assert events[-1].data["status"] == "uncertain"
    # The effect happened once, before the crash, and was not repeated.
    assert marker_lines(marker) == ["write_and_die:x"]
    told = json.dumps(llm_server.requests[-1].json["messages"])
    assert "outcome uncertain" in told
    assert swept[0].id in told


async def test_a_named_turn_asked_again_after_a_crash_continues_and_never_redoes_its_tools(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "once"}, id="toolu_7")]))
    # Killed after the tool ran and its result was saved, before the model answered.
    marker = await crash_child(tmp_path, llm_server, event="batch_done", turn_id="t-inbox-7")
    assert marker_lines(marker) == ["write_marker:once"]
    llm_server.script(Reply("Finished after the restart."))
    spec = SessionSpec("crash", tools=("write_marker",), preapproved=("write_marker",))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, marker)
        result = await app.run_turn(Mode.DAEMON, spec, "write the marker", turn_id="t-inbox-7")
        assert (result.ok, result.text, result.turn_id) == (
            True,
            "Finished after the restart.",
            "t-inbox-7",
        )
        roles = [r.role for r in await app.services.store.load_context("crash")]
        assert roles == ["user", "assistant", "user", "assistant"]
        # Asked once more (the answer was lost before the inbox row was finished): the
        # finished turn's answer, without a model call.
        calls = len(llm_server.requests)
        again = await app.run_turn(Mode.DAEMON, spec, "write the marker", turn_id="t-inbox-7")
        assert (again.ok, again.text) == (True, "Finished after the restart.")
        assert len(llm_server.requests) == calls
    assert marker_lines(marker) == ["write_marker:once"]
    sent = json.dumps(llm_server.requests[-1].json["messages"])
    assert sent.count("write the marker") == 1
    assert '"tool_use_id": "toolu_7"' in sent
