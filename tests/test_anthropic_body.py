"""The Anthropic adapter's request body: the SDK's encoding, history from cached block JSON."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator

import pytest

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter, MessageJSON
from geodebot.engine.llm.types import (
    LLMRequest,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolSchema,
    ToolUseBlock,
)
from tests.fakes.llm_server import FakeLLMServer, Reply

KEY = "sk-ant-test-0123456789abcdef"
SCHEMA = ToolSchema("lookup", "Looks a word up.", {"type": "object"})


@pytest.fixture
async def srv() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def adapter(srv: FakeLLMServer) -> AsyncIterator[AnthropicAdapter]:
    made = AnthropicAdapter(model="m", api_key=KEY, api_key_env="K", base_url=srv.url)
    yield made
    await made.aclose()


async def test_the_body_is_the_messages_api_shape(srv: FakeLLMServer, adapter: AnthropicAdapter):
    history = (
        Message("user", (TextBlock('Wörter: ünïcode, "quotes" and \\ <tags>'),)),
        Message("assistant", (TextBlock("Looking."), ToolUseBlock("c1", "lookup", {"q": "x"}))),
        Message("user", (TextBlock("also this"), ToolResultBlock("c1", "found", is_error=True))),
        Message("user", (TextBlock("   "),)),  # blank text: dropped
    )
    srv.script(Reply("ok"))
    await adapter.complete(LLMRequest("be brief", history, (SCHEMA,), max_tokens=77))
    sent = srv.requests[-1]
    assert sent.headers["content-type"] == "application/json"
    assert "ünïcode" in sent.raw.decode()  # UTF-8 as is, like the SDK (ensure_ascii off)
    assert json.loads(sent.raw) == {
        "model": "m",
        "max_tokens": 77,
        "system": "be brief",
        "tools": [{"name": "lookup", "description": "Looks a word up.",
                   "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user",
             "content": [{"type": "text", "text": "Wörter: ünïcode, \"quotes\" and \\ <tags>"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"q": "x"}},
            ]},
            # The tool result leads its user turn; the two user messages are one turn.
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "found", "is_error": True},
                {"type": "text", "text": "also this"},
            ]},
        ],
    }  # fmt: skip


def test_a_message_is_encoded_once_while_it_is_held():
    cache = MessageJSON()
    blocks = (TextBlock("hello"), TextBlock("  "), ToolResultBlock("c", "r"))
    message = Message("user", blocks)
    first = cache(message)
    # Blank text is not sent; a tool result is marked as one.
    assert [(role, result, json.loads(text)) for role, result, text in first] == [
        ("user", False, {"type": "text", "text": "hello"}),
        ("user", True, {"type": "tool_result", "tool_use_id": "c", "content": "r",
                        "is_error": False}),
    ]  # fmt: skip
    assert cache(message) is first  # not encoded again
    equal_but_new = Message("user", blocks)
    assert cache(equal_but_new) == first
    assert cache(equal_but_new) is not first  # a different object has its own entry


def test_the_cache_is_bounded_by_characters_oldest_first():
    size = len(MessageJSON()(Message.user_text("x" * 100))[0][2])
    cache = MessageJSON(max_chars=size * 3)
    messages = [Message.user_text(str(i) * 100) for i in range(1, 6)]
    kept = [cache(m) for m in messages]
    assert cache(messages[4]) is kept[4]
    assert cache(messages[3]) is kept[3]
    assert cache(messages[0]) is not kept[0]  # evicted, encoded again
    huge = Message.user_text("y" * (size * 4))
    assert cache(huge) is not cache(huge)  # larger than the bound: never held


def test_an_entry_goes_with_its_message():
    # The cache must never keep a history alive that the engine has let go of.
    cache = MessageJSON()
    kept = Message.user_text("kept")
    cache(kept)
    for i in range(100):
        cache(Message.user_text(f"gone {i}"))  # each freed right after the call
    gc.collect()
    assert len(cache) == 1
    assert cache(kept) is cache(kept)


def test_a_full_cache_stays_within_its_bound():
    cache = MessageJSON(max_chars=10_000)
    alive = [Message.user_text(f"message {i:05d} " + "x" * 40) for i in range(5_000)]
    size = len(MessageJSON()(alive[0])[0][2])  # every entry is this long
    for message in alive:
        cache(message)
    assert len(cache) == 10_000 // size  # as many as fit, no more
    assert cache(alive[-1]) is cache(alive[-1])  # the newest are the ones kept
