"""Sessions: ``create_session(mode, spec)`` and the shared services a session runs on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from geodebot.config.schema import BudgetConfig
from geodebot.engine.attachments import FileView
from geodebot.engine.context_cache import ContextCache
from geodebot.engine.lanes import Slot
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.llm.types import Block, LLMAdapter, StopReason, Usage
from geodebot.engine.modes import Mode
from geodebot.engine.spend import SpendGate, SpendScope
from geodebot.engine.tools.catalog import ToolCatalog
from geodebot.engine.tools.plan import BoundToolPlan
from geodebot.engine.tools.runner import ToolRunner
from geodebot.engine.tools.spec import ApprovalDesk, Approver, ChatOutlet
from geodebot.engine.verify import NonEmptyAnswer, Verifier
from geodebot.logs.redact import Redactor
from geodebot.store.protocol import Store
from geodebot.store.records import NewMessage, OpenedSession

log = logging.getLogger(__name__)

COMPUTER_USE_SWITCH = "computer_use"

Outcome = Literal[
    "completed",
    "budget",
    "model_error",
    "store_error",
    "max_rounds",
    "verify_failed",
    "internal_error",
]

# Lifecycle observers see what happens and never decide; see engine/hooks for decisions.
Observer = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True, slots=True)
class LastCheckpoint:
    """The turn's last checkpoint as the engine would write it: the session's new messages,
    its state and guards, and the turn's timeline events (see ``Store.checkpoint``)."""

    session_id: str
    messages: Sequence[NewMessage]
    state: Mapping[str, Any]
    guards: Mapping[str, Any]
    timeline: Sequence[tuple[str | None, str, Mapping[str, Any]]]


class TurnEnding(Protocol):
    """Writes committed with the last checkpoint: what a turn's caller saves in the same
    commit as the turn's end (a chat's answer to the message that started the turn), built
    from the result the turn is about to return."""

    async def commit(self, result: TurnResult, checkpoint: LastCheckpoint) -> list[int]:
        """Commit ``checkpoint`` and the caller's writes for ``result`` in one transaction,
        durably (:class:`StoreError`: neither is written); the seqs the checkpoint's
        messages got."""

    def written(self) -> None:
        """The commit returned: called at once, before the turn's own bookkeeping (its log
        line, observers, unwinding), so what it hands over (a reply) goes out first."""


class TurnListener(Protocol):
    """Watches a turn as it happens, to show it (a chat's streamed preview). It never decides
    anything, is called synchronously, and must return at once."""

    def round_started(self) -> None:
        """A model call begins: text shown from an earlier round is not the answer."""

    def text(self, delta: str) -> None:
        """The next piece of the model's answer."""

    def restarted(self, reason: str) -> None:
        """The model's answer broke off and is asked for again: what was shown is void."""

    def tools_started(self, calls: tuple[tuple[str, str], ...]) -> None:
        """Tools begin to run: (name, a short hint of what it works on) for each call."""


class TurnRunner(Protocol):
    """Runs one turn of a session: what the chat router, the job scheduler and the IPC
    server are given instead of the composition root (see ``App.run_turn``)."""

    async def __call__(
        self,
        mode: Mode,
        spec: SessionSpec,
        text: str,
        *,
        turn_id: str | None = None,
        ending: TurnEnding | None = None,
        attachments: Sequence[Block] = (),
        record_only: bool = False,
    ) -> TurnResult: ...


# Builds the model client for one turn; ``on_event`` receives retry/fallback notices.
LLMFactory = Callable[[Callable[[str, dict[str, Any]], None]], LLMAdapter]


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_tokens: int = 4096
    context_tokens: int = 200_000


@dataclass(slots=True)
class EngineServices:
    """Everything sessions share, wired once by the composition root. Only ``budgets``
    changes after that (a config reload: app/reload.py), read by sessions as they go."""

    store: Store
    llm: LLMFactory
    tools: ToolCatalog
    runner: ToolRunner
    ledger: EvidenceLedger
    redactor: Redactor
    system_prompt: str
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    limits: ModelLimits = field(default_factory=ModelLimits)
    verifiers: tuple[Verifier, ...] = (NonEmptyAnswer(),)
    observers: tuple[Observer, ...] = ()
    # Decoded contexts of recently active sessions; None reads every context from the store.
    context_cache: ContextCache | None = None
    # Fills in the files users sent for each model call; None shows them by name only.
    files: FileView | None = None
    # Token and spend budgets every model call reserves against; None: none, nothing counted.
    spend: SpendGate | None = None

    def emit(self, event: str, data: Mapping[str, Any]) -> None:
        for observer in self.observers:
            try:
                observer(event, data)
            except Exception:
                log.exception("observer failed on %s", event)


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """What a binding, a job, a terminal or a headless caller asks for."""

    session_id: str
    # The tool allowlist; empty means no tools at all.
    tools: tuple[str, ...] = ()
    # Tools the operator pre-authorised for unattended use (a subset of ``tools``).
    preapproved: tuple[str, ...] = ()
    # None: the mode's default from [budgets].
    time_budget_s: float | None = None
    # The person at the terminal (IPC only); nobody elsewhere.
    approver: Approver | None = field(default=None, compare=False)
    # The chat's approvers and their cards (DAEMON only); None: nobody approves.
    desk: ApprovalDesk | None = field(default=None, compare=False)
    # Sees the answer as it is generated (the model is then called streamed).
    listener: TurnListener | None = field(default=None, compare=False)
    # The chat the turn answers, for tools that post into it (DAEMON only).
    outlet: ChatOutlet | None = field(default=None, compare=False)
    # Who asked, opaque to the engine: the calling binding's key (``platform:channel``) for
    # a chat message, None otherwise. Tools that act for a chat (jobs) read it from their
    # call context, since several bindings may share one session.
    origin: str | None = None
    # The person the turn acts for (see ToolCallContext.user); None: nobody is there.
    user: str | None = None
    # Relays that brought the turn's message (see ToolCallContext.forwarded).
    forwarded: int = 0
    # The budgets the turn's model calls count against beyond the daemon's.
    spend: SpendScope = field(default_factory=SpendScope)


@dataclass(frozen=True, slots=True)
class TurnResult:
    session_id: str
    turn_id: str
    outcome: Outcome
    text: str
    rounds: int = 0
    usage: Usage = field(default_factory=Usage)
    # Classified error kind (e.g. "LLMMissingCredential"), for logs and exit codes.
    error: str | None = None
    # Tools the model asked for that the authority pipeline refused (not run), first-seen order.
    refused_tools: tuple[str, ...] = ()
    # The caller's ending, when the turn's last commit wrote it (see TurnEnding); None: the
    # caller records the result itself.
    ended: TurnEnding | None = field(default=None, compare=False, repr=False)
    # Why the model's last answer of the turn stopped, as its adapter reports it
    # ("end_turn", "max_tokens", "refusal", ...); None when no model answered.
    stop_reason: StopReason | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "completed"

    @property
    def refused_by_model(self) -> bool:
        """A completed turn whose last answer is the model declining: only that answer
        counts, so a refusal followed by an answer is not one."""
        return self.ok and self.stop_reason == "refusal"


def time_budget(mode: Mode, spec: SessionSpec, budgets: BudgetConfig) -> float:
    default = {
        Mode.DAEMON: budgets.daemon_time_s,
        Mode.IPC: budgets.ipc_time_s,
        Mode.HEADLESS: budgets.headless_time_s,
    }[mode]
    budget = spec.time_budget_s if spec.time_budget_s is not None else default
    if mode is Mode.HEADLESS:
        budget = min(budget, budgets.headless_max_time_s)
    return budget


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    mode: Mode
    plan: BoundToolPlan
    time_budget_s: float
    services: EngineServices = field(repr=False)
    approver: Approver | None = field(default=None, repr=False)
    desk: ApprovalDesk | None = field(default=None, repr=False)
    listener: TurnListener | None = field(default=None, repr=False)
    outlet: ChatOutlet | None = field(default=None, repr=False)
    origin: str | None = None
    user: str | None = None
    forwarded: int = 0
    spend: SpendScope = field(default_factory=SpendScope)
    # The turn's place under the global cap (see Lanes), given up while it waits for a person.
    slot: Slot | None = field(default=None, repr=False, compare=False)
    # What create_session read with the row. The first turn starts from it rather than
    # reading the row and its pending batches again; taken once, later turns read afresh.
    _opened: list[OpenedSession] = field(default_factory=list, repr=False, compare=False)
    # When create_session began, on the event loop's clock: the first turn's time budget
    # counts from there, so set-up (the store, MCP servers coming up) is inside it. Taken
    # once; later turns count from their own start.
    _budget_from: list[float] = field(default_factory=list, repr=False, compare=False)

    def take_opened(self) -> OpenedSession | None:
        return self._opened.pop() if self._opened else None

    def take_budget_start(self) -> float | None:
        return self._budget_from.pop() if self._budget_from else None


async def create_session(
    mode: Mode, spec: SessionSpec, services: EngineServices, *, slot: Slot | None = None
) -> Session:
    """Open (or create) the durable session and project its immutable tool plan.

    The first turn's time budget starts here: resolving the tools waits for the MCP servers
    of listed tools only briefly, bounded by that budget (see ToolCatalog.resolve)."""
    started = asyncio.get_running_loop().time()
    budget = time_budget(mode, spec, services.budgets)
    opened = await services.store.open_session(
        spec.session_id, mode.value, switch=COMPUTER_USE_SWITCH
    )
    switch = opened.switch
    plan = BoundToolPlan.project(
        # A batch a crash left unfinished runs under this plan: its tools must be the ones
        # its approvals were given under, not stand-ins for a server still starting.
        await services.tools.resolve(
            spec.tools, deadline=started + budget, patient=bool(opened.pending)
        ),
        mode,
        spec.tools,
        preapproved=spec.preapproved,
        computer_use=switch is not None and switch.active(time.time()),
        generation=opened.record.generation,
    )
    return Session(
        id=spec.session_id,
        mode=mode,
        plan=plan,
        time_budget_s=budget,
        services=services,
        approver=spec.approver if mode is Mode.IPC else None,
        desk=spec.desk if mode is Mode.DAEMON else None,
        listener=spec.listener,
        outlet=spec.outlet if mode is Mode.DAEMON else None,
        origin=spec.origin,
        # Only where a person can be asked: a headless run acts for nobody.
        user=spec.user if mode is not Mode.HEADLESS else None,
        forwarded=spec.forwarded,
        spend=spec.spend,
        slot=slot,
        _opened=[opened],
        _budget_from=[started],
    )
