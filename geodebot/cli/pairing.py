"""``geodebot pairing ...``: the requests of people who wrote to the bot unbound, straight on
the store (see chat/pairing.py).

``list`` shows the requests (``--all``: decided and expired ones too); ``approve PLATFORM
CODE`` stores the binding the ``[pairing]`` table grants (``--tools``, ``--session`` to give
other ones) and welcomes the person; ``deny PLATFORM CODE`` turns it down. Each code is decided
once, before it expires. Works whether or not the daemon runs: a running one has the new
binding in force within a second, a stopped one when it starts.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from contextlib import closing
from typing import Any

from geodebot.app.secrets import build_redactor
from geodebot.app.store import opened_store
from geodebot.chat.pairing import PairingDecisions, format_code
from geodebot.config.schema import Config
from geodebot.engine.ledger import EvidenceLedger
from geodebot.store.pairing import PairingRefused
from geodebot.store.records import PairingRecord

__all__ = ["add_pairing_parser", "pairing_command", "pairing_json"]

EXIT_OK, EXIT_FAILED = 0, 1
PLATFORMS = ("telegram", "slack", "discord")


def add_pairing_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    pairing = sub.add_parser(
        "pairing", help="requests to talk to the bot from people no binding allows"
    )
    actions = pairing.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="the requests waiting")
    listing.add_argument("--all", action="store_true", help="also decided and expired ones")
    listing.add_argument("--json", action="store_true", help="one request per line")
    approve = actions.add_parser(
        "approve", parents=[common], help="let the person talk to the bot (a stored binding)"
    )
    deny = actions.add_parser("deny", parents=[common], help="turn the request down")
    for action in (approve, deny):
        action.add_argument("platform", choices=PLATFORMS)
        action.add_argument("code", help="the code the person was given, as ABCDE-12345")
    approve.add_argument(
        "--tools",
        help="comma-separated tools the binding may use, instead of [pairing] tools ('' none)",
    )
    approve.add_argument("--session", help="the session to run on (default dm:PLATFORM:USER)")


async def pairing_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        if args.action == "list":
            found = await store.pairings(status=None if args.all else "pending")
            return _list(found, as_json=args.json)
        with closing(EvidenceLedger(config.ledger_path, build_redactor(config))) as ledger:
            decisions = PairingDecisions(store, config.pairing, ledger=ledger)
            by = getpass.getuser()
            try:
                if args.action == "approve":
                    tools = None
                    if args.tools is not None:
                        tools = [t.strip() for t in args.tools.split(",") if t.strip()]
                    record, binding = await decisions.approve(
                        args.platform,
                        args.code,
                        by=by,
                        via="cli",
                        tools=tools,
                        session=args.session,
                    )
                    granted = ", ".join(binding.data.get("tools", ())) or "no tools"
                    print(
                        f"approved: {args.platform} user {_who(record)} may talk to the bot "
                        f"in {binding.key} (session {binding.data['session']}; {granted})"
                    )
                    return EXIT_OK
                record = await decisions.deny(args.platform, args.code, by=by, via="cli")
                print(f"denied: {args.platform} user {_who(record)}")
                return EXIT_OK
            except (ValueError, PairingRefused) as exc:
                print(f"geodebot: {exc}", file=sys.stderr)
                return EXIT_FAILED


def _who(record: PairingRecord) -> str:
    return f"{record.user} ({record.user_name})" if record.user_name else record.user


def pairing_json(record: PairingRecord, now: float) -> dict[str, Any]:
    return {
        "platform": record.platform,
        "code": format_code(record.code),
        "user": record.user,
        "user_name": record.user_name,
        "channel": record.channel,
        "direct": record.is_dm,
        "first_text": record.first_text,
        "asked_at": record.created_at,
        "expires_at": record.expires_at,
        "status": record.state(now),
        "decided_by": record.decided_by,
        "binding": record.binding_key,
    }


def _list(found: list[PairingRecord], *, as_json: bool) -> int:
    now = time.time()
    if as_json:
        for record in found:
            print(json.dumps(pairing_json(record, now), sort_keys=True, ensure_ascii=False))
        return EXIT_OK
    if not found:
        print("no pairing requests waiting")
        return EXIT_OK
    print(f"{'PLATFORM':<9} {'CODE':<12} {'STATUS':<9} {'ASKED':<8} {'USER':<24} FIRST WORDS")
    for record in found:
        asked = f"{max(0, int((now - record.created_at) // 60))}m ago"
        words = " ".join(record.first_text.split())[:40]
        print(
            f"{record.platform:<9} {format_code(record.code):<12} {record.state(now):<9} "
            f"{asked:<8} {_who(record)[:24]:<24} {words}"
        )
    return EXIT_OK
