"""``geodebot store migrate`` and the store-reading commands as a user runs them: a
subprocess, on SQLite and on a database of the PostgreSQL test cluster."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg

from geodebot.store.schema import load_migrations
from tests.support.cli import geodebot, write_config
from tests.support.ports import free_port
from tests.support.postgres import Cluster

NEWEST = load_migrations()[-1][0]


def pg_config(tmp_path: Path, url: str) -> Path:
    return write_config(tmp_path, f'[store]\nurl = "{url}"\n')


async def migrate(config: Path) -> tuple[int, str, str]:
    return await geodebot("store", "migrate", "--config", str(config))


async def test_migrate_an_empty_postgresql_database_then_nothing_is_pending(
    tmp_path: Path, postgres_cluster: Cluster
) -> None:
    url = postgres_cluster.new_database()
    config = pg_config(tmp_path, url)
    place = url.removeprefix("postgresql://")
    code, out, err = await migrate(config)
    assert (code, err) == (0, "")
    assert out == (
        f"store postgresql://{place}: schema version 0 -> {NEWEST} "
        f"({len(load_migrations())} migrations applied)\n"
    )
    code, out, err = await migrate(config)
    assert (code, err) == (0, "")
    assert out == f"store postgresql://{place}: schema version {NEWEST}; nothing pending\n"
    # The commands that read the store work on it, daemon or not.
    for command, printed in (
        (("jobs", "list"), "JOB"),
        (("usage",), "no model calls"),
        (("deadletters", "list"), "no dead letters"),
    ):
        code, out, err = await geodebot(*command, "--config", str(config))
        assert (code, err) == (0, ""), command
        assert out.startswith(printed), (command, out)
    assert not (tmp_path / "var" / "geodebot.db").exists()


async def test_a_database_newer_than_the_code_is_refused(
    tmp_path: Path, postgres_cluster: Cluster
) -> None:
    url = postgres_cluster.new_database(migrated=True)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (9999, 0)")
    code, out, err = await migrate(pg_config(tmp_path, url))
    assert (code, out) == (1, "")
    assert f"its schema is at version 9999, newer than the {NEWEST} this geodebot knows" in err
    assert "Traceback" not in err


async def test_an_unreachable_server_is_named_with_what_to_check(tmp_path: Path) -> None:
    config = pg_config(tmp_path, f"postgresql://geodebot@127.0.0.1:{free_port()}/geodebot")
    for command in (("store", "migrate"), ("jobs", "list"), ("usage",), ("deadletters", "list")):
        code, out, err = await geodebot(*command, "--config", str(config))
        assert (code, out) == (1, ""), command
        [line] = err.splitlines()
        assert line.startswith("geodebot: opening store 'postgresql://geodebot@127.0.0.1:")
        assert line.endswith("(the database of [store] url could not be reached)")


async def test_a_missing_password_variable_is_named(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        '[store]\nurl = "postgresql://geodebot@127.0.0.1/geodebot"\n'
        'password_env = "GEODEBOT_CLI_DB_PASSWORD"\n',
    )
    env = {k: v for k, v in os.environ.items() if k != "GEODEBOT_CLI_DB_PASSWORD"}
    code, out, err = await geodebot("store", "migrate", "--config", str(config), env=env)
    assert (code, out) == (1, "")
    assert err == (
        "geodebot: opening store 'postgresql://geodebot@127.0.0.1:5432/geodebot' failed: no "
        "database password: set the environment variable GEODEBOT_CLI_DB_PASSWORD (or the "
        "systemd credential GEODEBOT_CLI_DB_PASSWORD)\n"
    )


async def test_a_password_in_the_url_is_a_config_error_that_never_shows_it(
    tmp_path: Path,
) -> None:
    config = pg_config(tmp_path, "postgresql://geodebot:s3cr3t-Pw@db.internal/geodebot")
    code, out, err = await migrate(config)
    assert (code, out) == (2, "")
    assert "store.url: must not hold a password" in err
    assert "store.password_env" in err
    assert "s3cr3t-Pw" not in err


async def test_sqlite_is_migrated_and_a_missing_state_is_still_named(tmp_path: Path) -> None:
    config = write_config(tmp_path, "")
    db = tmp_path / "var" / "geodebot.db"
    code, out, err = await geodebot("usage", "--config", str(config))
    assert (code, out) == (1, "")
    assert err == f"geodebot: no geodebot state at {db} (has the daemon run with this config?)\n"
    code, out, err = await migrate(config)
    assert (code, err) == (0, "")
    assert out == (
        f"store {db}: schema version 0 -> {NEWEST} ({len(load_migrations())} migrations applied)\n"
    )
    code, out, err = await migrate(config)
    assert (code, out, err) == (0, f"store {db}: schema version {NEWEST}; nothing pending\n", "")
