"""``geodebot bindings ...``: every binding in force, the config file's and those stored at
run time (an approved pairing), with where each comes from.

``list`` shows them (a stored binding that the config's binding of the same chat overrides
is marked shadowed); ``remove KEY`` removes a stored one, which a running daemon stops
answering within a second. A config binding is the file's: edit the file to remove it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from contextlib import closing
from typing import Any

from geodebot.app.secrets import build_redactor
from geodebot.app.store import opened_store
from geodebot.chat.bindings import binding_key
from geodebot.chat.pairing import PairingDecisions
from geodebot.chat.stored_bindings import binding_listing
from geodebot.config.schema import Config
from geodebot.engine.ledger import EvidenceLedger

__all__ = ["add_bindings_parser", "bindings_command"]

EXIT_OK, EXIT_FAILED = 0, 1


def add_bindings_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    bindings = sub.add_parser("bindings", help="the bindings in force: list, remove")
    actions = bindings.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="config and stored bindings")
    listing.add_argument("--json", action="store_true", help="one binding per line")
    remove = actions.add_parser("remove", parents=[common], help="remove a stored binding")
    remove.add_argument("key", help="PLATFORM:CHANNEL, as bindings list shows it")


async def bindings_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config, create=args.action == "list") as store:
        if args.action == "list":
            return _list(
                binding_listing(config.bindings, await store.stored_bindings()), as_json=args.json
            )
        if any(binding_key(b) == args.key for b in config.bindings):
            print(
                f"geodebot: {args.key} is a binding of the config file "
                f"({config.source or 'the config'}); edit the file to remove it",
                file=sys.stderr,
            )
            return EXIT_FAILED
        with closing(EvidenceLedger(config.ledger_path, build_redactor(config))) as ledger:
            decisions = PairingDecisions(store, config.pairing, ledger=ledger)
            removed = await decisions.remove_binding(args.key, by=getpass.getuser(), via="cli")
        if removed is None:
            print(
                f"geodebot: no stored binding {args.key} (see geodebot bindings list)",
                file=sys.stderr,
            )
            return EXIT_FAILED
        print(f"removed: {args.key} (made by {removed.origin}); its chat is no longer answered")
        return EXIT_OK


def _list(rows: list[dict[str, Any]], *, as_json: bool) -> int:
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True, ensure_ascii=False))
        return EXIT_OK
    if not rows:
        print("no bindings")
        return EXIT_OK
    print(f"{'KEY':<32} {'ORIGIN':<17} {'SESSION':<28} USERS / TOOLS")
    for row in rows:
        if row["problem"]:
            print(f"{row['key']:<32} {row['origin']:<17} {row['problem']}")
            continue
        users = ",".join(row["allowed_users"]) or "-"
        tools = ",".join(row["tools"]) or "no tools"
        print(f"{row['key']:<32} {row['origin']:<17} {row['session']:<28} {users} / {tools}")
    return EXIT_OK
