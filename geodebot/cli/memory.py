"""``geodebot memory ...``: the operator's look at project memory (store/memory.py), straight
on the store, whether or not the daemon runs.

``list`` shows items newest first (``--project`` one project's, else every project's);
``projects`` each project with how many items it holds; ``show ID`` one item whole, with its
provenance; ``search QUERY --project P`` the store's search, best first; ``forget ID`` deletes
one (and the evidence ledger records it). ``export`` writes JSON lines, one item each
(:meth:`MemoryItem.to_json`), oldest first, so that ``import`` saves them in the order they
were saved and ``list`` shows them newest first again. ``import`` keeps each item's id and
provenance; an id in the store already counts as a duplicate, a line that is no item is
named by its number and skipped, and a project at ``[memory] max_items`` takes no more.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import math
import os
import re
import sys
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from geodebot.app.secrets import build_redactor
from geodebot.app.store import opened_store
from geodebot.config.schema import Config
from geodebot.engine.ledger import EvidenceLedger
from geodebot.store.memory import DuplicateMemory, MemoryFull, MemoryStore
from geodebot.store.records import MemoryItem, StoreError

__all__ = ["add_memory_parser", "memory_command"]

EXIT_OK, EXIT_FAILED = 0, 1
# Items read from the store at once by an export.
PAGE = 500
TEXT_WIDTH = 80
# As the memory_save tool takes them: an id the tools can name, tags stored space-separated.
_REF = re.compile(r"^[A-Za-z0-9._:-]{1,40}$")
_TAG = re.compile(r"^[\w.-]{1,40}$")
MAX_TAGS = 8
_STRINGS = ("session", "turn", "user")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_memory_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    memory = sub.add_parser(
        "memory", help="project memory: list, projects, show, search, forget, export, import"
    )
    actions = memory.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="items, newest first")
    listing.add_argument("--project", help="only this project's (default: every project's)")
    listing.add_argument("--limit", type=_positive, default=100, help="at most N items (100)")
    listing.add_argument("--json", action="store_true", help="one item per line")
    projects = actions.add_parser("projects", parents=[common], help="projects and item counts")
    projects.add_argument("--json", action="store_true", help="one project per line")
    show = actions.add_parser("show", parents=[common], help="one item, with its provenance")
    show.add_argument("id")
    show.add_argument("--project", help="only if it is this project's")
    show.add_argument("--json", action="store_true", help="the item as one JSON object")
    search = actions.add_parser("search", parents=[common], help="a project's items, best first")
    search.add_argument("query")
    search.add_argument("--project", required=True)
    search.add_argument("--limit", type=_positive, default=10, help="at most N items (10)")
    search.add_argument("--json", action="store_true", help="one item per line, with its score")
    forget = actions.add_parser("forget", parents=[common], help="delete one item")
    forget.add_argument("id")
    forget.add_argument("--project", help="only if it is this project's")
    export = actions.add_parser("export", parents=[common], help="items as JSON lines")
    export.add_argument("--project", help="only this project's (default: every project's)")
    export.add_argument("file", nargs="?", help="the file to write (default: standard output)")
    load = actions.add_parser("import", parents=[common], help="items from an export's lines")
    load.add_argument("file", help="JSON lines, as export writes them ('-': standard input)")


async def memory_command(config: Config, args: argparse.Namespace) -> int:
    if args.action == "import":
        # The file first: a path that cannot be read creates no store.
        with _source(args.file) as lines:
            async with opened_store(config, create=True) as store:
                return await _Import(store, config, _name(args.file)).run(lines)
    async with opened_store(config) as store:
        if args.action != "export":
            return await _ACTIONS[args.action](store, config, args)
        items = await _every_item(store, args.project)
    # Written once read whole: a store that fails halfway leaves no half of an export.
    return _export(reversed(items), args.file)


# -- reading ---------------------------------------------------------------------------------
async def _list(store: MemoryStore, config: Config, args: argparse.Namespace) -> int:
    items = await store.memory_list(project=args.project, limit=args.limit)
    if args.json:
        for item in items:
            print(_json(item.to_json()))
        return EXIT_OK
    if not items:
        print("no memory items")
        return EXIT_OK
    print(_HEADER_ITEM)
    for item in items:
        print(_row(item))
    return EXIT_OK


async def _projects(store: MemoryStore, config: Config, args: argparse.Namespace) -> int:
    counts = await store.memory_projects()
    if args.json:
        for project, n in counts.items():
            print(_json({"project": project, "items": n}))
        return EXIT_OK
    if not counts:
        print("no project memory")
        return EXIT_OK
    print(f"{'ITEMS':>7}  PROJECT")
    for project, n in counts.items():
        print(f"{n:>7}  {_printable(project)}")
    return EXIT_OK


async def _show(store: MemoryStore, config: Config, args: argparse.Namespace) -> int:
    item = await store.memory_get(args.id, project=args.project)
    if item is None:
        return _unknown(args.id, args.project)
    if args.json:
        print(_json(item.to_json()))
        return EXIT_OK
    fields = (
        ("id", item.ref),
        ("project", item.project),
        ("saved at", _when(item.created_at, seconds=True) + " UTC"),
        ("origin", item.origin),
        ("forwarded", "yes (its message came through Thread Relay)" if item.forwarded else "no"),
        ("user", item.user or "-"),
        ("session", item.session_id or "-"),
        ("turn", item.turn_id or "-"),
        ("tags", ", ".join(item.tags) or "-"),
    )
    for name, value in fields:
        print(f"{name + ':':<11}{_printable(value)}")
    print("text:")
    for line in item.text.splitlines() or [""]:
        print(f"  {_printable(line)}")
    return EXIT_OK


async def _search(store: MemoryStore, config: Config, args: argparse.Namespace) -> int:
    hits = await store.memory_search(args.project, args.query, limit=args.limit)
    if args.json:
        for hit in hits:
            print(_json({**hit.item.to_json(), "score": hit.score}))
    elif not hits:
        print(f"nothing in project {_printable(repr(args.project))}'s memory matches")
    else:
        print(f"{'SCORE':>7} {_HEADER_ITEM}")
        for hit in hits:
            print(f"{hit.score:>7.3f} {_row(hit.item)}")
    return EXIT_OK


_HEADER_ITEM = f"{'ID':<18} {'SAVED (UTC)':<16} {'PROJECT':<16} {'ORIGIN':<8} {'USER':<16} TEXT"


def _row(item: MemoryItem) -> str:
    return (
        f"{item.ref:<18} {_when(item.created_at):<16} {_cut(item.project, 16):<16} "
        f"{item.origin:<8} {_cut(item.user or '-', 16):<16} {_cut(item.text, TEXT_WIDTH)}"
    )


def _unknown(ref: str, project: str | None) -> int:
    where = f" in project {project!r}" if project is not None else ""
    print(f"geodebot: no memory item {ref!r}{where} (see geodebot memory list)", file=sys.stderr)
    return EXIT_FAILED


# -- forgetting ------------------------------------------------------------------------------
async def _forget(store: MemoryStore, config: Config, args: argparse.Namespace) -> int:
    gone = await store.memory_forget(args.id, project=args.project)
    if gone is None:
        return _unknown(args.id, args.project)
    by = getpass.getuser()
    with closing(EvidenceLedger(config.ledger_path, build_redactor(config))) as ledger:
        ledger.record("memory_forgotten", id=gone.ref, project=gone.project, by=by, via="cli")
    print(
        f"forgot {gone.ref} of project {_printable(repr(gone.project))} (saved "
        f"{_when(gone.created_at)} UTC, {gone.origin}, by {_printable(gone.user or '-')}): "
        f"{_cut(gone.text, TEXT_WIDTH)}"
    )
    return EXIT_OK


_ACTIONS: dict[str, Callable[[MemoryStore, Config, argparse.Namespace], Awaitable[int]]] = {
    "list": _list,
    "projects": _projects,
    "show": _show,
    "search": _search,
    "forget": _forget,
}


# -- export ----------------------------------------------------------------------------------
async def _every_item(store: MemoryStore, project: str | None) -> list[MemoryItem]:
    """Every item, newest first, a page at a time, each page below the oldest item read so
    far. Should that item be forgotten meanwhile (a running daemon's memory_forget), the
    page comes back empty: it goes on below the oldest item read that is still there."""
    items: list[MemoryItem] = []
    seen: set[str] = set()
    before: str | None = None
    back = 0
    while True:
        page = await store.memory_list(project=project, limit=PAGE, before=before)
        fresh = [item for item in page if item.ref not in seen]
        items.extend(fresh)
        seen.update(item.ref for item in fresh)
        if page:
            before, back = page[-1].ref, 0
            continue
        if before is None or await store.memory_get(before, project=None) is not None:
            return items
        # The cursor was forgotten: below the next newer item read (after them all, the top).
        back += 1
        before = items[-1 - back].ref if back < len(items) else None


def _export(items: Iterable[MemoryItem], file: str | None) -> int:
    lines = [_json(item.to_json()) + "\n" for item in items]
    if file is None or file == "-":
        sys.stdout.writelines(lines)
        return EXIT_OK
    # Memory holds what people told the bot: a new file is readable by its owner alone.
    with open(file, "w", encoding="utf-8", opener=_private) as out:
        out.writelines(lines)
    print(f"exported {len(lines)} memory item(s) to {file}", file=sys.stderr)
    return EXIT_OK


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


# -- import ----------------------------------------------------------------------------------
@contextmanager
def _source(file: str) -> Iterator[Iterator[bytes]]:
    """The import's lines, as bytes (a line that is not UTF-8 is one bad line, not the end of
    the import): of the file, or of standard input for ``-``."""
    if file == "-":
        yield iter(sys.stdin.buffer)
        return
    with Path(file).open("rb") as handle:
        yield iter(handle)


def _name(file: str) -> str:
    return "standard input" if file == "-" else file


class _Import:
    """One import: each line saved, or counted a duplicate, or refused and reported."""

    def __init__(self, store: MemoryStore, config: Config, name: str) -> None:
        self._store = store
        self._config = config.memory
        self._name = name
        self.imported = self.duplicates = self.refused = 0
        # Each project found at its cap, and how many of its items it refused.
        self._full: dict[str, int] = {}

    async def run(self, lines: Iterator[bytes]) -> int:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                item = _parse(raw, self._config.max_item_chars)
            except ValueError as exc:
                self._problem(number, f"not a memory item, skipped: {_printable(str(exc))}")
                self.refused += 1
                continue
            try:
                await self._save(number, item)
            except StoreError as exc:
                self._problem(number, f"stopped: {exc}")
                print(f"{self._summary()}, then failed")
                return EXIT_FAILED
        for project, n in self._full.items():
            print(
                f"geodebot: project {_printable(repr(project))} is full: {n} of its item(s) "
                "refused (forget some, or raise [memory] max_items, and import again)",
                file=sys.stderr,
            )
        print(self._summary())
        return EXIT_FAILED if self.refused else EXIT_OK

    async def _save(self, number: int, item: MemoryItem) -> None:
        # Asked first: a project at its cap refuses every save, of the items it holds too.
        if await self._store.memory_get(item.ref, project=None) is not None:
            self.duplicates += 1
            return
        if item.project in self._full:
            self._full[item.project] += 1
            self.refused += 1
            return
        try:
            await self._store.memory_save(item, max_items=self._config.max_items)
        except DuplicateMemory:
            self.duplicates += 1
            return
        except MemoryFull:
            self._full[item.project] = 1
            self.refused += 1
            self._problem(
                number,
                f"refused: project {_printable(repr(item.project))} holds [memory] max_items "
                f"({self._config.max_items}) items; its later lines are refused too",
            )
            return
        self.imported += 1

    def _summary(self) -> str:
        return f"imported {self.imported}, duplicates {self.duplicates}, refused {self.refused}"

    def _problem(self, number: int, text: str) -> None:
        print(f"geodebot: {self._name} line {number}: {text}", file=sys.stderr)


def _parse(raw: bytes, max_chars: int) -> MemoryItem:
    """An exported item, held to what a save by the memory_save tool could have made;
    raises ValueError saying what is wrong."""
    data = _decode(raw)
    item = MemoryItem.from_json(data)
    if not _REF.match(item.ref):
        raise ValueError("id must be 1 to 40 letters, digits or . _ : -")
    if not item.text.strip():
        raise ValueError("text must hold more than spaces")
    if len(item.text) > max_chars:
        raise ValueError(
            f"text is {len(item.text)} characters, more than [memory] max_item_chars "
            f"({max_chars}) allows"
        )
    if len(item.tags) > MAX_TAGS or not all(_TAG.match(tag) for tag in item.tags):
        raise ValueError(
            f"tags must be at most {MAX_TAGS} words of 1 to 40 letters, digits or . _ -"
        )
    return item


def _decode(raw: bytes) -> dict[str, Any]:
    """A line's JSON object, its fields of the types an export writes (MemoryItem.from_json
    reads the rest)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    for key in _STRINGS:
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"{key} must be a string")
    if not isinstance(data.get("forwarded", False), bool):
        raise ValueError("forwarded must be true or false")
    created = data.get("created_at", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise ValueError("created_at must be a number (seconds since the epoch)")
    if not math.isfinite(created) or created < 0:
        raise ValueError("created_at must be a finite number of seconds, not negative")
    return data


# -- text ------------------------------------------------------------------------------------
def _json(row: Mapping[str, Any]) -> str:
    return json.dumps(row, sort_keys=True, ensure_ascii=False)


def _when(ts: float, *, seconds: bool = False) -> str:
    shape = "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime(shape)


def _printable(text: str) -> str:
    """What a chat wrote, safe on a terminal: control characters (escape sequences) shown
    as U+FFFD."""
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" else c for c in text)


def _cut(text: str, width: int) -> str:
    """On one line, at most ``width`` characters."""
    line = _printable(" ".join(text.split()))
    return line if len(line) <= width else line[: width - 1] + "…"
