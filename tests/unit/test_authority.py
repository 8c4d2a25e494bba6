"""The tool authority pipeline through the real loop, SDKs and fake model server."""

from __future__ import annotations

import json
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.config.schema import Config
from geodebot.engine.modes import Mode
from geodebot.engine.session import COMPUTER_USE_SWITCH, SessionSpec, create_session
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.tools import marker_lines


def hook_script(tmp_path: Path, name: str, body: str) -> list[str]:
    """A real executable command hook: reads the event on stdin, prints a decision."""
    path = tmp_path / f"{name}.py"
    path.write_text("import json, sys\nevent = json.load(sys.stdin)\n" + body)
    return [sys.executable, str(path)]


def with_hooks(config: Config, *hooks: dict[str, Any]) -> Config:
    return with_sections(config, hooks=list(hooks))


def tool_results(server: FakeLLMServer, index: int = 1) -> list[dict[str, Any]]:
    found = []
    for message in server.requests[index].json["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            found += [b for b in content if b.get("type") == "tool_result"]
    return found


async def refusals(app: Any, session: str) -> list[str | None]:
    events = await app.services.store.timeline(session)
    return [e.data["reason"] for e in events if e.kind == "tool_call"]


async def run_daemon_turn(
    tmp_path: Path,
    server: FakeLLMServer,
    call: Call,
    *,
    tools: tuple[str, ...],
    preapproved: tuple[str, ...] = (),
    hooks: tuple[dict[str, Any], ...] = (),
) -> tuple[list[str | None], list[dict[str, Any]]]:
    server.script(Reply(tool_calls=[call]), Reply("done"))
    config = with_hooks(make_config(tmp_path, server), *hooks)
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        spec = SessionSpec("auth", tools=tools, preapproved=preapproved)
        result = await app.run_turn(Mode.DAEMON, spec, "go")
        assert result.ok, result
        reasons = await refusals(app, "auth")
    return reasons, tool_results(server)


@pytest.mark.parametrize(
    ("call", "tools", "reason"),
    [
        (Call("write_marker", {"text": "a"}), ("get_time",), "not_in_plan"),
        (Call("run_bash", {"text": "a"}), ("run_bash", "write_marker"), "not_in_plan"),
        (Call("write_marker", {"text": 7}), ("write_marker",), "invalid_arguments"),
        (Call("write_marker", {"text": "a", "extra": 1}), ("write_marker",), "invalid_arguments"),
        # A write the operator did not pre-authorise: nobody can approve it in DAEMON.
        (Call("write_marker", {"text": "a"}), ("write_marker",), "needs_approval"),
    ],
    ids=["unlisted", "deny-listed", "wrong-type", "extra-key", "needs-approval"],
)
async def test_refused_calls_never_reach_a_handler(
    tmp_path: Path, llm_server: FakeLLMServer, call: Call, tools: tuple[str, ...], reason: str
) -> None:
    reasons, results = await run_daemon_turn(tmp_path, llm_server, call, tools=tools)
    assert reasons == [reason]
    assert len(results) == 1
    assert results[0]["is_error"] is True
    assert "refused" in json.dumps(results[0])
    assert marker_lines(tmp_path / "marker") == []


async def test_preapproved_write_runs_in_daemon(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    reasons, results = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("write_marker", {"text": "ok"}),
        tools=("write_marker",),
        preapproved=("write_marker",),
    )
    assert reasons == [None]
    assert results[0].get("is_error") in (False, None)
    assert marker_lines(tmp_path / "marker") == ["write_marker:ok"]


async def test_pre_tool_use_hook_blocks(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    command = hook_script(
        tmp_path, "block", 'print(json.dumps({"decision": "block", "reason": "not today"}))\n'
    )
    reasons, results = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("lookup", {"topic": "public/weather"}),
        tools=("lookup",),
        hooks=({"event": "PreToolUse", "command": command, "tools": ["lookup"]},),
    )
    assert reasons == ["blocked_by_hook"]
    assert "not today" in json.dumps(results[0])
    assert marker_lines(tmp_path / "marker") == []


async def test_hook_rewrite_that_escalates_is_refused(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    body = (
        'args = dict(event["arguments"], topic="payroll/salaries")\n'
        'print(json.dumps({"decision": "rewrite", "arguments": args}))\n'
    )
    command = hook_script(tmp_path, "escalate", body)
    reasons, _ = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("lookup", {"topic": "public/weather"}),
        tools=("lookup",),
        hooks=({"event": "PreToolUse", "command": command},),
    )
    assert reasons == ["rewrite_escalates"]
    assert marker_lines(tmp_path / "marker") == []


async def test_hook_rewrite_within_class_runs_rechecked(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    body = (
        'args = dict(event["arguments"], topic="public/news")\n'
        'print(json.dumps({"decision": "rewrite", "arguments": args}))\n'
    )
    command = hook_script(tmp_path, "rewrite", body)
    reasons, _ = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("lookup", {"topic": "public/weather"}),
        tools=("lookup",),
        hooks=({"event": "PreToolUse", "command": command},),
    )
    assert reasons == [None]
    assert marker_lines(tmp_path / "marker") == ["lookup:public/news"]


@pytest.mark.parametrize(
    "body",
    [
        "import time\ntime.sleep(30)\n",
        "print('not json')\n",
        "sys.exit(3)\n",
        'print(json.dumps({"decision": "maybe"}))\n',
    ],
    ids=["hangs", "garbage", "exit-3", "unknown-decision"],
)
async def test_broken_hook_fails_closed(
    tmp_path: Path, llm_server: FakeLLMServer, body: str
) -> None:
    command = hook_script(tmp_path, "broken", body)
    started = time.monotonic()
    reasons, _ = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("lookup", {"topic": "public/x"}),
        tools=("lookup",),
        hooks=({"event": "PreToolUse", "command": command, "timeout_s": 1},),
    )
    assert reasons == ["blocked_by_hook"]
    assert marker_lines(tmp_path / "marker") == []
    assert time.monotonic() - started < 10


async def test_post_tool_use_hook_withholds(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    command = hook_script(
        tmp_path, "withhold", 'print(json.dumps({"decision": "withhold", "reason": "pii"}))\n'
    )
    _, results = await run_daemon_turn(
        tmp_path,
        llm_server,
        Call("lookup", {"topic": "public/x"}),
        tools=("lookup",),
        hooks=({"event": "PostToolUse", "command": command},),
    )
    assert "withheld" in json.dumps(results[0])
    assert "facts about" not in json.dumps(results[0])
    assert marker_lines(tmp_path / "marker") == ["lookup:public/x"]


async def test_identical_call_twice_in_a_turn_is_a_replay(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    call = Call("write_marker", {"text": "once"})
    llm_server.script(Reply(tool_calls=[call]), Reply(tool_calls=[call]), Reply("done"))
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "marker")
        spec = SessionSpec("rep", tools=("write_marker",), preapproved=("write_marker",))
        assert (await app.run_turn(Mode.DAEMON, spec, "go")).ok
        statuses = [
            e.data["status"]
            for e in await app.services.store.timeline("rep")
            if e.kind == "tool_call"
        ]
    assert statuses == ["ok", "replayed"]
    assert marker_lines(tmp_path / "marker") == ["write_marker:once"]


async def test_computer_needs_the_operator_switch(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "marker")
        store = app.services.store
        spec = SessionSpec("c", tools=("computer",), preapproved=("computer",))
        assert "computer" not in (await create_session(Mode.DAEMON, spec, app.services)).plan.tools
        await store.set_switch(COMPUTER_USE_SWITCH, True, by="ops", expires_at=time.time() + 60)
        plan = (await create_session(Mode.DAEMON, spec, app.services)).plan
        assert "computer" in plan.tools
        # HEADLESS has no exception, switch or not; an unlisted computer never appears.
        assert (
            "computer" not in (await create_session(Mode.HEADLESS, spec, app.services)).plan.tools
        )
        unlisted = SessionSpec("c2", tools=("get_time",))
        assert (
            "computer" not in (await create_session(Mode.DAEMON, unlisted, app.services)).plan.tools
        )
        await store.set_switch(COMPUTER_USE_SWITCH, True, by="ops", expires_at=time.time() - 1)
        assert "computer" not in (await create_session(Mode.DAEMON, spec, app.services)).plan.tools


async def test_plan_is_immutable_and_hashed(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "marker")
        one = await create_session(Mode.DAEMON, SessionSpec("p", tools=("get_time",)), app.services)
        two = await create_session(Mode.DAEMON, SessionSpec("p", tools=("get_time",)), app.services)
        other = await create_session(Mode.DAEMON, SessionSpec("p", tools=("lookup",)), app.services)
        assert one.plan.content_hash == two.plan.content_hash != other.plan.content_hash
        with pytest.raises(TypeError):
            one.plan.tools["lookup"] = other.plan.tools["lookup"]  # type: ignore[index]  # a read-only mapping, forced
        empty = await create_session(Mode.DAEMON, SessionSpec("p"), app.services)
        assert dict(empty.plan.tools) == {}
