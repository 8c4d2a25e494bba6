"""A database of the test cluster that only a password opens.

The cluster trusts every connection (tests/support/postgres.py), so a password sent there
proves nothing. Here a login role gets a password, and the cluster's pg_hba.conf makes that
one role (and only it) authenticate with SCRAM over TCP; the role owns a fresh database.
Every other role of the cluster stays trusted, so the other tests are unaffected.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from tests.support.postgres import Cluster

_numbers = itertools.count(1)


@dataclass(frozen=True)
class PasswordDatabase:
    role: str
    password: str
    dbname: str
    port: int

    @property
    def url(self) -> str:
        """The database's URL without the password, as ``[store] url`` names it."""
        return f"postgresql://{self.role}@127.0.0.1:{self.port}/{self.dbname}"


def password_database(cluster: Cluster) -> PasswordDatabase:
    import psycopg

    number = next(_numbers)
    role, dbname = f"pw_role_{number}", f"pw_db_{number}"
    password = f"pw-{number}-Zq8vKx3LmT0r"
    hba = cluster.data / "pg_hba.conf"
    # The first matching line decides: this one, above the cluster's "trust" lines.
    hba.write_text(
        f"host all {role} 127.0.0.1/32 scram-sha-256\n" + hba.read_text(encoding="utf-8"),
        encoding="utf-8",
    )
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        conn.execute(f"CREATE DATABASE {dbname} OWNER {role}")
        conn.execute("SELECT pg_reload_conf()")
    found = PasswordDatabase(role, password, dbname, cluster.port)
    # The server rereads the file once signalled, a moment later: until a wrong password is
    # refused, the old trust lines still let it in.
    deadline = time.monotonic() + 10
    while True:
        try:
            psycopg.connect(found.url, password="wrong", connect_timeout=5).close()
        except psycopg.OperationalError:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not take up the password line of pg_hba.conf")
        time.sleep(0.05)
