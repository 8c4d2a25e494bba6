"""What a tool declares about itself, and the context a handler runs in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from geodebot.engine.llm.types import ImageData, ToolSchema
from geodebot.engine.modes import Mode
from geodebot.engine.tools.schema import ArgumentSchema
from geodebot.store.records import ApprovalRecord, StoredFile


class Safety(StrEnum):
    READ = "read"
    WRITE = "write"
    DANGEROUS = "dangerous"

    @property
    def rank(self) -> int:
        return _SAFETY_RANK[self]


_SAFETY_RANK = {Safety.READ: 0, Safety.WRITE: 1, Safety.DANGEROUS: 2}


class Effect(StrEnum):
    NONE = "none"
    MUTATE = "mutate"
    COMMUNICATE = "communicate"
    ADMINISTRATIVE = "administrative"


class DataClass(StrEnum):
    """How sensitive the data a call touches is; a rewrite may never make it more so."""

    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"

    @property
    def rank(self) -> int:
        return _DATA_RANK[self]


_DATA_RANK = {DataClass.PUBLIC: 0, DataClass.INTERNAL: 1, DataClass.CONFIDENTIAL: 2}


@dataclass(frozen=True, slots=True)
class CallClass:
    """The risk of one concrete call: its tool's defaults, or what ``classify`` says."""

    safety: Safety
    data: DataClass

    def riskier_than(self, other: CallClass) -> bool:
        return self.safety.rank > other.safety.rank or self.data.rank > other.data.rank


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    session_id: str
    turn_id: str
    tool: str
    arguments: Mapping[str, Any]
    safety: Safety
    effect: Effect
    reason: str


class Approver(Protocol):
    """The person at the terminal, who can say yes or no (IPC sessions)."""

    async def approve(self, request: ApprovalRequest) -> bool: ...


class ApprovalDesk(Protocol):
    """Where listed people decide on a stored request with a card's buttons (a chat's
    DAEMON session, when its binding names approvers)."""

    @property
    def approvers(self) -> tuple[str, ...]: ...

    @property
    def timeout_s(self) -> float: ...

    async def settle(self, request: ApprovalRecord) -> ApprovalRecord:
        """Show the pending ``request`` to its approvers (once, across restarts too) and
        return it decided or expired; at its expiry it is expired, never left pending."""


class ChatOutlet(Protocol):
    """Where a tool's messages to the chat a turn answers go (a chat's DAEMON session):
    through the outbox, in order with the turn's other replies, exactly once."""

    @property
    def platform(self) -> str: ...

    async def send_file(self, file: StoredFile, caption: str) -> None:
        """Queue ``file`` (already in the file store) for upload into the chat; returns once
        the message is durably queued, not when it is sent."""


@dataclass(frozen=True, slots=True)
class ToolCallContext:
    session_id: str
    turn_id: str
    mode: Mode
    call_id: str = ""
    approver: Approver | None = field(default=None, compare=False)
    desk: ApprovalDesk | None = field(default=None, compare=False)
    # The session spec's ``origin``: the binding a chat message came through, or None.
    origin: str | None = None
    # The chat the turn answers, for tools that post into it (send_file); None elsewhere.
    outlet: ChatOutlet | None = field(default=None, compare=False)
    # The person the turn acts for (a chat message's sender; "terminal" at the terminal);
    # None for a job or a headless run, where nobody is there.
    user: str | None = None
    # How many relays brought the turn's message here: 0 for a person's own message, 1 for
    # a message another thread relayed with intent "ask" (which may relay no further).
    forwarded: int = 0
    # Entered while the call waits for a person's decision: the turn's time budget stands
    # still and its place under the global cap is free (see AgenticLoop).
    waiting_for_a_person: Callable[[], AbstractAsyncContextManager[None]] | None = field(
        default=None, compare=False
    )


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A result with images (a screenshot) besides its text; plain results are just ``str``."""

    text: str
    images: tuple[ImageData, ...] = ()


Handler = Callable[[Mapping[str, Any], ToolCallContext], Awaitable[str | ToolOutput]]
Classifier = Callable[[Mapping[str, Any]], CallClass]


class ToolError(Exception):
    """A handler's way to say the call failed in a way the model should read."""


class ToolOutcomeUnknown(ToolError):
    """The call failed part-way: it may have acted (e.g. a remote server went away)."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    input_schema: Mapping[str, Any]
    safety: Safety
    effect: Effect
    handler: Handler = field(compare=False)
    # Calls whose keys overlap never run at the same time ("fs:workspace", "net").
    resource_keys: tuple[str, ...] = ()
    timeout_s: float = 30.0
    data_class: DataClass = DataClass.INTERNAL
    # None: writes and dangerous tools need approval, reads do not.
    requires_approval: bool | None = None
    classify: Classifier | None = field(default=None, compare=False)
    # Identical calls in one turn are separate actions (a second screenshot, the same key
    # pressed twice), not a repeat to answer from the first call's receipt.
    repeatable: bool = False
    # The call must be approved by the person the turn acts for, every time: no standing
    # pre-authorisation and no other approver counts, and where nobody is there (a job, a
    # headless run, a turn answering a forwarded message) it is refused. Given the call's
    # arguments and context (e.g. only agent-written text, and not where the handler refuses
    # the call itself).
    asks_caller: Callable[[Mapping[str, Any], ToolCallContext], bool] | None = field(
        default=None, compare=False
    )
    # The handler keeps its own durable record per idempotency key (Thread Relay's
    # deliveries): the pipeline admits no effect receipt, and a call a crash cut short is
    # run again, which answers from that record instead of acting twice.
    idempotent: bool = False
    # The input schema once compiled (see arguments_schema).
    _compiled: list[ArgumentSchema] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def arguments_schema(self) -> ArgumentSchema:
        """The input schema, compiled on first use; SchemaError if it is unusable."""
        if not self._compiled:
            self._compiled.append(ArgumentSchema(self.input_schema))
        return self._compiled[0]

    @property
    def needs_approval(self) -> bool:
        if self.requires_approval is not None:
            return self.requires_approval
        return self.safety is not Safety.READ

    @property
    def effectful(self) -> bool:
        return self.effect is not Effect.NONE

    def call_class(self, arguments: Mapping[str, Any]) -> CallClass:
        if self.classify is not None:
            return self.classify(arguments)
        return CallClass(self.safety, self.data_class)

    def schema(self) -> ToolSchema:
        return ToolSchema(self.name, self.description, self.input_schema)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "safety": self.safety.value,
            "effect": self.effect.value,
            "resource_keys": list(self.resource_keys),
            "data_class": self.data_class.value,
            "needs_approval": self.needs_approval,
        }
