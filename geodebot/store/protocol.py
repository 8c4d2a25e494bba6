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

MessageKind = Literal["message", "summary"]
BatchStatus = Literal["proposed", "done", "abandoned"]
ReceiptStatus = Literal["admitted", "committed", "failed", "uncertain"]
FinishStatus = Literal["committed", "failed", "uncertain"]
Resolution = Literal["done", "failed"]


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


class Store(Protocol):
    async def open(self) -> None:
        """Open the store and apply pending migrations."""

    async def close(self) -> None: ...

    async def schema_version(self) -> int: ...

    # -- sessions -------------------------------------------------------------------------
    async def ensure_session(self, session_id: str, mode: str) -> SessionRecord:
        """Return the session, creating it (generation 1, empty state) if it does not exist."""

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
