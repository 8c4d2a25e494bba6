"""Thread Relay's four tools: ``thread_list``, ``thread_read``, ``thread_status`` (reads) and
``thread_send`` (a delivery with a receipt).

Every call acts for the person the turn acts for, in their thread's project: a chat
message's sender in a bound chat, or the terminal user in ``[relay] terminal_project``. A
job or a headless run acts for nobody and gets a tool error. Another project's threads do
not exist as far as a caller can tell.

A send is checked, in this order, before anything changes (each refusal is recorded with a
receipt of its own, keyless, so the same key can be tried again once its cause is gone):
the idempotency key (a key used before answers with its first receipt and sends nothing),
the relay switched on, the forwarding depth (a turn started by a relayed ``ask`` relays no
further), no sending to itself, the target's adapter, the caller's last read of the target
(its capability revision, its age, which is the envelope's expiry, the target's revision and
active turn), then the text: ``user_authored`` must be exactly a message the caller wrote in
this thread; ``agent_proposed_user_approved`` was approved by the caller through the tool
authority pipeline (``ToolSpec.asks_caller``) before the handler ran (except in a turn
answering a relayed message, which the depth check refuses without asking anyone). The
delivery itself is one store transaction with the count of deliveries in flight (store
``relay_deliver``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from geodebot.chat.bindings import BindingIndex, calling_binding
from geodebot.config.schema import BindingConfig, RelayConfig
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.modes import Mode
from geodebot.engine.tools.spec import (
    Effect,
    Handler,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)
from geodebot.relay.contracts import (
    DeliveryState,
    Intent,
    ReceiptReferences,
    ThreadDeliveryReceiptV1,
    ThreadLocatorV1,
    ThreadMessageEnvelopeV1,
    content_sha256,
)
from geodebot.relay.projection import ThreadStore, project_thread
from geodebot.relay.threads import Thread, ThreadDirectory
from geodebot.store.records import (
    InboxRow,
    NewOutbound,
    OutboxRow,
    RelayDelivery,
    RelayedMessage,
    RelayInFlight,
    RelayRead,
    StoreError,
)

__all__ = [
    "RELAY_TOOL_NAMES",
    "THREAD_LIST",
    "THREAD_READ",
    "THREAD_SEND",
    "THREAD_STATUS",
    "Delivered",
    "ThreadRelay",
]

THREAD_LIST, THREAD_READ, THREAD_STATUS, THREAD_SEND = (
    "thread_list",
    "thread_read",
    "thread_status",
    "thread_send",
)
RELAY_TOOL_NAMES = (THREAD_LIST, THREAD_READ, THREAD_STATUS, THREAD_SEND)
AGENT_PROPOSED = "agent_proposed_user_approved"
# Told of each delivery once it is committed: its attributed post and its target inbox row.
Delivered = Callable[[OutboxRow, InboxRow], None]

_THREAD = {"type": "string", "minLength": 1, "maxLength": 300, "description": "a thread id"}
_STATUS_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {"thread": _THREAD},
    "required": ["thread"],
    "additionalProperties": False,
}
_READ_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "thread": _THREAD,
        "cursor": {"type": "string", "maxLength": 64, "description": "from an earlier read"},
    },
    "required": ["thread"],
    "additionalProperties": False,
}


def _send_schema(max_chars: int) -> Mapping[str, Any]:
    return {
        "type": "object",
        "properties": {
            "thread": _THREAD,
            "text": {"type": "string", "minLength": 1, "maxLength": max_chars},
            "mode": {
                "enum": ["user_authored", AGENT_PROPOSED],
                "description": (
                    "user_authored: the exact text of a message the user wrote here; "
                    f"{AGENT_PROPOSED}: your own text, which the user is asked to approve"
                ),
            },
            "intent": {
                "enum": ["notify", "ask"],
                "description": "notify: post it there; ask: also have it answered there",
            },
            "idempotency_key": {
                "type": "string",
                "minLength": 1,
                "maxLength": 128,
                "description": "unique per message; repeating it sends nothing again",
            },
        },
        "required": ["thread", "text", "mode", "intent", "idempotency_key"],
        "additionalProperties": False,
    }


def _reader(name: str, description: str, schema: Mapping[str, Any], handler: Handler) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=description,
        input_schema=schema,
        safety=Safety.READ,
        effect=Effect.NONE,
        handler=handler,
        timeout_s=10.0,
    )


@dataclass(frozen=True, slots=True)
class _Caller:
    user: str
    thread: Thread

    @property
    def project(self) -> str:
        return self.thread.project


class _Refusal(Exception):
    def __init__(self, state: DeliveryState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


class ThreadRelay:
    def __init__(
        self,
        store: ThreadStore,
        bindings: BindingIndex | Sequence[BindingConfig],
        config: RelayConfig,
        *,
        adapters: frozenset[str],
        model: str,
        ledger: EvidenceLedger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._index = BindingIndex.of(bindings)
        self._directory = ThreadDirectory(self._index, config.terminal_project)
        self._config = config
        # The platforms with a configured channel: a thread on any other cannot be posted to.
        self._adapters = adapters
        self._model = model
        self._ledger = ledger
        self._clock = clock
        self._delivered: list[Delivered] = []

    def connect(self, delivered: Delivered) -> None:
        """Have the daemon told of each delivery (its outbox sends the post, its router runs
        the target's turn). Without one, delivered rows wait in the store for the daemon."""
        self._delivered.append(delivered)

    def specs(self) -> list[ToolSpec]:
        return [
            _reader(
                THREAD_LIST,
                "The threads of this chat's project that you can read and send into, each with "
                "the id the other thread tools take.",
                {"type": "object", "properties": {}, "additionalProperties": False},
                self._list,
            ),
            _reader(
                THREAD_STATUS,
                "A thread's state: whether a turn is running there, its revision and "
                "capability revision. Reading it again is what a send is checked against.",
                _STATUS_SCHEMA,
                self._status,
            ),
            _reader(
                THREAD_READ,
                "The latest visible messages of a thread (user and assistant text only, "
                "bounded); pass the cursor back for older ones.",
                _READ_SCHEMA,
                self._read,
            ),
            ToolSpec(
                name=THREAD_SEND,
                description=(
                    "Post a message into another thread of this project, attributed to the "
                    "user who asked, based on your last thread_status or thread_read of it. "
                    "Returns a delivery receipt."
                ),
                input_schema=_send_schema(self._config.max_send_chars),
                safety=Safety.WRITE,
                effect=Effect.COMMUNICATE,
                handler=self._send,
                resource_keys=("relay",),
                timeout_s=15.0,
                # Listing the tool authorises relaying the user's own words; text the model
                # wrote goes only with the asker's own approval, every time.
                requires_approval=False,
                # A turn answering a relayed message is refused by the handler (depth), with
                # a receipt like every refused send, rather than asking anyone.
                asks_caller=lambda arguments, ctx: (
                    arguments.get("mode") == AGENT_PROPOSED and not ctx.forwarded
                ),
                idempotent=True,
            ),
        ]

    # -- who asks, about what -----------------------------------------------------------------
    def _caller(self, ctx: ToolCallContext) -> _Caller:
        if ctx.mode is Mode.DAEMON and ctx.user:
            binding = calling_binding(self._index, ctx)
            thread = self._directory.locate(ctx.session_id) if binding is not None else None
            if thread is not None:
                return _Caller(ctx.user, thread)
        if ctx.mode is Mode.IPC:
            thread = self._directory.terminal(ctx.session_id)
            if thread is None:
                raise ToolError(
                    "the terminal takes no part in Thread Relay here ([relay] terminal_project "
                    "is not set)"
                )
            return _Caller(ctx.user or "terminal", thread)
        raise ToolError(
            "Thread Relay acts for a person in a bound chat; this turn acts for nobody "
            "(a scheduled job or a headless run)"
        )

    def _target(self, caller: _Caller, raw: object) -> Thread:
        thread = self._directory.locate(str(raw))
        # Another project's thread gets the same answer as none: its existence is not shared.
        if thread is None or thread.project != caller.project:
            raise _Refusal(
                "refused", f"there is no thread {str(raw)[:120]!r} in project {caller.project!r}"
            )
        return thread

    # -- reads --------------------------------------------------------------------------------
    async def _list(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        caller = self._caller(ctx)
        threads = await self._directory.in_project(caller.project, self._store)
        rows = [
            {
                "thread": t.session_id,
                "adapter": t.adapter,
                "where": t.key,
                "links": list(t.links),
                "this_thread": t.session_id == ctx.session_id,
            }
            for t in threads
        ]
        return json.dumps({"project": caller.project, "threads": rows}, ensure_ascii=False)

    async def _status(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        caller = self._caller(ctx)
        target = self._readable(caller, arguments)
        view = await project_thread(
            self._store, target, self._config, model=self._model, messages=False
        )
        await self._mark_read(ctx, target, view.revision, view.active_turn)
        status = view.model_dump(mode="json", exclude={"messages", "cursor", "excluded"})
        status["send_valid_until"] = self._clock() + self._config.envelope_ttl_s
        return json.dumps(status, ensure_ascii=False)

    async def _read(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        caller = self._caller(ctx)
        target = self._readable(caller, arguments)
        try:
            view = await project_thread(
                self._store,
                target,
                self._config,
                model=self._model,
                cursor=arguments.get("cursor"),
            )
        except ValueError as exc:
            raise ToolError(str(exc)) from None
        await self._mark_read(ctx, target, view.revision, view.active_turn)
        return view.model_dump_json()

    def _readable(self, caller: _Caller, arguments: Mapping[str, Any]) -> Thread:
        try:
            return self._target(caller, arguments.get("thread"))
        except _Refusal as refusal:
            raise ToolError(refusal.reason) from None

    async def _mark_read(
        self, ctx: ToolCallContext, target: Thread, revision: int, active_turn: str | None
    ) -> None:
        await self._store.relay_mark_read(
            RelayRead(
                ctx.session_id,
                target.session_id,
                revision,
                target.capability(self._config),
                active_turn,
                target.adapter,
                self._clock(),
            )
        )

    # -- the send -----------------------------------------------------------------------------
    async def _send(self, arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        caller = self._caller(ctx)
        key = str(arguments["idempotency_key"])
        text = str(arguments["text"])
        first = await self._store.relay_find(ctx.session_id, key)
        if first is not None:
            return self._answer(
                first, replayed=True, other=content_sha256(text) != first.content_sha256
            )
        try:
            target = self._target(caller, arguments.get("thread"))
            envelope = await self._envelope(caller, target, arguments, ctx)
        except _Refusal as refusal:
            return await self._refuse(caller, arguments, ctx, refusal)
        return await self._deliver(caller, target, envelope, ctx)

    # -- the operator's send (the console) ----------------------------------------------------
    async def project_threads(self, session_id: str) -> list[str]:
        """The other threads of ``session_id``'s project, which a send from it may go to."""
        thread = self._directory.locate(session_id)
        if thread is None:
            return []
        return [
            other.session_id
            for other in await self._directory.in_project(thread.project, self._store)
            if other.session_id != session_id
        ]

    async def operator_send(
        self, source_session: str, turn_id: str, target_session: str, intent: Intent, *, by: str
    ) -> tuple[RelayDelivery, bool]:
        """The operator sends a run's result (the last answer of ``turn_id`` in
        ``source_session``) into another thread of its project: a ``user_authored`` delivery
        by ``by`` whose ``message_ref`` is that answer. Its key names the run and the target,
        so a second press returns the first receipt (``(first, False)``).

        Checked as a tool's send is, but for the read: the operator looks at the target as it
        is, so the envelope expects its current revision and active turn. A refusal is
        recorded with its receipt and raised as :class:`ToolError`."""
        source = self._directory.locate(source_session)
        if source is None:
            raise ToolError(f"{source_session!r} is not a thread of any binding")
        caller = _Caller(by, source)
        ctx = ToolCallContext(source_session, f"console:{turn_id}", Mode.DAEMON, user=by)
        key = f"console:{turn_id}:{target_session}"[:128]
        first = await self._store.relay_find(source_session, key)
        if first is not None:
            return first, False
        arguments: dict[str, Any] = {
            "thread": target_session,
            "intent": intent,
            "mode": "user_authored",
            "idempotency_key": key,
        }
        try:
            text, message_ref = await self._result(source_session, turn_id)
            arguments["text"] = text
            target = self._target(caller, target_session)
            self._may_send(target, ctx)
            if len(text) > self._config.max_send_chars:
                limit = self._config.max_send_chars
                raise _Refusal("refused", f"the answer is longer than {limit} characters")
            record = await self._store.get_session(target.session_id)
            running, _ = await self._store.inbox_activity(target.session_id)
            envelope = self._operator_envelope(
                id=f"env-{secrets.token_hex(8)}",
                source=source.locator(self._config, send=True),
                target=target.locator(self._config, send=True),
                project=caller.project,
                user=by,
                mode="user_authored",
                text=text,
                message_ref=message_ref,
                intent=intent,
                expected_revision=record.next_seq - 1 if record is not None else 0,
                active_turn=None if running is None else running.turn_id,
                idempotency_key=key,
                expires_at=self._clock() + self._config.envelope_ttl_s,
                depth=0,
            )
        except _Refusal as refusal:
            await self._refuse(caller, arguments, ctx, refusal)
            raise AssertionError("_refuse raises") from None
        await self._deliver(caller, target, envelope, ctx)
        stored = await self._store.relay_find(source_session, key)
        assert stored is not None, "a delivery is found by its key once made"
        return stored, True

    @staticmethod
    def _operator_envelope(**fields: Any) -> ThreadMessageEnvelopeV1:
        try:
            return ThreadMessageEnvelopeV1(**fields)
        except ValidationError as exc:
            reason = f"the envelope is not valid: {exc.errors()[0]['msg']}"
            raise _Refusal("refused", reason) from None

    async def _result(self, session_id: str, turn_id: str) -> tuple[str, str]:
        """The text of a run's last answer and its reference (``seq:<n>``)."""
        for record in reversed(await self._store.load_messages(session_id)):
            if record.turn_id == turn_id and record.role == "assistant":
                text = _plain_text(record.content)
                if text.strip():
                    return text, f"seq:{record.seq}"
        raise _Refusal("refused", f"run {turn_id} has no answer in this context to send")

    async def _envelope(
        self,
        caller: _Caller,
        target: Thread,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
    ) -> ThreadMessageEnvelopeV1:
        """The envelope, once every check before a delivery has passed."""
        self._may_send(target, ctx)
        read, active = await self._current_read(target, ctx)
        text = str(arguments["text"])
        mode = str(arguments["mode"])
        message_ref = None
        if mode == "user_authored":
            message_ref = await self._authored(caller, ctx, text)
        elif not ctx.user:
            raise _Refusal("refused", "agent-written text needs the approval of a person")
        try:
            return ThreadMessageEnvelopeV1(
                id=f"env-{secrets.token_hex(8)}",
                source=caller.thread.locator(self._config, send=True),
                target=target.locator(self._config, send=True),
                project=caller.project,
                user=caller.user,
                mode=mode,  # type: ignore[arg-type]  # checked by the input schema
                text=text,
                message_ref=message_ref,
                intent=arguments["intent"],
                expected_revision=read.revision,
                active_turn=active,
                idempotency_key=str(arguments["idempotency_key"]),
                expires_at=read.read_at + self._config.envelope_ttl_s,
                depth=ctx.forwarded,
            )
        except ValidationError as exc:
            reason = f"the envelope is not valid: {exc.errors()[0]['msg']}"
            raise _Refusal("refused", reason) from None

    def _may_send(self, target: Thread, ctx: ToolCallContext) -> None:
        """The checks that need no read: the switch, the depth, the target and its adapter."""
        if not self._config.enabled:
            raise _Refusal("refused", "Thread Relay is switched off ([relay] enabled = false)")
        if ctx.forwarded >= 1:
            raise _Refusal(
                "refused",
                "forwarding depth: this turn answers a relayed message and may not relay further",
            )
        if target.session_id == ctx.session_id:
            raise _Refusal("refused", "a thread cannot send into itself")
        if target.binding is None or target.adapter not in self._adapters:
            raise _Refusal(
                "refused",
                f"{target.key} cannot be posted to: its adapter {target.adapter!r} is not "
                "running here, and no other adapter is used in its place",
            )

    async def _current_read(
        self, target: Thread, ctx: ToolCallContext
    ) -> tuple[RelayRead, str | None]:
        """The caller's last read of ``target``, if it still holds: its capability revision,
        its age (the envelope's expiry), the revision and active turn it saw; and the
        target's active turn."""
        read = await self._store.relay_last_read(ctx.session_id, target.session_id)
        if read is None:
            raise _Refusal("refused", "read the thread first (thread_status or thread_read)")
        if read.capability != target.capability(self._config) or read.adapter != target.adapter:
            raise _Refusal(
                "refused",
                "the thread's capability revision changed since it was read; read it again "
                "(thread_status)",
            )
        now = self._clock()
        expires_at = read.read_at + self._config.envelope_ttl_s
        if now > expires_at:
            raise _Refusal(
                "expired", "the read this send is based on is too old; read the thread again"
            )
        record = await self._store.get_session(target.session_id)
        revision = record.next_seq - 1 if record is not None else 0
        # The records of the caller's own notifies are no news to it: several can be sent
        # on one read.
        if revision != read.revision and await self._store.relay_foreign_changes(
            ctx.session_id, target.session_id, read.revision
        ):
            raise _Refusal(
                "stale",
                f"the thread changed since it was read (revision {read.revision}, now "
                f"{revision}); read it again",
            )
        running, _ = await self._store.inbox_activity(target.session_id)
        active = None if running is None else running.turn_id
        if running is not None and await self._own_notify(running, ctx):
            active = read.active_turn
        if active is not None and active != read.active_turn:
            raise _Refusal(
                "stale",
                f"the thread is in turn {active}, which the read did not see; interjecting "
                "needs that turn's exact id: read it again",
            )
        return read, active

    async def _own_notify(self, row: InboxRow, ctx: ToolCallContext) -> bool:
        """Whether ``row`` only records a notify the caller's thread sent."""
        if row.relay_intent != "notify" or row.relay_id is None:
            return False
        delivery = await self._store.relay_get(row.relay_id)
        return delivery is not None and delivery.source_session == ctx.session_id

    async def _authored(self, caller: _Caller, ctx: ToolCallContext, text: str) -> str:
        """The id of the caller's own message in this thread that ``text`` is exactly."""
        if caller.thread.binding is None:
            # The terminal: its user is the only one who writes in its session.
            for record in reversed(await self._store.load_context(ctx.session_id)):
                if record.role == "user" and _plain_text(record.content) == text:
                    return f"seq:{record.seq}"
        else:
            row = await self._store.inbox_authored(ctx.session_id, caller.user, text)
            if row is not None:
                return f"inbox:{row.id}"
        raise _Refusal(
            "refused",
            "user_authored text must be exactly a message the user wrote in this thread; "
            f"for your own wording use mode {AGENT_PROPOSED}",
        )

    async def _deliver(
        self,
        caller: _Caller,
        target: Thread,
        envelope: ThreadMessageEnvelopeV1,
        ctx: ToolCallContext,
    ) -> str:
        assert target.binding is not None
        delivery = self._record(
            envelope.id, caller, target, envelope.source, envelope.target, ctx, envelope
        )
        source_where = caller.thread.key
        post = NewOutbound(
            session_id=target.session_id,
            platform=target.adapter,
            channel=target.binding.channel,
            thread=target.platform_thread,
            reply_to=None,
            text=f"From #{caller.thread.session_id} ({source_where}), by @{caller.user}:\n\n"
            + envelope.text,
            kind="relay",
        )
        message = RelayedMessage(
            platform=target.adapter,
            channel=target.binding.channel,
            thread=target.platform_thread,
            user=caller.user,
            text=(
                f"[Relayed from thread {caller.thread.session_id} ({source_where}) by "
                f"{caller.user}; {envelope.intent}; envelope {envelope.id}]\n{envelope.text}"
            ),
        )
        try:
            stored, new, outbox, inbox = await self._store.relay_deliver(
                delivery, post, message, max_in_flight=self._config.max_in_flight
            )
        except RelayInFlight as exc:
            refusal = _Refusal(
                "refused",
                f"{exc.in_flight} deliveries from this thread are in flight (at most "
                f"{self._config.max_in_flight}); wait for them to be taken",
            )
            return await self._refuse(caller, envelope.model_dump(), ctx, refusal, target)
        except StoreError as exc:
            # Nothing of it was written: the target is as it was.
            refusal = _Refusal("failed", f"the delivery could not be saved: {exc}")
            return await self._refuse(caller, envelope.model_dump(), ctx, refusal, target)
        if new and outbox is not None and inbox is not None:
            self._evidence(stored)
            for delivered in self._delivered:
                delivered(outbox, inbox)
        return self._answer(stored, replayed=not new)

    def _record(
        self,
        delivery_id: str,
        caller: _Caller,
        target: Thread | None,
        source: ThreadLocatorV1 | None,
        target_locator: ThreadLocatorV1 | None,
        ctx: ToolCallContext,
        envelope: ThreadMessageEnvelopeV1 | None,
        arguments: Mapping[str, Any] | None = None,
        refusal: _Refusal | None = None,
    ) -> RelayDelivery:
        given = envelope.model_dump() if envelope is not None else dict(arguments or {})
        text = str(given.get("text", ""))
        key = str(given.get("idempotency_key", ""))
        intent: Intent = "ask" if given.get("intent") == "ask" else "notify"
        now = self._clock()
        receipt = ThreadDeliveryReceiptV1(
            id=delivery_id,
            source=source,
            target=target_locator,
            action=intent,
            state=refusal.state if refusal is not None else "delivered",
            at=now,
            references=ReceiptReferences(
                envelope_id=envelope.id if envelope is not None else delivery_id,
                idempotency_key=key[:128],
                message_ref=envelope.message_ref if envelope is not None else None,
            ),
            capability_revision=(target.capability(self._config) if target is not None else "-"),
            content_sha256=content_sha256(text),
            reason=(refusal.reason[:300] if refusal is not None else ""),
        )
        return RelayDelivery(
            id=delivery_id,
            source_session=ctx.session_id,
            target_session=target.session_id if target is not None else str(given.get("thread")),
            project=caller.project,
            user=caller.user,
            source_turn=ctx.turn_id,
            idem_key=key if refusal is None else None,
            intent=intent,
            mode=str(given.get("mode", "")),
            state=receipt.state,
            reason=receipt.reason,
            content_sha256=receipt.content_sha256,
            receipt=receipt.model_dump(mode="json"),
            created_at=now,
            envelope=(
                envelope.model_dump(mode="json", exclude={"text"}) if envelope is not None else {}
            ),
        )

    async def _refuse(
        self,
        caller: _Caller,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        refusal: _Refusal,
        target: Thread | None = None,
    ) -> str:
        if target is None:
            located = self._directory.locate(str(arguments.get("thread")))
            target = located if located is not None and located.project == caller.project else None
        record = self._record(
            f"rd-{secrets.token_hex(8)}",
            caller,
            target,
            caller.thread.locator(self._config, send=True),
            target.locator(self._config, send=True) if target is not None else None,
            ctx,
            None,
            arguments,
            refusal,
        )
        stored = await self._store.relay_record(record, on_target=target is not None)
        self._evidence(stored)
        raise ToolError(self._answer(stored, replayed=False))

    def _evidence(self, delivery: RelayDelivery) -> None:
        if self._ledger is None:
            return
        self._ledger.record(
            "relay_delivery",
            delivery=delivery.id,
            source=delivery.source_session,
            target=delivery.target_session,
            project=delivery.project,
            user=delivery.user,
            intent=delivery.intent,
            mode=delivery.mode,
            state=delivery.state,
            reason=delivery.reason,
            content_sha256=delivery.content_sha256,
        )

    @staticmethod
    def _answer(delivery: RelayDelivery, *, replayed: bool, other: bool = False) -> str:
        out: dict[str, Any] = {"receipt": dict(delivery.receipt)}
        if replayed:
            out["note"] = (
                "this idempotency key was used before: this is its first receipt, and "
                "nothing was sent again"
                + (" (this call's text differs from what it sent)" if other else "")
            )
        return json.dumps(out, ensure_ascii=False)


def _plain_text(content: Mapping[str, Any]) -> str:
    blocks = content.get("content", ())
    return "".join(
        str(b.get("text", "")) for b in blocks if isinstance(b, Mapping) and b.get("type") == "text"
    )
