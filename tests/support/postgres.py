"""A throwaway PostgreSQL cluster for the store tests, and the stores the tests run against.

Debian's ``postgresql`` package brings the server (``.ci/run`` installs it); its binaries are
found in the newest ``/usr/lib/postgresql/*/bin`` or on PATH, and a missing server FAILS the
tests that want it, naming the package: they never skip.

One cluster per test process (``make test`` runs two at once, each with its own), started
the first time a test asks for it: ``initdb`` in a temporary directory, a server on a free
port of 127.0.0.1 only, without fsync, stopped and removed at the end. As root (initdb refuses
root) the server runs as the ``postgres`` user. Each test gets a database of its own.

Fixtures (registered for every test by tests/conftest.py):

- ``postgres_cluster``: the process's cluster (:class:`Cluster`).
- ``place``: where a test's store lives, once per kind of store (``sqlite``, ``postgres``):
  a fresh database file or database (:class:`Place`). Parametrising a test file's ``store``
  fixture on it runs the file against both stores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import itertools
import os
import pathlib
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest

from geodebot.store import sqlite as sqlite_module
from geodebot.store.protocol import Store
from geodebot.store.sqlite import SQLiteStore
from tests.support.ports import free_port

PACKAGE = "postgresql"
USER = "geodebot"
KINDS = ("sqlite", "postgres")
TEMPLATE = "geodebot_migrated"


def binaries() -> pathlib.Path:
    """The directory of ``initdb`` and ``pg_ctl``: the newest Debian version, else PATH."""
    versions = []
    for found in glob.glob("/usr/lib/postgresql/*/bin"):
        name = pathlib.Path(found).parent.name
        if name.isdigit() and (pathlib.Path(found) / "initdb").exists():
            versions.append((int(name), pathlib.Path(found)))
    if versions:
        return max(versions)[1]
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return pathlib.Path(initdb).resolve().parent
    pytest.fail(
        f"PostgreSQL's server is not installed (no initdb in /usr/lib/postgresql/*/bin or on "
        f"PATH): install Debian's {PACKAGE!r} package (apt-get install {PACKAGE}); .ci/run does"
    )


class Cluster:
    """A PostgreSQL server of this test process, in a directory of its own."""

    def __init__(self) -> None:
        self.bin = binaries()
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="geodebot-pg-"))
        self.data = self.root / "data"
        self.port = 0
        self._as_postgres = os.geteuid() == 0
        self._numbers = itertools.count(1)
        self._migrated = False
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")

    def _run(self, *argv: str) -> None:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stdout}{done.stderr}")

    def start(self, *, durable: bool = False) -> None:
        """Start the server. Tests need no power-cut safety: without ``durable`` (a benchmark's
        server, which must pay what a real one does) nothing is synced to disk."""
        self._run("initdb", "-D", str(self.data), "-U", USER, "-A", "trust", "--no-sync")
        options = f"-p {{port}} -k {self.root} -c listen_addresses=127.0.0.1"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        for attempt in range(3):  # the free port may be taken before the server binds it
            self.port = free_port()
            try:
                self._run(
                    "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w",
                    "-o", options.format(port=self.port), "start",
                )  # fmt: skip
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, *, migrated: bool = False) -> str:
        """A fresh database's URL: empty, or ``migrated`` (a copy of a database the store
        migrated once, which saves each test the migrations' dozen transactions)."""
        import psycopg

        template = ""
        if migrated:
            if not self._migrated:
                self._migrate_template()
            template = f" TEMPLATE {TEMPLATE}"
        name = f"t_{next(self._numbers)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}{template}")  # type: ignore[arg-type]
        return self.url(name)

    def _migrate_template(self) -> None:
        import psycopg

        from geodebot.store.postgres import PostgresStore

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")  # type: ignore[arg-type]

        async def migrate() -> None:
            async with PostgresStore(self.url(TEMPLATE)):
                pass

        # On a thread of its own: a test's event loop may be running on this one.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, migrate()).result()
        self._migrated = True


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Place:
    """Where one test's store lives: a SQLite file or a PostgreSQL database; opened as often
    as the test likes, and inspected behind the store's back."""

    def __init__(
        self, kind: str, *, path: pathlib.Path, url: str = "", cluster: Cluster | None = None
    ) -> None:
        self.kind = kind
        self.path = path
        self._url = url
        self._cluster = cluster
        self._migrated = True

    def unmigrated(self) -> Place:
        """Start from an empty database (before anything opened it), for the migrations'
        own tests: by default a PostgreSQL place starts migrated, as a SQLite file that the
        first open migrates ends the same."""
        assert not self._url, "the database exists already"
        self._migrated = False
        return self

    @property
    def url(self) -> str:
        if not self._url and self._cluster is not None:
            self._url = self._cluster.new_database(migrated=self._migrated)
        return self._url

    def __repr__(self) -> str:
        return f"Place({self.kind})"

    def store(self, **options: Any) -> Store:
        """A new, unopened store on this place. ``synchronous`` only means something to
        SQLite (default NORMAL here, as tests need no power-cut safety)."""
        synchronous = options.pop("synchronous", "NORMAL")
        if self.kind == "sqlite":
            return SQLiteStore(self.path, synchronous=synchronous, **options)
        from geodebot.store.postgres import PostgresStore

        return PostgresStore(self.url, **options)

    @property
    def module(self) -> ModuleType:
        """The module of the store's class: what a test patches to change what it migrates
        (``load_migrations``)."""
        if self.kind == "sqlite":
            return sqlite_module
        from geodebot.store import postgres

        return postgres

    def opening(self) -> str:
        """Python source that makes ``store`` a new, unopened store on this place: for a
        child process."""
        if self.kind == "sqlite":
            made = f"SQLiteStore({str(self.path)!r})"
            return f"from geodebot.store.sqlite import SQLiteStore\nstore = {made}"
        made = f"PostgresStore({self.url!r})"
        return f"from geodebot.store.postgres import PostgresStore\nstore = {made}"

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """What a plain second connection reads: only what the store actually committed.
        ``?`` placeholders."""
        if self.kind == "sqlite":
            with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as conn:
                return conn.execute(sql, params).fetchall()
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description is not None else []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.rows(sql, params)

    def names(self) -> set[str]:
        """The names of the schema's tables and indexes."""
        if self.kind == "sqlite":
            return {row[0] for row in self.rows("SELECT name FROM sqlite_master")}
        return {
            row[0]
            for row in self.rows(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "UNION SELECT indexname FROM pg_indexes WHERE schemaname = 'public'"
            )
        }

    @property
    def integrity_error(self) -> tuple[type[Exception], ...]:
        """What a plain connection raises when a write breaks a constraint."""
        if self.kind == "sqlite":
            return (sqlite3.IntegrityError,)
        import psycopg

        return (psycopg.errors.IntegrityError,)

    def fail(self, table: str, message: str = "disk full", *, on: str = "INSERT") -> None:
        """Make every ``on`` (INSERT, UPDATE) of ``table`` fail with ``message`` until
        :meth:`heal`, as a full disk would make it fail."""
        trigger = f"fail_{on.lower()}_{table}"
        if self.kind == "sqlite":
            self.execute(
                f"CREATE TRIGGER {trigger} BEFORE {on} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
            return
        self.execute(
            f"CREATE FUNCTION {trigger}() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{message}'; END $$"
        )
        self.execute(
            f"CREATE TRIGGER {trigger} BEFORE {on} ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
        )

    def heal(self, table: str, *, on: str = "INSERT") -> None:
        trigger = f"fail_{on.lower()}_{table}"
        if self.kind == "sqlite":
            self.execute(f"DROP TRIGGER {trigger}")
            return
        self.execute(f"DROP TRIGGER {trigger} ON {table}")
        self.execute(f"DROP FUNCTION {trigger}()")


@pytest.fixture(params=KINDS)
def place(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Place:
    path = tmp_path / "store" / "geodebot.db"
    if request.param == "sqlite":
        return Place("sqlite", path=path)
    cluster: Cluster = request.getfixturevalue("postgres_cluster")
    return Place("postgres", path=path, cluster=cluster)


def inbox_by_pickup(url: str, platform: str) -> dict[tuple[str | None, str], int]:
    """A platform's inbox rows in the database at ``url``, counted by (the standing-by
    replica that received it, or None, and status)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pickup, status, COUNT(*) FROM inbox WHERE platform = %s "
            "GROUP BY pickup, status",
            (platform,),
        ).fetchall()
    return {(r[0], r[1]): r[2] for r in rows}


async def waiting_for_a_lock(url: str) -> None:
    """Return once some session of the database at ``url`` waits for a lock."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for _ in range(1000):
            cursor = await conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("nothing waited for a lock")
