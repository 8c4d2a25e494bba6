"""MCP servers that misbehave (tests/support/fakes/mcp_misbehaving_server.py) cost no more than
their own calls: a bad input schema, a server hung at initialize, an HTTP server that forgot our
session; plus the environment a stdio server gets, and run_agent's own hardening."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Literal

import pytest

from geodebot.cli.check import run_checks
from geodebot.config.schema import ConfigError, MCPServerConfig, parse_config
from geodebot.engine.mcp.client import MCPServerPool
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, create_session
from geodebot.engine.tools import ToolCallContext, ToolError
from geodebot.store.sqlite import SQLiteStore
from tests.support.app import open_app
from tests.support.config import TEST_KEY_ENV, make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Hang, RecordedRequest, Reply
from tests.support.fakes.mcp_misbehaving_server import FakeMCPHTTP
from tests.support.mcp import FAKE, MISBEHAVING, alive, children, serving, wait_for_state

ROOT = Path(__file__).resolve().parents[2]
READ: dict[str, Any] = {"safety": "read", "effect": "none"}
CTX = ToolCallContext(session_id="s1", turn_id="t1", mode=Mode.HEADLESS)
BAD_TOOLS = ("bad_type", "bad_pattern", "bad_ref")


def server(name: str, *args: str, tools: tuple[str, ...] = ("echo",)) -> dict[str, Any]:
    return {
        "name": name,
        "command": [sys.executable, str(MISBEHAVING), *args],
        "tools": {tool: READ for tool in tools},
    }


def tool_results(request: RecordedRequest) -> list[dict[str, Any]]:
    """The tool results a model request ends with, as ``content`` and ``is_error``."""
    messages = request.json["messages"]
    if request.path.endswith("/chat/completions"):
        results: list[dict[str, Any]] = []
        for message in reversed(messages):
            if message["role"] != "tool":
                break
            content = str(message["content"])
            results.insert(0, {"content": content, "is_error": content.startswith("ERROR: ")})
        return results
    blocks = messages[-1]["content"]
    return [
        {"content": str(b["content"]), "is_error": bool(b.get("is_error"))}
        for b in blocks
        if b.get("type") == "tool_result"
    ]


def offered(request: RecordedRequest) -> list[dict[str, Any]]:
    """The tools a model request offers, as ``name`` and ``description``."""
    tools = request.json.get("tools", [])
    return [t.get("function", t) for t in tools]


def pool_for(*configs: dict[str, Any], **kwargs: Any) -> MCPServerPool:
    servers = [MCPServerConfig.model_validate(c) for c in configs]
    kwargs.setdefault("environ", dict(os.environ))
    return MCPServerPool(servers, cwd=ROOT, **kwargs)


# -- item 7: a server's own schema cannot break a turn ------------------------------------


async def test_a_tool_with_a_bad_schema_is_unavailable_and_its_neighbours_work(
    tmp_path: Path, llm_server: FakeLLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    mixed = server("mixed", "--bad-schemas", tools=("echo", *BAD_TOOLS))
    config = with_sections(
        make_config(tmp_path, llm_server),
        # A long grace: this test is about schemas, not about a server slow to start.
        mcp={"servers": [mixed], "connect_grace_s": 30},
        tools={"workspace": str(tmp_path / "ws"), "ipc_tools": [], "headless_tools": []},
    )
    listed = ("mcp__mixed__echo", *(f"mcp__mixed__{tool}" for tool in BAD_TOOLS))
    llm_server.script(
        Reply(
            tool_calls=[
                Call("mcp__mixed__echo", {"text": "the good one"}, id="e1"),
                Call("mcp__mixed__bad_pattern", {"x": "ab"}, id="b1"),
            ]
        ),
        Reply("first done"),
        Reply(tool_calls=[Call("mcp__mixed__echo", {"text": "again"}, id="e2")]),
        Reply("second done"),
    )
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        spec = SessionSpec("m", tools=listed)
        session = await create_session(Mode.DAEMON, spec, app.services)
        assert list(session.plan.tools) == ["mcp__mixed__echo"]
        first = await app.run_turn(Mode.DAEMON, spec, "use the tools")
        second = await app.run_turn(Mode.DAEMON, SessionSpec("n", tools=listed), "again")
        assert (first.ok, second.ok) == (True, True), (first, second)
        events = [e.data for e in await app.services.store.timeline("m") if e.kind == "tool_call"]
    assert [(e["tool"], e["status"], e["reason"]) for e in events] == [
        ("mcp__mixed__echo", "ok", None),
        ("mcp__mixed__bad_pattern", "refused", "not_in_plan"),
    ]
    assert [t["name"] for t in offered(llm_server.requests[0])] == ["mcp__mixed__echo"]
    echoed = tool_results(llm_server.requests[1])[0]
    assert "the good one" in str(echoed["content"])
    assert not echoed["is_error"]
    assert "again" in str(tool_results(llm_server.requests[3])[0]["content"])
    # Three sessions resolved the plan (one above, two turns): still one line per bad tool.
    for tool in BAD_TOOLS:
        lines = [r.getMessage() for r in caplog.records if f"mcp__mixed__{tool}" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "input schema" in lines[0]


async def test_check_names_a_declared_tool_with_a_bad_schema(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    mixed = server("mixed", "--bad-schemas", tools=("echo", "bad_ref"))
    config = with_sections(
        make_config(tmp_path, llm_server),
        mcp={"servers": [mixed]},
        tools={"workspace": str(tmp_path / "ws"), "ipc_tools": [], "headless_tools": []},
    )
    rows = {row.what: row for row in await run_checks(config)}
    row = rows["mcp mixed"]
    assert not row.ok
    assert row.detail.startswith("1 declared tools offered")
    assert "bad_ref: its input schema is unusable" in row.detail


# -- item 8: a hung server costs nothing to sessions that do not use it -------------------


def run_config(tmp_path: Path, llm: FakeLLMServer, headless: list[str], *servers: Any) -> Path:
    """A config file for the CLI; JSON strings and lists are valid TOML values.

    The model speaks the OpenAI dialect: a run imports its provider's SDK inside the turn's
    budget, and the anthropic SDK takes seconds of CPU to import on a busy machine, which the
    tests of tight budgets would measure instead of the MCP servers."""
    text = (
        f"[daemon]\nstate_dir = {json.dumps(str(tmp_path / 'var'))}\n"
        f'[model]\nprovider = "openai-compatible"\nname = "hardening-model"\n'
        f'base_url = "{llm.openai_base_url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f"[tools]\nworkspace = {json.dumps(str(tmp_path / 'ws'))}\n"
        f"headless_tools = {json.dumps(headless)}\n"
    )
    for config in servers:
        text += f"[[mcp.servers]]\nname = {json.dumps(config['name'])}\n"
        text += f"command = {json.dumps(config['command'])}\n"
        for tool in config["tools"]:
            text += f'[mcp.servers.tools.{tool}]\nsafety = "read"\neffect = "none"\n'
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


async def geodebot(*args: str) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - started


async def plain_run(tmp_path: Path, llm: FakeLLMServer) -> float:
    """How long a run with no MCP server at all takes here and now: the process's own start
    and stop, which a busy machine stretches by seconds."""
    (tmp_path / "plain").mkdir()
    config = run_config(tmp_path / "plain", llm, ["get_time"])
    llm.script(Reply("plain"))
    code, out, err, elapsed = await geodebot("run", "--config", str(config), "hi")
    assert (code, out) == (0, "plain\n"), err
    llm.requests.clear()
    return elapsed


async def test_run_is_not_held_up_by_a_hung_server_whose_tools_it_does_not_list(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    started_file = tmp_path / "hung-started"
    config = run_config(
        tmp_path,
        llm_server,
        ["get_time", "mcp__good__echo"],
        server("hung", "--hang-initialize", "--started-file", str(started_file)),
        server("good"),
    )
    plain = await plain_run(tmp_path, llm_server)
    llm_server.script(Reply(tool_calls=[Call("mcp__good__echo", {"text": "hi"})]), Reply("done"))
    code, out, err, elapsed = await geodebot(
        "run", "--config", str(config), "--time-budget", "10", "say hi"
    )
    assert (code, out) == (0, "done\n"), err
    # A bound, not a benchmark (waiting for the hung server took over 30 s): 8 s, or a few
    # seconds more than a run without servers where a busy machine makes that slower.
    assert elapsed < max(8, plain + 3), (elapsed, plain)
    assert not started_file.exists()
    assert "hi" in str(tool_results(llm_server.requests[1])[0]["content"])


async def test_a_listed_hung_server_fails_its_call_and_the_turn_keeps_its_budget(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = run_config(
        tmp_path, llm_server, ["mcp__hung__echo"], server("hung", "--hang-initialize")
    )
    plain = await plain_run(tmp_path, llm_server)
    llm_server.script(
        Reply(tool_calls=[Call("mcp__hung__echo", {"text": "hi"})]), Reply("it is not up")
    )
    code, out, err, elapsed = await geodebot(
        "run", "--config", str(config), "--time-budget", "3", "use it"
    )
    # Completed, not stopped by its budget (which counts from the session's set-up): the
    # call failed in time for the model to answer.
    assert (code, out) == (0, "it is not up\n"), err
    # The call itself, between the model's two requests, failed within the budget; the old
    # wait for the server alone was 30 s.
    first, second = llm_server.requests
    assert second.at - first.at < 3, (second.at - first.at, elapsed)
    # And the process did not wait for the server either: a run without servers, plus the
    # budget, plus the MCP SDK's 2 s for a server to exit before it is terminated, plus
    # starting and stopping that server's own Python process, which a busy machine (the
    # suite runs test files side by side) stretches by seconds.
    assert elapsed < plain + 3 + 2 + 5, (elapsed, plain)
    (result,) = tool_results(llm_server.requests[1])
    assert result["is_error"] is True
    assert "MCP server hung is not connected yet" in str(result["content"])
    # The model saw a stand-in: the operator's tool, its server's schema unknown.
    (tool,) = offered(llm_server.requests[0])
    assert tool["name"] == "mcp__hung__echo"
    assert "not connected yet" in tool["description"]


async def test_run_agent_with_a_hung_server_finishes_within_its_budget(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = run_config(
        tmp_path,
        llm_server,
        ["get_time", "mcp__hung__echo"],
        server("hung", "--hang-initialize"),
    )
    llm_server.script(
        Reply(tool_calls=[Call("mcp__hung__echo", {"text": "hi"})]),
        Reply("first"),
        Reply(tool_calls=[Call("mcp__hung__echo", {"text": "hi"})]),
        Reply("second"),
    )
    async with serving(tmp_path, config) as served:
        for answer in ("first", "second"):
            started = time.monotonic()
            assert await served.run_agent(prompt="use it", time_budget_s=5) == (False, answer)
            elapsed = time.monotonic() - started
            assert elapsed < 5, elapsed
    for request in (llm_server.requests[1], llm_server.requests[3]):
        (result,) = tool_results(request)
        assert result["is_error"] is True
        assert "MCP server hung" in str(result["content"])


async def test_a_server_hung_at_initialize_ends_its_own_start_and_backs_off(
    spawned: Callable[[], set[int]],
) -> None:
    hung = server("hung", "--hang-initialize")
    async with pool_for(hung, connect_timeout_s=1.0, connect_grace_s=0.2) as pool:
        started = time.monotonic()
        (spec,) = await pool.tool_specs({"mcp__hung__echo"})
        assert time.monotonic() - started < 1
        assert spec.input_schema == {"type": "object"}
        # Nobody waits for the whole start, yet it ends, counted as a failure.
        await wait_for_state(pool, "down", "hung")
        status = (await pool.status())["hung"]
        assert (status["last_error"], status["failures"]) == ("did not start within 1 s", 1)
        # A call starts it again and waits, within its own deadline, for the start to end.
        with pytest.raises(ToolError, match="MCP server hung is down: did not start within 1 s"):
            await spec.handler({"text": "x"}, CTX)
        # Then the backoff holds: no third start right away.
        with pytest.raises(ToolError, match=r"MCP server hung is down .*next attempt in"):
            await spec.handler({"text": "x"}, CTX)
        assert (await pool.status())["hung"]["failures"] == 2
    assert spawned() == set()


@pytest.fixture
def spawned() -> Callable[[], set[int]]:
    before = children()
    return lambda: {pid for pid in children() - before if alive(pid)}


async def test_a_stand_in_checks_the_real_schema_once_its_server_is_up() -> None:
    good = server("good")
    async with pool_for(good, connect_grace_s=30.0) as pool:
        (stand_in,) = await pool.tool_specs({"mcp__good__echo"}, wait_s=0)
        assert "not connected yet" in stand_in.description
        with pytest.raises(ToolError, match="invalid arguments for mcp__good__echo"):
            await stand_in.handler({"text": 5}, CTX)
        assert await stand_in.handler({"text": "checked"}, CTX) == "checked"
        # Listed now: later sessions get the real spec.
        (real,) = await pool.tool_specs({"mcp__good__echo"})
        assert real.input_schema["required"] == ["text"]


# -- item 9: a streamable-HTTP server that restarts is reconnected -------------------------


@pytest.mark.parametrize(
    ("status", "body"),
    [(400, "json"), (400, "text"), (404, "json")],
    ids=["400-jsonrpc", "400-text", "404-session-not-found"],
)
async def test_an_http_server_that_forgot_the_session_is_reconnected(
    status: int, body: Literal["json", "text"]
) -> None:
    async with FakeMCPHTTP(stale_status=status, stale_body=body) as web:
        config = {
            "name": "web",
            "transport": "http",
            "url": web.url,
            "tools": {"echo": READ, "not_offered": READ},
        }
        async with pool_for(config) as pool:
            echo = await pool.call("web", "echo", {"text": "before"}, timeout_s=10)
            assert echo == "before"
            web.restart()
            with pytest.raises(ToolError, match="rejected the session") as refused:
                await pool.call("web", "echo", {"text": "stale"}, timeout_s=10)
            assert "was not run" in str(refused.value)
            if body == "json":  # the server's own words reach the model too
                said = "Session not found" if status == 404 else "No valid session ID provided"
                assert said in str(refused.value)
            assert await pool.call("web", "echo", {"text": "after"}, timeout_s=10) == "after"
            assert await pool.call("web", "echo", {"text": "still"}, timeout_s=10) == "still"
            assert len(web.issued) == 2
            # A call the server refuses on a live session is only that call's failure.
            with pytest.raises(ToolError, match="refused the call"):
                await pool.call("web", "not_offered", {}, timeout_s=10)
            assert await pool.call("web", "echo", {"text": "same"}, timeout_s=10) == "same"
            assert len(web.issued) == 2
            assert (await pool.status())["web"]["state"] == "up"


# -- item 10: the environment, cancellation, booleans ------------------------------------


async def test_a_stdio_server_gets_exactly_the_documented_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": "/srv/geodebot-home",
        "USER": "geodebot-user",
        "LOGNAME": "geodebot-user",
        "SHELL": "/bin/false",
        "TERM": "dumb",
        "NOTES_FILE": "/tmp/listed",
        "GEODEBOT_TEST_SECRET": "hunter2",
    }
    # In the process environment too, where the SDK's stdio transport looks.
    monkeypatch.setenv("GEODEBOT_TEST_SECRET", "hunter2")
    config = {
        "name": "fake",
        "command": [sys.executable, str(FAKE)],
        "env": ["NOTES_FILE"],
        "tools": {"echo": READ},
    }
    async with pool_for(config, environ=environ, connect_grace_s=30.0) as pool:

        async def echo(text: str) -> str:
            return await pool.call("fake", "echo", {"text": text}, timeout_s=10)

        for name, value in environ.items():
            expected = "unset" if name == "GEODEBOT_TEST_SECRET" else value
            assert await echo(f"env:{name}") == expected, name
        names = set((await echo("env:*")).split(","))
    # Python itself adds LC_CTYPE in a C locale (PEP 538); nothing else may appear.
    assert names - {"LC_CTYPE"} == set(environ) - {"GEODEBOT_TEST_SECRET"}


def test_the_readme_documents_what_a_stdio_server_gets() -> None:
    from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS

    from geodebot.engine.mcp.client import BASE_ENV

    # Whatever we pass, the SDK adds these from the environment: they must be in our list.
    assert set(DEFAULT_INHERITED_ENV_VARS) <= set(BASE_ENV)
    readme = (ROOT / "README.md").read_text()
    mcp = readme[readme.index("\nMCP: ") :]
    mcp = mcp.split("\n\n")[0]
    for name in BASE_ENV:
        assert f"`{name}`" in mcp, name


async def test_a_cancelled_run_agent_call_is_recorded_on_the_timeline(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Hang())
    config = run_config(tmp_path, llm_server, ["get_time"])
    store = SQLiteStore(tmp_path / "var" / "geodebot.db")
    async with serving(tmp_path, config) as served:
        call = asyncio.create_task(served.run_agent(prompt="think forever", time_budget_s=60))
        await llm_server.wait_for_requests(1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await store.open()
        try:
            for _ in range(200):
                sessions = await store.list_sessions()
                kinds = [e.kind for s in sessions for e in await store.timeline(s.id)]
                if "turn_finished" in kinds:
                    break
                await asyncio.sleep(0.05)
        finally:
            await store.close()
        (session,) = sessions
    code, out, err, _ = await geodebot("timeline", session.id, "--json", "--config", str(config))
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "turn_started"
    assert "turn_cancelled" in kinds
    assert events[-1]["kind"] == "turn_finished"
    assert events[-1]["data"]["outcome"] == "cancelled"


async def test_a_boolean_time_budget_is_refused(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    config = run_config(tmp_path, llm_server, ["get_time"])
    async with serving(tmp_path, config) as served:
        for value in (True, False):
            is_error, text = await served.run_agent(prompt="hi", time_budget_s=value)
            assert is_error
            assert f"time_budget_s must be a number of seconds, not {str(value).lower()}" in text
        # Nor a string that looks like a number.
        is_error, text = await served.run_agent(prompt="hi", time_budget_s="5")
        assert is_error
        assert "valid number" in text
    assert llm_server.requests == []


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        (
            {"budgets": {"headless_time_s": True}},
            "budgets.headless_time_s: must be a number, not true",
        ),
        ({"tools": {"http_timeout_s": True}}, "tools.http_timeout_s: must be a number, not true"),
        ({"model": {"max_retries": False}}, "model.max_retries: must be a number, not false"),
        (
            {"daemon": {"shutdown_grace_s": True}},
            "daemon.shutdown_grace_s: must be a number, not true",
        ),
        ({"mcp": {"connect_grace_s": True}}, "mcp.connect_grace_s: must be a number, not true"),
        (
            {"mcp": {"servers": [{**server("s"), "tools": {"echo": {**READ, "timeout_s": True}}}]}},
            "mcp.servers.0.tools.echo.timeout_s: must be a number, not true",
        ),
        (
            {
                "bindings": [
                    {"platform": "slack", "channel": "C1", "session": "s", "time_budget_s": True}
                ]
            },
            "bindings.0.time_budget_s: must be a number, not true",
        ),
    ],
)
def test_config_numbers_refuse_booleans(section: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(section)
    assert raised.value.problems == [problem]


def test_a_job_time_budget_refuses_booleans() -> None:
    data = {
        "bindings": [{"platform": "slack", "channel": "C1", "session": "s"}],
        "jobs": [
            {"id": "j", "every": "1m", "prompt": "p", "deliver_to": "s", "time_budget_s": True}
        ],
    }
    with pytest.raises(ConfigError) as raised:
        parse_config(data)
    assert raised.value.problems == ["jobs.0.time_budget_s: must be a number, not true"]


async def test_the_cli_names_a_boolean_config_key(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[budgets]\nheadless_time_s = true\n")
    code, _out, err, _ = await geodebot("run", "--config", str(config), "hi")
    assert code == 2
    assert "budgets.headless_time_s: must be a number, not true" in err
    assert "Traceback" not in err
