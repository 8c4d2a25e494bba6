"""``geodebot memory ...`` as an operator runs it: a subprocess, on a SQLite store filled
here as the memory tools would have filled it; export, then import into a fresh state
directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest

from geodebot.cli import memory as cli_memory
from geodebot.config.schema import DB_FILE, LEDGER_FILE
from geodebot.store.memory import MemoryStore
from geodebot.store.records import MemoryItem
from geodebot.store.sqlite import SQLiteStore
from tests.support.cli import geodebot, write_config

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
LONG = "Deploys go out on Tuesdays only,\nnever on a Friday " + "and never in a freeze " * 8
ITEMS = (
    MemoryItem(
        ref="m-00000000000000a1",
        project="ops",
        text="The staging database runs on db-stage-2, port 5433.",
        tags=("db", "staging"),
        session_id="ops",
        turn_id="t-1",
        user="4242",
        origin="chat",
        created_at=T0,
    ),
    MemoryItem(
        ref="m-00000000000000a2",
        project="ops",
        text=LONG + "\x1b[31m",
        session_id="ops-b",
        turn_id="t-2",
        user="77",
        origin="relay",
        forwarded=True,
        created_at=T0 + 3600,
    ),
    MemoryItem(
        ref="m-00000000000000b1",
        project="web",
        text="The CDN in front of the web database is CloudFront.",
        session_id="web",
        turn_id="t-3",
        origin="job",
        created_at=T0 + 7200,
    ),
)


async def fill(state: Path, items: tuple[MemoryItem, ...] = ITEMS) -> None:
    async with SQLiteStore(state / DB_FILE) as store:
        for item in items:
            await store.memory_save(item, max_items=100)


async def stored(state: Path) -> dict[str, MemoryItem]:
    async with SQLiteStore(state / DB_FILE) as store:
        return {i.ref: i for i in await store.memory_list(project=None, limit=1000)}


async def memory(config: Path, *args: str) -> tuple[int, str, str]:
    return await geodebot("memory", *args, "--config", str(config))


def lines(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines()]


async def test_list_projects_show_search_and_forget(tmp_path: Path) -> None:
    config = write_config(tmp_path, "")
    await fill(tmp_path / "var")
    (
        listed,
        listed_json,
        projects,
        projects_json,
        shown,
        shown_json,
        elsewhere,
        found,
        hits,
    ) = await asyncio.gather(
        memory(config, "list"),
        memory(config, "list", "--project", "ops", "--limit", "1", "--json"),
        memory(config, "projects"),
        memory(config, "projects", "--json"),
        memory(config, "show", "m-00000000000000a2"),
        memory(config, "show", "m-00000000000000a1", "--json"),
        memory(config, "show", "m-00000000000000a1", "--project", "web"),
        memory(config, "search", "database port", "--project", "ops"),
        memory(config, "search", "database", "--project", "web", "--json"),
    )

    code, out, err = listed
    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "SAVED", "(UTC)", "PROJECT", "ORIGIN", "USER", "TEXT"]
    assert [row.split()[0] for row in rows] == [
        "m-00000000000000b1",
        "m-00000000000000a2",
        "m-00000000000000a1",
    ]
    assert rows[2].split()[1:7] == ["2023-11-14", "22:13", "ops", "chat", "4242", "The"]
    assert rows[0].split()[5] == "-"  # a job's item: no person
    # The text on one line, cut at 80 characters, its control characters made harmless.
    text = rows[1][rows[1].index("Deploys") :]
    assert text.startswith("Deploys go out on Tuesdays only, never on a Friday")
    assert (len(text), text[-1]) == (80, "…")
    assert "\x1b" not in out

    code, out, err = listed_json
    assert (code, err) == (0, "")
    assert lines(out) == [ITEMS[1].to_json()]

    assert projects[0] == 0
    assert projects[1].splitlines()[1:] == ["      2  ops", "      1  web"]
    assert projects_json[0] == 0
    assert lines(projects_json[1]) == [
        {"project": "ops", "items": 2},
        {"project": "web", "items": 1},
    ]

    code, out, err = shown
    assert (code, err) == (0, "")
    fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith(" "))
    assert {k: v.strip() for k, v in fields.items()} == {
        "id": "m-00000000000000a2",
        "project": "ops",
        "saved at": "2023-11-14 23:13:20 UTC",
        "origin": "relay",
        "forwarded": "yes (its message came through Thread Relay)",
        "user": "77",
        "session": "ops-b",
        "turn": "t-2",
        "tags": "-",
        "text": "",
    }
    assert "  Deploys go out on Tuesdays only,\n  never on a Friday" in out
    assert shown_json[0] == 0
    assert MemoryItem.from_json(json.loads(shown_json[1])) == ITEMS[0]
    # Another project's id is no item of it.
    code, out, err = elsewhere
    assert (code, out) == (1, "")
    assert err == (
        "geodebot: no memory item 'm-00000000000000a1' in project 'web' "
        "(see geodebot memory list)\n"
    )

    code, out, err = found
    assert (code, err) == (0, "")
    assert out.splitlines()[0].split()[:2] == ["SCORE", "ID"]
    assert [row.split()[1] for row in out.splitlines()[1:]] == ["m-00000000000000a1"]
    code, out, err = hits
    assert (code, err) == (0, "")
    [hit] = lines(out)
    assert hit["id"] == "m-00000000000000b1"
    assert isinstance(hit["score"], float)
    assert hit["score"] > 0

    code, out, err = await memory(config, "forget", "m-00000000000000a1")
    assert (code, err) == (0, "")
    assert out.startswith(
        "forgot m-00000000000000a1 of project 'ops' (saved 2023-11-14 22:13 UTC, chat, by 4242)"
    )
    again, other, after = await asyncio.gather(
        memory(config, "forget", "m-00000000000000a1"),
        memory(config, "forget", "m-00000000000000b1", "--project", "ops"),
        memory(config, "list", "--json"),
    )
    assert again[0] == other[0] == 1
    assert "no memory item 'm-00000000000000a1'" in again[2]
    assert "no memory item 'm-00000000000000b1' in project 'ops'" in other[2]
    assert [row["id"] for row in lines(after[1])] == ["m-00000000000000b1", "m-00000000000000a2"]
    ledger = [
        json.loads(line) for line in (tmp_path / "var" / LEDGER_FILE).read_text().splitlines()
    ]
    [row] = [row for row in ledger if row["kind"] == "memory_forgotten"]
    assert {k: row[k] for k in ("id", "project", "via")} == {
        "id": "m-00000000000000a1",
        "project": "ops",
        "via": "cli",
    }


async def test_export_then_import_into_a_fresh_state_dir_keeps_ids_and_provenance(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, "")
    await fill(tmp_path / "var")
    dump = tmp_path / "memory.jsonl"
    (code, out, err), web = await asyncio.gather(
        memory(config, "export", str(dump)), memory(config, "export", "--project", "web")
    )
    assert (code, out, err) == (0, "", f"exported 3 memory item(s) to {dump}\n")
    assert dump.stat().st_mode & 0o777 == 0o600
    # Oldest first, as they were saved.
    assert [MemoryItem.from_json(row) for row in lines(dump.read_text())] == list(ITEMS)
    assert web[0] == 0
    assert lines(web[1]) == [ITEMS[2].to_json()]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fresh_config = write_config(fresh, "")
    assert await memory(fresh_config, "import", str(dump)) == (
        0,
        "imported 3, duplicates 0, refused 0\n",
        "",
    )
    before, after, found, again = await asyncio.gather(
        memory(config, "list", "--json"),
        memory(fresh_config, "list", "--json"),
        memory(fresh_config, "search", "Friday freeze", "--project", "ops", "--json"),
        memory(fresh_config, "import", str(dump)),
    )
    # The same items, ids and provenance, newest first as in the store they came from.
    assert after == before
    assert after[0] == 0
    [hit] = lines(found[1])
    assert {k: hit[k] for k in ("id", "origin", "forwarded", "user", "session", "turn")} == {
        "id": "m-00000000000000a2",
        "origin": "relay",
        "forwarded": True,
        "user": "77",
        "session": "ops-b",
        "turn": "t-2",
    }
    # The same file twice: every line a duplicate, nothing added, no failure.
    assert again == (0, "imported 0, duplicates 3, refused 0\n", "")
    assert await stored(fresh / "var") == {item.ref: item for item in ITEMS}


async def test_a_malformed_line_is_named_and_skipped_and_a_full_project_refuses(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, "[memory]\nmax_items = 2\n")
    good = [
        MemoryItem(ref=f"m-{n:016x}", project="ops", text=f"fact {n}", created_at=T0 + n)
        for n in range(4)
    ]
    web = MemoryItem(ref="m-web", project="web", text="the web fact", tags=("cdn",))
    rows = [
        json.dumps(good[0].to_json()),
        "not json at all",
        json.dumps({"id": "m-no-text", "project": "ops"}),
        json.dumps({**good[1].to_json(), "id": "m-bad-tags", "tags": "db"}),
        json.dumps({**good[1].to_json(), "id": "m-bad-tag", "tags": ["two words"]}),
        "",
        json.dumps(good[1].to_json()),
        json.dumps(good[2].to_json()),
        json.dumps(web.to_json()),
        json.dumps(good[3].to_json()),
    ]
    dump = tmp_path / "memory.jsonl"
    dump.write_text("\n".join(rows) + "\n")

    code, out, err = await memory(config, "import", str(dump))
    assert (code, out) == (1, "imported 3, duplicates 0, refused 6\n")
    problems = err.splitlines()
    assert problems[0].startswith(f"geodebot: {dump} line 2: not a memory item, skipped: not JSON")
    assert problems[1] == (
        f"geodebot: {dump} line 3: not a memory item, skipped: text must be a non-empty string"
    )
    assert problems[2] == (
        f"geodebot: {dump} line 4: not a memory item, skipped: tags must be a list of strings"
    )
    assert problems[3].startswith(f"geodebot: {dump} line 5: not a memory item, skipped: tags")
    assert problems[4] == (
        f"geodebot: {dump} line 8: refused: project 'ops' holds [memory] max_items (2) items; "
        "its later lines are refused too"
    )
    assert problems[5].startswith("geodebot: project 'ops' is full: 2 of its item(s) refused")
    assert len(problems) == 6
    # The valid lines saved whole, up to the cap; another project's still taken.
    assert await stored(tmp_path / "var") == {i.ref: i for i in (good[0], good[1], web)}


class ForgetsTheCursor:
    """A store on which a running daemon forgets the last item of the first page just after
    the export read it."""

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store

    async def memory_list(self, **kwargs: Any) -> list[MemoryItem]:
        page = await self._store.memory_list(**kwargs)
        if kwargs.get("before") is None and page:
            await self._store.memory_forget(page[-1].ref, project=None)
        return page

    async def memory_get(self, ref: str, *, project: str | None) -> MemoryItem | None:
        return await self._store.memory_get(ref, project=project)


async def test_an_export_goes_on_past_an_item_forgotten_while_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_memory, "PAGE", 2)
    items = tuple(
        MemoryItem(ref=f"m-{n:016x}", project="ops", text=f"fact {n}", created_at=T0 + n)
        for n in range(5)
    )
    await fill(tmp_path, items)
    async with SQLiteStore(tmp_path / DB_FILE) as store:
        read = await cli_memory._every_item(cast(MemoryStore, ForgetsTheCursor(store)), None)
    assert [item.ref for item in read] == [item.ref for item in reversed(items)]
