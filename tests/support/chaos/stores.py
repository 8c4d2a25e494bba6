"""The chaos run's look into the store behind the daemons' back: the SQLite file of one daemon,
or the PostgreSQL database replicas share. Plain connections, so only what was committed is
seen; the same queries for both (``?`` placeholders), and each store's own integrity checks.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import psycopg

Row = tuple[Any, ...]

# The drain waits for these to reach zero: messages not yet answered, replies not yet sent.
_BUSY = (
    "SELECT (SELECT count(*) FROM inbox WHERE status IN ('pending', 'running'))"
    " + (SELECT count(*) FROM outbox WHERE status = 'pending')"
)
_DISCORD_SEEN = "SELECT event_id FROM inbox WHERE platform = 'discord'"


class ChaosStore(Protocol):
    kind: str

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def integrity(self) -> tuple[dict[str, Any], list[str]]:
        """(counts to print, problems found)."""
        ...


def drain_state(store: ChaosStore) -> tuple[int, set[str]]:
    """(inbox rows unanswered + outbox rows unsent, Discord event ids in the inbox)."""
    busy = store.rows(_BUSY)[0][0]
    return int(busy), {str(r[0]) for r in store.rows(_DISCORD_SEEN)}


class SQLiteFile:
    kind = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        uri = f"file:{self.path}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10)) as conn:
            return conn.execute(sql, params).fetchall()

    def integrity(self) -> tuple[dict[str, Any], list[str]]:
        integrity = [str(r[0]) for r in self.rows("PRAGMA integrity_check")]
        foreign = self.rows("PRAGMA foreign_key_check")
        counts = {
            "PRAGMA integrity_check": ",".join(integrity),
            "PRAGMA foreign_key_check rows": len(foreign),
        }
        problems = []
        if integrity != ["ok"]:
            problems.append(f"integrity_check: {integrity[:5]}")
        if foreign:
            problems.append(f"foreign_key_check: {foreign[:5]}")
        return counts, problems


# Every foreign key of the schema: (table, columns, referenced table, referenced columns).
_FOREIGN_KEYS = """
SELECT c.conrelid::regclass::text, c.confrelid::regclass::text,
  ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY AS k(n, o)
        JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.o),
  ARRAY(SELECT a.attname FROM unnest(c.confkey) WITH ORDINALITY AS k(n, o)
        JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.o)
FROM pg_constraint c
WHERE c.contype = 'f' AND c.connamespace = 'public'::regnamespace
"""
_BTREE_INDEXES = """
SELECT c.oid, c.relname FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_am am ON am.oid = c.relam
WHERE am.amname = 'btree' AND c.relnamespace = 'public'::regnamespace
ORDER BY c.relname
"""


class PostgresDatabase:
    kind = "postgres"

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description is not None else []

    def integrity(self) -> tuple[dict[str, Any], list[str]]:
        """amcheck on every B-tree index (with every heap tuple looked up in it), and rows
        whose foreign key points at nothing: what PostgreSQL should never let happen."""
        problems: list[str] = []
        checked = 0
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
            for oid, name in conn.execute(_BTREE_INDEXES).fetchall():
                try:
                    conn.execute("SELECT bt_index_check(%s, true)", (oid,))
                except psycopg.Error as exc:
                    problems.append(f"amcheck {name}: {exc}")
                checked += 1
            orphans = 0
            for table, parent, columns, referenced in conn.execute(_FOREIGN_KEYS).fetchall():
                orphans += _orphans(conn, table, parent, columns, referenced, problems)
        counts = {
            "amcheck B-tree indexes checked / failed": f"{checked} / {len(problems)}",
            "rows whose foreign key points at nothing": orphans,
        }
        return counts, problems


def _orphans(
    conn: psycopg.Connection[Row],
    table: str,
    parent: str,
    columns: list[str],
    referenced: list[str],
    problems: list[str],
) -> int:
    present = " AND ".join(f'c."{col}" IS NOT NULL' for col in columns)
    match = " AND ".join(f'p."{r}" = c."{col}"' for col, r in zip(columns, referenced, strict=True))
    sql = (
        f"SELECT count(*) FROM {table} c WHERE {present}"
        f" AND NOT EXISTS (SELECT 1 FROM {parent} p WHERE {match})"
    )
    row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
    n = int(row[0]) if row else 0
    if n:
        problems.append(f"{n} rows of {table} ({', '.join(columns)}) point at nothing in {parent}")
    return n
