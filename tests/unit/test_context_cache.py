"""The context cache gives a turn exactly the context the store would, or nothing."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from geodebot.engine.compaction import ContextItem
from geodebot.engine.context_cache import ContextCache, item_size
from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
from geodebot.engine.llm.types import (
    ImageData,
    LLMRequest,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.store.records import NewMessage
from geodebot.store.sqlite import SQLiteStore
from tests.support.app import open_app
from tests.support.config import make_config
from tests.support.fakes.llm_server import FakeLLMServer, Reply

SID = "s"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(tmp_path / "store.db") as opened:
        await opened.ensure_session(SID, "daemon")
        yield opened


async def stored_context(store: SQLiteStore) -> list[ContextItem]:
    return [
        ContextItem(
            r.seq,
            Message.from_json(r.content),
            is_summary=r.kind == "summary",
            covers_from=r.covers_from,
        )
        for r in await store.load_context(SID)
    ]


def shape(items: list[ContextItem]) -> list[tuple[int, bool, int | None, str]]:
    return [(i.seq, i.is_summary, i.covers_from, i.canonical) for i in items]


async def cached_now(store: SQLiteStore, cache: ContextCache) -> list[ContextItem] | None:
    row = await store.get_session(SID)
    assert row is not None
    return cache.get(SID, row.generation, row.next_seq)


async def prime(store: SQLiteStore, cache: ContextCache) -> None:
    row = await store.get_session(SID)
    assert row is not None
    cache.put(SID, row.generation, row.next_seq, await stored_context(store))


@pytest.mark.parametrize("seed", range(6))
async def test_appends_and_summaries_keep_the_copy_equal_to_the_store(
    store: SQLiteStore, seed: int
) -> None:
    rng = random.Random(seed)
    cache = ContextCache()
    await prime(store, cache)
    floor, dropped = 0, 0
    for step in range(40):
        backwards = False
        if step > 3 and rng.random() < 0.25:
            row = await store.get_session(SID)
            assert row is not None
            # A summary of some prefix of what exists, or (no covers_to) of everything before it.
            covers_to = rng.choice([None, rng.randrange(1, row.next_seq)])
            upto = row.next_seq if covers_to is None else covers_to
            # The loop never does this, but a summary reaching below the last one's range
            # brings back messages the copy no longer holds.
            backwards, floor = upto < floor, max(floor, upto)
            new = [
                NewMessage(
                    "user",
                    Message.user_text(f"summary {step}").to_json(),
                    "t",
                    kind="summary",
                    covers_from=1,
                    covers_to=covers_to,
                )
            ]
        else:
            new = [
                NewMessage(role, _text(f"m{step}.{i}", role), "t")
                for i, role in enumerate(rng.choices(["user", "assistant"], k=rng.randint(1, 3)))
            ]
        seqs = await store.checkpoint(SID, messages=new)
        cache.appended(SID, seqs, new)
        copy = await cached_now(store, cache)
        if backwards and copy is None:
            dropped += 1
            await prime(store, cache)
            continue
        assert copy is not None
        assert shape(copy) == shape(await stored_context(store))
        # The size kept for the bound follows the copy, appends and summaries alike.
        assert cache.size == sum(item_size(item) for item in copy)
    assert cache.hits + dropped == 40
    assert cache.hits >= 30


async def test_a_foreign_append_or_a_reset_makes_the_copy_unusable(store: SQLiteStore) -> None:
    cache = ContextCache()
    first = [NewMessage("user", _text("one"), "t")]
    await store.checkpoint(SID, messages=first)
    await prime(store, cache)
    assert await cached_now(store, cache) is not None

    # Another process appends: the row moves on, the copy does not.
    await store.checkpoint(SID, messages=[NewMessage("assistant", _text("two", "assistant"), "t")])
    assert await cached_now(store, cache) is None

    # This process's next append does not continue the copy: it is dropped, not patched.
    await prime(store, cache)
    await store.checkpoint(SID, messages=[NewMessage("user", _text("three"), "t")])
    mine = [NewMessage("user", _text("four"), "t")]
    seqs = await store.checkpoint(SID, messages=mine)
    cache.appended(SID, seqs, mine)
    assert len(cache) == 0

    await prime(store, cache)
    await store.reset_session(SID)
    assert await cached_now(store, cache) is None


async def test_a_copy_read_after_a_later_append_is_not_kept(store: SQLiteStore) -> None:
    cache = ContextCache()
    row = await store.get_session(SID)
    assert row is not None
    await store.checkpoint(SID, messages=[NewMessage("user", _text("raced"), "t")])
    cache.put(SID, row.generation, row.next_seq, await stored_context(store))
    assert len(cache) == 0


def test_least_recently_used_sessions_go_first() -> None:
    item = ContextItem(1, Message.user_text("x" * 100))
    cache = ContextCache(max_sessions=2, max_bytes=10_000)
    cache.put("a", 1, 2, [item])
    cache.put("b", 1, 2, [item])
    assert cache.get("a", 1, 2) is not None  # a is now the most recent
    cache.put("c", 1, 2, [item])
    assert cache.get("b", 1, 2) is None
    assert cache.get("a", 1, 2) is not None
    assert cache.get("c", 1, 2) is not None

    by_size = ContextCache(max_sessions=100, max_bytes=2 * item_size(item))
    for name in "abc":
        by_size.put(name, 1, 2, [item])
    assert len(by_size) == 2
    assert by_size.size == 2 * item_size(item)
    by_size.put("huge", 1, 2, [item] * 3)
    assert by_size.get("huge", 1, 2) is None


def test_an_images_bytes_count_though_the_canonical_form_holds_only_its_digest() -> None:
    shot = ImageData("image/png", "A" * 400_000)
    result = ToolResultBlock("c1", "screenshot taken", images=(shot,))
    item = ContextItem(2, Message("user", (result,)))
    assert len(item.canonical) < 1_000
    assert item_size(item) > 400_000
    cache = ContextCache(max_bytes=1_000_000)
    cache.put("a", 1, 3, [item])
    cache.put("b", 1, 3, [item])
    cache.put("c", 1, 3, [item])
    assert len(cache) == 2  # three screenshots do not fit in a million bytes
    assert cache.size <= 1_000_000


async def test_turns_send_the_same_context_with_and_without_the_cache(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """The same conversation (compaction, a reset and a foreign append included) twice."""
    sent: dict[str, list[object]] = {}
    # Every call not scripted (answers, and summaries of later compactions) gets this.
    llm_server.default = Reply("noted")
    for label in ("cached", "uncached"):
        config = make_config(
            tmp_path / label,
            llm_server,
            model={"context_tokens": 1024},
            budgets={"keep_recent_messages": 2, "compact_at": 0.5},
        )
        first = len(llm_server.requests)
        async with AsyncExitStack() as stack:
            app = await open_app(config, stack, tmp_path / label / "marker")
            if label == "uncached":
                services = dataclasses.replace(app.services, context_cache=None)
                app = dataclasses.replace(app, services=services)
            store = app.services.store
            for index in range(6):
                if index == 3:
                    llm_server.script(Reply("THE SUMMARY"))
                    text = "long " + "lorem ipsum " * 200
                else:
                    text = f"q{index}"
                if index == 4:
                    # Written behind the daemon's back, as `geodebot run` on the session would.
                    note = [
                        NewMessage("user", _text("asked elsewhere"), "x"),
                        NewMessage("assistant", _text("answered elsewhere", "assistant"), "x"),
                    ]
                    await store.checkpoint("long", messages=note)
                assert (await app.run_turn(Mode.IPC, SessionSpec("long"), text)).ok
            await store.reset_session("long")
            assert (await app.run_turn(Mode.IPC, SessionSpec("long"), "after reset")).ok
            cache = app.services.context_cache
            if cache is not None:
                assert cache.hits >= 3
        sent[label] = [r.json for r in llm_server.requests[first:]]
    assert json.dumps(sent["cached"]) == json.dumps(sent["uncached"])
    assert "THE SUMMARY" in json.dumps(sent["cached"])
    assert "answered elsewhere" in json.dumps(sent["cached"][-2])
    assert "answered elsewhere" not in json.dumps(sent["cached"][-1])


def _text(text: str, role: str = "user") -> dict[str, object]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


async def test_the_next_turn_sends_the_very_messages_of_the_one_before(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # The cache keeps the messages a turn wrote as they are, so the adapter's cache of the
    # encoded history recognises them: each turn encodes only its question and the answer
    # before it, however long the session.
    llm_server.default = Reply("noted")
    async with AsyncExitStack() as stack:
        app = await open_app(make_config(tmp_path, llm_server), stack, tmp_path / "marker")
        adapter = await app.adapters[0].adapter()
        history = adapter._history  # type: ignore[attr-defined]  # the fake's own record
        encoded: list[Message] = []
        inner = history._encoded

        def counting(message: Message) -> object:
            encoded.append(message)
            return inner(message)

        history._encoded = counting
        per_turn = []
        for index in range(5):
            encoded.clear()
            assert (await app.run_turn(Mode.IPC, SessionSpec("same"), f"q{index}")).ok
            per_turn.append([m.text for m in encoded])
    assert per_turn == [["q0"], ["noted", "q1"], ["noted", "q2"], ["noted", "q3"], ["noted", "q4"]]


def test_appended_keeps_the_decoded_messages_as_they_are() -> None:
    cache = ContextCache()
    first = Message.user_text("one")
    cache.put(SID, 1, 1, [ContextItem(0, first)])
    answer = Message.user_text("two")
    cache.appended(SID, [1], [NewMessage("user", answer.to_json(), "t")], [answer])
    items = cache.get(SID, 1, 2)
    assert items is not None
    assert [i.message for i in items] == [first, answer]
    assert items[1].message is answer


def _text_turn(i: int, length: int) -> list[Message]:
    return [
        Message.user_text(f"question {i} " + "q" * length),
        Message.assistant_text(f"answer {i} " + "a" * length),
    ]


def _tool_turn(i: int, length: int) -> list[Message]:
    return [
        Message("user", (ToolResultBlock(f"c{i}", "r" * length),)),
        Message(
            "assistant",
            (TextBlock(f"answer {i}"), ToolUseBlock(f"c{i + 1}", "read", {"path": "p" * length})),
        ),
    ]


@pytest.mark.parametrize(
    ("turn", "length"), [(_text_turn, 5), (_text_turn, 400), (_tool_turn, 40), (_tool_turn, 2000)]
)
def test_the_bound_counts_what_a_cached_session_really_holds(
    turn: Callable[[int, int], list[Message]], length: int
) -> None:
    # The bound is what keeps the daemon's memory in check: the measure must be what the
    # session costs, with every request's encodings, not a part of it.
    adapter = AnthropicAdapter(model="m", api_key=None, api_key_env="NO_KEY")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = ContextCache()
        cache.put(SID, 1, 1, [])
        seq = 1
        for i in range(500):
            messages = turn(i, length)
            rows = [NewMessage(m.role, m.to_json(), "t") for m in messages]
            cache.appended(SID, [seq, seq + 1], rows, messages)
            seq += 2
            context = cache.get(SID, 1, seq)
            assert context is not None
            adapter._body(LLMRequest("system", tuple(item.message for item in context)))
            del context
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert 0.85 < cache.size / held < 1.15, (cache.size, held)
