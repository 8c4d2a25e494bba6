"""What the store's SQL runs on, whichever database holds it, and the row and payload helpers
the store modules share.

Each store method's work is written once, as an ``async`` function of a :class:`Tx`: the SQL
in it is portable (SQLite's ``?`` and ``:name`` placeholders; the PostgreSQL store rewrites
them), and the two stores run it. SQLite's statements never wait for the event loop, so the
SQLite store runs such a function to its end in one step on its own connection (:func:`drive`),
inside its group commit; the PostgreSQL store awaits it on a pooled connection.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from geodebot.store.records import StoreError

__all__ = [
    "ENSURE_SESSION",
    "INSERT_EVENT",
    "Body",
    "Params",
    "Row",
    "Transactions",
    "Tx",
    "drive",
    "dumps",
    "dumps_list",
    "encoding",
    "from_row",
    "paged",
]

_R = TypeVar("_R")

Params = Sequence[Any] | Mapping[str, Any]

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


class Row(Protocol):
    """A result row: its values by position or by column name, and the names."""

    def __getitem__(self, key: int | str, /) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...

    def keys(self) -> list[str]: ...


class Tx(Protocol):
    """One connection, inside a write's transaction or (for a read) outside any.

    ``lock``: the rows the SELECT reads stay locked to this write transaction until it ends,
    so a second writer deciding on the same rows waits and then sees this one's outcome
    (``SELECT ... FOR UPDATE`` on PostgreSQL; on SQLite a write transaction holds the whole
    database already). Every check-then-change of a row takes its lock this way.

    ``skip_locked`` (with ``lock``): rows another transaction has locked are left out rather
    than waited for (``FOR UPDATE SKIP LOCKED``): for claims several processes make over the
    same rows at once, where a row another claimer holds is simply not this one's to take.
    SQLite has one writer at a time, so nothing there is ever skipped.
    """

    async def one(
        self, sql: str, params: Params = (), *, lock: bool = False, share: bool = False
    ) -> Any:
        """The first row (a :class:`Row`), or None. ``share``: the rows read cannot change
        until the write transaction ends, but other transactions may read them so too
        (``FOR SHARE`` on PostgreSQL)."""

    async def all(
        self, sql: str, params: Params = (), *, lock: bool = False, skip_locked: bool = False
    ) -> list[Row]: ...

    async def tuples(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        """Rows as plain tuples in column order: cheaper where many rows are read."""

    async def run(self, sql: str, params: Params = ()) -> int:
        """A statement whose rows, if any, are not needed; the number of rows it changed."""

    async def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    async def exclusive(self, key: str) -> None:
        """Hold the lock named ``key`` until the write transaction ends: for a decision that
        depends on rows that may not exist yet (a count, a budget), where no row can be
        locked. Two writers naming the same key run one after the other."""

    async def now(self) -> float:
        """The database's clock, in seconds since the epoch: what every replica of one
        database agrees on (see leases.py)."""


Body = Callable[[Tx], Coroutine[Any, Any, _R]]


class Transactions(Protocol):
    """What the store's mixins need from it: reads, and atomic writes.

    A write's ``body`` runs inside one transaction that a raised exception rolls back; a
    read's runs outside any (each statement sees what was committed when it started).
    ``durable``: something outside acts on the commit next (see ``SQLiteStore._transact``).
    """

    # "sqlite" or "postgres": for the few statements the two cannot share (a search).
    dialect: str

    async def _read(self, what: str, body: Body[_R]) -> _R: ...

    async def _write(
        self, what: str, body: Body[_R], *, durable: bool = False, fenced: bool = True
    ) -> _R:
        """``fenced``: refused (:class:`~geodebot.store.records.Fenced`) when the store writes
        under a lease that is no longer its own (see leases.py); only the leases' own writes
        are not."""


def drive(work: Coroutine[Any, Any, _R]) -> _R:
    """Run ``work`` to its end in one step: a body on a connection whose statements never wait
    for the event loop (SQLite's)."""
    try:
        work.send(None)
    except StopIteration as done:
        result: _R = done.value
        return result
    work.close()
    raise RuntimeError("a store body waited for the event loop inside a SQLite transaction")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def dumps_list(items: Sequence[Mapping[str, Any]]) -> str:
    return dumps([dict(item) for item in items])


def from_row(cls: Callable[..., _R], row: Row) -> _R:
    """Build a record from a row whose column names are the record's field names."""
    names = row.keys()  # iterating a row yields values, not names
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
