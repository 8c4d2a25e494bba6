"""Project memory in the store (store/memory.py), one module for both backends: saving,
reading, listing and forgetting by project, the cap, and one search contract (the same
corpus and queries give the same top results on SQLite's FTS5 and PostgreSQL's tsvector)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from geodebot.store.memory import (
    COMMON_AFTER,
    DuplicateMemory,
    MemoryFull,
    new_ref,
    search_terms,
)
from geodebot.store.protocol import Store
from geodebot.store.records import MemoryItem
from geodebot.store.sqlite import SQLiteStore
from tests.support.postgres import Place


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as opened:  # type: ignore[attr-defined]
        yield opened


def item(text: str, project: str = "ops", **over: object) -> MemoryItem:
    fields: dict[str, object] = {
        "ref": new_ref(),
        "project": project,
        "text": text,
        "session_id": "s",
        "turn_id": "t",
        "user": "alice",
        "created_at": 1.0,
    }
    fields.update(over)
    return MemoryItem(**fields)  # type: ignore[arg-type]


CORPUS = (
    "The web server runs nginx on port 8080",
    "Backups run nightly at 03:00 to the NAS",
    "Alice prefers short answers without emoji",
    "The database is PostgreSQL 15 on db-1",
    "Rotate the application logs weekly, keep four weeks",
)
# query -> the corpus entry that must come first
TOP = {
    "which port is the web server on": 0,
    "when do backups run": 1,
    "what does alice prefer? short answers": 2,
    "postgresql database version": 3,
    "how long do we keep logs": 4,
}


async def test_the_same_queries_find_the_same_top_items_on_both_backends(store: Store) -> None:
    saved = [await store.memory_save(item(text), max_items=100) for text in CORPUS]
    # Another project's items are never found, however well they match.
    await store.memory_save(item("nginx port 8080 web server", project="other"), max_items=100)
    for query, best in TOP.items():
        hits = await store.memory_search("ops", query, limit=3)
        assert hits, query
        assert hits[0].item.ref == saved[best].ref, (query, [h.item.text for h in hits])
        assert all(h.item.project == "ops" for h in hits)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert await store.memory_search("ops", "kubernetes helm", limit=5) == []
    assert await store.memory_search("ops", "  ?! ", limit=5) == []
    assert len(await store.memory_search("ops", "the", limit=2)) == 2


async def test_search_text_is_words_only(store: Store) -> None:
    # What would be query syntax in either index is only words here.
    await store.memory_save(item("deploys happen on fridays"), max_items=10)
    for query in ('fridays" OR project:other', "fridays' | !x", "NEAR(fridays deploys)"):
        hits = await store.memory_search("ops", query, limit=5)
        assert [h.item.text for h in hits] == ["deploys happen on fridays"], query
    assert await store.memory_search("ops", "(*) & | !", limit=5) == []
    assert search_terms('A "b" a c-d') == ["a", "b", "c", "d"]


async def test_an_item_is_read_and_forgotten_only_through_its_project(store: Store) -> None:
    saved = await store.memory_save(
        item("the VPN is at vpn.example.org", tags=("net",)), max_items=10
    )
    assert await store.memory_get(saved.ref, project="other") is None
    assert await store.memory_forget(saved.ref, project="other") is None
    got = await store.memory_get(saved.ref, project="ops")
    assert got == saved
    assert (got.tags, got.user, got.origin) == (("net",), "alice", "chat")
    assert await store.memory_projects() == {"ops": 1}
    assert await store.memory_forget(saved.ref, project="ops") == saved
    assert await store.memory_get(saved.ref, project=None) is None
    assert await store.memory_search("ops", "vpn", limit=5) == []
    assert await store.memory_projects() == {}


async def test_a_full_project_refuses_a_save_and_a_taken_id_is_refused(store: Store) -> None:
    first = await store.memory_save(item("one"), max_items=2)
    await store.memory_save(item("two"), max_items=2)
    with pytest.raises(MemoryFull, match="holds 2 memory items"):
        await store.memory_save(item("three"), max_items=2)
    # A save run again that took the last place is saved already, not refused as full.
    with pytest.raises(DuplicateMemory):
        await store.memory_save(first, max_items=2)
    # Another project has its own room.
    await store.memory_save(item("three", project="other"), max_items=2)
    with pytest.raises(DuplicateMemory):
        await store.memory_save(item("again", ref=first.ref, project="third"), max_items=2)
    listed = await store.memory_list(project="ops", limit=10)
    assert [i.text for i in listed] == ["two", "one"]
    older = await store.memory_list(project=None, limit=10, before=listed[0].ref)
    assert [i.text for i in older] == ["one"]


async def test_two_saves_at_once_cannot_both_take_the_last_place(place: Place) -> None:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        await one.memory_save(item("first"), max_items=2)
        results = await asyncio.gather(
            one.memory_save(item("a"), max_items=2),
            other.memory_save(item("b"), max_items=2),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["MemoryFull", "MemoryItem"]
        assert (await one.memory_projects())["ops"] == 2


async def test_in_a_large_project_common_words_give_way_to_rare_ones(tmp_path: Path) -> None:
    # SQLite's own search plan (the pruning of common words past COMMON_AFTER items).
    async with SQLiteStore(tmp_path / "geodebot.db") as store:
        for n in range(COMMON_AFTER + 20):
            await store.memory_save(item(f"note {n} about the shared cluster"), max_items=5000)
        needle = await store.memory_save(item("the cluster uses calico networking"), max_items=5000)
        # "the", "cluster" are in every item: ranked by "calico" alone, the item is first.
        hits = await store.memory_search("ops", "the cluster calico", limit=3)
        assert hits[0].item.ref == needle.ref
        assert hits[0].score > 0
        # Nothing but common words: the newest items holding them, unranked.
        newest = await store.memory_search("ops", "the shared cluster", limit=3)
        assert [h.item.text for h in newest] == [
            "the cluster uses calico networking",
            f"note {COMMON_AFTER + 19} about the shared cluster",
            f"note {COMMON_AFTER + 18} about the shared cluster",
        ]
        assert {h.score for h in newest} == {0.0}
