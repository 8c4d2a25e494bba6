"""Streamed replies: one message in the chat, edited as the answer arrives.

A :class:`StreamedReply` watches its turn (it is the turn's ``TurnListener``) and keeps a
preview message up to date: the answer so far as plain text, or a progress line while tools
run. It never holds up the turn: edits go out in the background, at most one per chat per
``stream_edit_interval_s`` (:class:`EditPacer`, shared by every turn in the chat), and a rate
limit or a failed edit only skips previews. The preview's message id is recorded with the
inbox row as soon as it exists, so the final answer, which goes through the outbox like
every reply, replaces that message (after a crash too) instead of arriving a second time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol, cast, runtime_checkable

from geodebot.channels.base import (
    Channel,
    ChannelError,
    Destination,
    Edits,
    Lookups,
    OutboundPart,
    Platform,
)
from geodebot.channels.render import LIMITS
from geodebot.config.schema import BindingConfig
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import Fenced, InboxRow, StoreError

log = logging.getLogger(__name__)

# An answer complete this soon after its first text (or progress line) goes out as one
# message, with no preview at all.
FIRST_PREVIEW_AFTER_S = 0.3
# The preview holds the answer up to the platform's message limit less this much (room for
# the progress line, and for characters a platform counts double); the final reply brings
# the rest, continued in further messages past the limit.
PREVIEW_ROOM = 500
# A preview request still under way when the turn ends gets this long (an SDK may be waiting
# out a rate limit on it), then is cancelled: the final answer does not wait longer for it.
CLOSE_WAIT_S = 2.0
RETRYING_TEXT = "(The answer broke off; asking the model again…)"

# The platforms limit a chat (a Slack channel, a Telegram chat with its forum topics, a
# Discord channel), not a thread: every thread of one chat shares its pace.
_ChatKey = tuple[str, str]
# Discord allows 5 edits per 5 s per channel, the final answer's edit included: previews at
# one a second would leave it no room, and four in any 5 s (with some slack for timing) do.
# Elsewhere the limits are about one a second.
MIN_INTERVAL_S: Mapping[str, float] = {"discord": 1.3}


class EditPacer:
    """When each chat may get its next preview request: one per interval (never more often
    than its platform's MIN_INTERVAL_S), and none before a rate limit's Retry-After."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next: dict[_ChatKey, float] = {}

    def wait_s(self, key: _ChatKey, now: float) -> float:
        return max(0.0, self._next.get(key, 0.0) - now)

    def used(self, key: _ChatKey, now: float) -> None:
        interval = max(self._interval_s, MIN_INTERVAL_S.get(key[0], 0.0))
        self._next[key] = max(self._next.get(key, 0.0), now + interval)
        if len(self._next) > 10_000:
            # Chats long past their slot need no entry: drop those, so the map stays small.
            self._next = {k: t for k, t in self._next.items() if t > now}

    def back_off(self, key: _ChatKey, seconds: float, now: float) -> None:
        self._next[key] = max(self._next.get(key, 0.0), now + seconds)


@runtime_checkable
class PreviewChannel(Channel, Edits, Protocol):
    """What a streamed preview needs of its platform: a message sent, then edited as the
    answer grows (``edit_of``), and deleted when it must not stay."""


class ReplyStreams:
    """Makes each chat turn's StreamedReply, where its binding streams."""

    def __init__(
        self,
        store: InboxOutboxStore,
        channels: Mapping[str, Channel],
        *,
        interval_s: float,
        may_send: Callable[[str], bool] | None = None,
    ) -> None:
        self._store = store
        self._channels = channels
        self._pacer = EditPacer(interval_s)
        self._may_send = may_send

    def for_row(self, row: InboxRow, binding: BindingConfig) -> StreamedReply | None:
        channel = self._channels.get(row.platform)
        # A platform whose messages cannot be edited shows the answer when it is done.
        if not binding.stream or not isinstance(channel, PreviewChannel):
            return None
        return StreamedReply(channel, self._store, row, self._pacer, may_send=self._may_send)


class StreamedReply:
    """A ``TurnListener`` that shows the turn in one chat message; :meth:`close` when the
    turn is over, before its reply is delivered."""

    def __init__(
        self,
        channel: PreviewChannel,
        store: InboxOutboxStore,
        row: InboxRow,
        pacer: EditPacer,
        *,
        first_after_s: float = FIRST_PREVIEW_AFTER_S,
        may_send: Callable[[str], bool] | None = None,
    ) -> None:
        self._channel = channel
        # As the outbox's: false for a session whose lease this replica may no longer hold
        # (replicas/leases.py). A preview goes on the platform outside the outbox, and one shown
        # by a replica that lost the session is recorded nowhere: the new holder's answer
        # would come a second time.
        self._may_send = may_send
        self._store = store
        self._row = row
        self._pacer = pacer
        self._key: _ChatKey = (row.platform, row.channel)
        self._destination = Destination(
            cast(Platform, row.platform), row.channel, row.thread, row.message_id
        )
        self._loop = asyncio.get_running_loop()
        # A turn resumed after a crash goes on editing the preview it showed before.
        self.preview_id: str | None = row.preview or None
        # Counted from the turn's first event, not its start: a model that is slow to begin
        # (its first call loading the SDK, say) must not turn a quick answer into a preview.
        self._first_after_s = 0.0 if self.preview_id else first_after_s
        self._not_before: float | None = None
        self._answer: list[str] = []
        self._status = ""
        self._heard = ""
        self._shown = ""
        self._dirty = False
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task[None] | None = None

    # -- TurnListener -----------------------------------------------------------------------
    def round_started(self) -> None:
        self._answer.clear()

    def text(self, delta: str) -> None:
        self._answer.append(delta)
        self._status = ""
        self._changed()

    def restarted(self, reason: str) -> None:
        self._answer.clear()
        self._status = RETRYING_TEXT
        self._changed()

    def tools_started(self, calls: tuple[tuple[str, str], ...]) -> None:
        named = [f"{name} {hint}".strip() for name, hint in calls[:3]]
        more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
        self._status = f"(running {', '.join(named)}{more}…)"
        self._changed()

    # -- the preview ------------------------------------------------------------------------
    async def adopt(self) -> None:
        """For a turn another process began (a crash, or another replica that stopped): the
        preview that process showed but did not record (it stopped between the send and the
        record), found by its key where the platform can look it up (Slack's metadata,
        Discord's nonce while Discord still returns it), becomes this turn's preview, so the
        answer replaces it instead of arriving as a second message. Call before the turn."""
        if self.preview_id:
            return
        # Index 1: a lookup only, never the answer to a slash command (part 0 fills that in).
        part = OutboundPart(self._destination, "", f"gb-preview-{self._row.id}", 1, 2, plain=True)
        if not isinstance(self._channel, Lookups):
            return
        try:
            found = await self._channel.find_sent(part)
        except NotImplementedError:
            return
        except ChannelError as exc:
            log.info("inbox %s: no look for an earlier preview: %s", self._row.id, exc)
            return
        if found is None:
            return
        self.preview_id = found.message_id
        self._first_after_s = 0.0
        log.info("inbox %s: the preview %s shown before goes on", self._row.id, found.message_id)
        try:
            await self._store.inbox_preview(self._row.id, found.message_id)
        except StoreError as exc:
            log.warning("inbox %s: preview not recorded: %s", self._row.id, exc)

    async def close(self) -> str | None:
        """Stop previewing; waits for a preview request under way, so that nothing edits the
        message after the final answer. The preview's message id, if one was shown."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sending = self._sending
        if sending is not None:
            await asyncio.wait((sending,), timeout=CLOSE_WAIT_S)
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
        return self.preview_id

    def close_now(self) -> bool:
        """:meth:`close` when it need not wait (no preview request under way); False, and
        still open, when it must."""
        if self._sending is not None and not self._sending.done():
            return False
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return True

    def heard(self, line: str) -> None:
        """Show what was heard of the message's voice notes at once, above the answer."""
        self._heard = line
        self._first_after_s = 0.0
        self._changed()

    def waiting(self, note: str) -> None:
        """Show what the turn waits for (a person's decision) instead of a progress line."""
        self._status = f"({note})"
        self._changed()

    def _changed(self) -> None:
        if self._not_before is None:
            self._not_before = self._loop.time() + self._first_after_s
        self._dirty = True
        if self._timer is None and self._sending is None and not self._closed:
            self._schedule()

    def _schedule(self) -> None:
        now = self._loop.time()
        not_before = self._not_before if self._not_before is not None else now
        delay = max(not_before - now, self._pacer.wait_s(self._key, now))
        self._timer = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._closed or not self._dirty:
            return
        self._dirty = False
        text = self._view()
        if text == self._shown:
            return
        self._pacer.used(self._key, self._loop.time())
        self._sending = asyncio.create_task(self._show(text))
        self._sending.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending = None
        # The platform counts a request when it arrives, which may be any time up to its
        # answer (a busy loop or a slow link holds it on the way): the next one is paced
        # from the answer, so two never arrive closer than the interval.
        self._pacer.used(self._key, self._loop.time())
        if self._dirty and not self._closed:
            self._schedule()

    def _view(self) -> str:
        answer = "".join(self._answer).strip()
        limit = LIMITS[self._row.platform] - PREVIEW_ROOM
        if len(answer) > limit:
            answer = answer[: limit - 1] + "…"
        if self._status:
            answer = f"{answer}\n\n{self._status}" if answer else self._status
        if self._heard:
            return f"{self._heard}\n\n{answer}" if answer else self._heard
        return answer

    async def _show(self, text: str) -> None:
        if self._may_send is not None and not self._may_send(self._row.session_id):
            log.info("inbox %s: preview skipped: the session's lease is lost", self._row.id)
            return
        part = OutboundPart(
            self._destination,
            text,
            f"gb-preview-{self._row.id}",
            edit_of=self.preview_id,
            plain=True,
        )
        try:
            sent = await self._channel.send(part)
        except ChannelError as exc:
            if exc.retry_after is not None:
                # Previews wait out the limit; the final answer does not wait for them.
                self._pacer.back_off(self._key, exc.retry_after, self._loop.time())
            log.info("inbox %s: preview skipped: %s", self._row.id, exc)
            return
        except Exception:
            log.exception("inbox %s: preview failed", self._row.id)
            return
        self._shown = text
        if sent.message_id != self.preview_id:
            self.preview_id = sent.message_id
            try:
                await self._store.inbox_preview(self._row.id, sent.message_id)
            except Fenced as exc:
                # Another replica runs the session now (this one was paused or cut off while
                # the preview went out): its answer knows nothing of this message, which
                # would stay as an answer of its own.
                log.warning("inbox %s: preview not recorded: %s; deleting it", self._row.id, exc)
                self.preview_id = None
                await self._delete(sent.message_id)
            except StoreError as exc:
                # The turn still knows it and hands it to its reply; only a crash now would
                # leave the preview behind as a message of its own.
                log.warning("inbox %s: preview not recorded: %s", self._row.id, exc)

    async def _delete(self, message_id: str) -> None:
        try:
            await self._channel.delete(self._destination, message_id)
        except ChannelError as exc:
            log.error("inbox %s: preview %s left behind: %s", self._row.id, message_id, exc)
