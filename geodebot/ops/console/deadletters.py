"""The ``/deadletters`` board: messages that will never get a reply and replies the sender
gave up on, each with its error and any decision on it, read through the daemon's
:class:`~geodebot.chat.deadletters.DeadLetters` (chat/deadletters.py says which rows count).
"""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.chat.deadletters import DeadLetters
from geodebot.ops.console.parts import ConsoleParts
from geodebot.store.records import DeadLetter, DeadLetterDecision, InboxRow, OutboxRow

PAGE = 50
# The latest decisions shown below the list, replays whose row went out again among them.
DECISIONS = 20
# A text longer than this is cut in the list; the whole is one click away.
SHORT_TEXT = 160


def letters_of(parts: ConsoleParts) -> DeadLetters:
    """The daemon's dead letters; without them (a console built on a bare store) one over
    the store, whose replays a running daemon picks up by its poll instead of at once."""
    return parts.deadletters if parts.deadletters is not None else DeadLetters(parts.store)


@dataclass(frozen=True, slots=True)
class LetterView:
    letter: DeadLetter
    # "reply (outbox)", "message (inbox)": what the row is, for the operator.
    kind: str
    short: str
    # The text was cut for the list.
    cut: bool

    @property
    def row(self) -> InboxRow | OutboxRow:
        return self.letter.row

    @property
    def outbox(self) -> OutboxRow | None:
        return self.letter.row if isinstance(self.letter.row, OutboxRow) else None

    @property
    def inbox(self) -> InboxRow | None:
        return self.letter.row if isinstance(self.letter.row, InboxRow) else None

    @property
    def open(self) -> bool:
        """Dead now and not decided on: replay and discard apply."""
        return self.letter.dead and self.letter.decision is None


@dataclass(frozen=True, slots=True)
class DecisionLine:
    decision: DeadLetterDecision
    id: str
    # The row as it is now: "sent" after a replay that went out, "failed" when dead again;
    # "" for a row that no longer exists.
    status: str


@dataclass(frozen=True, slots=True)
class DeadLettersView:
    waiting: list[LetterView]
    # Where the next (older) page starts; None: this page reaches the oldest.
    older: int | None
    offset: int
    decisions: list[DecisionLine]


def letter_view(letter: DeadLetter) -> LetterView:
    row = letter.row
    kind = f"{row.kind} (outbox)" if isinstance(row, OutboxRow) else "message (inbox)"
    flat = " ".join(row.text.split())
    cut = len(flat) > SHORT_TEXT or flat != row.text
    short = flat if len(flat) <= SHORT_TEXT else flat[: SHORT_TEXT - 1] + "…"
    return LetterView(letter, kind, short, cut)


async def deadletters_view(parts: ConsoleParts, *, offset: int = 0) -> DeadLettersView:
    letters = letters_of(parts)
    # One more than shown says whether an older page exists.
    found = await letters.list(limit=PAGE + 1, offset=offset)
    older = offset + PAGE if len(found) > PAGE else None
    return DeadLettersView(
        [letter_view(letter) for letter in found[:PAGE]],
        older,
        offset,
        await _latest_decisions(parts),
    )


async def _latest_decisions(parts: ConsoleParts) -> list[DecisionLine]:
    store = parts.store
    # Decisions are numbered as they are made: the newest are the last few below the
    # revision, read without going through the older ones.
    revision = await store.deadletters_revision()
    decisions = await store.deadletter_decisions(
        after=max(0, revision - DECISIONS), limit=DECISIONS
    )
    lines = []
    for decision in reversed(decisions):
        letter = await store.deadletter_get(decision.kind, decision.row_id)
        name = f"{'in' if decision.kind == 'inbox' else 'out'}-{decision.row_id}"
        lines.append(DecisionLine(decision, name, "" if letter is None else letter.row.status))
    return lines


@dataclass(frozen=True, slots=True)
class Attention:
    """What ``/work`` shows at a glance: dead letters waiting for a decision, and accepted
    messages without a reply for longer than ``[daemon] unanswered_alert_s`` (what makes
    ``/healthz``'s ``unanswered`` component fail)."""

    deadletters: int
    unanswered: int
    oldest_age_s: float | None
    alert_s: float


async def attention(parts: ConsoleParts) -> Attention:
    alert_s = parts.config.daemon.unanswered_alert_s
    late = await parts.store.inbox_unanswered(alert_s)
    return Attention(await letters_of(parts).count(), late.count, late.oldest_age_s, alert_s)
