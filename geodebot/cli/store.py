"""``geodebot store migrate``: bring the configured store's schema up to this geodebot's.

Opening a store applies its pending migrations anyway (``geodebot serve`` does at start);
this does it on its own, before a deployment starts replicas, and says what it did. A
database that a newer geodebot migrated is refused, as at any open: exit 1 with why.
"""

from __future__ import annotations

import argparse
from typing import Any

from geodebot.app.store import opened_store, store_place
from geodebot.config.schema import Config
from geodebot.store.schema import load_migrations

__all__ = ["add_store_parser", "store_command"]

EXIT_OK = 0


def add_store_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    store = sub.add_parser("store", help="the durable state: SQLite, or PostgreSQL at [store] url")
    actions = store.add_subparsers(dest="action", required=True)
    actions.add_parser(
        "migrate", parents=[common], help="apply pending schema migrations; print the versions"
    )


async def store_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config, create=True) as store:
        before, after = store.version_found, await store.schema_version()
    where = store_place(config)
    if before == after:
        print(f"store {where}: schema version {after}; nothing pending")
    else:
        applied = sum(1 for version, _, _ in load_migrations() if before < version <= after)
        print(
            f"store {where}: schema version {before} -> {after} "
            f"({applied} migration{'s' if applied != 1 else ''} applied)"
        )
    return EXIT_OK
