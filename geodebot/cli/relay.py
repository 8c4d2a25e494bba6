"""``geodebot relay ...``: Thread Relay for operators, straight on the store.

``schema`` prints the JSON Schema of the four contracts (it needs no configuration);
``list`` shows the newest deliveries and refusals; ``show ID`` one receipt in full. Receipts
hold a checksum of each message, never its text.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from geodebot.app.store import opened_store
from geodebot.config.schema import Config
from geodebot.relay.contracts import schemas
from geodebot.store.records import RelayDelivery, StoreError

__all__ = ["add_relay_parser", "print_schema", "relay_command"]

EXIT_OK, EXIT_FAILED = 0, 1


def add_relay_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    relay = sub.add_parser("relay", help="Thread Relay: contracts, deliveries and receipts")
    relay_sub = relay.add_subparsers(dest="action", required=True)
    relay_sub.add_parser("schema", help="the JSON Schema of the four contracts")
    listing = relay_sub.add_parser("list", parents=[common], help="the newest deliveries")
    listing.add_argument("--session", help="only deliveries from or into this session")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="one receipt per line")
    show = relay_sub.add_parser("show", parents=[common], help="one delivery's receipt")
    show.add_argument("id")


def print_schema() -> int:
    print(json.dumps(schemas(), indent=2, sort_keys=True))
    return EXIT_OK


async def relay_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        if args.action == "show":
            found = await store.relay_get(args.id)
            if found is None:
                raise StoreError(f"no relay delivery {args.id!r}")
            print(json.dumps(_shown(found), indent=2, sort_keys=True, ensure_ascii=False))
            return EXIT_OK
        rows = await store.relay_list(session_id=args.session, limit=max(1, args.limit))
    if args.json:
        for row in rows:
            print(json.dumps(_shown(row), sort_keys=True, ensure_ascii=False))
        return EXIT_OK
    if not rows:
        print("no relay deliveries")
        return EXIT_OK
    print(f"{'DELIVERY':<22} {'STATE':<10} {'INTENT':<7} {'FROM':<24} {'TO':<24} {'BY':<14} AT")
    for r in rows:
        print(
            f"{r.id:<22} {r.state:<10} {r.intent:<7} {r.source_session[:24]:<24} "
            f"{r.target_session[:24]:<24} {r.user[:14]:<14} {_when(r.created_at)}"
            + (f"  {r.reason}" if r.reason else "")
        )
    return EXIT_OK


def _shown(row: RelayDelivery) -> dict[str, Any]:
    return {
        "id": row.id,
        "project": row.project,
        "source_session": row.source_session,
        "source_turn": row.source_turn,
        "target_session": row.target_session,
        "user": row.user,
        "mode": row.mode,
        "intent": row.intent,
        "state": row.state,
        "reason": row.reason,
        "idempotency_key": row.idem_key,
        "target_inbox": row.inbox_id,
        "target_outbox": row.outbox_id,
        "receipt": dict(row.receipt),
        "envelope": dict(row.envelope),
    }


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
