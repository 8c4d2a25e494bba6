"""From accepted chat message to reply: gate, inbox, per-session lanes, turn, outbox.

The sink every channel adapter calls is :meth:`ChatRouter.accept`. It returns once the event
is committed to the inbox (the adapter may then acknowledge the platform) and never waits for
the turn. Each session has a bounded queue worked by one task, so a chat's messages are
answered one at a time and in arrival order, while different sessions run concurrently up to
the global cap. Nothing about a session is held in memory once its queue is empty.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from geodebot.app.build import App
from geodebot.channels.base import Destination, Inbound, Platform, command_of, commands_help
from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.chat.gate import Accepted, decide
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.throttle import UserRateLimiter, Verdict
from geodebot.config.schema import BindingConfig
from geodebot.engine.modes import Mode
from geodebot.engine.session import COMPUTER_USE_SWITCH, SessionSpec, TurnResult, time_budget
from geodebot.logs.context import log_context
from geodebot.store.records import InboxEnding, InboxRow, NewOutbound, StoreError

log = logging.getLogger(__name__)

TYPING_EVERY_S = 4.0
# A reply that comes sooner needs no typing indicator: the first one waits this long, which
# spares a platform request (and the chat's rate limit) on every quick turn.
TYPING_AFTER_S = 0.5
# "@bot /status" is a command too: Slack and Discord write mentions as <@id>, Telegram as @name.
_LEADING_MENTION = re.compile(r"^\s*(<@!?[A-Za-z0-9]+>|@\w+)\s+(?=/)")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FinishStatus = Literal["done", "failed", "dropped"]
Typing = Callable[[Destination], Awaitable[None]]
# Lines about the scheduled jobs that post in a binding's chat (given by key), for /status.
JobStatusText = Callable[[str], Awaitable[str]]
# An accepted message whose reply the store refuses (a full disk, say) is retried at these
# pauses, doubling, until the store takes it: the message was acknowledged, so it must end
# in a reply, not wait for a restart.
RECORD_RETRY_FIRST_S = 0.5
RECORD_RETRY_MAX_S = 30.0
STORE_FAILURE_TEXT = "geodebot could not save this conversation, so it stopped the turn."
INTERNAL_FAILURE_TEXT = "Something went wrong inside geodebot; the turn was stopped."


@dataclass(slots=True)
class _Lane:
    queue: collections.deque[tuple[InboxRow, BindingConfig]] = field(
        default_factory=collections.deque
    )
    worker: asyncio.Task[None] | None = None
    running: asyncio.Task[None] | None = None
    stop_requested: bool = False


class ChatRouter:
    def __init__(
        self,
        app: App,
        bindings: BindingIndex | Sequence[BindingConfig],
        outbox: OutboxSender,
        *,
        max_chars: Mapping[str, int],
        typing: Typing | None = None,
        typing_after_s: float = TYPING_AFTER_S,
        job_status: JobStatusText | None = None,
    ) -> None:
        self._app = app
        self._store = app.services.store
        self._index = BindingIndex.of(bindings)
        self._outbox = outbox
        self._max_chars = max_chars
        self._typing = typing
        self._typing_after_s = typing_after_s
        self._job_status = job_status
        self._queue_limit = app.config.daemon.session_queue
        daemon = app.config.daemon
        self._limiter = (
            UserRateLimiter(daemon.user_rate_per_min, daemon.user_burst)
            if daemon.user_rate_per_min > 0
            else None
        )
        self._lanes: dict[str, _Lane] = {}
        self._closing = False
        self.counters: collections.Counter[str] = collections.Counter()

    # -- the sink ---------------------------------------------------------------------------
    async def accept(self, inbound: Inbound) -> None:
        self.counters["received"] += 1
        decision = decide(inbound, self._index, self._max_chars.get(inbound.platform, 16_000))
        if not isinstance(decision, Accepted):
            self.counters[f"dropped:{decision.reason}"] += 1
            return
        row, new = await self._store.inbox_add(
            platform=inbound.platform,
            event_id=inbound.event_id,
            session_id=decision.session_id,
            channel=inbound.channel,
            thread=inbound.thread,
            user=inbound.user,
            text=inbound.text,
            message_id=inbound.message_id,
        )
        if not new:
            # A redelivery: it was committed (and will be or was answered) already.
            self.counters["duplicate"] += 1
            return
        # After the inbox, so redeliveries (Discord's catch-up, Slack's retries) cost the
        # sender nothing; before the size refusal and commands, whose answers could flood too.
        if await self._throttled(inbound, row):
            return
        self.counters["accepted"] += 1
        if decision.refusal is not None:
            self.counters["too_large"] += 1
            await self._answer(row, "dropped", decision.refusal, detail="too_large")
            return
        command = command_of(_LEADING_MENTION.sub("", inbound.text, count=1))
        if command is not None:
            await self._command(row, decision.binding, command)
            return
        self._enqueue(row, decision.binding)

    async def _throttled(self, inbound: Inbound, row: InboxRow) -> bool:
        """Drop the message if its sender is over the rate limit (see chat/throttle.py:
        dropped, not queued, so a flood costs no model calls), with one notice per window."""
        if self._limiter is None:
            return False
        verdict = self._limiter.check(inbound.platform, inbound.user)
        if verdict is Verdict.ALLOW:
            return False
        self.counters["throttled"] += 1
        if verdict is Verdict.THROTTLE_NOTICE:
            self.counters["throttle_notices"] += 1
            wait = self._limiter.retry_after_s(inbound.platform, inbound.user)
            notice = (
                "You are sending messages faster than I take them here, so I am skipping "
                f"them for now; try again in about {max(1, math.ceil(wait))} s."
            )
            await self._answer(row, "dropped", notice, detail="throttled")
        else:
            await self._store.inbox_finish(row.id, "dropped", detail="throttled")
        return True

    async def recover(self) -> int:
        """Queue what a previous run accepted but did not answer (in arrival order)."""
        rows = await self._store.inbox_unfinished()
        for row in rows:
            binding = self._index.find(row.platform, row.channel)
            if binding is None:
                await self._store.inbox_finish(row.id, "dropped", detail="binding removed")
                continue
            self._enqueue(row, binding)
        return len(rows)

    # -- lanes ------------------------------------------------------------------------------
    def _enqueue(self, row: InboxRow, binding: BindingConfig) -> None:
        lane = self._lanes.setdefault(row.session_id, _Lane())
        if len(lane.queue) >= self._queue_limit:
            self.counters["busy"] += 1
            task = asyncio.create_task(
                self._answer(
                    row,
                    "dropped",
                    "I am still working on earlier messages here; please send this again "
                    "in a moment.",
                    detail="busy",
                )
            )
            task.add_done_callback(_log_failure)
            return
        lane.queue.append((row, binding))
        if lane.worker is None or lane.worker.done():
            lane.worker = asyncio.create_task(self._work(row.session_id, lane))

    async def _work(self, session_id: str, lane: _Lane) -> None:
        try:
            while lane.queue and not self._closing:
                row, binding = lane.queue.popleft()
                lane.stop_requested = False
                lane.running = asyncio.create_task(self._turn(row, binding))
                try:
                    await lane.running
                except asyncio.CancelledError:
                    if not lane.stop_requested:
                        raise
                    await self._record(row, "failed", "Stopped, as asked.", detail="stopped")
                except StoreError as exc:
                    log.error("turn for inbox row %s: store failure: %s", row.id, exc)
                    await self._record(row, "failed", STORE_FAILURE_TEXT, detail="store_error")
                except Exception:
                    log.exception("turn for inbox row %s failed", row.id)
                    await self._record(
                        row, "failed", INTERNAL_FAILURE_TEXT, detail="internal_error"
                    )
                finally:
                    lane.running = None
        finally:
            if not lane.queue and self._lanes.get(session_id) is lane:
                del self._lanes[session_id]

    async def _turn(self, row: InboxRow, binding: BindingConfig) -> None:
        with log_context(platform=row.platform, session=row.session_id, inbox=str(row.id)):
            await self._turn_in_context(row, binding)

    async def _turn_in_context(self, row: InboxRow, binding: BindingConfig) -> None:
        # Not awaited first: the row is marked running in the same store transaction as the
        # turn's own first write (group commit), one round trip to the store less before the
        # model is asked. A row that cannot start (already finished) gets no second answer.
        started = asyncio.ensure_future(self._store.inbox_start(row.id))
        try:
            result = await self._run(row, binding)
        except BaseException:
            # The turn's own failure (or a stop) is what propagates, not the start's.
            await asyncio.gather(started, return_exceptions=True)
            raise
        if result.ended is not None:
            # The turn's last commit finished the row and wrote its reply, begun: it goes
            # out at once. The start, which committed before it, has nothing left to say.
            _, outbound = result.ended
            if outbound is not None:
                self._outbox.submit(outbound, first_part_begun=True)
            await asyncio.gather(started, return_exceptions=True)
            return
        await started
        status, text, detail = _closing(result)
        await self._record(row, status, text, detail=detail)

    async def _run(self, row: InboxRow, binding: BindingConfig) -> TurnResult:
        destination = Destination(
            cast(Platform, row.platform), row.channel, row.thread, row.message_id
        )
        typing: list[asyncio.Task[None]] = []
        start = asyncio.get_running_loop().call_later(
            self._typing_after_s,
            lambda: typing.append(asyncio.create_task(self._keep_typing(destination))),
        )
        try:
            spec = self._spec(row.session_id, binding)
            # Named after the row: a row recovered after a crash continues its turn.
            turn_id = f"t-inbox-{row.id}"
            result = await self._app.run_turn(
                Mode.DAEMON,
                spec,
                row.text,
                turn_id=turn_id,
                ending=functools.partial(self._ending, row),
            )
        finally:
            start.cancel()
            for task in typing:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return result

    def _spec(self, session_id: str, binding: BindingConfig) -> SessionSpec:
        return SessionSpec(
            session_id,
            tools=binding.tools,
            preapproved=binding.preapproved,
            time_budget_s=binding.time_budget_s,
            # Tools acting for the chat (jobs) go by the binding, not the session, which
            # other bindings may share.
            origin=binding_key(binding),
        )

    async def _keep_typing(self, destination: Destination) -> None:
        if self._typing is None:
            return
        while True:
            with contextlib.suppress(Exception):
                await self._typing(destination)
            await asyncio.sleep(TYPING_EVERY_S)

    def _ending(self, row: InboxRow, result: TurnResult) -> InboxEnding:
        """What the turn's last commit writes for ``row``: the same as :meth:`_answer`."""
        status, text, detail = _closing(result)
        return InboxEnding(row.id, status, detail, self._reply(row, text), begin_first_part=True)

    async def _record(self, row: InboxRow, status: FinishStatus, text: str, *, detail: str) -> None:
        """:meth:`_answer`, tried again while the store refuses writes. At shutdown the row is
        left unfinished instead, and the restart answers it."""
        pause = RECORD_RETRY_FIRST_S
        while True:
            try:
                await self._answer(row, status, text, detail=detail)
                return
            except StoreError as exc:
                if self._closing:
                    raise
                if await self._finished_already(row):
                    # Its answer is written (a stop that came as the turn's last commit did):
                    # trying again could never succeed, and must not.
                    log.warning("inbox row %s: already finished; %s", row.id, exc)
                    return
                log.error(
                    "inbox row %s: cannot record its reply (%s); trying again in %.1f s",
                    row.id,
                    exc,
                    pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECORD_RETRY_MAX_S)

    async def _finished_already(self, row: InboxRow) -> bool:
        try:
            current = await self._store.get_inbox(row.id)
        except StoreError:
            return False
        return current is not None and current.status not in ("pending", "running")

    async def _answer(self, row: InboxRow, status: FinishStatus, text: str, *, detail: str) -> None:
        # Part 0 is begun in the same commit: the sender can send it at once.
        _, outbound = await self._store.inbox_finish(
            row.id, status, detail=detail, reply=self._reply(row, text), begin_first_part=True
        )
        if outbound is not None:
            self._outbox.submit(outbound, first_part_begun=True)

    @staticmethod
    def _reply(row: InboxRow, text: str) -> NewOutbound:
        return NewOutbound(
            session_id=row.session_id,
            platform=row.platform,
            channel=row.channel,
            thread=row.thread,
            reply_to=row.message_id,
            text=text,
        )

    # -- chat commands ----------------------------------------------------------------------
    async def _command(self, row: InboxRow, binding: BindingConfig, command: str) -> None:
        session_id = row.session_id
        lane = self._lanes.get(session_id)
        if command == "help":
            text = "I answer messages in this chat.\n\n" + commands_help()
        elif command == "status":
            text = await self._status_text(session_id, binding, lane)
        elif command == "stop":
            if lane is not None and lane.running is not None and not lane.running.done():
                lane.stop_requested = True
                lane.running.cancel()
                text = "Stopping the running turn."
            else:
                text = "Nothing is running here."
        else:  # reset
            if await self._store.get_session(session_id) is not None:
                record = await self._store.reset_session(session_id)
                text = (
                    f"Started a fresh context (generation {record.generation}). "
                    "The earlier history is kept in the store."
                )
            else:
                text = "This chat has no history yet."
        await self._answer(row, "done", text, detail=f"command:{command}")

    async def _status_text(
        self, session_id: str, binding: BindingConfig, lane: _Lane | None
    ) -> str:
        config = self._app.config
        budget = time_budget(Mode.DAEMON, self._spec(session_id, binding), config.budgets)
        running = lane is not None and lane.running is not None and not lane.running.done()
        queued = len(lane.queue) if lane is not None else 0
        tools = ", ".join(binding.tools) if binding.tools else "none"
        busy, waiting = self.load()
        switch = await self._store.get_switch(COMPUTER_USE_SWITCH)
        if switch is None or not switch.active(time.time()):
            computer = "off"
        else:
            until = (
                "until switched off"
                if switch.expires_at is None
                else "until " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(switch.expires_at))
            )
            computer = f"on ({until}, by {switch.set_by})"
        jobs = "" if self._job_status is None else await self._job_status(binding_key(binding))
        return (
            f"Session: {session_id}\n"
            f"Model: {config.model.provider} {config.model.name}\n"
            f"Turn running: {'yes' if running else 'no'}; queued: {queued}\n"
            f"Time budget per turn: {budget:g} s\n"
            f"Tools: {tools}\n"
            f"Computer use: {computer}\n"
            f"Daemon: {busy} of at most {config.daemon.max_concurrent_sessions} turns "
            f"running; {waiting} messages queued"
        ) + (f"\n{jobs}" if jobs else "")

    # -- lifecycle --------------------------------------------------------------------------
    def busy_sessions(self) -> int:
        return len(self._lanes)

    def load(self) -> tuple[int, int]:
        """(turns running, messages queued behind them), over every session."""
        running = sum(1 for lane in self._lanes.values() if lane.running is not None)
        return running, sum(len(lane.queue) for lane in self._lanes.values())

    async def drain(self, grace_s: float) -> None:
        """Stop taking new work; give running turns ``grace_s``, then cancel them.

        A cancelled turn's inbox row stays ``running`` and is answered after the restart.
        """
        self._closing = True
        workers = [lane.worker for lane in self._lanes.values() if lane.worker is not None]
        if not workers:
            return
        _, pending = await asyncio.wait(workers, timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _closing(result: TurnResult) -> tuple[FinishStatus, str, str]:
    """How a turn's result finishes its inbox row: status, reply text, detail."""
    status: FinishStatus = "done" if result.ok else "failed"
    return status, result.text + refusal_note(result.refused_tools), result.outcome


def refusal_note(tools: Sequence[str], shown: int = 8) -> str:
    """A line under the answer naming the tools that were refused, said by geodebot itself:
    a model steered by a prompt injection may well not mention them. Names come from the
    model, so anything that is not a plain tool name is not repeated into the chat."""
    if not tools:
        return ""
    names = [f"`{t}`" if _TOOL_NAME.fullmatch(t) else "a tool with an odd name" for t in tools]
    listed = ", ".join(names[:shown])
    if len(names) > shown:
        listed += f" and {len(names) - shown} more"
    return f"\n\n(Not allowed here, so not run: {listed}.)"


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("router task failed", exc_info=task.exception())
