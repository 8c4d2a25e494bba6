"""Row and payload helpers shared by the SQLite store modules."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from geodebot.store.records import StoreError

__all__ = [
    "ENSURE_SESSION",
    "INSERT_EVENT",
    "Transactions",
    "dumps",
    "dumps_list",
    "encoding",
    "from_row",
    "paged",
]

_R = TypeVar("_R")

_JSON_COLUMNS = frozenset(
    {
        "state",
        "guards",
        "content",
        "calls",
        "results",
        "data",
        "outcome",
        "approvers",
        "card",
    }
)

INSERT_EVENT = "INSERT INTO timeline (session_id, turn_id, ts, kind, data) VALUES (?, ?, ?, ?, ?)"
# (id, mode, created_at, updated_at): a fresh session, unless it exists.
ENSURE_SESSION = (
    "INSERT INTO sessions (id, mode, created_at, updated_at, generation, state, guards, "
    "next_seq) VALUES (?, ?, ?, ?, 1, '{}', '{}', 1) ON CONFLICT (id) DO NOTHING"
)


class Transactions(Protocol):
    """What the store's mixins need from it: one-hop reads and atomic writes.

    ``fn`` runs on the store's connection thread; a write's ``fn`` runs inside one
    transaction that a raised exception rolls back.
    """

    async def _query(self, what: str, fn: Callable[[sqlite3.Connection], _R]) -> _R: ...

    async def _transact(
        self, what: str, fn: Callable[[sqlite3.Connection], _R], *, durable: bool = False
    ) -> _R: ...


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def dumps_list(items: Sequence[Mapping[str, Any]]) -> str:
    return dumps([dict(item) for item in items])


def from_row(cls: Callable[..., _R], row: sqlite3.Row) -> _R:
    """Build a record from a row whose column names are the record's field names."""
    names = row.keys()  # iterating a Row yields values, not names
    return cls(**{k: json.loads(row[k]) if k in _JSON_COLUMNS else row[k] for k in names})


@contextlib.contextmanager
def encoding(what: str) -> Iterator[None]:
    # Payloads are encoded before the transaction starts, so a bad one writes nothing.
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise StoreError(f"{what} failed: payload is not JSON-serialisable: {exc}") from exc


def paged(sql: str, params: dict[str, Any], limit: int | None) -> tuple[str, dict[str, Any]]:
    if limit is None:
        return sql, params
    if limit < 0:
        raise ValueError("limit must not be negative")
    return f"{sql} LIMIT :limit", {**params, "limit": limit}
