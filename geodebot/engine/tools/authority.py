"""The tool authority pipeline: a model's proposal is not a permission.

Per call, in this order (each step a small method; a refusal in steps 1-4 returns an error
result and nothing is dispatched):

1. scope: the tool is in the session's BoundToolPlan, and not denied by the mode;
2. policy (malformed arguments) and JSON-schema validation;
3. PreToolUse hooks: block, rewrite (a rewrite that makes the call riskier, a higher safety
   level or data class, is refused; step 2 runs again on the new arguments), or ask;
4. approval: IPC asks the terminal user; DAEMON asks the binding's approvers with a card in
   the chat (a durable request, decided once), if it names any; otherwise, and in HEADLESS,
   a call that needs approval is refused unless the operator pre-authorised the tool. A call
   its tool says only the asker may approve (``ToolSpec.asks_caller``: agent-written text
   for another thread) goes to that person alone, shown whole, every time;
5. effect receipt for effectful tools, admitted before dispatch; a repeated identical call in
   the same turn is a replay and is not run again; an uncertain one is never re-run. A tool
   that keeps its own record per idempotency key (``ToolSpec.idempotent``) gets none: it is
   simply run again, and answers from that record;
6. resource locks, then dispatch under the tool's deadline;
7. PostToolUse hooks may add context or withhold the result;
8. the outcome (result, refusal or error) goes back to the loop, which puts it on the timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from geodebot.engine.hooks import HookRegistry
from geodebot.engine.llm.types import ImageData, ToolResultBlock, ToolUseBlock, canonical_json
from geodebot.engine.llm.untrusted import clean_text
from geodebot.engine.modes import Mode, denied_tools
from geodebot.engine.tools.plan import COMPUTER, BoundToolPlan
from geodebot.engine.tools.runner import OutcomeStatus, ToolOutcome
from geodebot.engine.tools.schema import SchemaError
from geodebot.engine.tools.spec import (
    ApprovalRequest,
    Approver,
    CallClass,
    ToolCallContext,
    ToolError,
    ToolOutcomeUnknown,
    ToolOutput,
    ToolSpec,
)
from geodebot.store.protocol import ApprovalStore, ReceiptStore
from geodebot.store.records import ApprovalRecord, EffectReceipt

log = logging.getLogger(__name__)


def report_uncertain(receipts: Iterable[EffectReceipt]) -> None:
    """Say, for the operator, each call whose effect nobody can know any more (the process
    running it stopped): it is never run again by itself, and waits for a person."""
    for receipt in receipts:
        log.warning(
            "effect receipt %s (%s in session %s) is uncertain; reconcile it with "
            "geodebot receipts resolve",
            receipt.id,
            receipt.tool,
            receipt.session_id,
        )


MAX_RESULT_CHARS = 32_000
# Images per tool result, and the base64 size of each (providers take about 5 MB per image).
MAX_IMAGES = 2
MAX_IMAGE_B64_CHARS = 5_000_000
MAX_REWRITES = 3
# The arguments as an approval request records them.
APPROVAL_SUMMARY_CHARS = 300
# A call the asker approves (agent-written text) is shown whole, or not asked about: a person
# must see exactly what they approve. Cards fit this on every platform.
CALLER_SUMMARY_CHARS = 1500
# Who decides in a terminal chat: the one person at the socket.
TERMINAL = "terminal"
_UNSEEN = "its result was not passed on: the turn ended before the result hooks decided"


class _Refused(Exception):
    def __init__(self, reason: str, message: str, request: ApprovalRecord | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        # The person's decision the refusal comes from, if one was asked for.
        self.request = request


@dataclass(frozen=True, slots=True)
class _Admitted:
    spec: ToolSpec
    call: ToolUseBlock  # with the final arguments
    receipt: EffectReceipt | None
    approved: bool | None
    request: ApprovalRecord | None = None

    @property
    def approval_id(self) -> str | None:
        return self.request.id if self.request is not None else None


class ResourceLocks:
    """Calls whose resource keys overlap run one after the other, in any batch."""

    def __init__(self) -> None:
        # Keys come from tool declarations, a small fixed set, so locks are never dropped.
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, keys: Sequence[str]) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            # Sorted acquisition: two calls can never wait on each other's keys.
            for key in sorted(set(keys)):
                await stack.enter_async_context(self._locks.setdefault(key, asyncio.Lock()))
            yield


def approval_hash(plan: BoundToolPlan, tool: str, arguments: Mapping[str, Any]) -> str:
    """What a person's decision is bound to: the session's tool plan, the tool and its
    canonical arguments. Any other call, or this one rewritten, needs a decision of its own."""
    return hashlib.sha256(
        canonical_json([plan.content_hash, tool, dict(arguments)]).encode()
    ).hexdigest()


def receipt_key(
    ctx: ToolCallContext, tool: str, arguments: Mapping[str, Any], call_id: str | None = None
) -> str:
    """Identical calls in a turn share a key (a repeat is answered from the first), unless the
    tool's calls are each their own action: then the call id is part of the key."""
    parts: list[Any] = [ctx.session_id, ctx.turn_id, tool, dict(arguments)]
    if call_id is not None:
        parts.append(call_id)
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


class AuthorityStore(ApprovalStore, ReceiptStore, Protocol):
    """What the authority pipeline keeps: approval requests and effect receipts."""


class ToolAuthority:
    def __init__(
        self,
        *,
        store: AuthorityStore,
        hooks: HookRegistry | None = None,
        approval_timeout_s: float = 120.0,
    ) -> None:
        self._store = store
        self._hooks = hooks if hooks is not None else HookRegistry()
        self._approval_timeout_s = approval_timeout_s
        self._locks = ResourceLocks()

    async def run_batch(
        self, plan: BoundToolPlan, calls: Sequence[ToolUseBlock], ctx: ToolCallContext
    ) -> list[ToolOutcome]:
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        admitted: list[tuple[int, _Admitted]] = []
        first_of_receipt: dict[str, int] = {}
        duplicates: list[tuple[int, int]] = []
        # Authorisation is sequential so approval prompts reach the user one at a time.
        for index, call in enumerate(calls):
            call_ctx = replace(ctx, call_id=call.id)
            try:
                grant = await self._authorise(plan, call, call_ctx)
                outcome, grant = await self._admit(grant, call_ctx, first_of_receipt)
            except _Refused as refusal:
                outcomes[index] = _refused(call, refusal)
                continue
            if outcome is not None:
                outcomes[index] = outcome
            elif grant.receipt is not None and grant.receipt.id in first_of_receipt:
                duplicates.append((index, first_of_receipt[grant.receipt.id]))
            else:
                if grant.receipt is not None:
                    first_of_receipt[grant.receipt.id] = index
                admitted.append((index, grant))
        dispatched = await asyncio.gather(
            *(self._dispatch(grant, replace(ctx, call_id=grant.call.id)) for _, grant in admitted)
        )
        for (index, _), outcome in zip(admitted, dispatched, strict=True):
            outcomes[index] = outcome
        for index, original in duplicates:
            first = outcomes[original]
            assert first is not None
            outcomes[index] = _replay(calls[index], first.result, first.receipt_id)
        return [o for o in outcomes if o is not None]

    # -- steps 1-4 --------------------------------------------------------------------------
    async def _authorise(
        self, plan: BoundToolPlan, call: ToolUseBlock, ctx: ToolCallContext
    ) -> _Admitted:
        spec = self._scope(plan, call)
        if call.arguments_error is not None:
            raise _Refused("invalid_arguments", f"invalid arguments: {call.arguments_error}")
        original = self._classify(spec, call.arguments)
        self._validate(spec, call.arguments)
        arguments, ask = await self._pre_hooks(spec, call.arguments, ctx, original)
        approved, request = await self._approval(plan, spec, arguments, ctx, ask)
        return _Admitted(spec, replace(call, arguments=dict(arguments)), None, approved, request)

    def _scope(self, plan: BoundToolPlan, call: ToolUseBlock) -> ToolSpec:
        spec = plan.get(call.name)
        if spec is None:
            raise _Refused(
                "not_in_plan", f"tool {call.name[:80]!r} is not available in this session"
            )
        # Defence in depth: the plan already left these out, but a plan built wrongly must
        # still not hand an unattended session a shell.
        if call.name in denied_tools(plan.mode) and not (
            call.name == COMPUTER and plan.mode is Mode.DAEMON
        ):
            raise _Refused("denied_by_mode", f"tool {call.name} is never available here")
        return spec

    def _classify(self, spec: ToolSpec, arguments: Mapping[str, Any]) -> CallClass:
        try:
            return spec.call_class(arguments)
        except Exception as exc:
            raise _Refused("invalid_arguments", f"arguments cannot be classified: {exc}") from exc

    def _check_rewrite(
        self, spec: ToolSpec, arguments: Mapping[str, Any], original: CallClass, by: str
    ) -> None:
        if self._classify(spec, arguments).riskier_than(original):
            raise _Refused(
                "rewrite_escalates",
                f"a {by} rewrite would make this {spec.name} call riskier; refused",
            )

    def _validate(self, spec: ToolSpec, arguments: Mapping[str, Any]) -> None:
        try:
            problems = spec.arguments_schema.problems(arguments)
        except SchemaError as exc:
            raise _Refused(
                "schema_unusable",
                f"{spec.name} cannot be called: its input schema is unusable ({exc})",
            ) from None
        if problems:
            raise _Refused("invalid_arguments", "invalid arguments: " + "; ".join(problems))

    async def _pre_hooks(
        self,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        original: CallClass,
    ) -> tuple[Mapping[str, Any], str | None]:
        ask: str | None = None
        for _ in range(MAX_REWRITES + 1):
            outcome = await self._hooks.pre_tool_use(_payload("PreToolUse", spec, arguments, ctx))
            if outcome.blocked is not None:
                raise _Refused("blocked_by_hook", f"blocked: {outcome.blocked}")
            ask = outcome.ask or ask
            if outcome.arguments is None or outcome.arguments == arguments:
                return arguments, ask
            # A rewrite goes through the checks again, as if the model had proposed it.
            self._check_rewrite(spec, outcome.arguments, original, "hook")
            self._validate(spec, outcome.arguments)
            arguments = outcome.arguments
        raise _Refused("blocked_by_hook", "hooks kept rewriting the call; refused")

    async def _approval(
        self,
        plan: BoundToolPlan,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        ask: str | None,
    ) -> tuple[bool | None, ApprovalRecord | None]:
        """Whether the call was approved (None: it needs no approval) and the person's
        decision, if one was asked for."""
        if spec.asks_caller is not None and spec.asks_caller(arguments, ctx):
            return True, await self._ask_caller(plan, spec, arguments, ctx)
        if not spec.needs_approval and ask is None:
            return None, None
        if ctx.mode is Mode.IPC and ctx.approver is not None:
            return True, await self._ask_terminal(plan, spec, arguments, ctx, ask)
        # A hook that asks for a person is never overridden by a standing pre-authorisation.
        if ask is None and spec.name in plan.preapproved:
            return True, None
        if ctx.mode is Mode.DAEMON and ctx.desk is not None and ctx.desk.approvers:
            return True, await self._ask_desk(plan, spec, arguments, ctx)
        raise _Refused(
            "needs_approval",
            f"{spec.name} needs approval and nobody can approve in {ctx.mode.value} mode"
            + (
                f" ({ask})"
                if ask
                else "; an operator can pre-authorise it, or name approvers, on the binding"
            ),
        )

    async def _open(
        self,
        plan: BoundToolPlan,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        approvers: tuple[str, ...],
        timeout_s: float,
    ) -> ApprovalRecord:
        """The durable request bound to this exact call: a resumed turn finds its own (and
        any decision on it) instead of asking again."""
        now = time.time()
        call_sha256 = approval_hash(plan, spec.name, arguments)
        # What the asker approves is shown whole (its length was checked in _ask_caller).
        whole = spec.asks_caller is not None and spec.asks_caller(arguments, ctx)
        record, _ = await self._store.approval_open(
            ApprovalRecord(
                id=secrets.token_urlsafe(16),
                session_id=ctx.session_id,
                turn_id=ctx.turn_id,
                call_id=ctx.call_id,
                tool=spec.name,
                safety=spec.safety.value,
                call_sha256=call_sha256,
                summary=_summary(arguments, CALLER_SUMMARY_CHARS if whole else None),
                origin=ctx.origin or ctx.mode.value,
                approvers=approvers,
                status="pending",
                created_at=now,
                expires_at=now + timeout_s,
            )
        )
        if record.call_sha256 != call_sha256:
            # The turn's call was asked about with other arguments (a hook rewrote it since):
            # that decision is not this call's.
            raise _Refused("approval_denied", f"this {spec.name} call changed since it was asked")
        return record

    async def _ask_terminal(
        self,
        plan: BoundToolPlan,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        ask: str | None,
    ) -> ApprovalRecord:
        """Ask the person at the terminal; the request once approved."""
        assert ctx.approver is not None
        record = await self._open(plan, spec, arguments, ctx, (TERMINAL,), self._approval_timeout_s)
        if record.status == "pending":
            request = ApprovalRequest(
                ctx.session_id,
                ctx.turn_id,
                spec.name,
                dict(arguments),
                spec.safety,
                spec.effect,
                ask or f"{spec.name} is a {spec.safety.value} tool",
            )
            answer = await self._wait_for_person(ctx.approver, request, ctx)
            if answer is None:
                # No answer in time; a decision made elsewhere meanwhile still counts.
                ended = await self._store.approval_expire(record.id)
            else:
                ended, _ = await self._store.approval_decide(
                    record.id, answer, by=TERMINAL, via="chat"
                )
            record = ended if ended is not None else record
        if record.status != "approved":
            raise _Refused("approval_denied", f"the user did not approve {spec.name}", record)
        return record

    async def _ask_caller(
        self,
        plan: BoundToolPlan,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
    ) -> ApprovalRecord:
        """Ask the person the turn acts for, and nobody else: the terminal user, or the
        chat message's sender with a card only they can press."""
        if ctx.forwarded:
            # The message came from another thread: whoever wrote it is not in this chat to
            # press a card here, and its turn may not act further in their name.
            raise _Refused(
                "needs_approval",
                f"this {spec.name} call needs the approval of the person who asked, who wrote "
                "in another thread: a turn answering a forwarded message cannot ask them "
                "(forwarding depth)",
            )
        shown = len(clean_text(canonical_json(dict(arguments))))
        if shown > CALLER_SUMMARY_CHARS:
            raise _Refused(
                "needs_approval",
                f"this {spec.name} call needs the approval of the person who asked, who must "
                f"see it whole: its arguments are {shown} characters, at most "
                f"{CALLER_SUMMARY_CHARS} can be shown; make it shorter",
            )
        if ctx.mode is Mode.IPC and ctx.approver is not None:
            return await self._ask_terminal(plan, spec, arguments, ctx, None)
        if ctx.mode is Mode.DAEMON and ctx.desk is not None and ctx.user:
            return await self._ask_desk(plan, spec, arguments, ctx, (ctx.user,))
        raise _Refused(
            "needs_approval",
            f"this {spec.name} call needs the approval of the person who asked, and nobody "
            "is there to give it (a scheduled job or a headless run acts for nobody)",
        )

    async def _ask_desk(
        self,
        plan: BoundToolPlan,
        spec: ToolSpec,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        approvers: tuple[str, ...] | None = None,
    ) -> ApprovalRecord:
        """Ask the chat's approvers (or ``approvers``) with a card; the request once
        approved. The turn waits outside its time budget, for as long as the request lives."""
        desk = ctx.desk
        assert desk is not None
        who = approvers if approvers is not None else desk.approvers
        record = await self._open(plan, spec, arguments, ctx, who, desk.timeout_s)
        if record.status == "pending":
            async with _parked(ctx):
                record = await desk.settle(record)
        if record.status == "approved":
            return record
        if record.status == "denied":
            raise _Refused(
                "approval_denied",
                f"{record.decided_by} denied {spec.name}; it was not run",
                record,
            )
        raise _Refused(
            "approval_expired",
            f"nobody approved {spec.name} before the request expired; it was not run",
            record,
        )

    async def _wait_for_person(
        self, approver: Approver, request: ApprovalRequest, ctx: ToolCallContext
    ) -> bool | None:
        """The person's answer; None when none came within the approval timeout."""
        async with _parked(ctx):
            try:
                async with asyncio.timeout(self._approval_timeout_s):
                    return await approver.approve(request)
            except TimeoutError:
                return None

    # -- step 5 -----------------------------------------------------------------------------
    async def _admit(
        self, grant: _Admitted, ctx: ToolCallContext, this_batch: Mapping[str, int]
    ) -> tuple[ToolOutcome | None, _Admitted]:
        spec, call = grant.spec, grant.call
        if not spec.effectful or spec.idempotent:
            return None, grant
        receipt = EffectReceipt(
            id=f"r-{uuid.uuid4().hex[:16]}",
            key=receipt_key(ctx, spec.name, call.arguments, call.id if spec.repeatable else None),
            session_id=ctx.session_id,
            turn_id=ctx.turn_id,
            call_id=call.id,
            tool=spec.name,
            effect=spec.effect.value,
            arguments_sha256=hashlib.sha256(
                canonical_json(dict(call.arguments)).encode()
            ).hexdigest(),
            status="admitted",
            admitted_at=time.time(),
            approval_id=grant.approval_id,
        )
        stored, inserted = await self._store.admit_receipt(receipt)
        grant = replace(grant, receipt=stored)
        if inserted or stored.id in this_batch:
            return None, grant
        if stored.status in ("committed", "failed"):
            result = str(stored.outcome.get("result", ""))
            block = ToolResultBlock(call.id, result, bool(stored.outcome.get("is_error")))
            return _replay(call, block, stored.id), grant
        if stored.status == "admitted":
            stored = await self._store.finish_receipt(
                stored.id, "uncertain", {"reason": "found unfinished after an interruption"}
            )
        message = (
            f"outcome uncertain: an earlier attempt of this exact {spec.name} call was "
            f"interrupted and may or may not have acted. It was not run again; an operator "
            f"can reconcile receipt {stored.id}."
        )
        return (
            ToolOutcome(
                call,
                ToolResultBlock(call.id, message, is_error=True),
                "uncertain",
                "receipt_uncertain",
                stored.id,
            ),
            grant,
        )

    # -- steps 6-7 --------------------------------------------------------------------------
    async def _dispatch(self, grant: _Admitted, ctx: ToolCallContext) -> ToolOutcome:
        spec, call, receipt = grant.spec, grant.call, grant.receipt
        status: OutcomeStatus = "ok"
        reason: str | None = None
        images: tuple[ImageData, ...] = ()
        async with self._locks.hold(spec.resource_keys):
            try:
                async with asyncio.timeout(spec.timeout_s):
                    output = await spec.handler(call.arguments, ctx)
                is_error = False
                if isinstance(output, ToolOutput):
                    text, images = output.text, _bounded(output.images)
                else:
                    text = output
            except TimeoutError:
                text = f"{spec.name} did not finish within {spec.timeout_s:g} s"
                status, reason, is_error = "error", "deadline", True
                if receipt is not None:
                    text += "; it may have acted before it was stopped"
                    await self._finish(receipt, "uncertain", {"reason": "deadline"})
                    status = "uncertain"
            except ToolOutcomeUnknown as exc:
                text, reason, is_error = str(exc), "outcome_unknown", True
                status = "uncertain" if receipt is not None else "error"
                await self._finish(receipt, "uncertain", {"reason": text[:300]})
            except ToolError as exc:
                text, status, reason, is_error = str(exc), "error", "tool_error", True
                await self._finish(receipt, "failed", {"result": text, "is_error": True})
            except asyncio.CancelledError:
                # The turn's budget ran out mid-call: whatever it did is unknown.
                await asyncio.shield(self._finish(receipt, "uncertain", {"reason": "cancelled"}))
                raise
            except Exception as exc:
                # The handler broke without saying what it did: for an effect, that is unknown.
                log.exception("tool %s failed", spec.name)
                text = f"{spec.name} failed unexpectedly ({type(exc).__name__})"
                status = "uncertain" if receipt is not None else "error"
                reason, is_error = "crashed", True
                await self._finish(receipt, "uncertain", {"reason": f"crashed: {exc!r}"[:300]})
        result = ToolResultBlock(call.id, _truncate(text), is_error, images=images)
        if status == "ok":
            result = await self._seen(spec, call, ctx, result, receipt)
        return ToolOutcome(
            call,
            result,
            status,
            reason,
            receipt.id if receipt else None,
            grant.approved,
            grant.approval_id,
            _decided_by(grant.request),
        )

    async def _finish(
        self,
        receipt: EffectReceipt | None,
        status: Literal["committed", "failed", "uncertain"],
        outcome: Mapping[str, Any],
    ) -> None:
        if receipt is not None:
            await self._store.finish_receipt(receipt.id, status, outcome)

    async def _seen(
        self,
        spec: ToolSpec,
        call: ToolUseBlock,
        ctx: ToolCallContext,
        result: ToolResultBlock,
        receipt: EffectReceipt | None,
    ) -> ToolResultBlock:
        """What the model gets of a call that ran: the result after the PostToolUse hooks.

        The receipt records exactly that, and a replay of the call answers from the receipt,
        so a result a hook withheld stays withheld and its notes are kept. Until the hooks
        have decided, the receipt stays admitted: a crash in between leaves the call
        uncertain, never re-run and never answered with the unfiltered result."""
        try:
            seen = await self._post_hooks(spec, call, ctx, result)
        except asyncio.CancelledError:
            cut = {"result": f"{spec.name} ran; {_UNSEEN}", "is_error": True}
            await asyncio.shield(self._finish(receipt, "committed", cut))
            raise
        await self._finish(
            receipt, "committed", {"result": seen.content, "is_error": seen.is_error}
        )
        return seen

    async def _post_hooks(
        self, spec: ToolSpec, call: ToolUseBlock, ctx: ToolCallContext, result: ToolResultBlock
    ) -> ToolResultBlock:
        payload = _payload("PostToolUse", spec, call.arguments, ctx)
        payload["result"] = result.content
        post = await self._hooks.post_tool_use(payload)
        if post.withheld is not None:
            return ToolResultBlock(call.id, f"result withheld by policy: {post.withheld}", True)
        if post.context:
            extra = "\n\n".join(post.context)
            return replace(result, content=_truncate(f"{result.content}\n\n[note] {extra}"))
        return result


def _payload(
    event: str, spec: ToolSpec, arguments: Mapping[str, Any], ctx: ToolCallContext
) -> dict[str, Any]:
    return {
        "event": event,
        "session": ctx.session_id,
        "turn": ctx.turn_id,
        "mode": ctx.mode.value,
        "tool": spec.name,
        "arguments": dict(arguments),
        "safety": spec.safety.value,
        "effect": spec.effect.value,
    }


def _parked(ctx: ToolCallContext) -> contextlib.AbstractAsyncContextManager[None]:
    """Entered while the call waits for a person (see ToolCallContext.waiting_for_a_person)."""
    waiting = ctx.waiting_for_a_person
    return waiting() if waiting is not None else contextlib.nullcontext()


def _refused(call: ToolUseBlock, refusal: _Refused) -> ToolOutcome:
    block = ToolResultBlock(call.id, f"refused: {refusal}", is_error=True)
    request = refusal.request
    return ToolOutcome(
        call,
        block,
        "refused",
        refusal.reason,
        approved=False if request is not None else None,
        approval_id=request.id if request is not None else None,
        decided_by=_decided_by(request),
    )


def _decided_by(request: ApprovalRecord | None) -> str | None:
    """Who decided, for the record: a person's id, or "expired" when nobody did."""
    if request is None:
        return None
    return request.decided_by or ("expired" if request.status == "expired" else None)


def _replay(call: ToolUseBlock, original: ToolResultBlock, receipt_id: str | None) -> ToolOutcome:
    note = "(this exact call already ran in this turn; it was not run again) "
    block = ToolResultBlock(call.id, note + original.content, original.is_error)
    return ToolOutcome(call, block, "replayed", "replay", receipt_id)


def _bounded(images: tuple[ImageData, ...]) -> tuple[ImageData, ...]:
    """At most MAX_IMAGES, each within what providers accept; larger ones are dropped."""
    return tuple(i for i in images if len(i.data) <= MAX_IMAGE_B64_CHARS)[:MAX_IMAGES]


def _summary(arguments: Mapping[str, Any], limit: int | None = None) -> str:
    text = clean_text(canonical_json(dict(arguments)))
    limit = limit or APPROVAL_SUMMARY_CHARS
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def _truncate(text: str) -> str:
    # A result goes into the history and is sent with every later request, so it must be
    # encodable: an MCP server's JSON may carry lone surrogate escapes.
    text = clean_text(text)
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[truncated {len(text) - MAX_RESULT_CHARS} characters]"
