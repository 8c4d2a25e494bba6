"""Project memory, a mixin of both stores (see rows.py; migration 0019): items saved per
project, searched by words, listed, forgotten, exported and imported.

Search splits the query into words (letters and digits, lower case, as both indexes split
text) and finds the project's items holding any of them, best first: SQLite ranks by FTS5's
bm25, PostgreSQL by ts_rank over a tsvector, so the order is the same wherever one item is
clearly the better match (more of the words, more often, in a shorter text) and may differ
between near ties. A project's items are found only by a search, a read or a forget that
names that project: another project's item answers as no item does.

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
INSERT INTO memory_items (ref, project, text, tags, session_id, turn_id, user_id, origin,
    forwarded, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (ref) DO NOTHING
RETURNING id
"""
_SEARCH_SQLITE = f"""
SELECT {_COLS}, -bm25(memory_fts) AS score
FROM memory_fts JOIN memory_items m ON m.id = memory_fts.rowid
WHERE memory_fts MATCH ? AND m.project = ?
ORDER BY score DESC, m.id DESC LIMIT ?
"""
_SEARCH_POSTGRES = f"""
SELECT {_COLS}, ts_rank(m.search, q) AS score
FROM memory_items m, to_tsquery('simple', ?) q
WHERE m.project = ? AND m.search @@ q
ORDER BY score DESC, m.id DESC LIMIT ?
"""


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


def _fts_query(project: str, terms: Sequence[str]) -> str:
    """An FTS5 query: any of the words, in the text or tags, of this project (the project
    column narrows the match in the index; the join's equality decides)."""
    words = " OR ".join(f'"{term}"' for term in terms)
    place = " ".join(f'"{w}"' for w in _WORD.findall(project.lower())) or '""'
    return f"project : ({place}) AND {{text tags}} : ({words})"


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
            row = await db.one(
                "SELECT COUNT(*) FROM memory_items WHERE project = ?", (item.project,)
            )
            if int(row[0]) >= max_items:
                raise MemoryFull(
                    f"project {item.project!r} holds {max_items} memory items, as many as "
                    "[memory] max_items allows; forget some first"
                )
            if await db.one(_INSERT, params) is None:
                raise DuplicateMemory(f"memory item {item.ref} exists already")
            return item

        result: MemoryItem = await self._write(what, save)
        return result

    async def memory_search(
        self: Transactions, project: str, query: str, *, limit: int
    ) -> list[MemoryHit]:
        terms = search_terms(query)
        if not terms or limit <= 0:
            return []
        if self.dialect == "postgres":
            sql, match = _SEARCH_POSTGRES, " | ".join(f"'{t}'" for t in terms)
        else:
            sql, match = _SEARCH_SQLITE, _fts_query(project, terms)

        async def search(db: Tx) -> list[MemoryHit]:
            rows = await db.all(sql, (match, project, limit))
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
        sql = "SELECT project, COUNT(*) FROM memory_items GROUP BY project ORDER BY project"

        async def read(db: Tx) -> dict[str, int]:
            return {str(r[0]): int(r[1]) for r in await db.tuples(sql)}

        counts: dict[str, int] = await self._read("counting memory items", read)
        return counts


def _one(ref: str, project: str | None) -> tuple[str, tuple[str, ...]]:
    sql = f"SELECT {_COLS} FROM memory_items m WHERE m.ref = ?"
    if project is None:
        return sql, (ref,)
    return sql + " AND m.project = ?", (ref, project)
