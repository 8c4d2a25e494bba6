"""The Memory page: each project with its item count, and one project's items, newest first
or as the store's search ranks them, with the same forget as ``geodebot memory forget`` (the
store's ``memory_forget`` and its ``memory_forgotten`` ledger row).

Item text was written in chats: the template shows it as text, whole, never as markup."""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.ops.console.parts import ConsoleParts
from geodebot.store.records import MemoryItem

__all__ = ["FOUND", "LISTED", "ItemLine", "MemoryView", "memory_view"]

# A project's items on one page, newest first; older ones a link away.
LISTED = 50
# A search's best matches shown.
FOUND = 20


@dataclass(frozen=True, slots=True)
class ItemLine:
    item: MemoryItem
    # The search's rank (higher is better, within that search); None in the listing.
    score: float | None = None


@dataclass(frozen=True, slots=True)
class MemoryView:
    enabled: bool
    # Each project with items, and how many (as ``geodebot memory projects``).
    projects: dict[str, int]
    # The project shown, if one was chosen, and the search asked of it ("" for none).
    project: str | None
    query: str
    lines: list[ItemLine]
    # The item the listing went below (``before``), and the last one shown when older ones
    # remain: the next page's ``before``.
    before: str | None
    older: str | None


async def memory_view(
    parts: ConsoleParts, project: str | None, query: str = "", before: str | None = None
) -> MemoryView:
    store = parts.store
    projects = await store.memory_projects()
    lines: list[ItemLine] = []
    older = None
    query = query.strip()
    if project is not None and query:
        hits = await store.memory_search(project, query, limit=FOUND)
        lines = [ItemLine(hit.item, hit.score) for hit in hits]
        before = None
    elif project is not None:
        # One more than shown says whether an older page exists.
        items = await store.memory_list(project=project, limit=LISTED + 1, before=before)
        if len(items) > LISTED:
            items = items[:LISTED]
            older = items[-1].ref
        lines = [ItemLine(item) for item in items]
    return MemoryView(
        enabled=parts.config.memory.enabled,
        projects=projects,
        project=project,
        query=query if project is not None else "",
        lines=lines,
        before=before if project is not None else None,
        older=older,
    )
