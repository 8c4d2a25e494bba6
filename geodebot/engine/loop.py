"""The agent loop: ``AgenticLoop(session).arun(message)``.

Each round has six phases: prepare input, prepare call, call provider, process tools, observe
and compact, terminate. Durability rules:

* the user message is saved by the turn's first checkpoint (a tool batch's proposal, or the
  turn's end), so no tool runs and no answer is returned before it is saved; a crash before
  that only repeats a model call;
* a proposed tool batch is saved (with the assistant message proposing it) before any tool
  runs, and it does not run if it cannot be saved; the finished batch is saved again;
* a batch left ``proposed`` by a crash is finished by the next turn or by :meth:`resume`;
* a turn the caller names (``arun(text, turn_id=...)``, an inbox row's turn) and asks for
  again after a crash is continued where it stopped, or answered from the store if it had
  finished: its message is never saved twice and its tools never proposed anew;
* everything a turn needs is restored from the store, so a restart loses nothing.

The whole turn runs under the session's hard time budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from geodebot.engine import compaction
from geodebot.engine.compaction import Context, ContextItem
from geodebot.engine.ledger import content_hash
from geodebot.engine.llm.errors import LLMContextOverflow, LLMError
from geodebot.engine.llm.types import (
    Block,
    FileBlock,
    LLMAdapter,
    LLMRequest,
    LLMResponse,
    Message,
    StopReason,
    StreamEvent,
    StreamListener,
    TextBlock,
    TextDelta,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
    block_from_json,
    block_to_json,
    canonical_json,
)
from geodebot.engine.modes import Mode
from geodebot.engine.session import (
    LastCheckpoint,
    Outcome,
    Session,
    TurnEnding,
    TurnListener,
    TurnResult,
)
from geodebot.engine.spend import BudgetExhausted
from geodebot.engine.stored_context import decode_context
from geodebot.engine.tools.spec import ToolCallContext
from geodebot.engine.verify import VerifyContext, run_verifiers
from geodebot.logs.context import log_context
from geodebot.store.records import (
    BatchStatus,
    NewMessage,
    StoreError,
    ToolBatchRecord,
)

log = logging.getLogger(__name__)

# Cleanup after a budget expiry must itself be bounded.
_CLEANUP_TIMEOUT_S = 5.0

CANCELLED_RESULT = "cancelled: the turn's time budget ran out; this tool may or may not have acted"
CALLER_CANCELLED_RESULT = (
    "cancelled: the caller cancelled the turn; this tool may or may not have acted"
)


def _relay(listener: TurnListener) -> StreamListener:
    def on_stream(event: StreamEvent) -> None:
        if isinstance(event, TextDelta):
            listener.text(event.text)
        else:
            listener.restarted(event.reason)

    return on_stream


# Arguments that say what a call works on, for a progress line ("read_file notes/todo.md").
_HINT_KEYS = ("path", "file", "url", "name", "query", "command")
_HINT_CHARS = 60


def _hint(call: ToolUseBlock) -> str:
    for key in _HINT_KEYS:
        value = call.arguments.get(key)
        if isinstance(value, str) and value:
            return value if len(value) <= _HINT_CHARS else value[: _HINT_CHARS - 1] + "…"
    return ""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(slots=True)
class _Turn:
    id: str
    user_text: str
    state: dict[str, Any]
    guards: dict[str, Any]
    rounds: int = 0
    repairs: int = 0
    usage: Usage = field(default_factory=Usage)
    forced_compaction: bool = False
    open_batch: ToolBatchRecord | None = None
    events: list[tuple[str | None, str, Mapping[str, Any]]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    # The session row as the turn began: which context copy is still current.
    generation: int = 0
    next_seq: int = 0
    # The session's unfinished tool batches when they were read with its row; None: unread.
    pending: list[ToolBatchRecord] | None = None
    # Names of the calls the authority pipeline refused, for the turn's result.
    refused: list[str] = field(default_factory=list)
    # The user's message until the turn's first checkpoint writes it (see _run), with the
    # context list and item that get its seq then.
    unsaved: tuple[_Append, Context, ContextItem] | None = None
    # What the caller writes with the turn's last checkpoint (see arun).
    ending: TurnEnding | None = None
    # The stop reason of the turn's latest model answer ("end_turn", "refusal", ...).
    stop_reason: StopReason | None = None
    # The turn's time budget, as the timeout it runs under (see _guarded).
    deadline: asyncio.Timeout | None = None


@dataclass(frozen=True, slots=True)
class _Append:
    """A message a checkpoint writes: its row, and the message it was encoded from, which
    the context cache keeps as it is (see ContextCache.appended)."""

    row: NewMessage
    message: Message


def _append(message: Message, turn_id: str, **summary: Any) -> _Append:
    return _Append(NewMessage(message.role, message.to_json(), turn_id, **summary), message)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    state: dict[str, Any]
    guards: dict[str, Any]
    events: list[tuple[str | None, str, Mapping[str, Any]]]


class AgenticLoop:
    def __init__(self, session: Session) -> None:
        self._session = session
        self._svc = session.services
        # The tool schemas' share of a request's estimated tokens (the plan is immutable).
        self._tool_tokens: int | None = None

    # -- entry points ---------------------------------------------------------------------
    async def arun(
        self,
        message: str,
        turn_id: str | None = None,
        *,
        ending: TurnEnding | None = None,
        attachments: Sequence[Block] = (),
        record_only: bool = False,
    ) -> TurnResult:
        """Run one turn. ``ending`` is written in the commit of the turn's last checkpoint
        (its result's ``ended``); a turn that ends without one (the store failed, or it had
        ended before a crash) returns ``ended=None`` and its caller records it.
        ``attachments``: blocks of the user's message after its text (files it carried).
        ``record_only``: the message is saved in the history (with the ending) and nobody
        answers it: no model call (a message another thread relayed to be read later)."""
        turn = await self._new_turn(turn_id or new_id("t"), message)
        turn.ending = ending
        with log_context(session=self._session.id, turn=turn.id):
            if turn_id is not None and turn.guards.get("open_turn") == turn_id:
                return await self._guarded(turn, self._continue(turn))
            if turn_id is not None and turn.state.get("last_turn_id") == turn_id:
                return await self._finished(turn)
            if record_only:
                return await self._guarded(turn, self._record(turn, message))
            return await self._guarded(turn, self._run(turn, message, attachments))

    async def resume(self) -> TurnResult | None:
        """Finish a turn a crash interrupted after its tool batch was saved."""
        opened = self._session.take_opened()
        pending = (
            opened.pending
            if opened is not None
            else await self._svc.store.pending_batches(self._session.id)
        )
        if not pending:
            return None
        turn = await self._new_turn(pending[0].turn_id, "")
        with log_context(session=self._session.id, turn=turn.id):
            return await self._guarded(turn, self._resume(turn))

    # -- the turn -------------------------------------------------------------------------
    async def _new_turn(self, turn_id: str, text: str) -> _Turn:
        # create_session made the row; its state is read each turn afresh.
        opened = self._session.take_opened()
        record = (
            opened.record
            if opened is not None
            else await self._svc.store.get_session(self._session.id)
        )
        if record is None:
            raise StoreError(f"session {self._session.id!r} does not exist")
        return _Turn(
            turn_id,
            text,
            dict(record.state),
            dict(record.guards),
            generation=record.generation,
            next_seq=record.next_seq,
            pending=None if opened is None else opened.pending,
        )

    async def _guarded(self, turn: _Turn, work: Awaitable[TurnResult]) -> TurnResult:
        # A session's first turn counts from create_session, whose set-up (MCP servers of
        # listed tools coming up) is part of the turn; later turns from their own start.
        start = self._session.take_budget_start()
        if start is None:
            start = asyncio.get_running_loop().time()
        deadline = turn.deadline = asyncio.timeout_at(start + self._session.time_budget_s)
        try:
            async with deadline:
                return await work
        except asyncio.CancelledError:
            # A HEADLESS turn has nobody to continue it (its MCP client cancelled the call,
            # or geodebot run was interrupted): it ends here, on the timeline like a budget
            # expiry. DAEMON and IPC turns cancelled at shutdown stay open for the restart.
            if self._session.mode is Mode.HEADLESS:
                await self._cancelled(turn)
            raise
        except TimeoutError:
            if deadline.expired():
                return await self._budget_exhausted(turn)
            log.exception("turn %s: unexpected timeout", turn.id)
            return await self._fail(turn, "internal_error", "An internal timeout stopped the turn.")
        except StoreError as exc:
            log.error("turn %s: store failure: %s", turn.id, exc)
            return self._result(
                turn,
                "store_error",
                "geodebot could not save this conversation, so it stopped the turn.",
                error="StoreError",
            )
        except Exception as exc:
            # The one catch-all for a turn: the user gets a short answer, the log the details.
            log.exception("turn %s failed", turn.id)
            return await self._fail(
                turn,
                "internal_error",
                "Something went wrong inside geodebot; the turn was stopped.",
                error=type(exc).__name__,
            )

    async def _run(self, turn: _Turn, message: str, attachments: Sequence[Block]) -> TurnResult:
        items = await self._restore(turn)
        text = (TextBlock(message),) if message or not attachments else ()
        user = Message("user", (*text, *attachments))
        turn.guards["open_turn"] = turn.id
        started: dict[str, Any] = {"mode": self._session.mode.value, "chars": len(message)}
        files = [b for b in attachments if isinstance(b, FileBlock)]
        if files:
            started["files"] = [
                {"sha256": f.sha256, "media_type": f.media_type, "size": f.size} for f in files
            ]
        turn.events.append((turn.id, "turn_started", started))
        # Saved by the turn's first checkpoint, not before the model is asked: nothing the
        # answer leads to (a tool, a reply) happens before that checkpoint commits, and a
        # crash before it only repeats a model call. A message's turn without tools thus
        # makes one commit, where saving first cost it a store round trip more.
        item = ContextItem(0, user)  # its seq is known once saved
        items.append(item)
        turn.unsaved = (_append(user, turn.id), items, item)
        self._svc.emit("turn_started", {"session": self._session.id, "turn": turn.id})
        return await self._rounds(turn, items)

    async def _record(self, turn: _Turn, message: str) -> TurnResult:
        user = Message.user_text(message)
        turn.events.append((turn.id, "turn_started", {"mode": "record", "chars": len(message)}))
        item = ContextItem(0, user)
        turn.unsaved = (_append(user, turn.id), Context([item]), item)
        self._close(turn, "completed")
        result = self._outcome(turn, "completed", "")
        return self._report(turn, await self._end(turn, [], result))

    async def _continue(self, turn: _Turn) -> TurnResult:
        # The message was saved by the attempt a crash cut short; saving it again would
        # present it to the model twice, and the model would redo what it already did.
        items = await self._restore(turn)
        turn.events.append((turn.id, "turn_continued", {}))
        return await self._rounds(turn, items)

    async def _finished(self, turn: _Turn) -> TurnResult:
        """The turn ended before the crash; only its answer was lost with the process."""
        outcome = str(turn.state.get("last_outcome", ""))
        records = await self._svc.store.load_context(self._session.id)
        answers = [r for r in records if r.turn_id == turn.id and r.role == "assistant"]
        if outcome == "completed" and answers:
            return self._result(turn, "completed", Message.from_json(answers[-1].content).text)
        return self._result(
            turn,
            "internal_error",
            "This request ended without an answer before geodebot restarted; please ask again.",
            error=outcome or None,
        )

    async def _resume(self, turn: _Turn) -> TurnResult:
        items = await self._restore(turn)
        turn.events.append((turn.id, "turn_resumed", {}))
        return await self._rounds(turn, items)

    async def _restore(self, turn: _Turn) -> Context:
        """The one restore path: context, then any batch a crash left unfinished."""
        items = await self._context(turn)
        pending, turn.pending = turn.pending, None
        if pending is None:
            pending = await self._svc.store.pending_batches(self._session.id)
        for batch in pending:
            turn.events.append((batch.turn_id, "tool_batch_recovered", {"batch": batch.id}))
            calls = [block_from_json(c) for c in batch.calls]
            await self._execute_batch(
                turn, items, batch, [c for c in calls if isinstance(c, ToolUseBlock)]
            )
        return items

    async def _context(self, turn: _Turn) -> Context:
        cache, session_id = self._svc.context_cache, self._session.id
        if cache is not None:
            cached = cache.get(session_id, turn.generation, turn.next_seq)
            if cached is not None:
                return cached
        # A miss reads the whole history: the rows as stored, decoded in one pass.
        items = Context(decode_context(await self._svc.store.load_context_json(session_id)))
        if cache is not None:
            cache.put(session_id, turn.generation, turn.next_seq, items)
        return items

    async def _rounds(self, turn: _Turn, items: Context) -> TurnResult:
        budgets = self._svc.budgets
        while turn.rounds < budgets.max_rounds:
            turn.rounds += 1
            items = await self._maybe_compact(turn, items, force=False)
            try:
                view = compaction.latest_images_only(items)
                if self._svc.files is not None:
                    view = await self._svc.files.view(view)
                response = await self._call(turn, self._request(view), view)
            except LLMContextOverflow as exc:
                # One forced compaction, and one more try only if it shortened anything.
                compacted = None
                if not turn.forced_compaction:
                    turn.forced_compaction = True
                    compacted = await self._maybe_compact(turn, items, force=True)
                if compacted is None or compacted is items:
                    return await self._fail(turn, "model_error", exc.user_message, exc.kind)
                items = compacted
                continue
            except BudgetExhausted as exc:
                turn.events.append((turn.id, "budget_exhausted", {"budget": exc.budget}))
                return await self._fail(turn, "budget", exc.user_message, exc.kind)
            except LLMError as exc:
                return await self._fail(turn, "model_error", exc.user_message, exc.kind)
            message = response.message
            if message.tool_uses:
                await self._process_tools(turn, items, message)
                continue
            done = await self._terminate(turn, items, message)
            if done is not None:
                return done
        return await self._fail(
            turn,
            "max_rounds",
            f"I stopped after {budgets.max_rounds} model rounds without finishing.",
        )

    # -- phases ---------------------------------------------------------------------------
    def _request(self, items: Context) -> LLMRequest:
        tools = self._session.plan.schemas()
        if self._tool_tokens is None:
            chars = sum(len(t.description) + len(canonical_json(t.input_schema)) for t in tools)
            self._tool_tokens = chars // 4
        system = self._svc.system_prompt
        return LLMRequest(
            system=system,
            messages=items.messages(),
            tools=tools,
            max_tokens=self._svc.limits.max_tokens,
            estimated_input_tokens=compaction.estimate_tokens(items, system) + self._tool_tokens,
        )

    def _llm(self, turn: _Turn) -> LLMAdapter:
        def on_event(kind: str, data: dict[str, Any]) -> None:
            turn.events.append((turn.id, kind, data))

        llm = self._svc.llm(on_event)
        spend = self._svc.spend
        if spend is None:
            return llm
        session = self._session
        return spend.wrap(llm, session_id=session.id, turn_id=turn.id, scope=session.spend)

    async def _call(self, turn: _Turn, request: LLMRequest, items: Context) -> LLMResponse:
        llm = self._llm(turn)
        started = time.monotonic()
        # content_hash([[message JSON...], system, [tool name...]]), the messages' part kept
        # by the context as it grows (see Context.digest).
        request_hash = items.digest(
            canonical_json(request.system), canonical_json([t.name for t in request.tools])
        )
        base = {"session": self._session.id, "turn": turn.id, "request_sha256": request_hash}
        listener = self._session.listener
        try:
            if listener is None:
                response = await llm.complete(request)
            else:
                listener.round_started()
                response = await llm.complete(request, on_stream=_relay(listener))
        except LLMError as exc:
            elapsed = round((time.monotonic() - started) * 1000)
            self._svc.ledger.record("model_call", **base, outcome=exc.kind, latency_ms=elapsed)
            turn.events.append((turn.id, "llm_error", {"kind": exc.kind, "error": str(exc)}))
            self._svc.emit(
                "llm_error", {"session": self._session.id, "turn": turn.id, "kind": exc.kind}
            )
            raise
        elapsed = round((time.monotonic() - started) * 1000)
        turn.usage = turn.usage + response.usage
        turn.stop_reason = response.stop_reason
        info = {
            "provider": response.provider,
            "model": response.model,
            "stop_reason": response.stop_reason,
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
            "cache_read_tokens": response.usage.cache_read_tokens,
            "cache_write_tokens": response.usage.cache_write_tokens,
            "latency_ms": elapsed,
        }
        self._svc.ledger.record(
            "model_call",
            **base,
            **info,
            outcome="ok",
            response_sha256=content_hash(response.message.to_json()),
        )
        turn.events.append((turn.id, "llm_call", info))
        self._svc.emit("llm_call", {"session": self._session.id, "turn": turn.id, **info})
        return response

    @contextlib.asynccontextmanager
    async def _waiting_for_a_person(self, turn: _Turn) -> AsyncIterator[None]:
        """While a person decides on a call, the turn's time budget stands still (it must not
        run out on someone reading a card) and its place under the global cap is free; the
        rest of the turn then gets a fresh budget."""
        if turn.deadline is not None:
            turn.deadline.reschedule(None)
        try:
            if self._session.slot is None:
                yield
            else:
                async with self._session.slot.released():
                    yield
        finally:
            if turn.deadline is not None:
                fresh = asyncio.get_running_loop().time() + self._session.time_budget_s
                turn.deadline.reschedule(fresh)

    async def _process_tools(self, turn: _Turn, items: Context, message: Message) -> None:
        calls = list(message.tool_uses)
        batch = ToolBatchRecord(
            id=new_id("b"),
            session_id=self._session.id,
            turn_id=turn.id,
            round=turn.rounds,
            status="proposed",
            calls=[block_to_json(c) for c in calls],
            results=[],
            created_at=time.time(),
            finished_at=None,
        )
        turn.events.append(
            (turn.id, "tool_batch_proposed", {"batch": batch.id, "tools": [c.name for c in calls]})
        )
        # If this save fails the StoreError ends the turn and no tool has run.
        seqs = await self._checkpoint(turn, [_append(message, turn.id)], propose_batch=batch)
        items.append(ContextItem(seqs[0], message))
        self._svc.emit("batch_saved", {"session": self._session.id, "batch": batch.id})
        await self._execute_batch(turn, items, batch, calls)

    async def _execute_batch(
        self,
        turn: _Turn,
        items: Context,
        batch: ToolBatchRecord,
        calls: Sequence[ToolUseBlock],
    ) -> None:
        turn.open_batch = batch
        ctx = ToolCallContext(
            self._session.id,
            batch.turn_id,
            self._session.mode,
            approver=self._session.approver,
            desk=self._session.desk,
            origin=self._session.origin,
            outlet=self._session.outlet,
            user=self._session.user,
            forwarded=self._session.forwarded,
            waiting_for_a_person=functools.partial(self._waiting_for_a_person, turn),
        )
        if self._session.listener is not None:
            self._session.listener.tools_started(tuple((c.name, _hint(c)) for c in calls))
        outcomes = await self._svc.runner.run_batch(self._session.plan, calls, ctx)
        for outcome in outcomes:
            self._svc.ledger.record(
                "tool_call",
                session=self._session.id,
                turn=batch.turn_id,
                tool=outcome.call.name,
                status=outcome.status,
                reason=outcome.reason,
                receipt=outcome.receipt_id,
                approval=outcome.approval_id,
                approved_by=outcome.decided_by,
                arguments_sha256=content_hash(dict(outcome.call.arguments)),
                result_sha256=content_hash(outcome.result.content),
            )
            if outcome.status == "refused":
                turn.refused.append(outcome.call.name)
            event = outcome.timeline()
            turn.events.append((batch.turn_id, "tool_call", event))
            self._svc.emit("tool_call", {"session": self._session.id, **event})
        await self._save_results(turn, items, batch, [o.result for o in outcomes], "done")

    async def _save_results(
        self,
        turn: _Turn,
        items: Context,
        batch: ToolBatchRecord,
        results: Sequence[ToolResultBlock],
        status: BatchStatus,
    ) -> None:
        message = Message("user", tuple(results))
        finish = (batch.id, [block_to_json(r) for r in results], status)
        seqs = await self._checkpoint(turn, [_append(message, batch.turn_id)], finish_batch=finish)
        turn.open_batch = None
        items.append(ContextItem(seqs[0], message))
        self._svc.emit("batch_done", {"session": self._session.id, "batch": batch.id})

    async def _terminate(self, turn: _Turn, items: Context, message: Message) -> TurnResult | None:
        answer = message.text
        name, verdict = await run_verifiers(
            self._svc.verifiers,
            VerifyContext(self._session.id, turn.id, turn.user_text, answer, turn.rounds),
        )
        if verdict.ok:
            turn.events.append((turn.id, "verify", {"ok": True}))
            self._close(turn, "completed")
            result = self._outcome(turn, "completed", answer)
            return self._report(turn, await self._end(turn, [_append(message, turn.id)], result))
        turn.events.append(
            (turn.id, "verify", {"ok": False, "verifier": name, "reason": verdict.reason})
        )
        if verdict.repair is None or turn.repairs >= self._svc.budgets.repair_budget:
            return await self._fail(
                turn, "verify_failed", f"I could not finish this request: {verdict.reason}."
            )
        turn.repairs += 1
        repair = Message.user_text(verdict.repair)
        new = [_append(repair, turn.id)]
        # An empty assistant message is rejected by providers; keep only real content.
        if message.content and answer.strip():
            new.insert(0, _append(message, turn.id))
        seqs = await self._checkpoint(turn, new)
        for seq, written in zip(seqs, new, strict=True):
            items.append(ContextItem(seq, written.message))
        return None

    async def _maybe_compact(self, turn: _Turn, items: Context, *, force: bool) -> Context:
        limit = self._svc.budgets.compact_at * self._svc.limits.context_tokens
        size = compaction.estimate_tokens(
            compaction.latest_images_only(items), self._svc.system_prompt
        )
        if not force and size < limit:
            return items
        await self._user_saved(turn)  # the split needs every item's seq
        index = compaction.split_point(items, self._svc.budgets.keep_recent_messages)
        if index is None:
            return items
        old = items[:index]
        try:
            text = await compaction.summarise(self._llm(turn), old, self._svc.limits.max_tokens)
        except LLMError as exc:
            turn.events.append((turn.id, "compaction_failed", {"kind": exc.kind}))
            return items
        if not text:
            turn.events.append((turn.id, "compaction_failed", {"kind": "empty summary"}))
            return items
        first = old[0]
        covers_from = first.covers_from if first.is_summary and first.covers_from else first.seq
        covers_to = old[-1].seq
        summary = compaction.summary_message(text)
        turn.events.append(
            (turn.id, "compaction", {"covers_from": covers_from, "covers_to": covers_to})
        )
        written = _append(
            summary, turn.id, kind="summary", covers_from=covers_from, covers_to=covers_to
        )
        seqs = await self._checkpoint(turn, [written])
        return Context([ContextItem(seqs[0], summary, True, covers_from), *items[index:]])

    # -- endings --------------------------------------------------------------------------
    async def _budget_exhausted(self, turn: _Turn) -> TurnResult:
        budget = self._session.time_budget_s
        text = f"Stopped: the time budget of {budget:g} s was used up."
        try:
            async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                await self._abandon_open_batch(turn, CANCELLED_RESULT)
                turn.events.append((turn.id, "budget_exhausted", {"time_budget_s": budget}))
                return await self._fail(turn, "budget", text, "TimeBudgetExceeded")
        except (StoreError, TimeoutError) as exc:
            log.error("turn %s: could not record the budget stop: %s", turn.id, exc)
            return self._result(turn, "budget", text, error="TimeBudgetExceeded")

    async def _abandon_open_batch(self, turn: _Turn, text: str) -> None:
        """Close a batch whose tools were cut off, so the history stays valid for the
        provider; each call's result says that its outcome is unknown."""
        batch = turn.open_batch
        if batch is None:
            return
        results = [ToolResultBlock(str(c["id"]), text, is_error=True) for c in batch.calls]
        turn.events.append(
            (turn.id, "tool_batch_cancelled", {"batch": batch.id, "uncertain": True})
        )
        await self._save_results(turn, Context(), batch, results, "abandoned")

    async def _cancelled(self, turn: _Turn) -> None:
        """Record a turn its caller cancelled: the open batch abandoned, the turn closed."""
        try:
            async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                await self._abandon_open_batch(turn, CALLER_CANCELLED_RESULT)
                turn.events.append((turn.id, "turn_cancelled", {"by": "caller"}))
                self._close(turn, "cancelled", "Cancelled")
                await self._checkpoint(turn, [])
        except (StoreError, TimeoutError) as exc:
            log.error("turn %s: could not record its cancellation: %s", turn.id, exc)
        self._svc.emit(
            "turn_finished",
            {"session": self._session.id, "turn": turn.id, "outcome": "cancelled"},
        )
        log.info("turn cancelled by its caller after %d round(s)", turn.rounds)

    async def _fail(
        self, turn: _Turn, outcome: Outcome, text: str, error: str | None = None
    ) -> TurnResult:
        self._close(turn, outcome, error)
        result = self._outcome(turn, outcome, text, error=error)
        try:
            result = await self._end(turn, [], result)
        except StoreError as exc:
            log.error("turn %s: could not record its end: %s", turn.id, exc)
        return self._report(turn, result)

    def _close(self, turn: _Turn, outcome: str, error: str | None = None) -> None:
        """Account the turn in the session state and queue its final timeline event."""
        state = turn.state
        state["last_outcome"] = outcome
        state["turns"] = int(state.get("turns", 0)) + 1
        state["input_tokens"] = int(state.get("input_tokens", 0)) + turn.usage.input_tokens
        state["output_tokens"] = int(state.get("output_tokens", 0)) + turn.usage.output_tokens
        failures = int(turn.guards.get("consecutive_failures", 0))
        turn.guards["consecutive_failures"] = 0 if outcome == "completed" else failures + 1
        turn.guards["open_turn"] = None
        turn.events.append(
            (
                turn.id,
                "turn_finished",
                {
                    "outcome": outcome,
                    "error": error,
                    "rounds": turn.rounds,
                    "input_tokens": turn.usage.input_tokens,
                    "output_tokens": turn.usage.output_tokens,
                },
            )
        )

    def _result(
        self, turn: _Turn, outcome: Outcome, text: str, *, error: str | None = None
    ) -> TurnResult:
        return self._report(turn, self._outcome(turn, outcome, text, error=error))

    def _outcome(
        self, turn: _Turn, outcome: Outcome, text: str, *, error: str | None = None
    ) -> TurnResult:
        return TurnResult(
            self._session.id,
            turn.id,
            outcome,
            text,
            turn.rounds,
            turn.usage,
            error,
            refused_tools=tuple(dict.fromkeys(turn.refused)),
            stop_reason=turn.stop_reason,
        )

    def _report(self, turn: _Turn, result: TurnResult) -> TurnResult:
        self._svc.emit(
            "turn_finished",
            {"session": self._session.id, "turn": result.turn_id, "outcome": result.outcome},
        )
        log.info(
            "turn finished: %s after %d round(s), %d ms, %d+%d tokens",
            result.outcome,
            result.rounds,
            round((time.monotonic() - turn.started) * 1000),
            result.usage.input_tokens,
            result.usage.output_tokens,
        )
        return result

    # -- persistence ----------------------------------------------------------------------
    async def _checkpoint(
        self,
        turn: _Turn,
        messages: Sequence[_Append],
        *,
        propose_batch: ToolBatchRecord | None = None,
        finish_batch: tuple[str, Sequence[Mapping[str, Any]], Any] | None = None,
    ) -> list[int]:
        """Write ``messages`` (after the user's message, if still unsaved) with the turn's
        state; the seqs ``messages`` got."""
        return await self._write(
            turn, messages, propose_batch=propose_batch, finish_batch=finish_batch
        )

    async def _end(
        self, turn: _Turn, messages: Sequence[_Append], result: TurnResult
    ) -> TurnResult:
        """The turn's last checkpoint, carrying the caller's ending in the same commit."""
        ending = turn.ending
        if ending is None:
            await self._write(turn, messages)
            return result
        await self._write(turn, messages, ending=(ending, result))
        ending.written()
        # Whatever it handed over (a reply's first send) runs before this turn's bookkeeping,
        # so the answer is on its way a few hundred microseconds sooner: one pass of the
        # event loop for the sender to make its request, one for the HTTP client's task that
        # writes it (aiohttp writes a request's body in its own task).
        for _ in range(2):
            await asyncio.sleep(0)
        return replace(result, ended=ending)

    async def _user_saved(self, turn: _Turn) -> None:
        """Write the user's message now if no checkpoint has yet."""
        if turn.unsaved is not None:
            await self._checkpoint(turn, [])

    @staticmethod
    def _with_user(turn: _Turn, messages: Sequence[_Append]) -> Sequence[_Append]:
        return messages if turn.unsaved is None else [turn.unsaved[0], *messages]

    @staticmethod
    def _user_written(turn: _Turn, seqs: list[int]) -> list[int]:
        """After a commit of ``_with_user``'s messages: the user's context item gets its
        seq; the seqs of the other messages are returned."""
        if turn.unsaved is None:
            return seqs
        _, items, item = turn.unsaved
        turn.unsaved = None
        # From the end: the item was appended just before the model was asked, and this is
        # the turn's first checkpoint, so it is the last item or close to it.
        for index in range(len(items) - 1, -1, -1):
            if items[index] is item:
                items[index] = replace(item, seq=seqs[0])
                break
        return seqs[1:]

    def _snapshot(self, turn: _Turn) -> _Snapshot:
        """What the next checkpoint writes besides messages, taken now: the events so far
        go with it (and leave the turn), state and guards as they are at this moment."""
        turn.state["last_turn_id"] = turn.id
        events = [
            (turn_id, kind, self._svc.redactor.redact_obj(dict(data)))
            for turn_id, kind, data in turn.events
        ]
        turn.events.clear()
        return _Snapshot(dict(turn.state), dict(turn.guards), events)

    async def _write(
        self,
        turn: _Turn,
        messages: Sequence[_Append],
        *,
        propose_batch: ToolBatchRecord | None = None,
        finish_batch: tuple[str, Sequence[Mapping[str, Any]], Any] | None = None,
        ending: tuple[TurnEnding, TurnResult] | None = None,
    ) -> list[int]:
        """One checkpoint: ``messages`` after the user's message if still unsaved, the turn's
        state, and ``ending`` (the caller's, with the result it is written for) in the same
        commit when given. The seqs ``messages`` got."""
        written = self._with_user(turn, messages)
        snapshot = self._snapshot(turn)
        rows = [m.row for m in written]
        if ending is None:
            seqs = await self._svc.store.checkpoint(
                self._session.id,
                messages=rows,
                state=snapshot.state,
                guards=snapshot.guards,
                propose_batch=propose_batch,
                finish_batch=finish_batch,
                timeline=snapshot.events,
            )
        else:
            caller, result = ending
            seqs = await caller.commit(
                result,
                LastCheckpoint(
                    self._session.id,
                    messages=rows,
                    state=snapshot.state,
                    guards=snapshot.guards,
                    timeline=snapshot.events,
                ),
            )
        self._cached(seqs, written)
        return self._user_written(turn, seqs)

    def _cached(self, seqs: list[int], messages: Sequence[_Append]) -> None:
        if self._svc.context_cache is not None:
            self._svc.context_cache.appended(
                self._session.id,
                seqs,
                [m.row for m in messages],
                [m.message for m in messages],
            )
