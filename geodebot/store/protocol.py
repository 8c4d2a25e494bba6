"""The Store protocol and its record types.

Rules every implementation keeps:

* Messages and timeline events are append-only. A checkpoint inserts rows and updates one
  session row; it never rewrites or re-reads history, so its cost does not grow with history.
* Each method that writes is one transaction: it either happens whole or raises
  :class:`StoreError` and changes nothing.
* JSON payloads (``content``, ``state``, ``data``) are plain ``dict``/``list`` values; the store
  serialises them, callers never see SQL or driver types.
* SQL stays portable (no SQLite-only functions in queries) so a PostgreSQL implementation can
  follow with the same tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from geodebot.store.jobs import JobStore

MessageKind = Literal["message", "summary"]
BatchStatus = Literal["proposed", "done", "abandoned"]
ReceiptStatus = Literal["admitted", "committed", "failed", "uncertain"]
FinishStatus = Literal["committed", "failed", "uncertain"]
Resolution = Literal["done", "failed"]
InboxStatus = Literal["pending", "running", "done", "failed", "dropped"]
InboxFinish = Literal["done", "failed", "dropped"]
OutboxStatus = Literal["pending", "sent", "failed"]
OutboxFinish = Literal["sent", "failed"]


class StoreError(Exception):
    """A store operation failed; nothing of that operation was written."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    mode: str
    created_at: float
    updated_at: float
    # Bumped by reset; messages of an older generation are never loaded again.
    generation: int
    # Free-form cognitive state of the loop (token totals, last turn id, ...).
    state: Mapping[str, Any] = field(default_factory=dict)
    # Guard counters survive restarts (rounds, repairs, consecutive failures, ...).
    guards: Mapping[str, Any] = field(default_factory=dict)
    # The seq the next appended message gets: it changes with every append, so a copy of
    # the context taken at one value is still the context while the value is unchanged.
    next_seq: int = 1


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message to append. ``content`` is the JSON of an engine ``Message``."""

    role: str
    content: Mapping[str, Any]
    turn_id: str
    kind: MessageKind = "message"
    # For summaries: the inclusive range of message seqs this summary replaces.
    covers_from: int | None = None
    covers_to: int | None = None


@dataclass(frozen=True, slots=True)
class MessageRecord:
    session_id: str
    seq: int  # strictly increasing per session, assigned by the store
    generation: int
    role: str
    content: Mapping[str, Any]
    turn_id: str
    kind: MessageKind
    covers_from: int | None
    covers_to: int | None
    created_at: float


@dataclass(frozen=True, slots=True)
class ToolBatchRecord:
    """A tool batch the model proposed, saved before any of its tools runs."""

    id: str
    session_id: str
    turn_id: str
    round: int
    status: BatchStatus
    # JSON of the proposed ToolUseBlocks, in order.
    calls: Sequence[Mapping[str, Any]]
    # JSON of the ToolResultBlocks once the batch is done; empty while proposed.
    results: Sequence[Mapping[str, Any]]
    created_at: float
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    id: int  # strictly increasing over the whole store
    session_id: str
    turn_id: str | None
    ts: float
    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EffectReceipt:
    """The durable trace of one effectful tool call, written before the call is dispatched.

    ``admitted`` means the call may be running. A receipt still ``admitted`` when its call can
    no longer be running (crash, deadline) becomes ``uncertain``: whether the effect happened is
    unknown, so it is never re-run; an operator looks and records a ``resolution``. The status
    stays ``uncertain`` after that, so the history keeps saying the outcome was once unknown.
    """

    id: str  # caller-assigned, unique
    # Idempotency key, unique over the store: sha256 of (session, turn, tool, canonical
    # arguments), computed by the caller.
    key: str
    session_id: str
    turn_id: str
    call_id: str  # the model's tool_use id
    tool: str
    effect: str  # "mutate" | "communicate" | "administrative"
    arguments_sha256: str
    status: ReceiptStatus
    admitted_at: float
    finished_at: float | None = None
    # committed/failed: {"result": str, "is_error": bool}; uncertain: {"reason": str}.
    outcome: Mapping[str, Any] = field(default_factory=dict)
    resolution: Resolution | None = None
    resolved_by: str | None = None
    resolved_at: float | None = None


@dataclass(frozen=True, slots=True)
class OperatorSwitch:
    """An operator-controlled feature switch (e.g. ``computer_use``) with who set it and when."""

    name: str
    enabled: bool
    set_by: str
    set_at: float
    expires_at: float | None = None
    reason: str = ""

    def active(self, now: float) -> bool:
        """Enabled and not yet expired at ``now``; an expired switch reads as off."""
        return self.enabled and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True, slots=True)
class OpenedSession:
    """What a turn needs before it starts, read in one transaction (:meth:`Store.open_session`)."""

    record: SessionRecord
    switch: OperatorSwitch | None
    pending: list[ToolBatchRecord]


@dataclass(frozen=True, slots=True)
class InboxRow:
    """One accepted platform event, committed before the platform is acknowledged.

    ``pending`` and ``running`` rows are what a restart must still answer; a ``running`` row
    found after a restart had its turn cut short and is started again.
    """

    id: int  # store-assigned, increasing: arrival order
    platform: str
    event_id: str  # unique per platform; a redelivery carries the same id
    session_id: str
    channel: str
    thread: str | None
    user: str
    text: str
    message_id: str
    received_at: float
    status: InboxStatus
    attempts: int  # how many times a turn was started for it
    detail: str = ""
    finished_at: float | None = None


@dataclass(frozen=True, slots=True)
class NewOutbound:
    """A message to deliver: the reply to an inbox row, a job result or a notice."""

    session_id: str
    platform: str
    channel: str
    thread: str | None
    reply_to: str | None
    text: str  # the whole reply, markdown; split into parts only when sent
    kind: str = "reply"  # reply | notice | job  (free text, for reports)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A message written before it is sent, with the progress of its parts."""

    id: int
    inbox_id: int | None  # the inbox row this answers, if any; at most one reply per row
    session_id: str
    platform: str
    channel: str
    thread: str | None
    reply_to: str | None
    text: str
    kind: str
    status: OutboxStatus
    # index -> platform message id, for parts already confirmed sent
    sent_parts: Mapping[int, str]
    # The part being sent when the outcome became unknown (crash, timeout), else None: its
    # message may exist, so it is looked up before it is sent again.
    in_flight: int | None
    attempts: int  # send attempts over all parts
    created_at: float
    updated_at: float
    error: str = ""
    # Times an in-flight part the platform could not look up was sent again regardless; kept
    # so that a crash loop cannot turn "resend at most once" into "resend on every restart".
    blind_resends: int = 0


@dataclass(frozen=True, slots=True)
class InboxEnding:
    """An inbox row's finish and reply, as :meth:`Store.inbox_finish` takes them, for
    :meth:`Store.checkpoint_ending` to write with the last checkpoint of the row's turn."""

    inbox_id: int
    status: InboxFinish
    detail: str = ""
    reply: NewOutbound | None = None
    begin_first_part: bool = False


# What finishing an inbox row wrote: the finished row and its reply, if it has one.
InboxFinished = tuple[InboxRow, OutboxRow | None]


class Store(JobStore, Protocol):
    async def open(self) -> None:
        """Open the store and apply pending migrations."""

    async def close(self) -> None: ...

    async def schema_version(self) -> int: ...

    # -- sessions -------------------------------------------------------------------------
    async def ensure_session(self, session_id: str, mode: str) -> SessionRecord:
        """Return the session, creating it (generation 1, empty state) if it does not exist."""

    async def open_session(self, session_id: str, mode: str, *, switch: str) -> OpenedSession:
        """:meth:`ensure_session`, the operator switch ``switch`` and :meth:`pending_batches`
        in one transaction: one store round trip where a message's turn would need three."""

    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    async def list_sessions(self) -> list[SessionRecord]: ...

    async def reset_session(self, session_id: str) -> SessionRecord:
        """Start a fresh context: bump the generation, clear state and guards.

        History rows stay in place (append-only); they are simply not loaded any more.
        Pending tool batches of the old generation are marked abandoned.
        """

    # -- checkpoints ----------------------------------------------------------------------
    async def checkpoint(
        self,
        session_id: str,
        *,
        messages: Sequence[NewMessage] = (),
        state: Mapping[str, Any] | None = None,
        guards: Mapping[str, Any] | None = None,
        propose_batch: ToolBatchRecord | None = None,
        finish_batch: tuple[str, Sequence[Mapping[str, Any]], BatchStatus] | None = None,
        timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]] = (),
    ) -> list[int]:
        """Atomically append messages, replace state/guards (when given), and record a tool
        batch proposal or completion ``(batch_id, results, status)`` and timeline events
        ``(turn_id, kind, data)``.

        Returns the seqs assigned to ``messages``. Cost is O(len(messages)), independent of
        the history length.
        """

    async def checkpoint_ending(
        self,
        session_id: str,
        ending: InboxEnding,
        *,
        messages: Sequence[NewMessage] = (),
        state: Mapping[str, Any] | None = None,
        guards: Mapping[str, Any] | None = None,
        timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]] = (),
    ) -> tuple[list[int], InboxFinished]:
        """:meth:`checkpoint` and :meth:`inbox_finish` of ``ending`` in one transaction,
        committed durably: a turn's end and its reply are saved together or not at all, at
        the cost of one commit where they would need two.

        Returns the seqs assigned to ``messages`` and what :meth:`inbox_finish` returns.
        Raises :class:`StoreError` (and writes nothing) if either part fails.
        """

    async def load_context(self, session_id: str) -> list[MessageRecord]:
        """Messages of the current generation that the model should see: the newest summary
        (if any) followed by every message after the range it covers, in seq order."""

    async def load_messages(
        self, session_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> list[MessageRecord]:
        """Raw messages (kind ``message`` and ``summary``) of the current generation."""

    async def pending_batches(self, session_id: str) -> list[ToolBatchRecord]:
        """Batches of the current generation still ``proposed`` (crash before completion)."""

    # -- timeline -------------------------------------------------------------------------
    async def append_timeline(
        self, session_id: str, turn_id: str | None, kind: str, data: Mapping[str, Any]
    ) -> int: ...

    async def timeline(
        self, session_id: str, *, after_id: int = 0, limit: int | None = None
    ) -> list[TimelineEvent]: ...

    # -- effect receipts ------------------------------------------------------------------
    async def admit_receipt(self, receipt: EffectReceipt) -> tuple[EffectReceipt, bool]:
        """Record ``receipt`` as ``admitted`` before its call is dispatched.

        ``receipt`` must be fresh (status ``admitted``, no outcome, not finished or resolved).
        If a receipt with the same ``key`` exists, nothing is written and ``(existing, False)``
        is returned: the call was already admitted once and must not be dispatched again.
        Otherwise ``(stored, True)``. Concurrent admissions of one key admit exactly one.
        """

    async def finish_receipt(
        self, receipt_id: str, status: FinishStatus, outcome: Mapping[str, Any]
    ) -> EffectReceipt:
        """Record how an ``admitted`` receipt ended.

        Raises :class:`StoreError` for an unknown id or a receipt that is no longer
        ``admitted``: a late completion must not overwrite a sweep or an operator's decision.
        """

    async def mark_admitted_uncertain(
        self, reason: str, *, session_id: str | None = None
    ) -> list[EffectReceipt]:
        """Turn every ``admitted`` receipt (of one session, if given) ``uncertain`` with outcome
        ``{"reason": reason}`` and return them in admission order.

        Only safe when none of those calls can still be running, e.g. at daemon startup.
        """

    async def get_receipt(self, receipt_id: str) -> EffectReceipt | None: ...

    async def find_receipt(self, key: str) -> EffectReceipt | None:
        """The receipt with this idempotency key, if any."""

    async def list_receipts(
        self,
        *,
        status: ReceiptStatus | None = None,
        session_id: str | None = None,
        unresolved_only: bool = False,
        limit: int | None = None,
    ) -> list[EffectReceipt]:
        """Receipts in admission order (``admitted_at``, then ``id``).

        ``unresolved_only`` keeps the receipts waiting for an operator: ``uncertain`` and not
        yet resolved.
        """

    async def resolve_receipt(
        self, receipt_id: str, resolution: Resolution, *, by: str
    ) -> EffectReceipt:
        """Record an operator's reconciliation of an ``uncertain`` receipt, once.

        The status stays ``uncertain``; ``resolution``, ``resolved_by`` and ``resolved_at`` are
        set, and a ``receipt_resolved`` timeline event is appended to the receipt's session in
        the same transaction. Raises :class:`StoreError` for any other status or a second
        resolution.
        """

    # -- operator switches ----------------------------------------------------------------
    async def set_switch(
        self,
        name: str,
        enabled: bool,
        *,
        by: str,
        expires_at: float | None = None,
        reason: str = "",
    ) -> OperatorSwitch:
        """Replace the switch's current value and append it to the switch's history."""

    async def get_switch(self, name: str) -> OperatorSwitch | None:
        """The current value, expired or not; use :meth:`OperatorSwitch.active` to decide."""

    async def switch_history(self, name: str, *, limit: int | None = None) -> list[OperatorSwitch]:
        """Every value the switch was set to, newest first."""

    # -- chat inbox -----------------------------------------------------------------------
    async def inbox_add(
        self,
        *,
        platform: str,
        event_id: str,
        session_id: str,
        channel: str,
        thread: str | None,
        user: str,
        text: str,
        message_id: str,
        cursor: tuple[str, str] | None = None,
    ) -> tuple[InboxRow, bool]:
        """Commit an accepted event as ``pending``; ``(stored, True)``.

        A second event with the same ``(platform, event_id)`` writes nothing and returns
        ``(existing, False)``, also when the two race. ``cursor`` ``(name, value)`` is set in
        the same transaction, duplicate or not, so a poller's offset never runs ahead of the
        events it has committed.
        """

    async def inbox_start(self, inbox_id: int) -> InboxRow:
        """Mark a ``pending`` or ``running`` row ``running`` and count the attempt.

        Raises :class:`StoreError` for an unknown id or a finished row.
        """

    async def inbox_finish(
        self,
        inbox_id: int,
        status: InboxFinish,
        *,
        detail: str = "",
        reply: NewOutbound | None = None,
        begin_first_part: bool = False,
    ) -> tuple[InboxRow, OutboxRow | None]:
        """Finish a ``pending`` or ``running`` row and, in the same transaction, write its
        reply to the outbox: after a crash either both exist or neither does.

        ``begin_first_part`` also records the reply's part 0 as begun (as
        :meth:`outbox_begin_part` does) and commits durably, for a sender about to send it:
        one commit before the send instead of two. After a crash the part counts as perhaps
        sent, as any begun part does.

        Raises :class:`StoreError` (and writes nothing) for an unknown id or a finished row.
        """

    async def inbox_unfinished(self) -> list[InboxRow]:
        """``pending`` and ``running`` rows in arrival order."""

    async def get_inbox(self, inbox_id: int) -> InboxRow | None: ...

    async def find_inbox(self, platform: str, event_id: str) -> InboxRow | None: ...

    async def inbox_counts(self) -> dict[str, int]:
        """Rows per status, every status present (zero included)."""

    # -- chat outbox ----------------------------------------------------------------------
    async def outbox_add(self, reply: NewOutbound) -> OutboxRow:
        """Write a ``pending`` message that answers no inbox row (job result, notice)."""

    async def outbox_begin_part(self, outbox_id: int, index: int) -> OutboxRow:
        """Record that part ``index`` is about to be sent (``in_flight``, attempts + 1).

        Called before the request goes out, so a crash during it leaves the evidence that the
        outcome is unknown. Raises :class:`StoreError` unless the row is ``pending``, the part
        is not already sent and no other part's outcome is still unknown.
        """

    async def outbox_part_sent(
        self, outbox_id: int, index: int, message_id: str, *, last: bool = False
    ) -> OutboxRow:
        """Record part ``index`` as sent as ``message_id`` and clear it from ``in_flight``.

        With ``last`` the row is finished as ``sent`` in the same transaction (the caller
        knows every earlier part is sent). Recording the same message id again changes
        nothing else; a different one raises :class:`StoreError`. The row must be ``pending``.
        """

    async def outbox_part_unsent(self, outbox_id: int, index: int) -> OutboxRow:
        """Record that the send of part ``index`` definitely failed (e.g. a rate limit): its
        outcome is known again, so ``in_flight`` is cleared.

        A no-op when no part is in flight. Raises :class:`StoreError` when another part is in
        flight, the part is already sent or the row is not ``pending``.
        """

    async def outbox_note_blind_resend(self, outbox_id: int) -> OutboxRow:
        """Count a resend of the in-flight part whose arrival could not be checked.

        Raises :class:`StoreError` unless the row is ``pending`` with a part in flight.
        """

    async def outbox_finish(
        self, outbox_id: int, status: OutboxFinish, *, error: str = ""
    ) -> OutboxRow:
        """Finish a ``pending`` row; raises :class:`StoreError` for any other status."""

    async def outbox_pending(self, *, platform: str | None = None) -> list[OutboxRow]:
        """``pending`` rows (of one platform, if given) in id order."""

    async def get_outbox(self, outbox_id: int) -> OutboxRow | None: ...

    async def outbox_counts(self) -> dict[str, int]:
        """Rows per status, every status present (zero included)."""

    # -- cursors --------------------------------------------------------------------------
    async def get_cursor(self, name: str) -> str | None:
        """A named position that survives restarts (a poll offset, a last seen id)."""

    async def set_cursor(self, name: str, value: str) -> None: ...
