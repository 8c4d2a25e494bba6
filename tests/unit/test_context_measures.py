"""compaction.Context: what a model round measures of a context, kept as items are appended,
always equal to measuring the whole context afresh."""

from __future__ import annotations

import hashlib
import random
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from geodebot.engine import compaction
from geodebot.engine.attachments import FILES_SHOWN, _choose
from geodebot.engine.compaction import IMAGE_CHARS, Context, ContextItem
from geodebot.engine.ledger import content_hash
from geodebot.engine.llm.types import (
    FileBlock,
    ImageData,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    canonical_json,
)

SYSTEM = canonical_json("You are a careful assistant.")
TOOLS = canonical_json(["read_file", "search"])


def random_item(rng: random.Random, seq: int) -> ContextItem:
    kind = rng.choice(["text", "text", "text", "tool_use", "image", "file", "summary"])
    if kind == "tool_use":
        call = ToolUseBlock(f"call{seq}", "search", {"q": f"query {seq}"})
        return ContextItem(seq, Message("assistant", (TextBlock("looking"), call)))
    if kind == "image":
        shot = ImageData("image/png", f"cG5n{seq:04d}")
        result = ToolResultBlock(f"call{seq}", "a screenshot", images=(shot,))
        return ContextItem(seq, Message("user", (result,)))
    if kind == "file":
        block = FileBlock(f"{seq:064x}", "image/png", f"p{seq}.png", 100 + seq)
        return ContextItem(seq, Message("user", (TextBlock(f"picture {seq}"), block)))
    if kind == "summary":
        return ContextItem(seq, Message.user_text(f"summary {seq}"), True, 1)
    role = rng.choice(["user", "assistant"])
    return ContextItem(
        seq, Message(role, (TextBlock(f"message {seq} " + "x" * rng.randrange(40)),))
    )


def whole_digest(items: list[ContextItem]) -> str:
    """The ledger's request hash made from the whole text at once:
    content_hash([[message JSON...], system, [tool name...]])."""
    text = f"[[{','.join(item.canonical for item in items)}],{SYSTEM},{TOOLS}]"
    return hashlib.sha256(text.encode()).hexdigest()


def assert_measures(context: Context, items: list[ContextItem]) -> None:
    assert list(context) == items
    assert len(context) == len(items)
    chars = sum(len(i.canonical) + (i.images + i.files) * IMAGE_CHARS for i in items)
    assert context.chars == chars
    assert compaction.estimate_tokens(context, "sys") == (3 + chars) // 4 + 1
    assert list(context.with_images) == [n for n, i in enumerate(items) if i.images]
    assert list(context.with_files) == [
        n for n, i in enumerate(items) if i.files and not i.is_summary
    ]
    assert context.messages() == tuple(i.message for i in items)
    assert context.digest(SYSTEM, TOOLS) == whole_digest(items)


@pytest.mark.parametrize("seed", range(5))
def test_appends_keep_every_measure_equal_to_measuring_afresh(seed: int) -> None:
    rng = random.Random(seed)
    items = [random_item(rng, seq) for seq in range(rng.randrange(5))]
    context = Context(items)
    assert_measures(context, items)
    for seq in range(len(items), 120):
        item = random_item(rng, seq)
        context.append(item)
        items.append(item)
        if rng.random() < 0.3:  # measured now and then, as rounds do
            assert_measures(context, items)
        if rng.random() < 0.1:  # a turn's copy goes its own way
            copy = context.copy()
            extra = random_item(rng, 10_000 + seq)
            copy.append(extra)
            assert_measures(copy, [*items, extra])
            assert_measures(context, items)
    assert_measures(context, items)
    assert Context().digest() == hashlib.sha256(b"[[]]").hexdigest()


def test_the_digest_is_the_ledgers_hash_of_the_request_parts() -> None:
    rng = random.Random(11)
    context, messages = Context(), []
    for seq in range(40):
        item = random_item(rng, seq)
        if item.images:  # in the digest an image stands as the digest of its bytes
            continue
        context.append(item)
        messages.append(item.message.to_json())
        parts = [messages, "You are a careful assistant.", ["read_file", "search"]]
        assert context.digest(SYSTEM, TOOLS) == content_hash(parts)


def test_an_item_gets_its_seq_once_saved_and_nothing_else_replaces_one() -> None:
    user = ContextItem(0, Message.user_text("hello"))
    context = Context([ContextItem(1, Message.user_text("before")), user])
    context[1] = replace(user, seq=7)
    assert context[1].seq == 7
    assert_measures(context, [ContextItem(1, Message.user_text("before")), context[1]])
    with pytest.raises(ValueError, match="only by its own message"):
        context[1] = ContextItem(7, Message.user_text("hello"))  # equal, not the same


def test_only_the_newest_image_stays_and_the_view_is_measured_as_it_is_sent() -> None:
    rng = random.Random(7)
    items = [random_item(rng, seq) for seq in range(60)]
    assert sum(1 for i in items if i.images) > 2
    context = Context(items)
    view = compaction.latest_images_only(context)
    expected = [
        i
        if not i.images or n == context.with_images[-1]
        else ContextItem(
            i.seq,
            replace(
                i.message,
                content=tuple(
                    replace(b, content=f"{b.content}\n{compaction.IMAGE_DROPPED}", images=())
                    if isinstance(b, ToolResultBlock)
                    else b
                    for b in i.message.content
                ),
            ),
            i.is_summary,
            i.covers_from,
        )
        for n, i in enumerate(items)
    ]
    assert_measures(view, expected)
    assert_measures(context, items)  # the context itself is left as it was
    # With one image or none, the context is its own view.
    plain = Context([i for i in items if not i.images])
    assert compaction.latest_images_only(plain) is plain


def test_the_newest_files_are_chosen_from_the_items_that_carry_them() -> None:
    rng = random.Random(3)
    items = [random_item(rng, seq) for seq in range(200)]
    carriers = [n for n, i in enumerate(items) if i.files and not i.is_summary]
    assert len(carriers) > FILES_SHOWN
    chosen = _choose(Context(items))
    assert sorted(chosen) == carriers[-FILES_SHOWN:]
    assert all(positions == frozenset({1}) for positions in chosen.values())


def test_an_item_made_from_its_slots_is_the_one_the_dataclass_makes() -> None:
    message = Message("assistant", (TextBlock("one"), TextBlock("two")))
    made = ContextItem(12, message, True, 3)
    fast = compaction.text_item(12, message, True, 3, made.canonical)
    assert [getattr(fast, f.name) for f in fields(ContextItem)] == [
        getattr(made, f.name) for f in fields(ContextItem)
    ]
    assert fast == made
    with pytest.raises(FrozenInstanceError):
        fast.seq = 13  # type: ignore[misc]
