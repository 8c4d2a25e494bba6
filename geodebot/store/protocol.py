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
