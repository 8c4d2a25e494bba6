"""``[store]`` and ``[daemon] replica_id``: what the config accepts and refuses, and how
app/store.py turns them into a store and a replica id (the password only from the
environment or systemd's credentials)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from geodebot.app.store import (
    default_replica_id,
    make_store,
    opened_store,
    replica_id,
    store_facts,
    store_place,
)
from geodebot.config.schema import Config, ConfigError, load_config, parse_config, secret_names
from geodebot.engine.llm.errors import LLMMissingCredential
from geodebot.store.records import StoreError
from geodebot.store.sqlite import SQLiteStore
from tests.support.pg_password import password_database
from tests.support.postgres import Cluster

PASSWORD_ENV = "GEODEBOT_TEST_DB_PASSWORD"


def problems(data: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_a_postgresql_url_and_password_env_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[store]\nurl = "postgresql://geodebot@db.internal/geodebot"\n'
        'password_env = "GEODEBOT_DB_PASSWORD"\n[daemon]\nreplica_id = "web-1"\n'
    )
    config = load_config(path)
    assert config.store.url == "postgresql://geodebot@db.internal/geodebot"
    assert config.store.password_env == "GEODEBOT_DB_PASSWORD"
    assert config.daemon.replica_id == "web-1"
    assert "GEODEBOT_DB_PASSWORD" in set(secret_names(config))
    for url in (
        "postgres://geodebot@db.internal:6432/geodebot?sslmode=verify-full",
        "postgresql://geodebot@[::1]/geodebot",
        "postgresql:///geodebot?host=/run/postgresql",
    ):
        assert parse_config({"store": {"url": url}}).store.url == url


def test_no_url_is_sqlite_in_the_state_dir() -> None:
    config = parse_config({"daemon": {"state_dir": "/srv/geodebot"}})
    assert config.store.url is None
    assert parse_config({"store": {"url": ""}}).store.url is None
    assert store_facts(config) == {"kind": "sqlite", "path": "/srv/geodebot/geodebot.db"}
    assert isinstance(make_store(config), SQLiteStore)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://geodebot:hunter2secret@db.internal/geodebot",
        "postgresql://geodebot@db.internal/geodebot?password=hunter2secret",
        "postgres://geodebot:hunter2secret@db.internal:5432/geodebot",
    ],
)
def test_a_url_with_a_password_is_refused_naming_password_env(url: str) -> None:
    [problem] = problems({"store": {"url": url}})
    assert problem.startswith("store.url: must not hold a password")
    assert "store.password_env" in problem
    assert "hunter2secret" not in problem


@pytest.mark.parametrize(
    "url",
    [
        "mysql://geodebot@db.internal/geodebot",
        "sqlite:///var/lib/geodebot/geodebot.db",
        "db.internal:5432",
        "host=db.internal dbname=geodebot",
    ],
)
def test_a_url_of_another_kind_is_refused(url: str) -> None:
    [problem] = problems({"store": {"url": url}})
    assert problem.startswith("store.url: must be a postgresql:// (or postgres://) URL")


def test_store_keys_are_strict_and_password_env_needs_a_url() -> None:
    assert problems({"store": {"uri": "postgresql://db/x"}}) == ["store.uri: unknown key"]
    [problem] = problems({"store": {"password_env": "GEODEBOT_DB_PASSWORD"}})
    assert problem == "store: password_env needs url (SQLite has no password)"


@pytest.mark.parametrize("bad", ["", "web 1", "web/1", "é", "x" * 65, "web-1\n"])
def test_a_bad_replica_id_is_refused(bad: str) -> None:
    [problem] = problems({"daemon": {"replica_id": bad}})
    assert problem == (
        "daemon.replica_id: must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"
    )


@pytest.mark.parametrize("good", ["web-1", "a", "replica_2.eu-west", "x" * 64])
def test_a_good_replica_id_is_kept(good: str) -> None:
    config = parse_config({"daemon": {"replica_id": good}})
    assert replica_id(config) == good


def test_the_default_replica_id_is_the_host_and_pid_made_per_process() -> None:
    config = parse_config({})
    # Nothing is decided when the config is read: two processes of one file differ.
    assert config.daemon.replica_id is None
    made = replica_id(config)
    assert made == default_replica_id()
    assert made == f"{socket.gethostname()}-{os.getpid()}"
    assert parse_config({"daemon": {"replica_id": made}}).daemon.replica_id == made
    code = "from geodebot.app.store import default_replica_id; print(default_replica_id())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    others = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(others) == 2
    assert made not in others


def test_a_default_replica_id_fits_the_rules_whatever_the_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pid = str(os.getpid())
    for name, host in (("my host/Ünïcode", "my-host-n-code"), ("-", "host"), ("h" * 80, None)):
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        made = default_replica_id()
        parse_config({"daemon": {"replica_id": made}})  # a valid replica_id
        assert made.endswith(f"-{pid}")
        assert len(made) <= 64
        if host is not None:
            assert made == f"{host}-{pid}"


def test_postgresql_facts_and_place_never_show_a_password() -> None:
    config = parse_config(
        {"store": {"url": "postgresql://geodebot@db.internal:6432/state", "password_env": "X"}}
    )
    assert store_facts(config) == {
        "kind": "postgresql",
        "host": "db.internal",
        "port": 6432,
        "dbname": "state",
    }
    assert store_place(config) == "postgresql://geodebot@db.internal:6432/state"
    defaults = parse_config({"store": {"url": "postgresql://geodebot@db.internal"}})
    # libpq's defaults: port 5432, the database named after the user.
    assert store_facts(defaults) == {
        "kind": "postgresql",
        "host": "db.internal",
        "port": 5432,
        "dbname": "geodebot",
    }


def _pg_config(url: str) -> Config:
    return parse_config({"store": {"url": url, "password_env": PASSWORD_ENV}})


async def test_a_missing_password_variable_is_named_as_a_missing_model_key_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    # Loading the config does not look at the environment, as with the model's key ...
    config = _pg_config("postgresql://geodebot@127.0.0.1:1/geodebot")
    # ... using it does, and says which variable, in the model's words.
    with pytest.raises(StoreError) as caught:
        make_store(config)
    model = str(LLMMissingCredential(PASSWORD_ENV))
    assert model == f"no API key: {_set_it(PASSWORD_ENV)}"
    assert str(caught.value) == (
        "opening store 'postgresql://geodebot@127.0.0.1:1/geodebot' failed: no database "
        f"password: {_set_it(PASSWORD_ENV)}"
    )
    # An empty variable counts as missing, as for every secret.
    monkeypatch.setenv(PASSWORD_ENV, "")
    with pytest.raises(StoreError, match=PASSWORD_ENV):
        make_store(config)


def _set_it(name: str) -> str:
    return f"set the environment variable {name} (or the systemd credential {name})"


async def test_the_password_comes_from_the_environment_or_a_systemd_credential(
    postgres_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = password_database(postgres_cluster)
    config = _pg_config(db.url)
    monkeypatch.setenv(PASSWORD_ENV, db.password)
    async with opened_store(config) as store:
        assert await store.schema_version() > 0
    monkeypatch.delenv(PASSWORD_ENV)
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / PASSWORD_ENV).write_text(db.password + "\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    async with opened_store(config) as store:
        assert await store.schema_version() > 0
    # A wrong one is the server's refusal, which never repeats the password.
    monkeypatch.setenv(PASSWORD_ENV, "not-the-Password-42")
    with pytest.raises(StoreError) as caught:
        async with opened_store(config):
            pass
    message = str(caught.value)
    assert "password authentication failed" in message
    assert "(the database of [store] url could not be reached)" in message
    assert "not-the-Password-42" not in message
    assert db.password not in message
