"""The chat path, wired in one place: outbox, approvals, streams, files, router and the
dead-letter feed, for the daemon and the tests alike.

:func:`build_chat` makes the stages without starting any of them, because what sits in front
of them is made from them: the channel supervisor takes the router's and the approvals'
sinks, and it is entered before the pipeline (so its connections close after the last reply
went out). Entering the :class:`ChatPipeline` starts the outbox, the approvals, the router
and the dead-letter feed in that order; leaving stops them backwards: the router drains its
turns within its grace, then the outbox sends what they left within its own.

What a session's work may do where (one process, or replicas) comes from the one
:class:`~geodebot.chat.ownership.SessionOwner` handed in: cards and stream edits go out only
for sessions it holds, and replicas wake each other for approvals decided elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

from geodebot.channels.base import Channel, Destination
from geodebot.chat.approvals import ChatApprovals
from geodebot.chat.attachments import Attachments
from geodebot.chat.bindings import BindingIndex
from geodebot.chat.commands import JobStatusText
from geodebot.chat.deadletters import DeadLetters, ReplayFeed
from geodebot.chat.outbox import OnFinished, OutboxSender
from geodebot.chat.ownership import SessionOwner
from geodebot.chat.pairing import PairingDesk
from geodebot.chat.router import TYPING_AFTER_S, ChatRouter, RecallSource
from geodebot.chat.stored_bindings import StoredBindings
from geodebot.chat.stream import ReplyStreams
from geodebot.chat.voice import Hearing, Speaking
from geodebot.config.schema import BindingConfig, Config, VoiceConfig
from geodebot.engine.lanes import Grace, cancel_and_wait
from geodebot.engine.llm.audio import Speaker, Transcriber
from geodebot.engine.session import TurnRunner
from geodebot.engine.spend import AudioBudget, AudioPrices, SpendGate
from geodebot.logs.redact import Redactor
from geodebot.store.files import FileStore
from geodebot.store.protocol import Store
from geodebot.store.records import ApprovalRecord

__all__ = ["ChatHooks", "ChatPipeline", "build_chat", "max_chars_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatHooks:
    """What the chat path tells, asks or waits with outside itself; each has a default that
    does without it."""

    # Shows the platform's "typing…" while a turn runs (only for channels that can).
    typing: Callable[[Destination], Awaitable[None]] | None = None
    # How long a turn runs before typing is shown.
    typing_after_s: float = TYPING_AFTER_S
    # The jobs part of /status for a binding.
    job_status: JobStatusText | None = None
    # Told of each reply the outbox is done with (sent, or given up on as a dead letter).
    on_reply_finished: OnFinished | None = None
    # Told of each approval request shown or settled here.
    on_approval_change: Callable[[ApprovalRecord], None] | None = None
    # What the outbox waits with between tries (a platform's Retry-After among them).
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    # The approvals' wall clock (their timeouts).
    clock: Callable[[], float] = time.time


def max_chars_of(config: Config) -> dict[str, int]:
    """The longest message each configured platform takes in."""
    return {
        name: table.max_message_chars
        for name, table in (
            ("telegram", config.channels.telegram),
            ("slack", config.channels.slack),
            ("discord", config.channels.discord),
        )
        if table is not None
    }


class ChatPipeline:
    """The chat path's stages, made by :func:`build_chat`; ``async with`` it runs them."""

    def __init__(
        self,
        *,
        outbox: OutboxSender,
        approvals: ChatApprovals,
        router: ChatRouter,
        feed: ReplayFeed,
        deadletters: DeadLetters,
        stored: StoredBindings,
        pairing: PairingDesk,
        recover: bool,
    ) -> None:
        # The bindings made at run time, kept current in the router's index.
        self.stored = stored
        self.pairing = pairing
        self.outbox = outbox
        self.approvals = approvals
        self.router = router
        self.feed = feed
        # Replays made here (the console) reach the router and the outbox at once.
        self.deadletters = deadletters
        self._recover = recover
        self._stack: AsyncExitStack | None = None

    async def __aenter__(self) -> ChatPipeline:
        if self._stack is not None:
            raise RuntimeError("the chat pipeline is running already")
        async with AsyncExitStack() as stack:
            # First: what recovery finds for a paired chat is answered, not dropped.
            await stack.enter_async_context(self.stored)
            await stack.enter_async_context(self.outbox)
            await stack.enter_async_context(self.approvals)
            await stack.enter_async_context(self.router)
            # Before recover: a replay from now on is the feed's to hand over, an earlier one
            # is read by recover and the outbox's first scan like any pending row.
            await self.feed.start()
            if self._recover:
                recovered = await self.router.recover()
                if recovered:
                    log.info("answering %s message(s) accepted before the restart", recovered)
            feed = asyncio.create_task(self.feed.run(), name="dead-letter-replays")
            stack.push_async_callback(cancel_and_wait, feed)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


def audio_budget(spend: SpendGate | None, voice: VoiceConfig | None) -> AudioBudget | None:
    if spend is None or voice is None:
        return None
    return AudioBudget(spend, AudioPrices(voice.price_per_minute, voice.price_per_mchars))


def build_chat(
    run_turn: TurnRunner,
    store: Store,
    bindings: BindingIndex | Sequence[BindingConfig],
    channels: Mapping[str, Channel],
    config: Config,
    *,
    owner: SessionOwner,
    files: FileStore | None = None,
    redactor: Redactor | None = None,
    turns_grace: Grace | None = None,
    sends_grace: Grace | None = None,
    hooks: ChatHooks | None = None,
    streams: bool = True,
    recover: bool = False,
    max_chars: Mapping[str, int] | None = None,
    transcriber: Transcriber | None = None,
    speaker: Speaker | None = None,
    spend: SpendGate | None = None,
    recall: RecallSource | None = None,
) -> ChatPipeline:
    """The chat path over ``channels``, not yet running.

    ``owner`` says which sessions' work runs here; ``recover``: answer what the store holds
    unanswered from before a restart as the pipeline starts (one process only: replicas take
    up each session's rows as they take the session). ``streams``: answers of bindings that
    stream are shown as they come (by editing one message). ``files``: files users send reach
    the model, and the model can send files. ``max_chars``: by platform, defaults to the
    config's ``max_message_chars``. ``transcriber``: voice notes become text, and
    ``speaker``: answers are spoken (each with ``files`` and ``[voice]``), their calls
    under ``spend``'s budgets. ``recall``: the project's memory recalled into each turn.
    The two graces default to ``[daemon] shutdown_grace_s`` for the turns and none for the
    sends.
    """
    hooks = hooks if hooks is not None else ChatHooks()
    index = BindingIndex.of(bindings)
    budget = audio_budget(spend, config.voice)
    speaking = (
        Speaking(speaker, files, store, config.voice, budget)
        if speaker is not None and files is not None and config.voice is not None
        else None
    )
    outbox = OutboxSender(
        store,
        channels,
        sleep=hooks.sleep,
        grace=sends_grace,
        files=files,
        on_finished=hooks.on_reply_finished,
        owner=owner,
        speaking=speaking,
    )
    approvals = ChatApprovals(
        store,
        channels,
        redactor=redactor,
        clock=hooks.clock,
        on_change=hooks.on_approval_change,
        may_send=owner.holds,
        shared=owner.replica_id is not None,
    )
    # A change of the stored bindings may come with a welcome to send: looked for at once.
    stored = StoredBindings(store, index, on_change=outbox.kick)
    pairing = PairingDesk(store, config.pairing, submit=outbox.submit, refresh=stored.refresh)
    router = ChatRouter(
        run_turn,
        store,
        index,
        outbox,
        daemon=config.daemon,
        model=config.model,
        budgets=config.budgets,
        max_chars=max_chars if max_chars is not None else max_chars_of(config),
        typing=hooks.typing,
        typing_after_s=hooks.typing_after_s,
        job_status=hooks.job_status,
        grace=turns_grace,
        approvals=approvals,
        streams=(
            ReplyStreams(
                store,
                channels,
                interval_s=config.daemon.stream_edit_interval_s,
                may_send=owner.holds,
            )
            if streams
            else None
        ),
        attachments=(
            Attachments(
                store,
                files,
                channels,
                hearing=(
                    Hearing(transcriber, config.voice, budget)
                    if transcriber is not None and config.voice is not None
                    else None
                ),
            )
            if files is not None
            else None
        ),
        pairing=pairing,
        owner=owner,
        speaking=speaking,
        recall=recall,
    )
    feed = ReplayFeed(store, router.take, outbox.submit)
    return ChatPipeline(
        outbox=outbox,
        approvals=approvals,
        router=router,
        feed=feed,
        deadletters=DeadLetters(store, on_replayed=feed.replayed),
        stored=stored,
        pairing=pairing,
        recover=recover,
    )
