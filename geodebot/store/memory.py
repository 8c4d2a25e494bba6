"""Project memory, a mixin of both stores (see rows.py; migration 0019): items saved per
project, searched by words, listed, forgotten, exported and imported.

Search splits the query into words (letters and digits, lower case, as both indexes split
text) and finds the project's items holding any of them, best first: SQLite ranks by FTS5's
bm25, PostgreSQL by ts_rank over a tsvector, so the order is the same wherever one item is
clearly the better match (more of the words, more often, in a shorter text) and may differ
between near ties. A project's items are found only by a search, a read or a forget that
names that project: another project's item answers as no item does.

On SQLite a project's items hold one range of ids (its slot's), which the index is asked
for alone, so a search reads only the project's entries; in a project past COMMON_AFTER
items a word that more than COMMON_SHARE of them hold is left out where rarer words remain
(counted by a probe that stops at that share), the SCORED_TERMS rarest rank, and at most the
newest CANDIDATES matches are ranked; a query of common words only gives the newest items
holding any of them, unranked: a search costs about the same in a full store as in an empty
one (bench/memory_bench.py).

A save is refused, not evicted around, once the project holds ``max_items``: the count and
the insert run under the project's lock, so two saves cannot both take the last place.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Protocol

from geodebot.store.records import MemoryHit, MemoryItem, StoreError
from geodebot.store.rows import Row, Transactions, Tx

__all__ = [
    "CANDIDATES",
    "MAX_TERMS",
    "DuplicateMemory",
    "Memory",
    "MemoryFull",
    "MemoryStore",
    "new_ref",
    "search_terms",
]

# A query's words beyond these are not searched for (a pasted page is no query).
MAX_TERMS = 16
_WORD = re.compile(r"\w+", re.UNICODE)
_COLS = (
    "m.id, m.ref, m.project, m.text, m.tags, m.session_id, m.turn_id, m.user_id, m.origin, "
    "m.forwarded, m.created_at"
)
_INSERT = """
INSERT INTO memory_items (id, ref, project, text, tags, session_id, turn_id, user_id, origin,
    forwarded, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (ref) DO NOTHING
RETURNING id
"""
# A project's items are the ids of its slot (see migration 0019).
SLOT_BITS = 32
_SLOT = "SELECT id, items FROM memory_projects WHERE project = ?"
_LAST_IN_SLOT = "SELECT MAX(id) FROM memory_items WHERE id BETWEEN ? AND ?"
# A search ranks at most this many matches, the newest: words that match more items than
# this say little of which is meant, and ranking every match would cost as much as reading
# the project.
CANDIDATES = 300
# Ranked in the index over the project's range of ids alone (its newest CANDIDATES
# matches), then the best few read.
_SEARCH_SQLITE = f"""
SELECT {_COLS}, f.score AS score
FROM (
    SELECT rowid, score FROM (
        SELECT rowid, -bm25(memory_fts) AS score FROM memory_fts
        WHERE memory_fts MATCH ? AND rowid BETWEEN ? AND ?
        ORDER BY rowid DESC LIMIT {CANDIDATES}
    ) ORDER BY score DESC, rowid DESC LIMIT ?
) f JOIN memory_items m ON m.id = f.rowid
WHERE m.project = ?
ORDER BY score DESC, m.id DESC
"""
# Every word of the query common: the newest items holding one, unranked. bm25 would count
# the word's items over the whole index first, which costs as much as reading them all.
_NEWEST_SQLITE = f"""
SELECT {_COLS}, 0.0 AS score
FROM (
    SELECT rowid FROM memory_fts
    WHERE memory_fts MATCH ? AND rowid BETWEEN ? AND ?
    ORDER BY rowid DESC LIMIT ?
) f JOIN memory_items m ON m.id = f.rowid
WHERE m.project = ?
ORDER BY m.id DESC
"""
_SEARCH_POSTGRES = f"""
SELECT {_COLS}, ts_rank(m.search, q) AS score
FROM memory_items m, to_tsquery('simple', ?) q
WHERE m.project = ? AND m.search @@ q
ORDER BY score DESC, m.id DESC LIMIT ?
"""
# Past this many items in a project, a word more than COMMON_SHARE of its items hold is left
# out of a search that has rarer words: it would rank nearly every item alike (bm25 gives it
# almost no weight) and cost reading all of them; of the rest the SCORED_TERMS rarest rank.
COMMON_AFTER = 1000
COMMON_SHARE = 0.05
SCORED_TERMS = 4


def _slot_range(slot: int) -> tuple[int, int]:
    return slot << SLOT_BITS, ((slot + 1) << SLOT_BITS) - 1


class MemoryFull(StoreError):
    """The project holds ``max_items`` already; nothing was saved."""


class DuplicateMemory(StoreError):
    """An item with this id is in the store already (an import of it twice)."""


def new_ref() -> str:
    return f"m-{secrets.token_hex(8)}"


def search_terms(query: str) -> list[str]:
    """The words a query is searched for, each once, in order, at most MAX_TERMS."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(query.lower()):
        seen.setdefault(word, None)
    return list(seen)[:MAX_TERMS]


def _item(row: Row) -> MemoryItem:
    return MemoryItem(
        ref=row["ref"],
        project=row["project"],
        text=row["text"],
        tags=tuple(row["tags"].split()) if row["tags"] else (),
        session_id=row["session_id"],
        turn_id=row["turn_id"],
        user=row["user_id"],
        origin=row["origin"],
        forwarded=bool(row["forwarded"]),
        created_at=float(row["created_at"]),
    )


def _fts_query(terms: Sequence[str]) -> str:
    """An FTS5 query: any of the words, in the text or the tags."""
    return " OR ".join(f'"{term}"' for term in terms)


_PROBE = (
    "SELECT COUNT(*) FROM (SELECT rowid FROM memory_fts WHERE memory_fts MATCH ? "
    "AND rowid BETWEEN ? AND ? LIMIT ?) probe"
)


async def _uncommon(
    db: Tx, terms: list[str], items: int, low: int, high: int
) -> tuple[list[str], bool]:
    """The terms worth searching a project of ``items`` items for (see COMMON_AFTER), each
    counted in the project's range up to the share that makes it common (so a probe reads
    at most that many entries), and whether to rank by them: not when all are common."""
    if items <= COMMON_AFTER:
        return terms, True
    most = int(COMMON_SHARE * items)
    held: dict[str, int] = {}
    for term in terms:
        row = await db.one(_PROBE, (f'"{term}"', low, high, most + 1))
        held[term] = int(row[0])
    kept = [t for t in terms if held[t] <= most]
    if not kept:
        return terms, False
    # The rarest few say what the query is about; each more is more items to rank.
    return sorted(kept, key=lambda t: held[t])[:SCORED_TERMS], True


class MemoryStore(Protocol):
    async def memory_save(self, item: MemoryItem, *, max_items: int) -> MemoryItem:
        """Save ``item`` (its ``ref`` new, see :func:`new_ref`). Raises MemoryFull when its
        project holds ``max_items``, DuplicateMemory when its ref is taken."""

    async def memory_search(self, project: str, query: str, *, limit: int) -> list[MemoryHit]:
        """The project's items holding any word of ``query``, best first."""

    async def memory_get(self, ref: str, *, project: str | None) -> MemoryItem | None:
        """The item, if it is ``project``'s (None: the operator's look, any project)."""

    async def memory_forget(self, ref: str, *, project: str | None) -> MemoryItem | None:
        """Delete the item, if it is ``project``'s (None: any); what was deleted."""

    async def memory_list(
        self, *, project: str | None, limit: int, before: str | None = None
    ) -> list[MemoryItem]:
        """Newest first; ``before``: only items saved before that one."""

    async def memory_projects(self) -> dict[str, int]:
        """Each project with items, and how many."""


class Memory:
    """The store's side of project memory."""

    async def memory_save(self: Transactions, item: MemoryItem, *, max_items: int) -> MemoryItem:
        params = (
            item.ref,
            item.project,
            item.text,
            " ".join(item.tags),
            item.session_id,
            item.turn_id,
            item.user,
            item.origin,
            int(item.forwarded),
            item.created_at,
        )
        what = f"saving memory item {item.ref} in project {item.project!r}"

        async def save(db: Tx) -> MemoryItem:
            await db.exclusive(f"memory:{item.project}")
            # Before the cap: a save run again (its id made from its call) that took the
            # project's last place is saved already, not refused as full.
            if await db.one("SELECT 1 FROM memory_items WHERE ref = ?", (item.ref,)):
                raise DuplicateMemory(f"memory item {item.ref} exists already")
            found = await db.one(_SLOT, (item.project,))
            if found is None:
                added = "INSERT INTO memory_projects (project, items) VALUES (?, 0) RETURNING id"
                found = {"id": (await db.one(added, (item.project,)))[0], "items": 0}
            slot, held = int(found["id"]), int(found["items"])
            if held >= max_items:
                raise MemoryFull(
                    f"project {item.project!r} holds {max_items} memory items, as many as "
                    "[memory] max_items allows; forget some first"
                )
            low, high = _slot_range(slot)
            last = (await db.one(_LAST_IN_SLOT, (low, high)))[0]
            if await db.one(_INSERT, (int(last or low) + 1, *params)) is None:
                raise DuplicateMemory(f"memory item {item.ref} exists already")
            await db.run("UPDATE memory_projects SET items = items + 1 WHERE id = ?", (slot,))
            return item

        result: MemoryItem = await self._write(what, save)
        return result

    async def memory_search(
        self: Transactions, project: str, query: str, *, limit: int
    ) -> list[MemoryHit]:
        terms = search_terms(query)
        if not terms or limit <= 0:
            return []
        postgres = self.dialect == "postgres"

        async def search(db: Tx) -> list[MemoryHit]:
            if postgres:
                match = " | ".join(f"'{t}'" for t in terms)
                rows = await db.all(_SEARCH_POSTGRES, (match, project, limit))
            else:
                found = await db.one(_SLOT, (project,))
                if found is None:
                    return []
                low, high = _slot_range(int(found["id"]))
                words, ranked = await _uncommon(db, terms, int(found["items"]), low, high)
                sql = _SEARCH_SQLITE if ranked else _NEWEST_SQLITE
                rows = await db.all(sql, (_fts_query(words), low, high, limit, project))
            return [MemoryHit(_item(row), float(row["score"])) for row in rows]

        hits: list[MemoryHit] = await self._read(f"searching memory of {project!r}", search)
        return hits

    async def memory_get(self: Transactions, ref: str, *, project: str | None) -> MemoryItem | None:
        sql, params = _one(ref, project)

        async def read(db: Tx) -> MemoryItem | None:
            row = await db.one(sql, params)
            return None if row is None else _item(row)

        found: MemoryItem | None = await self._read(f"reading memory item {ref}", read)
        return found

    async def memory_forget(
        self: Transactions, ref: str, *, project: str | None
    ) -> MemoryItem | None:
        sql, params = _one(ref, project)

        async def forget(db: Tx) -> MemoryItem | None:
            row = await db.one(sql, params, lock=True)
            if row is None:
                return None
            await db.run("DELETE FROM memory_items WHERE id = ?", (row["id"],))
            await db.run(
                "UPDATE memory_projects SET items = items - 1 WHERE project = ?", (row["project"],)
            )
            return _item(row)

        gone: MemoryItem | None = await self._write(f"forgetting memory item {ref}", forget)
        return gone

    async def memory_list(
        self: Transactions, *, project: str | None, limit: int, before: str | None = None
    ) -> list[MemoryItem]:
        where, params = [], []
        if project is not None:
            where.append("m.project = ?")
            params.append(project)
        if before is not None:
            where.append("m.id < (SELECT id FROM memory_items WHERE ref = ?)")
            params.append(before)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        sql = f"SELECT {_COLS} FROM memory_items m {clause}ORDER BY m.id DESC LIMIT ?"

        async def read(db: Tx) -> list[MemoryItem]:
            return [_item(row) for row in await db.all(sql, (*params, limit))]

        items: list[MemoryItem] = await self._read("listing memory items", read)
        return items

    async def memory_projects(self: Transactions) -> dict[str, int]:
        sql = "SELECT project, items FROM memory_projects WHERE items > 0 ORDER BY project"

        async def read(db: Tx) -> dict[str, int]:
            return {str(r[0]): int(r[1]) for r in await db.tuples(sql)}

        counts: dict[str, int] = await self._read("counting memory items", read)
        return counts


def _one(ref: str, project: str | None) -> tuple[str, tuple[str, ...]]:
    sql = f"SELECT {_COLS} FROM memory_items m WHERE m.ref = ?"
    if project is None:
        return sql, (ref,)
    return sql + " AND m.project = ?", (ref, project)
