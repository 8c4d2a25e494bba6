"""From accepted chat message to reply: gate, inbox commit, queue, turn, outbox.

The sink every channel adapter calls is :meth:`ChatRouter.accept`. It returns once the event
is committed to the inbox (the adapter may then acknowledge the platform) and never waits for
the turn: the message is queued behind its session's earlier ones (chat/queues.py) and its
turn runs there. Commands are answered at once (chat/commands.py); what geodebot itself says
is in chat/replies.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Protocol, cast

from geodebot.channels.base import Destination, Inbound, Platform, command_of
from geodebot.chat.approvals import ChatApprovals
from geodebot.chat.attachments import Attachments
from geodebot.chat.bindings import BindingIndex
from geodebot.chat.commands import ChatCommands, CommandsStore, JobStatusText, session_spec
from geodebot.chat.gate import Accepted, Dropped, commit, too_long
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.ownership import SessionElsewhere, SessionOwner
from geodebot.chat.pairing import PairingDesk
from geodebot.chat.queues import SessionQueues
from geodebot.chat.replies import (
    BUSY_TEXT,
    INTERNAL_FAILURE_TEXT,
    STOPPED_TEXT,
    STORE_FAILURE_TEXT,
    VOICE_UNAVAILABLE_TEXT,
    FinishStatus,
    closing,
    reply_to,
    throttle_notice,
)
from geodebot.chat.send_file import OutboxOutlet
from geodebot.chat.stream import ReplyStreams, StreamedReply
from geodebot.chat.throttle import UserRateLimiter, Verdict
from geodebot.chat.voice import Speaking, VoiceUnavailable
from geodebot.config.schema import BindingConfig, BudgetConfig, DaemonConfig, ModelConfig
from geodebot.engine.lanes import Grace
from geodebot.engine.llm.types import Block, TextBlock
from geodebot.engine.modes import Mode
from geodebot.engine.session import LastCheckpoint, TurnResult, TurnRunner
from geodebot.logs.context import log_context
from geodebot.store.protocol import InboxOutboxStore, SessionStore, SyncStore
from geodebot.store.records import (
    Fenced,
    InboxEnding,
    InboxFinished,
    InboxRow,
    OutboxRow,
    StoreError,
)

log = logging.getLogger(__name__)

TYPING_EVERY_S = 4.0
# An accepted message's commit is synced within this, not at once: the turn's own first
# durable commit (a quick answer's) comes in that time and one sync covers both, where a sync
# under way would make it wait for the next. Only the platform's ack waits meanwhile.
ACK_SYNC_WITHIN_S = 0.005
# A reply that comes sooner needs no typing indicator: the first one waits this long, which
# spares a platform request (and the chat's rate limit) on every quick turn.
TYPING_AFTER_S = 0.5
# "@bot /status" is a command too: Slack and Discord write mentions as <@id>, Telegram as @name.
_LEADING_MENTION = re.compile(r"^\s*(<@!?[A-Za-z0-9]+>|@\w+)\s+(?=/)")
Typing = Callable[[Destination], Awaitable[None]]
# An accepted message whose reply the store refuses (a full disk, say) is retried at these
# pauses, doubling, until the store takes it: the message was acknowledged, so it must end
# in a reply, not wait for a restart.
RECORD_RETRY_FIRST_S = 0.5
RECORD_RETRY_MAX_S = 30.0

_Queued = tuple[InboxRow, BindingConfig]


class RouterStore(CommandsStore, InboxOutboxStore, SyncStore, Protocol):
    """What the chat path keeps: the inbox and outbox, the sessions, and what the commands
    read."""


class ChatRouter:
    """``async with`` it: leaving drains the running turns for what is left of ``grace``."""

    def __init__(
        self,
        run_turn: TurnRunner,
        store: RouterStore,
        bindings: BindingIndex | Sequence[BindingConfig],
        outbox: OutboxSender,
        *,
        daemon: DaemonConfig,
        model: ModelConfig,
        budgets: BudgetConfig,
        max_chars: Mapping[str, int],
        typing: Typing | None = None,
        typing_after_s: float = TYPING_AFTER_S,
        job_status: JobStatusText | None = None,
        grace: Grace | None = None,
        approvals: ChatApprovals | None = None,
        streams: ReplyStreams | None = None,
        attachments: Attachments | None = None,
        pairing: PairingDesk | None = None,
        owner: SessionOwner,
        speaking: Speaking | None = None,
        recall: RecallSource | None = None,
    ) -> None:
        self._run_turn = run_turn
        # Strangers' direct messages ask to pair there instead of being dropped.
        self._pairing = pairing
        # Which process runs each session's turns (chat/ownership.py).
        self._owner = owner
        self._attachments = attachments
        # Which answers are spoken too (chat/voice.py); None: no speech service.
        self._speaking = speaking
        # The project's memory recalled into a turn's message (memory/recall.py).
        self._recall = recall
        self._approvals = approvals
        self._streams = streams
        self._store = store
        self._index = BindingIndex.of(bindings)
        self._outbox = outbox
        self._max_chars = max_chars
        self._typing = typing
        self._typing_after_s = typing_after_s
        self._grace = grace if grace is not None else Grace(daemon.shutdown_grace_s)
        self._limiter = (
            UserRateLimiter(daemon.user_rate_per_min, daemon.user_burst)
            if daemon.user_rate_per_min > 0
            else None
        )
        self._queues: SessionQueues[_Queued] = SessionQueues(
            daemon.session_queue, self._work, self._stopped, self._failed
        )
        self._commands = ChatCommands(
            store, self._queues, model=model, budgets=budgets, daemon=daemon, job_status=job_status
        )
        self.counters: collections.Counter[str] = collections.Counter()
        # Inbox rows queued or running here (until _work ends, which _stopped and _failed
        # follow): a row handed over twice (the dead-letter feed and recover() can both find
        # a row replayed while the daemon starts) runs once.
        self._held: set[int] = set()
        owner.subscribe_lost(self.session_lost)
        owner.subscribe_in_use(self.session_in_use)

    async def __aenter__(self) -> ChatRouter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.drain(self._grace.left())

    # -- the sink ---------------------------------------------------------------------------
    async def accept(self, inbound: Inbound) -> None:
        """Returns once the message is committed for good: the platform may be acknowledged.

        The inbox's commit is synced to disk while its turn runs (within ACK_SYNC_WITHIN_S,
        so a quick turn's answer shares the sync): a turn's first effect on the outside waits
        for a durable commit of its own, whose sync covers this one."""
        committed = await self._commit(inbound)
        if isinstance(committed, Dropped):
            if committed.reason != "unbound" or not await self._paired_since(inbound):
                return
            # The chat was paired since this process last read the stored bindings: the
            # same message through the gate again, counted once.
            self.counters["received"] -= 1
            self.counters["dropped:unbound"] -= 1
            committed = await self._commit(inbound)
            if isinstance(committed, Dropped):
                return
        try:
            await self._accepted(*committed)
        finally:
            await self._store.sync(within_s=ACK_SYNC_WITHIN_S)

    async def _commit(self, inbound: Inbound) -> tuple[Accepted, InboxRow, bool] | Dropped:
        return await commit(
            self._store,
            self._index,
            self._max_chars,
            inbound,
            self.counters,
            pickup=self._owner.replica_id,
        )

    async def _paired_since(self, inbound: Inbound) -> bool:
        """An unbound message: a stranger's request to pair (chat/pairing.py), answered
        there; True if its chat turns out to have a stored binding now, read in."""
        if self._pairing is None or not self._pairing.takes(inbound):
            return False
        answer = await self._pairing.ask(inbound)
        # In status's "messages": code, waiting, quiet, full, bound.
        self.counters[f"pairing:{answer.outcome}"] += 1
        return (
            answer.outcome == "bound"
            and self._index.find(inbound.platform, inbound.channel) is not None
        )

    async def _accepted(self, decision: Accepted, row: InboxRow, new: bool) -> None:
        if not new:
            # A redelivery: it was committed (and will be or was answered) already.
            self.counters["duplicate"] += 1
            return
        # After the inbox, so redeliveries (Discord's catch-up, Slack's retries) cost the
        # sender nothing; before the size refusal and commands, whose answers could flood
        # too. By the replica that took it in, whichever runs its session: a row taken up
        # later (another replica's, or one left by a crash) was counted when it came.
        if await self._throttled(row):
            return
        await self._admit(row, decision.binding, decision.refusal)

    async def pick_up(self, row: InboxRow) -> bool:
        """Take up a message committed without being handled (by another replica, or before
        a restart): what :meth:`accept` does after its commit; True if it did. A row already
        handled here is left alone; one whose chat no binding has any more is dropped."""
        if row.id in self._held:
            return False
        binding = self._index.find(row.platform, row.channel)
        if binding is None:
            await self._store.inbox_finish(row.id, "dropped", detail="binding removed")
            return False
        self.counters["picked_up"] += 1
        limit = self._max_chars.get(row.platform, 16_000)
        await self._admit(row, binding, too_long(row.text, limit))
        return True

    def holds_row(self, inbox_id: int) -> bool:
        """Whether the row is queued or running here already."""
        return inbox_id in self._held

    async def _admit(self, row: InboxRow, binding: BindingConfig, refusal: str | None) -> None:
        """A newly committed message (its sender not throttled): refused, answered as a
        command, or queued for its turn. Held from here, so a row found again meanwhile (a
        pick-up poll) is handled once; until its turn ends when it is queued, else until
        this returns.

        Only the process running the session (chat/ownership.py) does any of it; on another
        the row waits for that one, which is woken now."""
        if row.id in self._held:
            return
        self._held.add(row.id)
        queued = False
        try:
            if not await self._owner.admit(row.session_id):
                self.counters["elsewhere"] += 1
                return
            async with self._owner.running(row.session_id):
                queued = await self._handle(row, binding, refusal)
        except SessionElsewhere:
            self.counters["elsewhere"] += 1
            await self._owner.wake_holder(row.session_id)
        finally:
            if not queued:
                self._held.discard(row.id)

    async def _handle(self, row: InboxRow, binding: BindingConfig, refusal: str | None) -> bool:
        """What :meth:`_admit` does with a row held here; whether its turn was queued."""
        self.counters["accepted"] += 1
        if refusal is not None:
            self.counters["too_large"] += 1
            await self._answer(row, "dropped", refusal, detail="too_large")
            return False
        command = command_of(_LEADING_MENTION.sub("", row.text, count=1))
        if command is not None:
            text = await self._commands.answer(row.session_id, binding, command)
            await self._answer(row, "done", text, detail=f"command:{command}")
            return False
        return self._enqueue(row, binding)

    async def _throttled(self, row: InboxRow) -> bool:
        """Drop the message if its sender is over the rate limit (see chat/throttle.py:
        dropped, not queued, so a flood costs no model calls), with one notice per window."""
        if self._limiter is None:
            return False
        verdict = self._limiter.check(row.platform, row.user)
        if verdict is Verdict.ALLOW:
            return False
        self.counters["throttled"] += 1
        if verdict is Verdict.THROTTLE_NOTICE:
            self.counters["throttle_notices"] += 1
            wait = self._limiter.retry_after_s(row.platform, row.user)
            await self._answer(row, "dropped", throttle_notice(wait), detail="throttled")
        else:
            await self._store.inbox_finish(row.id, "dropped", detail="throttled")
        return True

    async def recover(self) -> int:
        """Queue what a previous run accepted but did not answer (in arrival order), when
        this is the only process using the store (replicas take up each session's rows when
        they take the session instead: replicas/takeup.py)."""
        rows = await self._store.inbox_unfinished()
        for row in rows:
            if row.status == "pending":
                await self.pick_up(row)
            elif not self.take(row):
                await self._store.inbox_finish(row.id, "dropped", detail="binding removed")
        return len(rows)

    def session_in_use(self, session_id: str) -> bool:
        """Whether the session has a turn running or queued here."""
        queue = self._queues.get(session_id)
        return queue is not None and (queue.busy or bool(queue.items))

    def session_lost(self, session_id: str, why: str) -> None:
        """Another replica runs the session now: its work here stops, unanswered (the new
        holder answers it; nothing this replica would still write for it could commit)."""
        for row, _ in self._queues.abandon(session_id):
            self._held.discard(row.id)

    def take(self, row: InboxRow) -> bool:
        """Queue a row committed elsewhere: one a previous run left, or a message another
        thread relayed (the sender's commit wrote it). False: no binding has its chat. A row
        already queued or running here is left to that turn."""
        binding = self._index.find(row.platform, row.channel)
        if binding is None:
            return False
        if row.id not in self._held:
            self._enqueue(row, binding)
        return True

    def load(self) -> tuple[int, int]:
        """(turns running, messages queued behind them), over every session."""
        return self._queues.load()

    async def drain(self, grace_s: float) -> None:
        """Stop taking new work; give running turns ``grace_s``, then cancel them.

        A cancelled turn's inbox row stays ``running`` and is answered after the restart;
        a turn waiting for an approval stops at once (its card stays up for the restart).
        """
        if self._approvals is not None:
            self._approvals.park()
        await self._queues.close(grace_s)

    # -- queued turns -----------------------------------------------------------------------
    def _enqueue(self, row: InboxRow, binding: BindingConfig) -> bool:
        """Queue ``row``'s turn; False (and it is answered busy) if its session's queue is
        full."""
        if self._queues.offer(row.session_id, (row, binding)):
            self._held.add(row.id)
            return True
        self.counters["busy"] += 1
        task = asyncio.create_task(self._answer(row, "dropped", BUSY_TEXT, detail="busy"))
        task.add_done_callback(_log_failure)
        return False

    async def _work(self, item: _Queued) -> None:
        row, binding = item
        try:
            with log_context(platform=row.platform, session=row.session_id, inbox=str(row.id)):
                # Held already unless the row came another way (a relay, a replay): then
                # taken now, or left to the replica that holds it.
                try:
                    async with self._owner.running(row.session_id):
                        await self._turn(row, binding)
                except SessionElsewhere:
                    log.info("inbox row %s: its session runs on another replica", row.id)
                    await self._owner.wake_holder(row.session_id)
        finally:
            self._held.discard(row.id)

    async def _stopped(self, item: _Queued) -> None:
        await self._record(item[0], "failed", STOPPED_TEXT, detail="stopped")

    async def _failed(self, item: _Queued, exc: Exception) -> None:
        row = item[0]
        if isinstance(exc, Fenced):
            # Another replica holds the session now and answers the row; nothing said here
            # could commit.
            log.error("turn for inbox row %s stopped: %s", row.id, exc)
            return
        if isinstance(exc, StoreError):
            log.error("turn for inbox row %s: store failure: %s", row.id, exc)
            await self._record(row, "failed", STORE_FAILURE_TEXT, detail="store_error")
        else:
            log.error("turn for inbox row %s failed", row.id, exc_info=exc)
            await self._record(row, "failed", INTERNAL_FAILURE_TEXT, detail="internal_error")

    async def _turn(self, row: InboxRow, binding: BindingConfig) -> None:
        with self._outbox.handing_over(row.id):
            await self._turn_answering(row, binding)

    async def _turn_answering(self, row: InboxRow, binding: BindingConfig) -> None:
        # Not awaited first: the row is marked running in the same store transaction as the
        # turn's own first write (group commit), one round trip to the store less before the
        # model is asked. A row that cannot start (already finished) gets no second answer.
        started = asyncio.ensure_future(self._store.inbox_start(row.id))
        stream = (
            self._streams.for_row(row, binding)
            if self._streams is not None and not _recorded_only(row)
            else None
        )
        if stream is not None and row.status == "running":
            await stream.adopt()
        reply = _Reply()
        try:
            result = await self._run(row, binding, stream, reply)
        except (_Unheard, VoiceUnavailable) as exc:
            await asyncio.gather(started, return_exceptions=True)
            await self._not_heard(row, exc)
            return
        except BaseException:
            # The turn's own failure (or a stop) is what propagates, not the start's.
            await asyncio.gather(started, return_exceptions=True)
            raise
        if isinstance(result.ended, _RowEnding):
            # The turn's last commit finished the row and wrote its reply, begun: it goes
            # out at once, unless it went already. The start, which committed before it, has
            # nothing left to say.
            _, outbound = result.ended.finished
            if outbound is not None and not reply.submitted:
                self._submit(outbound, stream)
            await asyncio.gather(started, return_exceptions=True)
            return
        await started
        status, text, detail = closing(result)
        await self._record(row, status, reply.with_heard(text), detail=detail)

    async def _not_heard(self, row: InboxRow, exc: Exception) -> None:
        """A message of voice notes that gave no text: answered by the notice already sent,
        without a turn; or, with the transcription service down, told so and kept as a dead
        letter, untranscribed, for a replay (chat/deadletters.py)."""
        if isinstance(exc, _Unheard):
            self.counters["voice:unheard"] += 1
            await self._store.inbox_finish(row.id, "dropped", detail="unheard")
            return
        self.counters["voice:unavailable"] += 1
        log.error("inbox row %s: kept as a dead letter: %s", row.id, exc)
        notice = await self._store.outbox_add(reply_to(row, VOICE_UNAVAILABLE_TEXT, kind="notice"))
        self._outbox.submit(notice)
        await self._store.inbox_finish(row.id, "failed", detail="voice_unavailable")

    def _submit(self, outbound: OutboxRow, stream: StreamedReply | None) -> None:
        if stream is not None and stream.preview_id and not outbound.preview:
            # Shown after the commit that wrote the reply: the store has it, this copy not.
            outbound = dataclasses.replace(outbound, preview=stream.preview_id)
        self._outbox.submit(outbound, first_part_begun=True)

    def _written(
        self, stream: StreamedReply | None, reply: _Reply, stop_typing: Callable[[], None]
    ) -> Callable[[InboxFinished], None]:
        """What the turn calls once its last commit wrote the reply: send it now, before the
        turn's bookkeeping, unless something must be waited for first (a preview request
        under way), which :meth:`_turn_answering` then does."""

        def written(ended: InboxFinished) -> None:
            _, outbound = ended
            if outbound is None or (stream is not None and not stream.close_now()):
                return
            stop_typing()
            reply.submitted = True
            self._submit(outbound, stream)

        return written

    async def _run(
        self, row: InboxRow, binding: BindingConfig, stream: StreamedReply | None, reply: _Reply
    ) -> TurnResult:
        destination = Destination(
            cast(Platform, row.platform), row.channel, row.thread, row.message_id
        )
        typing: list[asyncio.Task[None]] = []
        # Nobody answers a message that is only recorded: no typing is shown for it.
        start = (
            None
            if _recorded_only(row)
            else asyncio.get_running_loop().call_later(
                self._typing_after_s,
                lambda: typing.append(asyncio.create_task(self._keep_typing(destination))),
            )
        )
        desk = (
            self._approvals.desk(row, binding, stream.waiting if stream is not None else None)
            if self._approvals is not None
            else None
        )
        outlet = OutboxOutlet.answering(self._store, row, self._outbox.submit)
        written = self._written(stream, reply, functools.partial(_stop_typing, start, typing))
        try:
            attachments = await self._blocks(row, binding, stream, reply)
            spec = session_spec(
                row.session_id,
                binding,
                desk,
                stream,
                outlet,
                user=row.user,
                # A relayed "ask" is answered here, and relays no further (see relay/).
                forwarded=1 if row.relay_id is not None else 0,
            )
            if _recorded_only(row):
                # Nothing runs in a turn that only records: no tool (nor its MCP server) is
                # brought up for it.
                spec = dataclasses.replace(spec, tools=(), preapproved=())
            return await self._run_turn(
                Mode.DAEMON,
                spec,
                row.text,
                # Named after the row: a row recovered after a crash continues its turn.
                turn_id=row.turn_id,
                ending=_RowEnding(
                    self._store, functools.partial(self._ending, row, binding, reply), written
                ),
                attachments=attachments,
                record_only=_recorded_only(row),
            )
        finally:
            if start is not None:
                start.cancel()
            for task in typing:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if stream is not None:
                # Before the reply goes out: no preview may edit the message after it.
                await stream.close()

    async def _blocks(
        self, row: InboxRow, binding: BindingConfig, stream: StreamedReply | None, reply: _Reply
    ) -> tuple[Block, ...]:
        """What the message's user message holds besides its text: its files (voice notes as
        their transcripts), then what the project's memory recalls of it."""
        blocks: tuple[Block, ...] = ()
        if self._attachments is not None:
            taken = await self._attachments.take(row, binding)
            if taken.notice is not None:
                self._outbox.submit(taken.notice)
            if taken.unheard:
                raise _Unheard
            blocks, reply.heard = taken.blocks, taken.heard
            if stream is not None and taken.heard:
                stream.heard(taken.heard)
        if self._recall is not None and not _recorded_only(row):
            heard = " ".join(b.text for b in blocks if isinstance(b, TextBlock))
            recalled = await self._recall.block(
                binding, f"{row.text} {heard}", session_id=row.session_id, turn_id=row.turn_id
            )
            if recalled is not None:
                blocks = (*blocks, recalled)
        return blocks

    async def _keep_typing(self, destination: Destination) -> None:
        if self._typing is None:
            return
        while True:
            with contextlib.suppress(Exception):
                await self._typing(destination)
            await asyncio.sleep(TYPING_EVERY_S)

    # -- replies ----------------------------------------------------------------------------
    def _ending(
        self, row: InboxRow, binding: BindingConfig, reply: _Reply, result: TurnResult
    ) -> InboxEnding:
        """What the turn's last commit writes for ``row``: the same as :meth:`_answer`, and
        the answer as it is spoken where the binding speaks it."""
        if _recorded_only(row) and result.ok:
            return InboxEnding(row.id, "done", "relay_notify")
        status, text, detail = closing(result)
        answer = reply_to(row, reply.with_heard(text))
        if self._speaking is not None and result.ok:
            speech = self._speaking.speech(binding, spoken_to=bool(reply.heard), answer=result.text)
            answer = dataclasses.replace(answer, speech=speech)
        return InboxEnding(row.id, status, detail, answer, begin_first_part=True)

    async def _record(self, row: InboxRow, status: FinishStatus, text: str, *, detail: str) -> None:
        """:meth:`_answer`, tried again while the store refuses writes. At shutdown the row is
        left unfinished instead, and the restart answers it."""
        pause = RECORD_RETRY_FIRST_S
        while True:
            try:
                await self._answer(row, status, text, detail=detail)
                return
            except StoreError as exc:
                if self._queues.closing or isinstance(exc, Fenced):
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
        with self._outbox.handing_over(row.id):
            _, outbound = await self._store.inbox_finish(
                row.id, status, detail=detail, reply=reply_to(row, text), begin_first_part=True
            )
            if outbound is not None:
                self._outbox.submit(outbound, first_part_begun=True)


def _stop_typing(start: asyncio.TimerHandle | None, typing: list[asyncio.Task[None]]) -> None:
    """No typing indicator after the reply: the one due is not started, one running stops."""
    if start is not None:
        start.cancel()
    for task in typing:
        task.cancel()


class RecallSource(Protocol):
    """What of a project's memory bears on a message (memory/recall.py), as one block."""

    async def block(
        self, binding: BindingConfig, text: str, *, session_id: str, turn_id: str
    ) -> TextBlock | None: ...


class _Reply:
    """Whether a turn's reply was handed to the outbox as soon as it was committed, and what
    was heard of its message's voice notes (the answer's first line)."""

    submitted = False
    heard = ""

    def with_heard(self, text: str) -> str:
        return f"{self.heard}\n\n{text}" if self.heard else text


class _Unheard(Exception):
    """The message was voice notes only, and none could be heard: no turn."""


class _RowEnding:
    """A turn's ending for the inbox row it answers: the row's finish and reply, built by
    ``write`` from the turn's result and committed with its last checkpoint; ``written`` is
    given what that commit wrote as soon as it returns."""

    def __init__(
        self,
        store: SessionStore,
        write: Callable[[TurnResult], InboxEnding],
        written: Callable[[InboxFinished], None],
    ) -> None:
        self._store = store
        self._write = write
        self._written = written
        self._finished: InboxFinished | None = None

    async def commit(self, result: TurnResult, checkpoint: LastCheckpoint) -> list[int]:
        seqs, self._finished = await self._store.checkpoint_ending(
            checkpoint.session_id,
            self._write(result),
            messages=checkpoint.messages,
            state=checkpoint.state,
            guards=checkpoint.guards,
            timeline=checkpoint.timeline,
        )
        return seqs

    def written(self) -> None:
        self._written(self.finished)

    @property
    def finished(self) -> InboxFinished:
        """What the commit wrote: the row, finished, and its reply's outbox row."""
        if self._finished is None:
            raise RuntimeError("the turn's ending is not committed yet")
        return self._finished


def _recorded_only(row: InboxRow) -> bool:
    """A message another thread relayed to be read here, not answered (intent "notify")."""
    return row.relay_intent == "notify"


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("router task failed", exc_info=task.exception())
