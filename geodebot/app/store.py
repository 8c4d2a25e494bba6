"""The store the configuration names, and this process's name among the replicas.

The composition root and every CLI command that reads or changes the durable state open it
here: SQLite in the state directory, or, with ``[store] url``, the PostgreSQL database there.
Everything above store/ then knows only the :class:`Store` protocol. The PostgreSQL store
(and with it psycopg) is imported only when a URL is set: a daemon on SQLite never loads it.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from geodebot.config.schema import Config, resolve_secret
from geodebot.store.protocol import Store
from geodebot.store.records import StoreError
from geodebot.store.sqlite import SQLiteStore

__all__ = [
    "default_replica_id",
    "make_store",
    "opened_store",
    "replica_id",
    "store_facts",
    "store_place",
]

_REPLICA_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_REPLICA_MAX = 64
_PG_DEFAULT_PORT = 5432


def default_replica_id() -> str:
    """``<hostname>-<pid>``: differs between two processes of one machine and one config
    file, so it is made when a process starts, never when the config is read. Characters
    a replica id may not hold become ``-``; a long host name is cut to fit 64 characters."""
    pid = str(os.getpid())
    host = _REPLICA_CHARS.sub("-", socket.gethostname()).strip("-") or "host"
    return f"{host[: _REPLICA_MAX - len(pid) - 1]}-{pid}"


def replica_id(config: Config) -> str:
    """``[daemon] replica_id``, else :func:`default_replica_id`."""
    return config.daemon.replica_id or default_replica_id()


def _pg_parts(url: str) -> dict[str, Any]:
    """Host, port, database and user of a ``postgresql://`` URL (as libpq reads it: query
    parameters count where the URL's own parts are empty), never its password."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    user = unquote(parts.username) if parts.username else query.get("user")
    port: Any = parts.port or query.get("port") or _PG_DEFAULT_PORT
    with contextlib.suppress(ValueError):  # a list of ports (several hosts): as written
        port = int(port)
    # Several hosts (host1,host2:5433) are kept as written; urlsplit reads only the last.
    hosts = parts.netloc.rpartition("@")[2]
    host = unquote(parts.hostname or "") if "," not in hosts else hosts
    return {
        "host": host or query.get("host") or "(local socket)",
        "port": port,
        "dbname": unquote(parts.path.lstrip("/")) or query.get("dbname") or user or "",
        "user": user,
    }


def store_facts(config: Config) -> dict[str, Any]:
    """Which store the config names, for status pages: ``{"kind": "sqlite", "path": ...}``
    or ``{"kind": "postgresql", "host": ..., "port": ..., "dbname": ...}``; no password."""
    if config.store.url is None:
        return {"kind": "sqlite", "path": str(config.db_path)}
    parts = _pg_parts(config.store.url)
    return {
        "kind": "postgresql",
        "host": parts["host"],
        "port": parts["port"],
        "dbname": parts["dbname"],
    }


def store_place(config: Config) -> str:
    """The store in one line, for messages: a path, or ``postgresql://user@host:port/db``."""
    if config.store.url is None:
        return str(config.db_path)
    parts = _pg_parts(config.store.url)
    user = f"{parts['user']}@" if parts["user"] else ""
    return f"postgresql://{user}{parts['host']}:{parts['port']}/{parts['dbname']}"


def _password(config: Config) -> str | None:
    """The database password from ``[store] password_env``, checked as the model's key is:
    named in the config, missing from the environment and from systemd's credentials, it is
    an error that names the variable when the store is opened."""
    name = config.store.password_env
    if name is None:
        return None
    value = resolve_secret(name)
    if value is None:
        raise StoreError(
            f"opening store {store_place(config)!r} failed: no database password: set the "
            f"environment variable {name} (or the systemd credential {name})"
        )
    return value


def make_store(config: Config) -> Store:
    """The store the config names, not opened yet (opening applies pending migrations)."""
    if config.store.url is None:
        return SQLiteStore(config.db_path)
    from geodebot.store.postgres import PostgresStore

    # A transaction left idle for as long as the daemon's lease lasts belongs to a replica
    # that stopped in its middle (paused, frozen): the server ends it, so that the row locks
    # it holds (the lease's own, taken by every write's fencing check) do not keep another
    # replica from taking over.
    return PostgresStore(
        config.store.url,
        password=_password(config),
        idle_transaction_timeout_s=config.store.lease_ttl_s,
    )


@asynccontextmanager
async def opened_store(config: Config, *, create: bool = False) -> AsyncIterator[Store]:
    """The configured store, open for a CLI command, closed after.

    Without ``create``, a store that is not there is an error that says so: no SQLite file
    (the daemon never ran with this config), or a PostgreSQL server that cannot be reached
    (its message says why: refused, no such database, password).
    """
    if config.store.url is None and not create and not config.db_path.exists():
        raise StoreError(
            f"no geodebot state at {config.db_path} (has the daemon run with this config?)"
        )
    if config.store.url is None:
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = make_store(config)
    try:
        await store.open()
    except StoreError as exc:
        if config.store.url is not None and _unreachable(exc):
            # libpq's reasons run over several lines; a command's error is one.
            flat = " ".join(str(exc).split())
            raise StoreError(f"{flat} (the database of [store] url could not be reached)") from exc
        raise
    try:
        yield store
    finally:
        await store.close()


def _unreachable(exc: StoreError) -> bool:
    """The store's database could not be connected to at all."""
    import psycopg

    return isinstance(exc.__cause__, psycopg.OperationalError)
