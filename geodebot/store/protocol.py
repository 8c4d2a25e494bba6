"""The Store protocol (its record types are in records.py).

Rules every implementation keeps:

* Messages and timeline events are append-only. A checkpoint inserts rows and updates one
  session row; it never rewrites or re-reads history, so its cost does not grow with history.
* Each method that writes is one transaction: it either happens whole or raises
  :class:`StoreError` and changes nothing.
* JSON payloads (``content``, ``state``, ``data``) are plain ``dict``/``list`` values; the store
  serialises them, callers never see SQL or driver types. One read gives a context's message
  contents as their JSON text (``load_context_json``), for the engine's one-pass decoding.
* SQL stays portable (no SQLite-only functions in queries) so a PostgreSQL implementation can
  follow with the same tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from geodebot.store.jobs import JobStore
from geodebot.store.records import (
    ApprovalRecord,
    AttachedFile,
    BatchStatus,
    ContextRow,
    DeadLetter,
    DeadLetterDecided,
    DeadLetterDecision,
    DeadLetterKind,
    DecisionVia,
    EffectReceipt,
    FinishStatus,
    InboxEnding,
    InboxFinish,
    InboxFinished,
    InboxRow,
    Lease,
    MessageRecord,
    ModelCall,
    NewMessage,
    NewOutbound,
    OpenedSession,
    OperatorSwitch,
    OutboxFinish,
    OutboxRow,
    ReceiptStatus,
    RelayDelivery,
    RelayedMessage,
    RelayRead,
    ReplicaRecord,
    Resolution,
    SessionRecord,
    SpendCharge,
    SpendRefusal,
    StoreError,
    TimelineEvent,
    ToolBatchRecord,
    Unanswered,
    UsageGrouping,
    UsageRow,
)
from geodebot.store.wakeups import Wakeups


class Store(JobStore, Protocol):
    async def open(self) -> None:
        """Open the store and apply pending migrations."""

    async def close(self) -> None: ...

    async def schema_version(self) -> int: ...

    async def sync(self, *, within_s: float = 0.0) -> None:
        """Return once every write committed so far is as durable as a durable write's (for
        the writes made with ``durable=False`` where a method offers it, before the outside
        acts on them). ``within_s``: the store may take up to this much longer, to make the
        durable writes asked for meanwhile durable with the same sync."""

    def on_broken(self, callback: Callable[[StoreError], None]) -> None:
        """Have ``callback`` called (once, on the event loop) if the store can no longer make
        any write durable, with why: the process should stop, and a restart recovers what is
        on disk. (SQLite: a sync of its log failed. PostgreSQL keeps its own durability and
        never calls it: a lost connection fails writes, and they are tried again.)"""

    version_found: int
    """The schema version :meth:`open` found, before it applied the pending migrations (0 for
    a new store): with :meth:`schema_version` after it, what this open migrated."""

    # -- leases (leases.py) ------------------------------------------------------------------
    def fence(self, lease: Lease | None) -> None:
        """From now on, refuse every write (:class:`Fenced`) unless ``lease`` is still its
        holder's at its epoch, checked in the write's own transaction; None: write freely."""

    def fenced(self, lease: Lease) -> AbstractContextManager[None]:
        """While inside (a plain ``with``), refuse each write issued from this context, and
        from the tasks created in it meanwhile, unless ``lease`` is still its holder's at its
        epoch, checked in the write's own transaction as :meth:`fence`'s lease is (and that
        one too, if set). The lease is read when the write is asked for; an inner block's
        replaces an outer one's. Reads and the leases' own writes are never fenced."""

    async def lease_acquire(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Take the lease if free or expired, or renew it if ``holder``'s already; the lease
        as it then stands (held by someone else when it could not be taken)."""

    async def lease_renew(self, lease: Lease, ttl_s: float) -> Lease | None:
        """Extend a held lease from now; None if another holder has taken it over."""

    async def lease_release(self, lease: Lease) -> bool:
        """Let the lease go at once; False if it was no longer ``lease``'s."""

    async def lease(self, name: str) -> Lease | None: ...

    async def leases(self) -> list[Lease]: ...

    async def lease_renew_many(
        self, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """Extend by ``ttl_s`` from the database's clock each of ``names`` that ``holder``
        still holds (at its current epoch, even if expired meanwhile), in one statement; the
        renewed leases, by name: a name missing from them was lost. No names: no query."""

    async def lease_acquire_many(
        self, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """In one transaction, take each of ``names`` that is absent, expired or ``holder``'s
        already (renewed, epoch kept), leaving those another holder holds unexpired; a
        takeover raises the epoch. The leases ``holder`` holds afterwards, by name. Never
        waits for another claimer's locks: a row locked by another transaction (a claimer,
        or a write in flight under its holder) is not taken this time."""

    async def lease_release_many(self, holder: str, names: Sequence[str]) -> int:
        """End now each of ``names`` that ``holder`` still holds unexpired; how many."""

    async def leases_held(self, holder: str, prefix: str = "") -> list[Lease]:
        """The unexpired leases of ``holder`` whose names start with ``prefix``, by name."""

    async def sessions_waiting(self, holder: str) -> list[str]:
        """Ids of the sessions with work nobody else is doing: an inbox row pending or
        running, or an outbox row pending, and a lease ``session:<id>`` that is absent,
        expired or ``holder``'s; the session with the oldest such row first. One query, on
        the status indexes: cheap however many finished rows there are."""

    # -- wake-ups between processes (pg_wakeups.py) ------------------------------------------
    async def wake(self, topic: str, about: str = "") -> None:
        """Tell other processes sharing the store to look at ``topic`` now (PostgreSQL:
        NOTIFY), at ``about`` (a session id, say) if given. A hint only: nothing on SQLite,
        whose one process needs none."""

    def wakeups(self, topic: str) -> AbstractAsyncContextManager[Wakeups]:
        """An event set whenever another process calls :meth:`wake` for ``topic`` (on
        SQLite: never), with what the wake-ups named. Waiters look by themselves now and then
        too: a wake-up may be lost."""

    # -- replicas (replicas.py) --------------------------------------------------------------
    async def replica_seen(self, replica_id: str, *, role: str, host: str, pid: int) -> None:
        """Record that ``replica_id`` is there now, in ``role`` (leader, member)."""

    async def replica_gone(self, replica_id: str) -> None: ...

    async def replicas(self) -> list[ReplicaRecord]:
        """Every replica heard of in the last hour, with how long ago."""

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

    async def load_context_json(self, session_id: str) -> list[ContextRow]:
        """:meth:`load_context`, each message's content as the JSON text stored (see
        :class:`ContextRow`): what the engine reads when a session's context is not cached."""

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

    async def timeline_newest(
        self, session_id: str, *, before_id: int | None = None, limit: int = 100
    ) -> list[TimelineEvent]:
        """The session's newest events, newest first: those with an id below ``before_id``
        (every one, if None), at most ``limit``; what a page of a long timeline shows."""

    # -- approval requests ----------------------------------------------------------------
    async def approval_open(self, request: ApprovalRecord) -> tuple[ApprovalRecord, bool]:
        """Record a fresh ``pending`` request (with an ``approval_requested`` timeline event).

        If the session's turn already asked about the same call, nothing is written and
        ``(existing, False)`` is returned, whatever its status: a resumed turn finds its
        request (and its decision) instead of asking twice. Otherwise ``(stored, True)``.
        """

    async def approval_decide(
        self,
        request_id: str,
        approved: bool,
        *,
        by: str,
        via: str,
        now: float | None = None,
    ) -> tuple[ApprovalRecord | None, bool]:
        """Decide a pending, unexpired request, once: ``(decided, True)`` for the call that
        decided it (with an ``approval_decided`` event). Any other press changes nothing and
        gets ``(current, False)``; one after the expiry first marks the request ``expired``;
        an unknown id gets ``(None, False)``. ``via``: ``chat`` or ``console``."""

    async def approval_expire(
        self, request_id: str, *, now: float | None = None
    ) -> ApprovalRecord | None:
        """Expire a request still pending (its asker stopped waiting), with an
        ``approval_expired`` event; a decided one is returned as it is, an unknown id as None.
        """

    async def approval_card(self, request_id: str, card: dict[str, Any]) -> ApprovalRecord | None:
        """Record where the request's card is (``{"state": "posting"}`` before it is sent, the
        message's address after), whatever the request's status; None for an unknown id."""

    async def get_approval(self, request_id: str) -> ApprovalRecord | None: ...

    async def approvals_pending(self, *, session_id: str | None = None) -> list[ApprovalRecord]:
        """Pending requests (of one session, or all), oldest first."""

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
        files: Sequence[Mapping[str, Any]] = (),
        pickup: str | None = None,
        durable: bool = True,
    ) -> tuple[InboxRow, bool]:
        """Commit an accepted event as ``pending``; ``(stored, True)``. ``files``: what the
        platform said the message carried (JSON objects), kept on the row as they are.
        ``pickup``: with replicas, the one that took the message in (its session may run on
        another). Not ``durable``: the caller calls :meth:`sync` before it acknowledges the
        event (and may start its turn meanwhile).

        A second event with the same ``(platform, event_id)`` writes nothing and returns
        ``(existing, False)``, also when the two race. ``cursor`` ``(name, value)`` is set in
        the same transaction, duplicate or not, so a poller's offset never runs ahead of the
        events it has committed.
        """

    async def inbox_attached(
        self,
        inbox_id: int,
        attached: Sequence[AttachedFile],
        notice: NewOutbound | None = None,
    ) -> tuple[InboxRow, OutboxRow | None]:
        """Record what became of a row's files, and add ``notice`` (a reply saying what was
        refused) to the outbox in the same commit; ``(row, the notice's outbox row)``.

        Only the first record counts: once a row has one, a later call writes nothing (no
        second notice) and returns ``(row as recorded, None)``. Raises StoreError for an
        unknown id.
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

    async def inbox_preview(self, inbox_id: int, message_id: str) -> None:
        """Remember the streamed preview shown for the row's answer (and give it to the
        row's reply if that is written already), durably."""

    async def inbox_unfinished(self, session_id: str | None = None) -> list[InboxRow]:
        """``pending`` and ``running`` rows in arrival order (of one session, if given)."""

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

    # -- dead letters (which rows they are: chat/deadletters.py) ----------------------------
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

    # -- cursors --------------------------------------------------------------------------
    async def get_cursor(self, name: str) -> str | None:
        """A named position that survives restarts (a poll offset, a last seen id)."""

    async def set_cursor(self, name: str, value: str) -> None: ...

    # -- Thread Relay ---------------------------------------------------------------------
    async def relay_deliver(
        self,
        delivery: RelayDelivery,
        post: NewOutbound,
        message: RelayedMessage,
        *,
        max_in_flight: int,
    ) -> tuple[RelayDelivery, bool, OutboxRow | None, InboxRow | None]:
        """Deliver into the target, in one transaction: the receipt (``delivery``, state
        ``delivered``, with its idempotency key), ``message`` as a ``pending`` row of the
        target session's inbox (event id ``relay:<id>``, with the delivery's id and intent),
        ``post`` (the attributed message) in the outbox, and ``relay_sent`` /
        ``relay_received`` events on both sessions' timelines.
        ``(stored, True, post's row, message's row)``, the stored receipt naming both rows.

        A delivery with the same source session and key exists: nothing is written,
        ``(first, False, None, None)``. The source has ``max_in_flight`` deliveries whose
        target has not taken them yet (inbox row unfinished or post unsent): nothing is
        written and :class:`RelayInFlight` is raised.
        """

    async def relay_record(
        self, delivery: RelayDelivery, *, on_target: bool = False
    ) -> RelayDelivery:
        """Record an attempt that was not delivered (keyless), with a ``relay_refused`` event
        on the source session's timeline and, ``on_target``, on the target's too (a thread
        the caller may address; never one it named wrongly or of another project)."""

    async def relay_get(self, delivery_id: str) -> RelayDelivery | None: ...

    async def relay_find(self, source_session: str, idem_key: str) -> RelayDelivery | None: ...

    async def relay_list(
        self, *, session_id: str | None = None, limit: int = 50
    ) -> list[RelayDelivery]:
        """Newest first; with ``session_id``, the ones from or into that session."""

    async def relay_in_flight(self, source_session: str) -> int:
        """The source's deliveries the target has not taken yet (see :meth:`relay_deliver`)."""

    async def relay_mark_read(self, read: RelayRead) -> None:
        """Remember what a session read of another thread (replacing the earlier read)."""

    async def relay_last_read(
        self, source_session: str, target_session: str
    ) -> RelayRead | None: ...

    async def relay_foreign_changes(
        self, source_session: str, target_session: str, since_revision: int
    ) -> int:
        """How many messages ``target_session`` got after ``since_revision`` that are not
        the records of ``source_session``'s own notifies: what its read did not see."""

    async def inbox_authored(self, session_id: str, user: str, text: str) -> InboxRow | None:
        """The newest platform message of ``session_id`` that ``user`` wrote with exactly
        ``text`` (relayed messages are not theirs)."""

    async def inbox_activity(self, session_id: str) -> tuple[InboxRow | None, int]:
        """The session's running row (its active turn), if any, and how many wait."""

    # -- token and spend budgets ----------------------------------------------------------
    async def spend_reserve(
        self, call: ModelCall, charges: Sequence[SpendCharge]
    ) -> SpendRefusal | None:
        """Reserve a model call's worst case (``call``, state ``reserved``: its
        ``reserved_tokens`` and ``reserved_usd``) against every charge, durably and in one
        transaction: the first limited charge it does not fit is returned and nothing is
        written; otherwise the row is written and every charge's counter grows by it."""

    async def spend_record(self, call: ModelCall, charges: Sequence[SpendCharge]) -> None:
        """Write a call that reserved nothing (settled or failed) and count what it used."""

    async def spend_settle(self, settled: ModelCall) -> bool:
        """Settle a reserved call with what it used (``settled``: state ``settled`` or
        ``failed``), moving its charges' counters from its worst case to that. False: the
        row was not reserved (settled already, or unknown), and nothing changed."""

    async def spend_used(self, counters: Sequence[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """What each ``(scope, period)`` counter has used (0 for one never charged)."""

    async def model_calls(
        self, *, session_id: str | None = None, limit: int = 100
    ) -> list[ModelCall]:
        """Newest first."""

    async def usage_report(
        self, *, by: UsageGrouping = "all", since_day: str | None = None
    ) -> list[UsageRow]:
        """Model calls summed per group (``all``, ``binding``, ``job`` or ``day``)."""
