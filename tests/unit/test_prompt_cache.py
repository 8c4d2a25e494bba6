"""Prompt caching: where the Anthropic requests put their cache breakpoints, that a long
session's repeated prefix is then read from the cache (the fake bills like the provider, see
tests/support/fakes/prompt_cache.py), and that cached tokens reach the timeline and metrics.
"""

from __future__ import annotations

import itertools
import json
import random
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
from geodebot.engine.llm.anthropic_json import HistoryJSON, MessageJSON
from geodebot.engine.llm.openai_adapter import OpenAIAdapter
from geodebot.engine.llm.types import (
    LLMRequest,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolSchema,
    ToolUseBlock,
)
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.ops.health import EngineMetrics
from tests.support.app import open_app
from tests.support.config import make_config
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.fakes.prompt_cache import PromptCache

KEY = "sk-cachetest-0123456789abcdef"
TOOLS = (
    ToolSchema("get_weather", "Weather for a city.", {"type": "object", "properties": {}}),
    ToolSchema("get_time", "The time.", {"type": "object", "properties": {}}),
)
SYSTEM = "You are a careful assistant. " * 40


def marked(block: dict[str, Any]) -> bool:
    return block.get("cache_control") == {"type": "ephemeral"}


def breakpoints(body: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Where a body's breakpoints are: ("tools", i, 0), ("system", i, 0), ("message", m, b)."""
    found = [("tools", i, 0) for i, t in enumerate(body.get("tools", ())) if marked(t)]
    system = body.get("system")
    if isinstance(system, list):
        found += [("system", i, 0) for i, b in enumerate(system) if marked(b)]
    for m, message in enumerate(body["messages"]):
        found += [("message", m, b) for b, block in enumerate(message["content"]) if marked(block)]
    return found


def unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            **m,
            "content": [{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]],
        }
        for m in messages
    ]


def conversation(rng: random.Random, turns: int) -> list[Message]:
    """A session's messages: user text, tool rounds, answers, and now and then two user
    messages in a row (a relayed note) that the request merges into one turn."""
    history: list[Message] = []
    for turn in range(turns):
        history.append(Message.user_text(f"question {turn} " + "x" * rng.randrange(1, 40)))
        if rng.random() < 0.2:
            history.append(Message.user_text(f"note {turn}"))
        for round_ in range(rng.randrange(0, 3)):
            calls = tuple(
                ToolUseBlock(f"c{turn}_{round_}_{i}", "get_weather", {"city": f"c{i}"})
                for i in range(rng.randrange(1, 4))
            )
            history.append(Message("assistant", (TextBlock("checking"), *calls)))
            history.append(Message("user", tuple(ToolResultBlock(c.id, "sunny") for c in calls)))
        history.append(Message.assistant_text(f"answer {turn}"))
    return history


def test_history_breakpoints_are_spliced_where_a_full_encoding_would_put_them() -> None:
    """The incremental array (continued from the previous request's) carries exactly the
    two message breakpoints: on the last block of the newest turn and of the turn two
    before it, and is otherwise the same JSON as the plain encoding."""
    rng = random.Random(7)
    history = conversation(rng, 40)
    cached, plain = HistoryJSON(MessageJSON()), HistoryJSON(MessageJSON())
    for end in range(1, len(history) + 1):
        request = history[:end]
        with_marks = json.loads(cached(request, cache=True))
        without = json.loads(plain(request))
        assert unmarked(with_marks) == without
        expected = {len(without) - 1, len(without) - 3} - {-1, -2}
        assert {
            m for m, message in enumerate(with_marks) for b in message["content"] if marked(b)
        } == expected
        for m in expected:
            assert marked(with_marks[m]["content"][-1])


async def test_requests_mark_tools_system_and_the_newest_turns(srv: FakeLLMServer) -> None:
    adapter = AnthropicAdapter(
        model="m", api_key=KEY, api_key_env="K", base_url=srv.url, timeout_s=5.0
    )
    srv.default = Reply("ok")
    history = conversation(random.Random(3), 6)
    try:
        for end in (1, 4, len(history)):
            await adapter.complete(LLMRequest(SYSTEM, tuple(history[:end]), TOOLS))
    finally:
        await adapter.aclose()
    for sent in srv.requests:
        body = sent.json
        n = len(body["messages"])
        where = breakpoints(body)
        assert len(where) <= 4  # the API's limit
        assert ("tools", len(TOOLS) - 1, 0) in where
        assert ("system", 0, 0) in where
        message_marks = sorted((m, b) for kind, m, b in where if kind == "message")
        last = [(m, len(body["messages"][m]["content"]) - 1) for m in (n - 3, n - 1) if m >= 0]
        assert message_marks == last


async def test_prompt_cache_off_sends_no_breakpoints(srv: FakeLLMServer) -> None:
    adapter = AnthropicAdapter(
        model="m", api_key=KEY, api_key_env="K", base_url=srv.url, prompt_cache=False
    )
    srv.default = Reply("ok")
    try:
        await adapter.complete(LLMRequest(SYSTEM, tuple(conversation(random.Random(1), 3)), TOOLS))
    finally:
        await adapter.aclose()
    body = srv.requests[0].json
    assert body["system"] == SYSTEM
    assert breakpoints(body) == []


async def test_a_long_sessions_prefix_is_read_from_the_cache(srv: FakeLLMServer) -> None:
    """Turn after turn (with tool rounds), every request after the first reads all of the
    previous request from the cache and pays the full rate for nothing."""
    srv.prompt_cache = PromptCache()
    srv.default = Reply("ok")
    adapter = AnthropicAdapter(model="m", api_key=KEY, api_key_env="K", base_url=srv.url)
    history = conversation(random.Random(11), 30)
    # The requests a session makes: one per user message and one per tool round.
    ends = [i + 1 for i, m in enumerate(history) if m.role == "user"]
    usages = []
    try:
        for end in ends:
            response = await adapter.complete(LLMRequest(SYSTEM, tuple(history[:end]), TOOLS))
            usages.append(response.usage)
    finally:
        await adapter.aclose()
    assert usages[0].cache_read_tokens == 0
    assert usages[0].cache_write_tokens == usages[0].input_tokens
    for before, usage in itertools.pairwise(usages):
        # Everything the previous request sent is read back; only the new turns are written.
        assert usage.cache_read_tokens >= before.input_tokens - 8
        assert usage.cache_read_tokens + usage.cache_write_tokens == usage.input_tokens
    read = sum(u.cache_read_tokens for u in usages)
    total = sum(u.input_tokens for u in usages)
    assert read / total > 0.85


async def test_openai_reports_its_automatic_cache(srv: FakeLLMServer) -> None:
    srv.prompt_cache = PromptCache()
    srv.default = Reply("ok")
    adapter = OpenAIAdapter(
        provider="openai", model="m", api_key=KEY, api_key_env="K", base_url=srv.openai_base_url
    )
    history = conversation(random.Random(5), 4)
    try:
        first = await adapter.complete(LLMRequest(SYSTEM, tuple(history[:1])))
        second = await adapter.complete(LLMRequest(SYSTEM, tuple(history)))
    finally:
        await adapter.aclose()
    assert first.usage.cache_read_tokens == 0
    assert 0 < second.usage.cache_read_tokens < second.usage.input_tokens


@pytest.mark.parametrize("provider", ["anthropic", "openai-compatible"])
async def test_cached_tokens_reach_the_timeline_and_metrics(
    tmp_path: Path, llm_server: FakeLLMServer, provider: str
) -> None:
    llm_server.prompt_cache = PromptCache()
    llm_server.script(
        Reply("one"), Reply(tool_calls=[Call("get_time", {})]), Reply("two"), Reply("three")
    )
    metrics = EngineMetrics()
    config = make_config(tmp_path, llm_server, provider=provider)
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker", observers=(metrics,))
        spec = SessionSpec("cached", tools=("get_time",))
        for text in ("first question " * 30, "second", "third"):
            assert (await app.run_turn(Mode.HEADLESS, spec, text)).ok
        events = [e for e in await app.services.store.timeline("cached") if e.kind == "llm_call"]
    assert len(events) == 4
    reads = [int(e.data["cache_read_tokens"]) for e in events]
    writes = [int(e.data["cache_write_tokens"]) for e in events]
    assert reads[0] == 0
    assert all(r > 0 for r in reads[1:])
    if provider == "anthropic":
        assert all(w > 0 for w in writes)
    else:
        assert writes == [0, 0, 0, 0]  # OpenAI bills no cache writes
    counted = {
        direction: metrics.model_tokens.labels(
            provider, "model-under-test-1", direction
        )._value.get()
        for direction in ("cache_read", "cache_write")
    }
    assert counted == {"cache_read": sum(reads), "cache_write": sum(writes)}


@pytest.fixture
async def srv() -> Any:
    async with FakeLLMServer() as server:
        yield server
