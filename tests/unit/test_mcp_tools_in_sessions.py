"""MCP tools in sessions: only declared tools reach the plan; project servers need trust."""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from geodebot.engine.mcp.trust import TrustStore
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, create_session
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply

ROOT = Path(__file__).resolve().parents[2]


def fake_server(name: str, *, declared: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "transport": "stdio",
        "command": [sys.executable, "-m", "tests.support.fakes.mcp_tools_server"],
        "env": ["PYTHONPATH"],
        "tools": declared,
    }


def project_file(tmp_path: Path) -> Path:
    path = tmp_path / "project-mcp.toml"
    path.write_text(
        "[[servers]]\n"
        'name = "proj"\n'
        f"command = [{sys.executable!r}, '-m', 'tests.support.fakes.mcp_tools_server']\n"
        'env = ["PYTHONPATH"]\n'
        "[servers.tools.echo]\n"
        'safety = "read"\n'
        'effect = "none"\n'
    )
    return path


async def test_declared_tool_is_callable_and_undeclared_is_not_in_the_plan(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: Any
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = with_sections(
        make_config(tmp_path, llm_server),
        mcp={
            "servers": [
                fake_server("fake", declared={"echo": {"safety": "read", "effect": "none"}})
            ]
        },
        tools={"workspace": str(tmp_path / "ws"), "ipc_tools": [], "headless_tools": []},
    )
    llm_server.script(
        Reply(
            tool_calls=[
                Call("mcp__fake__echo", {"text": "through mcp"}, id="e1"),
                Call("mcp__fake__add", {"a": 1, "b": 2}, id="a1"),
            ]
        ),
        Reply("done"),
    )
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        spec = SessionSpec("m", tools=("mcp__fake__echo", "mcp__fake__add"))
        session = await create_session(Mode.DAEMON, spec, app.services)
        assert sorted(session.plan.tools) == ["mcp__fake__echo"]
        result = await app.run_turn(Mode.DAEMON, spec, "use mcp")
        assert result.ok, result
        events = [e.data for e in await app.services.store.timeline("m") if e.kind == "tool_call"]
    assert [(e["tool"], e["status"], e["reason"]) for e in events] == [
        ("mcp__fake__echo", "ok", None),
        ("mcp__fake__add", "refused", "not_in_plan"),
    ]
    sent = llm_server.requests[0].json
    assert [t["name"] for t in sent["tools"]] == ["mcp__fake__echo"]
    results = [
        block
        for message in llm_server.requests[1].json["messages"]
        for block in (message["content"] if isinstance(message["content"], list) else [])
        if block.get("type") == "tool_result"
    ]
    assert "through mcp" in str(results[0]["content"])


async def test_project_servers_are_ignored_until_trusted(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: Any
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    path = project_file(tmp_path)
    config = with_sections(
        make_config(tmp_path, llm_server),
        mcp={"project_config": str(path)},
        tools={"workspace": str(tmp_path / "ws"), "ipc_tools": [], "headless_tools": []},
    )
    spec = SessionSpec("p", tools=("mcp__proj__echo",))
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        assert dict((await create_session(Mode.DAEMON, spec, app.services)).plan.tools) == {}
    TrustStore(tmp_path / "var" / "trust.json").trust(path, by="ops")
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        plan = (await create_session(Mode.DAEMON, spec, app.services)).plan
        assert list(plan.tools) == ["mcp__proj__echo"]
    # An edit after trusting withdraws the trust until it is reviewed again.
    path.write_text(path.read_text().replace('"read"', '"write"'))
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        assert dict((await create_session(Mode.DAEMON, spec, app.services)).plan.tools) == {}
