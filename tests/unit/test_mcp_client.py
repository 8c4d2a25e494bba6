"""MCPServerPool against a real MCP server (tests/support/fakes/mcp_tools_server.py) over stdio
and HTTP."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from geodebot.config.schema import MCPServerConfig
from geodebot.engine.mcp.client import Backoff, MCPServerPool
from geodebot.engine.modes import Mode
from geodebot.engine.tools import Effect, Safety, ToolCallContext, ToolError, ToolSpec
from tests.support.config import TEST_KEY_ENV
from tests.support.mcp import FAKE, ROOT, alive, children, wait_for_state
from tests.support.ports import free_port

CTX = ToolCallContext(session_id="s1", turn_id="t1", mode=Mode.DAEMON)

READ: dict[str, Any] = {"safety": "read", "effect": "none"}


def fake_server(
    tools: Mapping[str, Mapping[str, Any]],
    *,
    name: str = "fake",
    env: tuple[str, ...] = (),
    command: tuple[str, ...] = (sys.executable, str(FAKE)),
    with_pid: bool = True,
) -> MCPServerConfig:
    """A server config; ``pid`` is declared too unless asked not to, for the tests' plumbing."""
    declared = {"pid": READ, **tools} if with_pid else dict(tools)
    return MCPServerConfig.model_validate(
        {"name": name, "command": command, "env": env, "tools": declared}
    )


def make_pool(*servers: MCPServerConfig, **kwargs: Any) -> MCPServerPool:
    kwargs.setdefault("environ", dict(os.environ))
    kwargs.setdefault("probe_timeout_s", 1.0)
    # Long enough for a fake to start on a busy machine: these tests are about the servers,
    # not about a session's short wait for them (tests/unit/test_mcp_hardening.py).
    kwargs.setdefault("connect_grace_s", 30.0)
    return MCPServerPool(servers, cwd=ROOT, **kwargs)


@pytest.fixture
def spawned() -> Callable[[], set[int]]:
    """Children started during the test, whatever earlier tests may have left behind."""
    before = children()
    return lambda: children() - before


async def server_pid(pool: MCPServerPool, server: str = "fake") -> int:
    return int(await pool.call(server, "pid", {}, timeout_s=10))


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def by_name(specs: list[ToolSpec]) -> dict[str, ToolSpec]:
    return {spec.name: spec for spec in specs}


async def test_only_declared_tools_become_specs_with_their_policy() -> None:
    config = fake_server(
        {
            "echo": {**READ, "resource_keys": ["net"], "timeout_s": 7},
            "write_note": {"safety": "write", "effect": "mutate"},
            "not_offered": READ,
        },
        with_pid=False,
    )
    async with make_pool(config) as pool:
        specs = by_name(await pool.tool_specs())

        assert set(specs) == {"mcp__fake__echo", "mcp__fake__write_note"}
        echo = specs["mcp__fake__echo"]
        assert (echo.safety, echo.effect) == (Safety.READ, Effect.NONE)
        assert echo.resource_keys == ("net",)
        assert echo.timeout_s == 7
        assert echo.description.startswith("[fake] Repeat the text")
        assert echo.input_schema["required"] == ["text"]
        note = specs["mcp__fake__write_note"]
        assert (note.safety, note.effect) == (Safety.WRITE, Effect.MUTATE)
        assert note.needs_approval

        assert await echo.handler({"text": "hello"}, CTX) == "hello"
        status = (await pool.status())["fake"]
        assert status["state"] == "up"
        assert status["tools"] == 2
        # add is offered by the server but undeclared, so not even the pool calls it.
        with pytest.raises(ToolError, match="not a declared tool"):
            await pool.call("fake", "add", {"a": 1, "b": 2})


async def test_servers_start_on_first_use_and_only_once(spawned: Callable[[], set[int]]) -> None:
    async with make_pool(fake_server({"echo": READ})) as pool:
        assert spawned() == set()
        assert (await pool.status())["fake"]["state"] == "not started"
        first, second = await asyncio.gather(server_pid(pool), server_pid(pool))
        assert first == second
        assert spawned() == {first}


async def test_a_caller_cancelled_during_start_leaves_the_start_to_the_next_caller(
    spawned: Callable[[], set[int]],
) -> None:
    async with make_pool(fake_server({"echo": READ})) as pool:
        first = asyncio.create_task(server_pid(pool))
        await until(lambda: bool(spawned()))
        assert (await pool.status())["fake"]["state"] == "starting"
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        pid = await server_pid(pool)
        assert spawned() == {pid}


async def test_closing_ends_calls_in_flight_and_starts_in_progress(
    spawned: Callable[[], set[int]],
) -> None:
    mute = (sys.executable, "-c", "import time; time.sleep(60)")
    pool = make_pool(fake_server({"hang": READ}), fake_server({}, name="mute", command=mute))
    await server_pid(pool)
    hanging = asyncio.create_task(pool.call("fake", "hang", {}, timeout_s=60))
    starting = asyncio.create_task(server_pid(pool, "mute"))
    await until(lambda: len(spawned()) == 2)
    await asyncio.sleep(0.1)
    assert (await pool.status())["mute"]["state"] == "starting"

    async with asyncio.timeout(15):
        await pool.aclose()

    with pytest.raises(ToolError, match="went away during the call"):
        await hanging
    with pytest.raises(ToolError, match="shut down"):
        await starting
    assert spawned() == set()


async def test_close_leaves_no_server_process_running(spawned: Callable[[], set[int]]) -> None:
    pool = make_pool(fake_server({"echo": READ}), fake_server({"echo": READ}, name="other"))
    await pool.tool_specs()
    pids = {await server_pid(pool), await server_pid(pool, "other")}
    assert len(pids) == 2
    assert spawned() == pids

    await pool.aclose()

    assert spawned() == set()
    assert not any(alive(pid) for pid in pids)
    assert {s["state"] for s in (await pool.status()).values()} == {"stopped"}
    with pytest.raises(ToolError, match="shut down"):
        await pool.call("fake", "echo", {"text": "x"}, timeout_s=5)


async def test_each_call_runs_once_with_the_variables_the_config_passes(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    config = fake_server(
        {"write_note": {"safety": "write", "effect": "mutate"}}, env=("NOTES_FILE",)
    )
    environ = {**os.environ, "NOTES_FILE": str(notes)}
    async with make_pool(config, environ=environ) as pool:
        spec = by_name(await pool.tool_specs())["mcp__fake__write_note"]
        assert await spec.handler({"text": "first"}, CTX) == "noted 'first'"
        await spec.handler({"text": "second"}, CTX)
    assert notes.read_text().splitlines() == ["first", "second"]


async def test_unlisted_variables_never_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEODEBOT_TEST_SECRET", "hunter2")
    monkeypatch.setenv("NOTES_FILE", "/tmp/listed")
    config = fake_server({"echo": READ}, env=("NOTES_FILE",))
    async with make_pool(config, environ=dict(os.environ)) as pool:

        async def env(name: str) -> str:
            return await pool.call("fake", "echo", {"text": f"env:{name}"}, timeout_s=10)

        assert await env("NOTES_FILE") == "/tmp/listed"
        assert await env("PATH") == os.environ["PATH"]
        assert await env("GEODEBOT_TEST_SECRET") == "unset"
        assert await env(TEST_KEY_ENV) == "unset"


async def test_error_results_become_tool_errors_and_other_content_is_summarised() -> None:
    async with make_pool(fake_server({"fail": READ, "picture": READ})) as pool:
        specs = by_name(await pool.tool_specs())
        with pytest.raises(ToolError, match="this tool always fails"):
            await specs["mcp__fake__fail"].handler({}, CTX)
        picture = await specs["mcp__fake__picture"].handler({}, CTX)
        assert picture == "a tiny picture\n[image image/png]"
        # A failing tool is not a failing server.
        assert (await pool.status())["fake"]["failures"] == 0


async def test_a_call_that_times_out_fails_fast_and_the_server_stays() -> None:
    config = fake_server({"hang": {**READ, "timeout_s": 0.5}, "echo": READ})
    async with make_pool(config) as pool:
        specs = by_name(await pool.tool_specs())
        before = await server_pid(pool)
        started = time.monotonic()
        with pytest.raises(ToolError, match=r"did not answer within 0.5 s"):
            await specs["mcp__fake__hang"].handler({}, CTX)
        assert time.monotonic() - started < 3
        # The control: a call after a timeout waits for the health check's verdict, so
        # this one found the server answering, with no restart.
        assert await specs["mcp__fake__echo"].handler({"text": "still here"}, CTX) == "still here"
        assert await server_pid(pool) == before
        assert (await pool.status())["fake"]["state"] == "up"


async def test_a_crashed_server_is_restarted_by_the_next_call() -> None:
    async with make_pool(fake_server({"crash": READ, "echo": READ})) as pool:
        specs = by_name(await pool.tool_specs())
        before = await server_pid(pool)
        with pytest.raises(ToolError, match="went away during the call"):
            await specs["mcp__fake__crash"].handler({}, CTX)
        assert await specs["mcp__fake__echo"].handler({"text": "back"}, CTX) == "back"
        after = await server_pid(pool)
        assert after != before
        assert not alive(before)
        status = (await pool.status())["fake"]
        assert status["state"] == "up"
        assert status["last_error"] == "the server closed the connection"
        assert status["failures"] == 0


async def test_a_wedged_server_is_detected_after_a_cancelled_call_and_replaced() -> None:
    # The executor's own deadline cancels the handler; the pool must still notice the hang.
    async with make_pool(fake_server({"freeze": READ}), probe_timeout_s=0.5) as pool:
        freeze = by_name(await pool.tool_specs())["mcp__fake__freeze"]
        before = await server_pid(pool)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await freeze.handler({}, CTX)
        await wait_for_state(pool, "down")
        assert "health check" in str((await pool.status())["fake"]["last_error"])
        after = await server_pid(pool)
        assert after != before
        assert not alive(before)


async def test_a_server_that_keeps_failing_backs_off() -> None:
    now = [1000.0]
    broken = fake_server({"echo": READ}, command=(sys.executable, "-c", "raise SystemExit(5)"))
    async with make_pool(broken, backoff=Backoff(initial_s=30), clock=lambda: now[0]) as pool:
        # Never listed: its declared tools are stand-ins whose calls wait for the server.
        specs = by_name(await pool.tool_specs())
        assert set(specs) == {"mcp__fake__echo", "mcp__fake__pid"}
        assert "not connected yet" in specs["mcp__fake__echo"].description
        assert (await pool.status())["fake"]["failures"] == 1
        # One immediate retry, then the backoff holds.
        with pytest.raises(ToolError, match="is down"):
            await pool.call("fake", "echo", {"text": "x"}, timeout_s=5)
        status = (await pool.status())["fake"]
        assert (status["state"], status["failures"], status["retry_in_s"]) == ("down", 2, 30)
        assert (
            status["last_error"]
            == "the server closed the connection while starting (see its stderr)"
        )
        with pytest.raises(ToolError, match="next attempt in 30 s"):
            await pool.call("fake", "echo", {"text": "x"}, timeout_s=5)
        # Refused without starting anything: a start would have counted a third failure.
        assert (await pool.status())["fake"]["failures"] == 2

        now[0] += 31
        with pytest.raises(ToolError, match="is down"):
            await pool.call("fake", "echo", {"text": "x"}, timeout_s=5)
        status = (await pool.status())["fake"]
        assert (status["failures"], status["retry_in_s"]) == (3, 60)


def test_a_server_name_may_be_configured_only_once() -> None:
    with pytest.raises(ValueError, match="configured twice"):
        make_pool(fake_server({}), fake_server({}))


@pytest.fixture
def http_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(FAKE), "--http", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the HTTP fake did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_streamable_http_server(http_server: str) -> None:
    config = MCPServerConfig.model_validate(
        {
            "name": "web",
            "transport": "http",
            "url": http_server,
            "tools": {"echo": READ, "fail": READ},
        }
    )
    async with make_pool(config) as pool:
        specs = by_name(await pool.tool_specs())
        assert set(specs) == {"mcp__web__echo", "mcp__web__fail"}
        assert await specs["mcp__web__echo"].handler({"text": "over http"}, CTX) == "over http"
        with pytest.raises(ToolError, match="always fails"):
            await specs["mcp__web__fail"].handler({}, CTX)
        assert (await pool.status())["web"]["state"] == "up"


async def test_a_patient_resolve_waits_for_a_slow_server_where_a_session_would_not() -> None:
    """A session recovering a batch asks for the real specs (its approvals were given under
    them): it waits for a server that takes longer than the grace, where a fresh session
    takes stand-ins and goes on."""
    slow = (
        sys.executable,
        "-c",
        "import runpy, sys, time; time.sleep(1.5); sys.argv = [sys.argv[1]]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')",
        str(FAKE),
    )
    loop = asyncio.get_running_loop()
    async with make_pool(fake_server({"echo": READ}, command=slow), connect_grace_s=0.2) as pool:
        specs = by_name(await pool.tool_specs(["mcp__fake__echo"], deadline=loop.time() + 60))
        assert "not connected yet" in specs["mcp__fake__echo"].description
    async with make_pool(fake_server({"echo": READ}, command=slow), connect_grace_s=0.2) as pool:
        specs = by_name(
            await pool.tool_specs(["mcp__fake__echo"], deadline=loop.time() + 60, patient=True)
        )
        assert "not connected yet" not in specs["mcp__fake__echo"].description
        assert specs["mcp__fake__echo"].input_schema != {"type": "object"}
