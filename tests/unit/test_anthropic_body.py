"""The Anthropic adapter's request body: the SDK's encoding, history from cached block JSON
and, for a conversation that goes on, from the array its previous request built."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
from geodebot.engine.llm.anthropic_json import HistoryJSON, MessageJSON, segments
from geodebot.engine.llm.types import (
    FileBlock,
    ImageData,
    LLMRequest,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolSchema,
    ToolUseBlock,
)
from tests.support.fakes.llm_server import FakeLLMServer, Reply

KEY = "sk-ant-test-0123456789abcdef"
EPHEMERAL = {"type": "ephemeral"}
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
        # Prompt-cache breakpoints (on by default): the system prompt, the last tool, the
        # newest turn and the turn two before it (see test_prompt_cache.py).
        "system": [{"type": "text", "text": "be brief", "cache_control": EPHEMERAL}],
        "tools": [{"name": "lookup", "description": "Looks a word up.",
                   "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}],
        "messages": [
            {"role": "user",
             "content": [{"type": "text", "text": "Wörter: ünïcode, \"quotes\" and \\ <tags>",
                          "cache_control": EPHEMERAL}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"q": "x"}},
            ]},
            # The tool result leads its user turn; the two user messages are one turn.
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "found", "is_error": True},
                {"type": "text", "text": "also this", "cache_control": EPHEMERAL},
            ]},
        ],
    }  # fmt: skip


def test_a_message_is_encoded_once_and_the_encoding_lives_on_it():
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
    assert MessageJSON()(message) is first  # kept on the message, not in the cache
    equal_but_new = Message("user", blocks)
    assert equal_but_new == message  # the encoding is not part of the value
    assert cache(equal_but_new) == first
    assert cache(equal_but_new) is not first  # a different object is encoded on its own


def test_a_text_message_is_kept_as_its_block_json_alone():
    message = Message.user_text('say "hi"')
    encoded = MessageJSON()(message)
    assert encoded == '{"type":"text","text":"say \\"hi\\""}'
    assert segments(message, encoded) == (("user", False, encoded),)
    assert MessageJSON()(Message.user_text("  ")) == ()  # blank text is not sent


def test_an_images_encoding_is_not_kept():
    # Megabytes of base64: kept on a message that stays in the context cache long after
    # the image stopped being sent, it would be held for nothing.
    shot = ImageData("image/png", "iVBORw0KGgo" * 1000)
    message = Message("user", (ToolResultBlock("c", "screenshot", images=(shot,)),))
    encoded = MessageJSON()(message)
    assert shot.data in encoded[0][2]
    assert message.wire is None
    sent = Message("user", (FileBlock("ab" * 32, "image/png", "a.png", 3, data="AAAA"),))
    MessageJSON()(sent)
    assert sent.wire is None
    named = Message("user", (FileBlock("ab" * 32, "image/png", "a.png", 3),))  # no bytes
    assert MessageJSON()(named) is named.wire


def test_a_changed_copy_of_a_message_is_encoded_anew():
    # The engine's view replaces an old screenshot by a copy (dataclasses.replace): the
    # copy must not carry the original's encoding.
    original = Message("user", (ToolResultBlock("c", "shot"),))
    MessageJSON()(original)
    changed = replace(original, content=(ToolResultBlock("c", "shot, dropped"),))
    assert changed.wire is None
    assert "dropped" in MessageJSON()(changed)[0][2]


class CountingJSON:
    """MessageJSON that counts the messages it is asked for."""

    def __init__(self) -> None:
        self.inner = MessageJSON()
        self.asked: list[Message] = []

    def __call__(self, message: Message) -> str | tuple[tuple[str, bool, str], ...]:
        self.asked.append(message)
        return self.inner(message)  # type: ignore[return-value]  # the SDK's own type


def whole(messages: list[Message]) -> str:
    """The array built whole, by a cache that has seen nothing."""
    return HistoryJSON(MessageJSON())(messages)


def turn_pair(i: int) -> list[Message]:
    return [Message.user_text(f"question {i}"), Message("assistant", (TextBlock(f"answer {i}"),))]


def test_a_conversation_that_goes_on_encodes_only_its_new_messages():
    counting = CountingJSON()
    history = HistoryJSON(counting)
    messages = [m for i in range(50) for m in turn_pair(i)]
    assert history(messages) == whole(messages)
    assert len(counting.asked) == 100
    counting.asked.clear()
    messages += turn_pair(50)
    assert history(messages) == whole(messages)
    assert counting.asked == messages[-2:]


def test_a_new_message_of_the_same_role_joins_the_last_turn():
    # The previous request ended with a user turn; the next one adds a tool result and text
    # for the same user turn: the API must see one turn, tool result first.
    history = HistoryJSON(MessageJSON())
    messages = [Message.user_text("one"), Message.user_text("two")]
    history(messages)
    messages += [
        Message("user", (TextBlock("three"), ToolResultBlock("c1", "done"))),
        Message("assistant", (TextBlock("ok"),)),
    ]
    assert history(messages) == whole(messages)
    assert [t["role"] for t in json.loads(history(messages))] == ["user", "assistant"]


def test_a_request_that_is_not_a_continuation_is_built_whole():
    counting = CountingJSON()
    history = HistoryJSON(counting)
    messages = [m for i in range(5) for m in turn_pair(i)]
    history(messages)
    # As the engine's view does for an old screenshot: a message replaced by a copy.
    changed = list(messages)
    changed[3] = Message("assistant", (TextBlock("answer 1, its image dropped"),))
    counting.asked.clear()
    assert history(changed) == whole(changed)
    assert len(counting.asked) == len(changed)
    shorter = messages[:4]  # a summary request over the older part
    assert history(shorter) == whole(shorter)


def test_an_entry_goes_with_its_messages():
    history = HistoryJSON(MessageJSON())
    kept = [m for i in range(3) for m in turn_pair(i)]
    history(kept)
    for i in range(20):
        history(turn_pair(100 + i))  # freed right after the call
    gc.collect()
    assert len(history) == 1
    # An entry holds the messages after the first, but not the first: a context the engine
    # lets go of is freed whole, entry included.
    dropped = [m for i in range(3) for m in turn_pair(200 + i)]
    history(dropped)
    later = weakref.ref(dropped[-1])
    del dropped
    gc.collect()
    assert len(history) == 1
    assert later() is None
    counting = CountingJSON()
    reused = HistoryJSON(counting)
    reused(kept)
    counting.asked.clear()
    assert reused(kept) == whole(kept)
    assert counting.asked == []


def test_the_history_cache_is_bounded_by_entries_and_characters():
    alive = [turn_pair(i) for i in range(10)]
    history = HistoryJSON(MessageJSON(), max_entries=4)
    for pair in alive:
        history(pair)
    assert len(history) == 4
    one = len(whole(alive[0]))
    history = HistoryJSON(MessageJSON(), max_chars=one * 3)
    for pair in alive:
        history(pair)
    assert len(history) == 3


_BLOCKS = st.one_of(
    st.builds(TextBlock, st.sampled_from(["a", "b", " ", "ü"])),
    st.builds(ToolResultBlock, st.sampled_from(["c1", "c2"]), st.sampled_from(["r", ""])),
    st.builds(ToolUseBlock, st.sampled_from(["c1", "c2"]), st.just("t"), st.just({"q": 1})),
)
_MESSAGES = st.builds(
    lambda role, blocks: Message(role, tuple(blocks)),
    st.sampled_from(["user", "assistant"]),
    st.lists(_BLOCKS, min_size=1, max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_MESSAGES, min_size=1, max_size=8),
    st.lists(
        st.tuples(st.sampled_from(["extend", "cut", "replace"]), st.lists(_MESSAGES, max_size=3)),
        max_size=6,
    ),
)
def test_every_request_equals_the_array_built_whole(
    first: list[Message], steps: list[tuple[str, list[Message]]]
) -> None:
    history = HistoryJSON(MessageJSON())
    messages = list(first)
    assert history(messages) == whole(messages)
    for action, new in steps:
        if action == "extend":
            messages = messages + new
        elif action == "cut":
            messages = messages[: max(1, len(messages) // 2)] + new
        elif len(messages) > 1:
            messages = [messages[0], *new, *messages[2:]]
        if messages:
            assert history(messages) == whole(messages)
