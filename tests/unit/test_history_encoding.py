"""The fast ways a long history is encoded give exactly the text of the plain ways."""

from __future__ import annotations

import hashlib
import json
import re
import tracemalloc
from sys import getsizeof
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geodebot.engine.compaction import ContextItem
from geodebot.engine.context_cache import _ENCODING_OVERHEAD, ContextCache, item_size
from geodebot.engine.llm.anthropic_json import (
    HistoryJSON,
    MessageJSON,
    _block_json,
    _block_param,
    _encode,
    _Turns,
    segments,
)
from geodebot.engine.llm.types import (
    Block,
    FileBlock,
    ImageData,
    Message,
    Role,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    canonical_json,
    compact_encoder,
)
from geodebot.engine.stored_context import _text_item, decode_context
from geodebot.store.records import ContextRow
from geodebot.store.rows import dumps as store_dumps

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
            # Decoded as a context read from the store is: every string its own object; and
            # sent once, which gives each message the encodings that live as long as it does.
            items = [ContextItem(i, Message.from_json(json.loads(s))) for i, s in enumerate(stored)]
            history = HistoryJSON(MessageJSON())
            history([item.message for item in items])
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


# -- a context read back whole (engine/stored_context.py) ------------------------------------
def _plain_item(row: ContextRow) -> ContextItem:
    message = Message.from_json(json.loads(row.content))
    return ContextItem(row.seq, message, row.kind == "summary", row.covers_from)


def _same_items(fast: list[ContextItem], plain: list[ContextItem]) -> None:
    assert fast == plain  # seq, message, summary and range
    for one, other in zip(fast, plain, strict=True):
        assert (one.canonical, one.images, one.files) == (
            other.canonical,
            other.images,
            other.files,
        )


text_messages = st.builds(
    Message,
    st.sampled_from(["user", "assistant"]),
    st.lists(st.builds(TextBlock, texts), min_size=1, max_size=3).map(tuple),
)


@given(st.lists(st.tuples(text_messages | messages, st.booleans()), max_size=8))
def test_a_context_decoded_from_its_stored_rows_equals_the_plain_decoding(
    history: list[tuple[Message, bool]],
) -> None:
    rows = [
        ContextRow(seq, "summary" if summary else "message", seq - 1 if summary else None, stored)
        for seq, (message, summary) in enumerate(history, 1)
        for stored in [store_dumps(message.to_json())]  # what the store writes
    ]
    _same_items(decode_context(rows), [_plain_item(row) for row in rows])
    for row, (message, _) in zip(rows, history, strict=True):
        # The fast way is the one taken for every message of text blocks.
        fast = _text_item(row.seq, row.kind == "summary", row.covers_from, row.content)
        assert (fast is not None) == all(type(b) is TextBlock for b in message.content)


def _other_writings(message: Message) -> list[str]:
    """The same message's JSON as other writers could have stored it."""
    data = message.to_json()
    return [
        json.dumps(data),  # ASCII escapes, spaces
        json.dumps(data, ensure_ascii=True, separators=(",", ":")),
        json.dumps(data, ensure_ascii=False, separators=(",", ":"), sort_keys=True),
        json.dumps({**data, "extra": 1}, ensure_ascii=False, separators=(",", ":")),
        _escaped(store_dumps(data), "/", "\\/"),
        _escaped(store_dumps(data), "e", "\\u0065"),
        _escaped(store_dumps(data), "a", "\\u0061"),  # also in the keys and the role
    ]


def _escaped(text: str, char: str, escape: str) -> str:
    """``text`` with ``char`` escaped as ``escape`` wherever it is not part of an escape."""
    return re.sub(r"(\\u[0-9a-fA-F]{4}|\\.)|" + re.escape(char), lambda m: m[1] or escape, text)


@given(text_messages)
def test_a_row_in_another_form_decodes_as_json_loads_decodes_it(message: Message) -> None:
    rows = [ContextRow(1, "message", None, text) for text in _other_writings(message)]
    _same_items(decode_context(rows), [_plain_item(row) for row in rows])
    for row in rows:  # and it is the message stored, whichever way it was written
        assert decode_context([row])[0].message == message


@given(text_messages, st.integers(0, 200), st.sampled_from(['"', "\\", "}", "\x01", "", "x"]))
def test_a_broken_row_is_refused_as_json_loads_refuses_it(
    message: Message, at: int, insert: str
) -> None:
    stored = store_dumps(message.to_json())
    at = min(at, len(stored))
    for text in (stored[:at], stored[:at] + insert + stored[at + 1 :]):
        row = ContextRow(1, "message", None, text)
        try:
            plain = _plain_item(row)
        except (ValueError, KeyError, TypeError) as exc:
            with pytest.raises(type(exc)):
                decode_context([row])
        else:
            _same_items(decode_context([row]), [plain])


@given(st.builds(TextBlock, texts), st.sampled_from(["user", "assistant"]), st.booleans())
def test_a_one_text_block_items_size_is_the_sum_of_its_objects(
    block: TextBlock, role: Role, summary: bool
) -> None:
    item = ContextItem(3, Message(role, (block,)), summary, 1 if summary else None)
    message = item.message
    assert item_size(item) == (
        getsizeof(item)
        + getsizeof(message)
        + getsizeof(message.role)
        + getsizeof(message.content)
        + getsizeof(item.canonical)
        + getsizeof(block)
        + getsizeof(block.text)
        + 2 * len(item.canonical)  # the adapter's encodings, estimated from the JSON's length
        + _ENCODING_OVERHEAD
    )


# -- the Anthropic array (llm/anthropic_json.py) ---------------------------------------------
def _plain_segments(message: Message) -> tuple[tuple[str, bool, str], ...]:
    return tuple(
        (
            "user" if isinstance(b, ToolResultBlock) else message.role,
            isinstance(b, ToolResultBlock),
            dumps_param(b),
        )
        for b in message.content
        if not (isinstance(b, TextBlock) and not b.text.strip())
    )


def dumps_param(block: Block) -> str:
    return json.dumps(_block_param(block), ensure_ascii=False, separators=(",", ":"))


@given(messages | text_messages)
def test_a_messages_segments_are_those_of_its_blocks(message: Message) -> None:
    assert segments(message, _encode(message)) == _plain_segments(message)


@settings(max_examples=200)
@given(st.lists(messages | text_messages, max_size=12), st.lists(st.integers(0, 4), max_size=6))
def test_an_array_continued_message_by_message_equals_the_one_added_whole(
    history: list[Message], cuts: list[int]
) -> None:
    whole, stepwise = _Turns(), _Turns()
    whole.add(history, _encode)
    at = 0
    for cut in [*cuts, len(history)]:
        stepwise.add(history[at : at + cut], _encode)
        at += cut
    stepwise.add(history[at:], _encode)
    for cache in (False, True):
        assert stepwise.text(cache=cache) == whole.text(cache=cache)
    one_by_one = _Turns()
    for message in history:
        one_by_one.add([message], _encode)
        assert isinstance(json.loads(one_by_one.text(cache=True)), list)
    assert (one_by_one.done, one_by_one.ends) == (whole.done, whole.ends)
