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
from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.chat.pairing import PairingDecisions
from geodebot.chat.stored_bindings import valid_bindings
from geodebot.config.schema import BindingConfig, Config
from geodebot.engine.ledger import EvidenceLedger
from geodebot.store.records import StoredBinding

__all__ = ["add_bindings_parser", "binding_rows", "bindings_command"]

EXIT_OK, EXIT_FAILED = 0, 1


def add_bindings_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    bindings = sub.add_parser("bindings", help="the bindings in force: list, remove")
    actions = bindings.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="config and stored bindings")
    listing.add_argument("--json", action="store_true", help="one binding per line")
    remove = actions.add_parser("remove", parents=[common], help="remove a stored binding")
    remove.add_argument("key", help="PLATFORM:CHANNEL, as bindings list shows it")


def binding_rows(config: Config, stored: list[StoredBinding]) -> list[dict[str, Any]]:
    """Every binding as ``bindings list --json`` shows it: config ones first."""
    valid, problems = valid_bindings(stored)
    index = BindingIndex(config.bindings, valid)
    shadowed = {binding_key(b) for b in index.shadowed()}
    rows = {s.key: s for s in stored}

    def row(binding: BindingConfig, origin: str) -> dict[str, Any]:
        key = binding_key(binding)
        found = rows.get(key) if origin != "config" else None
        return {
            "key": key,
            "origin": origin,
            "session": binding.session,
            "allowed_users": list(binding.allowed_users),
            "tools": list(binding.tools),
            "made_by": found.origin if found is not None else "",
            "created_by": found.created_by if found is not None else "",
            "created_at": found.created_at if found is not None else None,
        }

    listed = [row(b, "config") for b in index.configured()]
    for binding in index.stored():
        key = binding_key(binding)
        listed.append(row(binding, "stored, shadowed" if key in shadowed else "stored"))
    for problem in problems:
        key = problem.split(":", 2)[0].removeprefix("stored binding ")
        listed.append({"key": key, "origin": "stored, invalid", "problem": problem})
    return listed


async def bindings_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config, create=args.action == "list") as store:
        if args.action == "list":
            return _list(binding_rows(config, await store.stored_bindings()), as_json=args.json)
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
        if "problem" in row:
            print(f"{row['key']:<32} {row['origin']:<17} {row['problem']}")
            continue
        users = ",".join(row["allowed_users"]) or "-"
        tools = ",".join(row["tools"]) or "no tools"
        print(f"{row['key']:<32} {row['origin']:<17} {row['session']:<28} {users} / {tools}")
    return EXIT_OK
