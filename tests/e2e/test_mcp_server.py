"""`run_agent` as an MCP client sees it: the real SDK client, the server as a subprocess."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from geodebot.cli.mcp_server import resolve_budget
from geodebot.config.schema import BudgetConfig
from geodebot.store.sqlite import SQLiteStore
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import Call, Error, FakeLLMServer, Hang, RecordedRequest, Reply
from tests.support.mcp import serving

UNATTENDED_DENY = {"run_bash", "computer", "delegate_task"}


def write_config(tmp_path: Path, server: FakeLLMServer, budgets: str = "") -> Path:
    # Listing run_bash or computer here is refused at startup (tested with the CLI); the
    # model asking for them anyway must still get refusals.
    path = tmp_path / "config.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nlog_level = "debug"\n'
        f'[model]\nprovider = "anthropic"\nname = "mcp-model-3"\nbase_url = "{server.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f"[budgets]\n{budgets}\n"
        '[tools]\nheadless_tools = ["get_time"]\n'
    )
    return path


def tool_results(request: RecordedRequest) -> list[dict[str, Any]]:
    last = request.json["messages"][-1]
    assert last["role"] == "user"
    return [b for b in last["content"] if b.get("type") == "tool_result"]


def tool_names(request: RecordedRequest) -> list[str]:
    return [tool["name"] for tool in request.json.get("tools", [])]


async def test_run_agent_is_listed_and_answers_in_fresh_sessions(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("The scripted answer."), Reply("Second answer."))
    async with serving(tmp_path, write_config(tmp_path, llm_server)) as served:
        listing = await served.client.list_tools()
        assert [tool.name for tool in listing.tools] == ["run_agent"]
        schema = listing.tools[0].input_schema
        assert schema["required"] == ["prompt"]
        assert schema["properties"]["prompt"]["type"] == "string"
        budget_types = {arm["type"] for arm in schema["properties"]["time_budget_s"]["anyOf"]}
        assert budget_types == {"number", "null"}

        assert await served.run_agent(prompt="What is it?") == (False, "The scripted answer.")
        assert await served.run_agent(prompt="And now?") == (False, "Second answer.")
    first, second = llm_server.requests
    assert first.json["model"] == "mcp-model-3"
    # A fresh session each time: the second run does not see the first conversation.
    # (The one message carries the prompt cache's breakpoint on the newest turn.)
    marked = {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}
    assert second.json["messages"] == [{"role": "user", "content": [marked]}]
    store = SQLiteStore(tmp_path / "var" / "geodebot.db")
    await store.open()
    try:
        sessions = await store.list_sessions()
    finally:
        await store.close()
    assert len(sessions) == 2
    assert all(s.id.startswith("mcp-") and s.mode == "headless" for s in sessions)


async def test_shell_and_computer_calls_are_refused_and_never_offered(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(
        Reply(tool_calls=[Call("run_bash", {"command": "cat ~/.ssh/id_rsa"})]),
        Reply(tool_calls=[Call("computer", {"action": "screenshot"})]),
        Reply("Done without them."),
    )
    async with serving(tmp_path, write_config(tmp_path, llm_server)) as served:
        assert await served.run_agent(prompt="Take over.") == (False, "Done without them.")
    assert len(llm_server.requests) == 3
    for request, denied in zip(llm_server.requests[1:], ["run_bash", "computer"], strict=True):
        (result,) = tool_results(request)
        assert result["is_error"] is True
        assert denied in str(result["content"])
        assert "available" in str(result["content"])
    for request in llm_server.requests:
        # get_time proves the configured headless tools reached the session at all.
        assert tool_names(request) == ["get_time"]


async def test_time_budget_is_capped_at_the_headless_maximum(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Hang())
    config = write_config(tmp_path, llm_server, budgets="headless_max_time_s = 1\n")
    async with serving(tmp_path, config) as served:
        started = time.monotonic()
        is_error, text = await served.run_agent(prompt="Think forever.", time_budget_s=100)
        elapsed = time.monotonic() - started
    assert is_error
    assert "time budget of 1 s" in text
    assert elapsed < 3.5


async def test_invalid_time_budgets_are_refused_before_any_model_call(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with serving(tmp_path, write_config(tmp_path, llm_server)) as served:
        for budget in (0, -5):
            is_error, text = await served.run_agent(prompt="hi", time_budget_s=budget)
            assert is_error
            assert "time_budget_s must be a positive" in text
        is_error, text = await served.run_agent(prompt="  ")
        assert (is_error, text) == (True, "prompt must not be empty")
    assert llm_server.requests == []


async def test_a_model_error_is_a_tool_error_without_the_key(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # Some providers quote the rejected key back; it must not reach the MCP client.
    llm_server.script(Error(401, "authentication_error", f"invalid x-api-key {TEST_KEY}"))
    async with serving(tmp_path, write_config(tmp_path, llm_server)) as served:
        is_error, text = await served.run_agent(prompt="hi")
    assert is_error
    assert "API key" in text
    assert TEST_KEY not in text
    assert len(llm_server.requests) == 1


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(None, 300.0), (100.0, 100.0), (5000.0, 1800.0), (0.5, 0.5)],
)
def test_resolve_budget_defaults_and_caps(requested: float | None, expected: float) -> None:
    assert resolve_budget(requested, BudgetConfig()) == expected


@pytest.mark.parametrize("requested", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_resolve_budget_refuses_non_positive_and_non_finite(requested: float) -> None:
    with pytest.raises(ValueError, match="positive, finite"):
        resolve_budget(requested, BudgetConfig())
