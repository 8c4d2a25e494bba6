"""The schema's migrations, which both stores apply: ``migrations/NNNN_name.sql``, in version
order, each once and in its own transaction; a database whose version is newer than the
newest file is refused (it was migrated by a newer geodebot)."""

from __future__ import annotations

import re
import sqlite3
from importlib import resources
from importlib.resources.abc import Traversable

from geodebot.store.records import StoreError

__all__ = ["for_backend", "load_migrations", "refuse_newer", "split_statements"]

_MIGRATION_NAME = re.compile(r"^(\d{4})_\w+\.sql$")
_BACKEND_LINE = re.compile(r"^--\s*backend:\s*(sqlite|postgres|all)\s*$")


def for_backend(script: str, backend: str) -> str:
    """The migration as ``backend`` runs it: a line ``-- backend: sqlite`` (or ``postgres``)
    starts statements only that store runs, ``-- backend: all`` ends them. Where the two
    differ by more than their types (a search index), each gets its own statements."""
    kept: list[str] = []
    current = "all"
    for line in script.splitlines(keepends=True):
        marker = _BACKEND_LINE.match(line.strip())
        if marker is not None:
            current = marker.group(1)
            continue
        if current in ("all", backend):
            kept.append(line)
    return "".join(kept)


def split_statements(script: str) -> list[str]:
    """Split a migration script into statements.

    Statements are cut at line ends where SQLite considers the text complete, which keeps
    trigger bodies (``BEGIN ... END;``) whole. Migrations run statement by statement, not via
    ``executescript``, because that commits the migration's surrounding transaction.
    """
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        # Trailing comments are harmless; a truncated statement makes SQLite report an error.
        statements.append(buffer.strip())
    return statements


def load_migrations(root: Traversable | None = None) -> list[tuple[int, str, str]]:
    """``(version, file name, sql)`` of every ``NNNN_name.sql`` migration, in version order.

    Adding a migration is adding the next-numbered file to ``migrations/``; ``open()`` applies
    it once, in its own transaction. A statement may span lines but must end at a line end.
    """
    directory = root if root is not None else resources.files("geodebot.store") / "migrations"
    found: dict[int, tuple[int, str, str]] = {}
    for entry in directory.iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match is None:
            continue
        version = int(match.group(1))
        if version in found:
            raise StoreError(f"two migrations share version {version}: {entry.name}")
        found[version] = (version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[version] for version in sorted(found)]


def refuse_newer(current: int, migrations: list[tuple[int, str, str]], where: str) -> None:
    """Raise unless ``current`` is a version ``migrations`` know: a newer geodebot migrated the
    database, and this one would misread or damage what it added."""
    known = migrations[-1][0] if migrations else 0
    if current > known:
        raise StoreError(
            f"opening store {where} failed: its schema is at version {current}, newer than "
            f"the {known} this geodebot knows; run the newer geodebot (or upgrade this one)"
        )
