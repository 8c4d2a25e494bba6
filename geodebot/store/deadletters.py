"""Dead letters, a mixin of both stores (see rows.py): listing them, the operator's one
decision on each (replay or discard), and the unanswered-message count.

Which rows are dead letters is argued in chat/deadletters.py; here it is the SQL below
(``_DEAD_INBOX``, ``_DEAD_OUTBOX``) and its Python twin :func:`_is_dead`, which must agree.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol, get_args

from geodebot.store.chat import INBOX_COLS, OUTBOX_COLS, inbox_from_row, outbox_from_row
from geodebot.store.records import (
    DeadLetter,
    DeadLetterDecided,
    DeadLetterDecision,
    DeadLetterKind,
    DecisionVia,
    InboxRow,
    OutboxRow,
    StoreError,
    Unanswered,
)
from geodebot.store.rows import Row, Transactions, Tx

__all__ = [
    "DeadLetterDecisions",
    "DeadLetterStore",
]

_KINDS: frozenset[str] = frozenset(get_args(DeadLetterKind))
_VIAS: frozenset[str] = frozenset(get_args(DecisionVia))

# An accepted message that was finished without any reply row, except one only recorded on
# purpose (a relayed "notify" message): its finish marked it no_reply (migration 0012), which
# the partial index inbox_no_reply finds without reading the answered ones. Only a finish as
# 'done' or 'failed' sets the mark and only a replay (back to 'pending') clears it, so the
# mark alone says the status; a test on status here would steer the planner to inbox_by_status
# and through every answered message.
_DEAD_INBOX = "i.no_reply = 1 AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.inbox_id = i.id)"
# A reply, notice or job result the sender gave up on.
_DEAD_OUTBOX = "o.status = 'failed'"
_UNDECIDED = (
    "NOT EXISTS (SELECT 1 FROM deadletter_decisions d WHERE d.kind = '{kind}' AND d.row_id = {id})"
)
_DEAD = f"""
SELECT 'outbox' AS kind, o.id AS row_id, o.updated_at AS at FROM outbox o
WHERE {_DEAD_OUTBOX} {{outbox_undecided}}
UNION ALL
SELECT 'inbox' AS kind, i.id AS row_id, COALESCE(i.finished_at, i.received_at) AS at
FROM inbox i WHERE {_DEAD_INBOX} {{inbox_undecided}}
"""
_DECISION_COLS = "id, kind, row_id, action, decided_by, via, decided_at, detail"
_ADD_DECISION = f"""
INSERT INTO deadletter_decisions (kind, row_id, action, decided_by, via, decided_at, detail)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (kind, row_id) DO NOTHING
RETURNING {_DECISION_COLS}
"""
# Back to the normal path. An outbox row keeps its sent parts (they are not sent again) and
# its in-flight part (looked up first where the platform can be asked); its blind resends
# start over, or a row given up as "outcome unknown" would be given up again at once.
_REPLAY_OUTBOX = f"""
UPDATE outbox SET status = 'pending', error = '', blind_resends = 0, updated_at = ?
WHERE id = ? AND status = 'failed'
RETURNING {OUTBOX_COLS}
"""
# Its turn runs again under the same turn id (the engine answers a finished turn from the
# store); its finish writes the reply row, which UNIQUE (inbox_id) keeps to one.
_REPLAY_INBOX = f"""
UPDATE inbox SET status = 'pending', detail = '', finished_at = NULL, no_reply = 0
WHERE id = ? AND status IN ('done', 'failed')
RETURNING {INBOX_COLS}
"""


def _decision(row: Row) -> DeadLetterDecision:
    return DeadLetterDecision(
        seq=row["id"],
        kind=row["kind"],
        row_id=row["row_id"],
        action=row["action"],
        by=row["decided_by"],
        via=row["via"],
        at=row["decided_at"],
        detail=row["detail"],
    )


async def _row(
    db: Tx, kind: str, row_id: int, *, lock: bool = False
) -> InboxRow | OutboxRow | None:
    if kind == "inbox":
        sql = f"SELECT {INBOX_COLS} FROM inbox WHERE id = ?"
        found = await db.one(sql, (row_id,), lock=lock)
        return None if found is None else inbox_from_row(found)
    sql = f"SELECT {OUTBOX_COLS} FROM outbox WHERE id = ?"
    found = await db.one(sql, (row_id,), lock=lock)
    return None if found is None else outbox_from_row(found)


async def _decided(db: Tx, kind: str, row_id: int) -> DeadLetterDecision | None:
    sql = f"SELECT {_DECISION_COLS} FROM deadletter_decisions WHERE kind = ? AND row_id = ?"
    found = await db.one(sql, (kind, row_id))
    return None if found is None else _decision(found)


async def _is_dead(db: Tx, row: InboxRow | OutboxRow) -> bool:
    """The row-at-a-time form of ``_DEAD_INBOX`` / ``_DEAD_OUTBOX``."""
    if isinstance(row, OutboxRow):
        return row.status == "failed"
    if row.status not in ("done", "failed"):
        return False
    marked = await db.one("SELECT no_reply FROM inbox WHERE id = ?", (row.id,))
    answered = await db.one("SELECT 1 FROM outbox WHERE inbox_id = ?", (row.id,))
    return bool(marked[0]) and answered is None


async def _letter(db: Tx, kind: str, row_id: int) -> DeadLetter | None:
    row = await _row(db, kind, row_id)
    if row is None:
        return None
    return DeadLetter(row, await _is_dead(db, row), await _decided(db, kind, row_id))


def _checked(kind: str, row_id: int) -> None:
    if kind not in _KINDS:
        raise StoreError(f"a dead letter's kind is one of {sorted(_KINDS)}, not {kind!r}")
    if row_id < 1:
        raise StoreError(f"no dead letter {kind} {row_id}: row ids start at 1")


class DeadLetterStore(Protocol):
    """Dead letters (which rows they are: chat/deadletters.py), the operators' decisions on
    them, and the messages left unanswered."""

    async def deadletters(
        self, *, limit: int = 100, offset: int = 0, decided: bool = False
    ) -> list[DeadLetter]:
        """Dead letters, the most recently dead first; ``decided``: also those an operator
        decided on already (discarded, or replayed and dead again)."""

    async def deadletter_count(self) -> int:
        """How many dead letters wait for a decision."""

    async def deadletter_get(self, kind: DeadLetterKind, row_id: int) -> DeadLetter | None:
        """The row as a dead letter (``dead`` false if it is not one now); None: no row."""

    async def deadletter_replay(
        self, kind: DeadLetterKind, row_id: int, *, by: str, via: DecisionVia
    ) -> DeadLetterDecided:
        """Record the replay and reset the row to ``pending`` in one transaction: an outbox
        row keeps its sent parts, an inbox row's turn runs again. Only the first decision
        on a row is made; a later one returns it as ``already_decided``."""

    async def deadletter_discard(
        self, kind: DeadLetterKind, row_id: int, *, by: str, via: DecisionVia
    ) -> DeadLetterDecided:
        """Record the discard (the row stays as it is, off the list); first decision wins."""

    async def deadletters_revision(self) -> int:
        """Grows with every decision, in any process: a daemon polls it to pick up replays
        made with the CLI."""

    async def deadletter_decisions(
        self, *, after: int = 0, limit: int = 1000
    ) -> list[DeadLetterDecision]:
        """Decisions with a ``seq`` above ``after``, oldest first."""

    async def inbox_unanswered(self, older_than_s: float) -> Unanswered:
        """Accepted messages without a reply yet (pending or running inbox rows) received at
        least ``older_than_s`` ago; not those whose turn waits for a pending approval."""


class DeadLetterDecisions:
    async def deadletters(
        self: Transactions, *, limit: int = 100, offset: int = 0, decided: bool = False
    ) -> list[DeadLetter]:
        if limit < 0 or offset < 0:
            raise StoreError("listing dead letters failed: limit and offset must not be negative")
        sql = _DEAD.format(
            outbox_undecided=""
            if decided
            else "AND " + _UNDECIDED.format(kind="outbox", id="o.id"),
            inbox_undecided="" if decided else "AND " + _UNDECIDED.format(kind="inbox", id="i.id"),
        )
        sql += " ORDER BY at DESC, kind, row_id DESC LIMIT ? OFFSET ?"

        async def read(db: Tx) -> list[DeadLetter]:
            keys = [(k, int(i)) for k, i, _ in await db.all(sql, (limit, offset))]
            letters = [await _letter(db, kind, row_id) for kind, row_id in keys]
            return [letter for letter in letters if letter is not None]

        return await self._read("listing dead letters", read)

    async def deadletter_count(self: Transactions) -> int:
        sql = _DEAD.format(
            outbox_undecided="AND " + _UNDECIDED.format(kind="outbox", id="o.id"),
            inbox_undecided="AND " + _UNDECIDED.format(kind="inbox", id="i.id"),
        )

        async def count(db: Tx) -> int:
            return int((await db.one(f"SELECT COUNT(*) FROM ({sql}) AS dead"))[0])

        return await self._read("counting dead letters", count)

    async def deadletter_get(
        self: Transactions, kind: DeadLetterKind, row_id: int
    ) -> DeadLetter | None:
        _checked(kind, row_id)
        return await self._read(
            f"reading dead letter {kind} {row_id}", lambda db: _letter(db, kind, row_id)
        )

    async def deadletter_replay(
        self: Transactions, kind: DeadLetterKind, row_id: int, *, by: str, via: DecisionVia
    ) -> DeadLetterDecided:
        return await _decide(self, kind, row_id, "replay", by, via)

    async def deadletter_discard(
        self: Transactions, kind: DeadLetterKind, row_id: int, *, by: str, via: DecisionVia
    ) -> DeadLetterDecided:
        return await _decide(self, kind, row_id, "discard", by, via)

    async def deadletters_revision(self: Transactions) -> int:
        sql = "SELECT MAX(id) FROM deadletter_decisions"
        newest = await self._read("reading the dead letters revision", lambda db: db.one(sql))
        return int(newest[0] or 0)

    async def deadletter_decisions(
        self: Transactions, *, after: int = 0, limit: int = 1000
    ) -> list[DeadLetterDecision]:
        sql = f"SELECT {_DECISION_COLS} FROM deadletter_decisions WHERE id > ? ORDER BY id LIMIT ?"
        rows = await self._read(
            "reading dead letter decisions", lambda db: db.all(sql, (after, limit))
        )
        return [_decision(row) for row in rows]

    async def inbox_unanswered(self: Transactions, older_than_s: float) -> Unanswered:
        # Unfinished rows only: a row's finish and its reply row are one commit, so an
        # unfinished row has no reply, and a finished one has its reply or is a dead letter.
        # A turn waiting for a person's approval was answered with its card; the wait is the
        # approver's (see /approvals), not a message geodebot failed to answer.
        sql = (
            "SELECT COUNT(*), MIN(received_at) FROM inbox "
            "WHERE status IN ('pending', 'running') AND received_at <= ? "
            "AND NOT EXISTS (SELECT 1 FROM approval_requests a WHERE a.status = 'pending' "
            "AND a.session_id = inbox.session_id AND a.turn_id = 't-inbox-' || inbox.id)"
        )

        async def count(db: Tx) -> Unanswered:
            now = time.time()
            number, oldest = await db.one(sql, (now - older_than_s,))
            age = None if oldest is None else max(0.0, now - float(oldest))
            return Unanswered(int(number), age)

        return await self._read("counting unanswered messages", count)


async def _decide(
    store: Transactions,
    kind: DeadLetterKind,
    row_id: int,
    action: Literal["replay", "discard"],
    by: str,
    via: DecisionVia,
) -> DeadLetterDecided:
    _checked(kind, row_id)
    what = f"{'replaying' if action == 'replay' else 'discarding'} dead letter {kind} {row_id}"
    if via not in _VIAS:
        raise StoreError(f"{what} failed: via is one of {sorted(_VIAS)}, not {via!r}")
    if not by:
        raise StoreError(f"{what} failed: who decides must be named")
    params: tuple[Any, ...] = (kind, row_id, action, by, via)

    async def decide(db: Tx) -> DeadLetterDecided:
        # The row is locked to this transaction from the first read: the checks and the
        # reset see one state, whichever process decides first.
        row = await _row(db, kind, row_id, lock=True)
        if row is None:
            return DeadLetterDecided("unknown", None, None)
        earlier = await _decided(db, kind, row_id)
        if earlier is not None:
            return DeadLetterDecided("already_decided", earlier, row)
        if not await _is_dead(db, row):
            return DeadLetterDecided("not_dead", None, row)
        error = row.error if isinstance(row, OutboxRow) else row.detail
        added = await db.one(_ADD_DECISION, (*params, time.time(), error))
        if added is None:  # the UNIQUE key says another decision got there first
            return DeadLetterDecided("already_decided", await _decided(db, kind, row_id), row)
        if action == "replay":
            if kind == "outbox":
                reset = await db.one(_REPLAY_OUTBOX, (time.time(), row_id))
                row = outbox_from_row(reset)
            else:
                row = inbox_from_row(await db.one(_REPLAY_INBOX, (row_id,)))
        return DeadLetterDecided("decided", _decision(added), row)

    # An operator's order that a daemon acts on next.
    return await store._write(what, decide, durable=True)
