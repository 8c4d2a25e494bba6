"""``geodebot deadletters ...``: messages that will never get a reply, straight on the store.

``list`` shows the dead letters waiting for a decision (``--all``: decided ones too);
``show ID`` one in full; ``replay ID`` puts it back on the normal path, ``discard ID`` takes
it off the list. Each dead letter is decided once. Works whether or not the daemon runs: a
running daemon picks a replay up within about a second, a stopped one when it starts.
chat/deadletters.py says which rows are dead letters.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from typing import Any

from geodebot.app.store import opened_store
from geodebot.chat.deadletters import DeadLetters
from geodebot.config.schema import Config
from geodebot.store.records import DeadLetter, InboxRow, OutboxRow

__all__ = ["add_deadletters_parser", "deadletters_command"]

EXIT_OK, EXIT_FAILED = 0, 1


def add_deadletters_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    letters = sub.add_parser(
        "deadletters", help="messages that will never get a reply: list, replay, discard"
    )
    actions = letters.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="the newest dead letters")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--offset", type=int, default=0, help="skip this many (paging)")
    listing.add_argument("--all", action="store_true", help="also those decided on already")
    listing.add_argument("--json", action="store_true", help="one dead letter per line")
    show = actions.add_parser("show", parents=[common], help="one dead letter in full")
    show.add_argument("id", help="in-<inbox id> or out-<outbox id>")
    show.add_argument("--json", action="store_true")
    for action, text in (
        ("replay", "send it again (an inbox row: run its turn again), once"),
        ("discard", "take it off the list; nothing is sent"),
    ):
        actions.add_parser(action, parents=[common], help=text).add_argument(
            "id", help="in-<inbox id> or out-<outbox id>"
        )


async def deadletters_command(config: Config, args: argparse.Namespace) -> int:
    async with opened_store(config) as store:
        letters = DeadLetters(store)
        if args.action == "list":
            return _list(
                await letters.list(
                    limit=max(1, args.limit), offset=max(0, args.offset), decided=args.all
                ),
                as_json=args.json,
            )
        if args.action == "show":
            found = await letters.show(args.id)
            if found is None:
                return _fail(f"no dead letter {args.id} (ids look like in-12 or out-5)")
            if args.json:
                print(json.dumps(shown(found), indent=2, sort_keys=True, ensure_ascii=False))
            else:
                _print_letter(found)
            return EXIT_OK
        decide = letters.replay if args.action == "replay" else letters.discard
        decided = await decide(args.id, by=getpass.getuser(), via="cli")
    if not decided.ok:
        return _fail(decided.message())
    print(decided.message())
    return EXIT_OK


def _fail(message: str) -> int:
    print(f"geodebot: {message}", file=sys.stderr)
    return EXIT_FAILED


def _list(letters: list[DeadLetter], *, as_json: bool) -> int:
    if as_json:
        for letter in letters:
            print(json.dumps(shown(letter), sort_keys=True, ensure_ascii=False))
        return EXIT_OK
    if not letters:
        print("no dead letters")
        return EXIT_OK
    print(f"{'ID':<10} {'DIED AT':<19} {'PLATFORM':<9} {'CHAT':<20} {'DECIDED':<9} ERROR")
    for letter in letters:
        row = letter.row
        decided = letter.decision.action if letter.decision is not None else "-"
        print(
            f"{letter.id:<10} {_when(letter.at):<19} {row.platform:<9} {row.channel[:20]:<20} "
            f"{decided:<9} {_one_line(letter.error, 80)}"
        )
    return EXIT_OK


def _print_letter(letter: DeadLetter) -> None:
    row = letter.row
    state = "a dead letter" if letter.dead else f"not a dead letter now ({row.status})"
    print(f"{letter.id}: {state}")
    print(f"  session:  {row.session_id}")
    print(
        f"  chat:     {row.platform} {row.channel}"
        + (f" thread {row.thread}" if row.thread else "")
    )
    print(f"  died at:  {_when(letter.at)}")
    print(f"  error:    {letter.error or '-'}")
    if isinstance(row, OutboxRow):
        print(
            f"  kind:     {row.kind}; parts sent: {len(row.sent_parts)}; attempts: {row.attempts}"
        )
        if row.in_flight is not None:
            print(
                f"  part {row.in_flight}'s outcome is unknown: a replay looks it up where the "
                "platform can say, else sends it once more (it may then arrive twice)"
            )
        if row.inbox_id is not None:
            print(f"  answers:  in-{row.inbox_id}")
    else:
        print(f"  from:     {row.user} at {_when(row.received_at)}; turns started: {row.attempts}")
    if letter.decision is not None:
        d = letter.decision
        print(f"  decided:  {d.action} by {d.by} via {d.via} at {_when(d.at)}")
    print("  text:")
    for line in row.text.splitlines() or [""]:
        print(f"    {line}")


def shown(letter: DeadLetter) -> dict[str, Any]:
    """A dead letter as JSON (``--json``)."""
    row = letter.row
    data: dict[str, Any] = {
        "id": letter.id,
        "kind": letter.kind,
        "dead": letter.dead,
        "status": row.status,
        "error": letter.error,
        "died_at": letter.at,
        "session": row.session_id,
        "platform": row.platform,
        "channel": row.channel,
        "thread": row.thread,
        "text": row.text,
        "decision": None,
    }
    if isinstance(row, OutboxRow):
        data.update(
            message_kind=row.kind,
            inbox_id=row.inbox_id,
            sent_parts=len(row.sent_parts),
            in_flight=row.in_flight,
            attempts=row.attempts,
        )
    elif isinstance(row, InboxRow):
        data.update(user=row.user, received_at=row.received_at, attempts=row.attempts)
    if letter.decision is not None:
        d = letter.decision
        data["decision"] = {"action": d.action, "by": d.by, "via": d.via, "at": d.at}
    return data


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split()) or "-"
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
