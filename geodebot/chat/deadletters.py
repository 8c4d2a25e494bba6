"""Dead letters: accepted messages that will never get a reply, and replies the sender gave
up on. The operator lists them and replays or discards each, once.

Which rows count, from what the chat path writes (router.py, outbox.py, store/chat.py):

* **An outbox row with status ``failed``** (id ``out-<outbox id>``): the sender gave up on it
  (the platform refused it for good, its file is gone, or a part's outcome stayed unknown
  after the one blind resend). Its ``error`` says which. A reply, a notice and a job's
  result alike: the user never saw it.
* **An inbox row finished ``done`` or ``failed`` that no outbox row answers** (id
  ``in-<inbox id>``), except a ``done`` relayed "notify" message, which is recorded and
  never answered on purpose. The router finishes a row and writes its reply in one commit,
  so today's chat path leaves none: such a row was finished by other code (an older
  version, a future caller of ``Store.inbox_finish`` without a reply) or lost its reply row
  outside the store. The finish marks it (``inbox.no_reply``, migration 0012, which also
  marks those of an older database), so listing reads only the marked rows. Not counted:

  - a ``failed`` row with a reply row: its turn failed and the user was told so (internal
    error, store error, "stopped, as asked"). That notice is the row's one reply (UNIQUE
    inbox_id), so a turn run again could not answer it.
    If the notice itself was not delivered, its outbox row is the dead letter;
  - a ``done`` row whose reply row failed: the outbox row is the one to replay (UNIQUE
    inbox_id allows one reply per message);
  - ``dropped`` rows: dropped on purpose, with a notice (too large, busy) or without one
    (throttled past the window's notice; binding removed, so there is no chat to answer);
  - ``pending`` and ``running`` rows: a daemon answers them (on start, ``router.recover``);
    one waiting too long is the unanswered alert's business (``Store.inbox_unanswered``).

Replay puts the row back on the normal path (``Store.deadletter_replay``): an outbox row
becomes ``pending`` with its sent parts kept, so no part already sent goes again; an inbox
row becomes ``pending`` and its turn runs again, its reply written once. A running daemon
gets the row from :class:`ReplayFeed` within about a second, whichever process replayed it;
a daemon that is down reads pending rows when it starts. Each dead letter gets one decision,
ever: the first replay or discard wins, and a later one is told who decided what.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from geodebot.store.protocol import DeadLetterStore, Store
from geodebot.store.records import (
    DeadLetter,
    DeadLetterDecided,
    DeadLetterDecision,
    DeadLetterKind,
    DecisionVia,
    InboxRow,
    OutboxRow,
    StoreError,
)

__all__ = [
    "DeadLetters",
    "Decided",
    "OnReplayed",
    "ReplayFeed",
    "parse_id",
]

log = logging.getLogger(__name__)

# How often a daemon looks for replays made by another process (the CLI).
FEED_POLL_S = 1.0
_ID = re.compile(r"(in|out)-([1-9][0-9]{0,17})")

# Called with a row just reset to pending by a replay in this process.
OnReplayed = Callable[[InboxRow | OutboxRow], None]
Result = Literal["replayed", "discarded", "already_decided", "not_dead", "unknown"]


def parse_id(text: str) -> tuple[DeadLetterKind, int] | None:
    """``in-12`` -> ("inbox", 12), ``out-5`` -> ("outbox", 5); None for anything else."""
    match = _ID.fullmatch(text.strip())
    if match is None:
        return None
    return ("inbox" if match[1] == "in" else "outbox"), int(match[2])


@dataclass(frozen=True, slots=True)
class Decided:
    """What a replay or discard came to. ``decision``: the one just made, or the one that
    stood already; ``row``: the row as it is now (None for an unknown id)."""

    id: str
    result: Result
    decision: DeadLetterDecision | None = None
    row: InboxRow | OutboxRow | None = None

    @property
    def ok(self) -> bool:
        return self.result in ("replayed", "discarded")

    def message(self) -> str:
        """One line for a person: the CLI prints it, the console shows it."""
        d = self.decision
        if self.result == "replayed":
            what = "its turn runs again" if self.id.startswith("in-") else "it is sent again"
            return f"{self.id} replayed: {what}"
        if self.result == "discarded":
            return f"{self.id} discarded: it stays as it is and is no longer listed"
        if self.result == "already_decided" and d is not None:
            done = "replayed" if d.action == "replay" else "discarded"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.at))
            return f"{self.id} was already {done} by {d.by} via {d.via} at {when}"
        if self.result == "not_dead" and self.row is not None:
            return f"{self.id} is not a dead letter (its status is {self.row.status!r})"
        return f"no dead letter {self.id} (ids look like in-12 or out-5)"


class DeadLetters:
    """The operator's dead letters over a store: the CLI's and the console's one interface.

    ``on_replayed``: given by a daemon, so a replay made in it (from the console) reaches its
    running router or outbox at once; without it (the CLI) the row waits for a daemon's
    :class:`ReplayFeed` or its next start.
    """

    def __init__(self, store: DeadLetterStore, on_replayed: OnReplayed | None = None) -> None:
        self._store = store
        self._on_replayed = on_replayed

    async def list(
        self, *, limit: int = 100, offset: int = 0, decided: bool = False
    ) -> list[DeadLetter]:
        """The most recently dead first; ``decided``: also the ones decided on already."""
        return await self._store.deadletters(limit=limit, offset=offset, decided=decided)

    async def count(self) -> int:
        """How many wait for a decision."""
        return await self._store.deadletter_count()

    async def show(self, id: str) -> DeadLetter | None:
        """The row behind ``id`` (``dead`` false if it is not a dead letter now), or None."""
        key = parse_id(id)
        return None if key is None else await self._store.deadletter_get(*key)

    async def replay(self, id: str, *, by: str, via: DecisionVia) -> Decided:
        return await self._decide(id, "replay", by, via)

    async def discard(self, id: str, *, by: str, via: DecisionVia) -> Decided:
        return await self._decide(id, "discard", by, via)

    async def _decide(
        self, id: str, action: Literal["replay", "discard"], by: str, via: DecisionVia
    ) -> Decided:
        key = parse_id(id)
        if key is None:
            return Decided(id, "unknown")
        name = f"{'in' if key[0] == 'inbox' else 'out'}-{key[1]}"
        if action == "replay":
            done = await self._store.deadletter_replay(*key, by=by, via=via)
        else:
            done = await self._store.deadletter_discard(*key, by=by, via=via)
        decided = _decided(name, action, done)
        if decided.result == "replayed" and self._on_replayed is not None:
            assert decided.row is not None
            self._on_replayed(decided.row)
        return decided


def _decided(name: str, action: str, done: DeadLetterDecided) -> Decided:
    result: Result
    if done.result == "decided":
        result = "replayed" if action == "replay" else "discarded"
    else:
        result = done.result
    return Decided(name, result, done.decision, done.row)


class ReplayFeed:
    """Hands replayed rows to a running daemon: an inbox row to ``take`` (the router's), an
    outbox row to ``submit`` (the sender's).

    A replay made in this process wakes it (:meth:`replayed`, a :class:`DeadLetters`'s
    ``on_replayed``); one made by another process (the CLI) is found by polling the store's
    dead-letter revision every ``poll_s``: one indexed read while nothing happens. Every
    replay passes through the same poll, so a row is handed over once. Rows replayed before
    :meth:`start` are the daemon's start-up's to read (router.recover, the outbox's first
    scan): call it before those.
    """

    def __init__(
        self,
        store: Store,
        take: Callable[[InboxRow], bool],
        submit: Callable[[OutboxRow], None],
        *,
        poll_s: float = FEED_POLL_S,
    ) -> None:
        self._store = store
        self._take = take
        self._submit = submit
        self._poll_s = poll_s
        self._seen: int | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        self._seen = await self._store.deadletters_revision()

    def replayed(self, row: InboxRow | OutboxRow) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self._seen is None:
            await self.start()
        while True:
            self._wake.clear()
            try:
                await self.poll()
            except StoreError as exc:
                log.error("dead letters: cannot read replays: %s; trying again", exc)
            try:
                async with asyncio.timeout(self._poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def poll(self) -> int:
        """Hand over the rows replayed since the last poll; returns how many."""
        seen = self._seen or 0
        if await self._store.deadletters_revision() <= seen:
            return 0
        handed = 0
        for decision in await self._store.deadletter_decisions(after=seen):
            if decision.action == "replay" and await self._hand(decision):
                handed += 1
            self._seen = decision.seq
        return handed

    async def _hand(self, decision: DeadLetterDecision) -> bool:
        # Read afresh: a row sent or answered since the replay is not handed over again.
        letter = await self._store.deadletter_get(decision.kind, decision.row_id)
        if letter is None or letter.row.status != "pending":
            return False
        row = letter.row
        log.info("dead letter %s replayed by %s via %s", letter.id, decision.by, decision.via)
        if isinstance(row, OutboxRow):
            self._submit(row)
            return True
        if not self._take(row):
            # As router.recover does: no binding has this chat any more.
            await self._store.inbox_finish(row.id, "dropped", detail="binding removed")
            return False
        return True
