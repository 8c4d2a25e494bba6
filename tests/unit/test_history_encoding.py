"""The fast ways a long history is encoded give exactly the text of the plain ways."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geodebot.engine.compaction import ContextItem
from geodebot.engine.context_cache import ContextCache, item_size
from geodebot.engine.llm.anthropic_json import HistoryJSON, MessageJSON, _block_json, _block_param
from geodebot.engine.llm.types import (
    Block,
    FileBlock,
    ImageData,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    canonical_json,
    compact_encoder,
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
texts = st.text(max_size=60) | st.sampled_from(["", " ", '"quoted"\n', "\u2028\x00\\", "é😀"])
blocks: st.SearchStrategy[Block] = st.one_of(
    st.builds(TextBlock, texts),
    st.builds(
        ToolUseBlock,
        st.text(max_size=8),
        st.text(max_size=8),
        st.dictionaries(st.text(max_size=5), json_values, max_size=3),
    ),
    st.builds(
        ToolResultBlock,
        st.text(max_size=8),
        texts,
        st.booleans(),
        images=st.lists(st.builds(ImageData, st.just("image/png"), texts), max_size=1).map(tuple),
    ),
    st.builds(FileBlock, st.text(max_size=8), st.just("text/plain"), texts, st.integers(0, 99)),
)
messages = st.builds(
    Message,
    st.sampled_from(["user", "assistant"]),
    st.lists(blocks, min_size=1, max_size=3).map(tuple),
)


@given(json_values, st.booleans())
def test_the_compact_encoder_writes_what_json_dumps_writes(value: Any, sort_keys: bool) -> None:
    encode = compact_encoder(sort_keys=sort_keys)
    expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=sort_keys)
    assert encode(value) == expected


def test_the_compact_encoder_refuses_what_json_dumps_refuses() -> None:
    strict = compact_encoder(sort_keys=False, allow_nan=False)
    for bad in ({"x": float("inf")}, [float("nan")], {"k": object()}):
        with pytest.raises((ValueError, TypeError)) as ours:
            strict(bad)
        with pytest.raises(ours.type):
            json.dumps(bad, allow_nan=False)
    assert compact_encoder(sort_keys=True)([float("inf")]) == "[Infinity]"


@given(messages)
def test_an_items_canonical_json_is_that_of_its_message(message: Message) -> None:
    data = message.to_json()
    for block in data["content"]:
        for image in block.get("images", ()):
            image["data"] = "sha256:" + hashlib.sha256(image["data"].encode()).hexdigest()
    assert ContextItem(1, message).canonical == canonical_json(data)


@given(blocks)
def test_a_blocks_json_is_dumps_of_its_param(block: Block) -> None:
    plain = json.dumps(_block_param(block), ensure_ascii=False, separators=(",", ":"))
    assert _block_json(block) == plain


@settings(max_examples=60)
@given(st.lists(messages, min_size=1, max_size=12), st.lists(st.integers(1, 3), max_size=6))
def test_a_history_continued_request_by_request_equals_one_encoded_whole(
    history: list[Message], steps: list[int]
) -> None:
    # Requests grow at the end (a turn's new messages), as a session's do; each spliced
    # array must be the array a fresh encoder makes of the same messages.
    spliced = HistoryJSON(MessageJSON())
    end = 1
    for step in [0, *steps]:
        end = min(len(history), end + step)
        request = history[:end]
        text = spliced(request)
        assert text == HistoryJSON(MessageJSON())(request)
        assert isinstance(json.loads(text), list)


def _stored(kind: str, i: int) -> str:
    """A message's JSON as the store holds it."""
    if kind == "question":
        message = Message.user_text(f"question {i}: how is the deployment of service {i} going?")
    elif kind == "answer":
        message = Message.assistant_text(f"Answer {i}: done; " + "all checks passed. " * 6)
    elif kind == "tool":
        call = ToolUseBlock(f"call_{i}", "read_file", {"path": f"notes/{i}.md", "lines": [1, i]})
        message = Message("assistant", (TextBlock(f"looking {i}"), call))
    else:
        message = Message("user", (ToolResultBlock(f"call_{i}", f"{i}: " + "x" * 300),))
    return json.dumps(message.to_json())


def _decoded(kind: str, i: int) -> Message:
    return Message.from_json(json.loads(_stored(kind, i)))


def test_an_items_measured_size_is_what_it_takes_in_memory() -> None:
    for kind in ("question", "answer", "tool", "result"):
        stored = [_stored(kind, i) for i in range(400)]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            # Decoded as a context read from the store is: every string its own object.
            items = [ContextItem(i, Message.from_json(json.loads(s))) for i, s in enumerate(stored)]
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        measured = sum(map(item_size, items))
        assert 0.85 * used <= measured <= 1.2 * used, (kind, measured, used)


def test_the_default_bound_holds_fifty_sessions_of_540_messages() -> None:
    # Below the working set every turn of every busy session would read its whole history.
    cache = ContextCache()
    for session in range(50):
        items = [
            ContextItem(seq, _decoded("question" if seq % 2 else "answer", seq))
            for seq in range(1, 541)
        ]
        cache.put(f"s{session}", 1, 541, items)
    assert len(cache) == 50
    assert all(cache.get(f"s{session}", 1, 541) is not None for session in range(50))
