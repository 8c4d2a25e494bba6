"""The chat commands every platform offers: /help, /status, /stop and /reset.

Each answer is said by geodebot (never the model) and written as the command's reply.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from geodebot.channels.base import commands_help
from geodebot.chat.bindings import binding_key
from geodebot.chat.queues import SessionQueues
from geodebot.config.schema import BindingConfig, BudgetConfig, DaemonConfig, ModelConfig
from geodebot.engine.modes import Mode
from geodebot.engine.session import (
    COMPUTER_USE_SWITCH,
    SessionSpec,
    TurnListener,
    time_budget,
)
from geodebot.engine.spend import SpendScope, binding_scope, utc_day
from geodebot.engine.tools.spec import ApprovalDesk, ChatOutlet
from geodebot.store.protocol import ApprovalStore, ReceiptStore, SessionStore, SpendStore

# Lines about the scheduled jobs that post in a binding's chat (given by key), for /status.
JobStatusText = Callable[[str], Awaitable[str]]


def session_spec(
    session_id: str,
    binding: BindingConfig,
    desk: ApprovalDesk | None = None,
    listener: TurnListener | None = None,
    outlet: ChatOutlet | None = None,
    *,
    user: str | None = None,
    forwarded: int = 0,
) -> SessionSpec:
    """A chat turn's session: the binding's tools, pre-approvals, approvers' desk and time
    budget, what shows the answer as it arrives, and where tools post into the chat."""
    return SessionSpec(
        session_id,
        tools=binding.tools,
        preapproved=binding.preapproved,
        desk=desk,
        listener=listener,
        outlet=outlet,
        time_budget_s=binding.time_budget_s,
        # Tools acting for the chat (jobs) go by the binding, not the session, which
        # other bindings may share.
        origin=binding_key(binding),
        user=user,
        forwarded=forwarded,
        spend=SpendScope(binding=binding_key(binding)),
    )


class CommandsStore(SessionStore, ApprovalStore, ReceiptStore, SpendStore, Protocol):
    """What the chat commands read and reset: sessions, pending approvals, the computer-use
    switch, the day's spend."""


class ChatCommands:
    def __init__(
        self,
        store: CommandsStore,
        queues: SessionQueues[Any],
        *,
        model: ModelConfig,
        budgets: BudgetConfig,
        daemon: DaemonConfig,
        job_status: JobStatusText | None = None,
    ) -> None:
        self._store = store
        self._queues = queues
        self._model = model
        self._budgets = budgets
        self._daemon = daemon
        self._job_status = job_status

    async def answer(self, session_id: str, binding: BindingConfig, command: str) -> str:
        if command == "help":
            return "I answer messages in this chat.\n\n" + commands_help()
        if command == "status":
            return await self._status(session_id, binding)
        if command == "stop":
            if self._queues.stop_running(session_id):
                return "Stopping the running turn."
            return "Nothing is running here."
        return await self._reset(session_id)

    async def _reset(self, session_id: str) -> str:
        if await self._store.get_session(session_id) is None:
            return "This chat has no history yet."
        record = await self._store.reset_session(session_id)
        return (
            f"Started a fresh context (generation {record.generation}). "
            "The earlier history is kept in the store."
        )

    async def _status(self, session_id: str, binding: BindingConfig) -> str:
        budget = time_budget(Mode.DAEMON, session_spec(session_id, binding), self._budgets)
        queue = self._queues.get(session_id)
        running = queue is not None and queue.busy
        queued = len(queue.items) if queue is not None else 0
        tools = ", ".join(binding.tools) if binding.tools else "none"
        busy, waiting = self._queues.load()
        jobs = "" if self._job_status is None else await self._job_status(binding_key(binding))
        approvals = await self._approvals(session_id)
        tokens = await self._tokens_today(binding)
        return (
            f"Session: {session_id}\n"
            f"Model: {self._model.provider} {self._model.name}\n"
            f"Turn running: {'yes' if running else 'no'}; queued: {queued}\n"
            f"Time budget per turn: {budget:g} s\n"
            f"Tools: {tools}\n"
            f"Computer use: {await self._computer_use()}\n"
            f"{tokens}\n"
            f"Daemon: {busy} of at most {self._daemon.max_concurrent_sessions} turns "
            f"running; {waiting} messages queued"
        ) + "".join(f"\n{line}" for line in (*approvals, jobs) if line)

    async def _tokens_today(self, binding: BindingConfig) -> str:
        """What this chat spent today, as its budget counts it (reserved calls at their
        worst case), and its limit."""
        counter = (binding_scope(binding_key(binding)), utc_day(time.time()))
        used = int((await self._store.spend_used([counter]))[counter])
        limit = f" of {binding.daily_tokens:,}" if binding.daily_tokens else ""
        return f"Tokens today (UTC day): {used:,}{limit}"

    async def _approvals(self, session_id: str) -> list[str]:
        """A line per call of this session waiting for a person's decision."""
        return [
            f"Waiting for approval: {request.tool} ({request.safety}), asked of "
            f"{', '.join(request.approvers)}, until {_utc(request.expires_at)}"
            for request in await self._store.approvals_pending(session_id=session_id)
        ]

    async def _computer_use(self) -> str:
        switch = await self._store.get_switch(COMPUTER_USE_SWITCH)
        if switch is None or not switch.active(time.time()):
            return "off"
        until = "switched off" if switch.expires_at is None else _utc(switch.expires_at)
        return f"on (until {until}, by {switch.set_by})"


def _utc(moment: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(moment))
