"""The outbox sender: every reply is a row before it is sent, and is sent exactly once.

Rows of one chat go out one after the other, in order; different chats go out concurrently.
Each part of a reply is marked in flight before its request and sent after it, so a crash or
a timeout leaves evidence. A part whose outcome is unknown is looked up where the platform
allows it (Discord nonce, Slack message metadata); where it does not, it is sent again at
most once, never blindly over and over. A 429 pauses that chat for Retry-After.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import cast

from geodebot.channels.base import (
    Channel,
    ChannelError,
    Destination,
    Edits,
    Lookups,
    OutboundFile,
    OutboundPart,
    Platform,
    SendUnknown,
)
from geodebot.chat.ownership import SessionElsewhere, SessionOwner
from geodebot.chat.voice import Speaking, cut_note
from geodebot.engine.lanes import Grace
from geodebot.engine.llm.audio import AudioError
from geodebot.store.files import FileStore
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import (
    Fenced,
    OutboxRow,
    OutboxRowFinished,
    StoredFile,
    StoreError,
)

log = logging.getLogger(__name__)

# Attempts per part before a reply is given up as failed (429s do not count).
MAX_ATTEMPTS = 6
# A part whose outcome is unknown may be resent blindly this many times where the platform
# cannot say whether it arrived.
MAX_BLIND_RESENDS = 1
MAX_RETRY_AFTER_S = 300.0
POLL_S = 5.0
# While the store refuses writes (a full disk, say) a chat waits this long before its next
# pass, doubling up to the cap, instead of trying again at once.
STORE_RETRY_FIRST_S = 0.5
STORE_RETRY_MAX_S = 30.0
# A part sent after this replica lost its session waits this long at most (bounded by the
# lease's time to live) for the new holder's record of the part, every COPY_CHECK_S.
COPY_WAIT_MIN_S, COPY_WAIT_MAX_S = 5.0, 30.0
COPY_CHECK_S = 0.5


ChatKey = tuple[str, str, str | None]
# Told of each row this sender finished (sent, or failed: given up on), after its commit.
OnFinished = Callable[[OutboxRow], None]


def part_key(outbox_id: int, index: int) -> str:
    return f"gb-{outbox_id}-{index}"


class OutboxSender:
    def __init__(
        self,
        store: InboxOutboxStore,
        channels: Mapping[str, Channel],
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        grace: Grace | None = None,
        files: FileStore | None = None,
        on_finished: OnFinished | None = None,
        owner: SessionOwner,
        speaking: Speaking | None = None,
    ) -> None:
        self._store = store
        # Makes the audio of spoken answers (chat/voice.py); None: a row's speech is left out.
        self._speaking = speaking
        # A row is sent by the process running its session (chat/ownership.py), its writes
        # fenced. With replicas, a part begun under a lease since lost is left for the
        # replica that holds the session now, never sent by both.
        self._owner = owner
        owner.subscribe_in_use(self.sending)
        # Whoever shows what became of replies (the console's open pages); it must return at
        # once and not raise.
        self._on_finished = on_finished
        # Where the files that rows upload are kept (send_file).
        self._files = files
        self._grace = grace if grace is not None else Grace(0.0)
        self._sender: asyncio.Task[None] | None = None
        self._channels = channels
        self._sleep = sleep
        self._wake = asyncio.Event()
        # Per chat: the rows queued for its one delivery task, oldest first.
        self._queues: dict[ChatKey, collections.deque[OutboxRow]] = {}
        self._active: dict[ChatKey, asyncio.Task[None]] = {}
        # Ids of rows queued or being delivered, so a row handed over twice (directly and by
        # a scan of pending rows) goes out once.
        self._known: set[int] = set()
        # Ids of queued rows whose part 0 the commit that wrote them began (see submit).
        self._begun: set[int] = set()
        # Per scan whose read is out (see _schedule; run and stop may both scan): the ids of
        # rows delivered meanwhile.
        self._scans: list[set[int]] = []
        # Inbox rows whose reply a turn of this process is writing, with how many writers.
        # The commit that writes such a reply also begins its part 0, and the turn hands the
        # row over right after it: a scan that read the row in between leaves it to the
        # turn, as taken from a scan the begun part would count as an open outcome (looked
        # up, or sent again blind where the platform cannot say: a second copy).
        self._handovers: collections.Counter[int] = collections.Counter()
        self._stopping = False
        self._store_pause = STORE_RETRY_FIRST_S
        # Parts sent after the session's lease was lost, each waiting for the new holder's
        # record of it (see _settle_copy); a stop waits for them too.
        self._copies: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> OutboxSender:
        """Deliver pending rows (:meth:`run`) until left; leaving sends what is pending for
        the ``grace`` (its own window: the replies of turns that used all of theirs)."""
        self._sender = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(self._grace.left())
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)

    def kick(self) -> None:
        """Look for pending rows now (rows written by someone who cannot hand them over)."""
        self._wake.set()

    def submit(self, row: OutboxRow, *, first_part_begun: bool = False) -> None:
        """Queue a row just written, without a read of the pending rows.

        ``first_part_begun``: the commit that wrote the row also began its part 0 (see
        ``Store.inbox_finish``), so that part is sent without a commit of its own first.
        """
        if row.status != "pending" or row.id in self._known or row.platform not in self._channels:
            return
        self._known.add(row.id)
        if first_part_begun and row.in_flight == 0 and not row.sent_parts:
            self._begun.add(row.id)
        key = (row.platform, row.channel, row.thread)
        self._queues.setdefault(key, collections.deque()).append(row)
        if key not in self._active:
            task = asyncio.create_task(self._drain(key))
            self._active[key] = task
            task.add_done_callback(functools.partial(self._finished, key))

    @contextlib.contextmanager
    def handing_over(self, inbox_id: int) -> Iterator[None]:
        """While inside, the reply to ``inbox_id`` is the caller's to :meth:`submit`; scans
        of pending rows leave it alone. One the caller never submitted (it failed after the
        commit) is taken by the first scan after it left."""
        self._handovers[inbox_id] += 1
        try:
            yield
        finally:
            self._handovers[inbox_id] -= 1
            if self._handovers[inbox_id] <= 0:
                del self._handovers[inbox_id]

    async def run(self) -> None:
        """Deliver pending rows until stopped; a restart picks up whatever is left."""
        while not self._stopping:
            self._wake.clear()
            await self._schedule()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()

    async def _schedule(self) -> None:
        """Queue every pending row (one read serves every chat); rows already queued stay put.

        The read may show a row as it was before a delivery that finished while the read was
        out (reads and writes do not share one queue): such a row is not queued again, which
        would make its sent part look like an open outcome."""
        done: set[int] = set()
        self._scans.append(done)
        try:
            rows = await self._store.outbox_pending()
        except Exception:
            log.exception("outbox: cannot read pending rows")
            return
        finally:
            # By identity: another scan's set may be equal to this one.
            self._scans = [scan for scan in self._scans if scan is not done]
        for row in rows:
            if row.id in done or row.inbox_id in self._handovers:
                continue
            if not self._owner.holds(row.session_id):
                continue  # another replica's to send, or nobody's yet (see replicas/pickup.py)
            self.submit(row)

    async def stop(self, grace_s: float) -> None:
        """Deliver what is pending (replies of turns that just drained included) for up to
        ``grace_s``, then cancel what is still going; the rest is sent after a restart."""
        self._stopping = True
        self._wake.set()
        try:
            async with asyncio.timeout(grace_s):
                await self._schedule()
                while self._active:
                    await asyncio.gather(*self._active.values(), return_exceptions=True)
        except TimeoutError:
            log.warning(
                "outbox: %s chat(s) still had replies to send at shutdown", len(self._active)
            )
        tasks = list(self._active.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Not cut short: each ends by its own deadline, and one cancelled could leave a
        # second copy of a reply in the chat.
        await asyncio.gather(*self._copies, return_exceptions=True)

    def _release(self, key: ChatKey) -> None:
        """The chat's delivery task is ending: a row handed over from now on starts another.
        Done by the task itself, in its last step: a done callback runs a loop iteration
        later, and a row queued in between would be dropped with the ending task's queue."""
        self._active.pop(key, None)
        left = self._queues.pop(key, collections.deque())
        self._known.difference_update(row.id for row in left)
        # A later pass reads them afresh: a begun part 0 is then an open outcome, looked up
        # or resent once like any other.
        self._begun.difference_update(row.id for row in left)
        if left:
            # The chat stopped early (platform unwell, or a failure): a fresh pass decides.
            self._wake.set()

    def _finished(self, key: ChatKey, task: asyncio.Task[None]) -> None:
        if self._active.get(key) is task:  # cancelled before its first step: not released
            self._release(key)

    def sending(self, session_id: str) -> bool:
        """Whether a reply of the session is queued or going out here."""
        return any(row.session_id == session_id for q in self._queues.values() for row in q)

    def pending_destinations(self) -> int:
        return len(self._active)

    async def _drain(self, key: ChatKey) -> None:
        try:
            await self._drain_queue(self._queues[key])
        except Exception:
            log.exception("outbox delivery to %s failed", key[:2])
        finally:
            self._release(key)

    async def _drain_queue(self, queue: collections.deque[OutboxRow]) -> None:
        while queue:
            row = queue[0]
            try:
                await self.deliver(row)
            except Fenced as exc:
                # Its session runs on another replica now, which sends it: the chat's other
                # rows go on.
                log.info("outbox %s: %s", row.id, exc)
            except OutboxRowFinished as exc:
                # Finished by another delivery of the same row: nothing is left to send.
                log.error("outbox %s: %s", row.id, exc)
            except _Later:
                # The platform is unwell: this and later rows stay pending for the next pass.
                return
            except StoreError as exc:
                # The store is unwell: the row stays pending as the store last saw it, and a
                # pass that came at once would only fail again.
                pause, self._store_pause = (
                    self._store_pause,
                    min(self._store_pause * 2, STORE_RETRY_MAX_S),
                )
                log.error("outbox %s: %s; trying again in %.1f s", row.id, exc, pause)
                await self._sleep(pause)
                return
            self._store_pause = STORE_RETRY_FIRST_S
            queue.popleft()
            self._known.discard(row.id)
            for done in self._scans:
                done.add(row.id)

    async def deliver(self, row: OutboxRow) -> OutboxRow:
        """Send what is left of ``row``; the row as it ends up (still ``pending`` when the
        chat is to be tried again later, by :class:`_Later`, raised)."""
        try:
            async with self._owner.running(row.session_id, take=False):
                done = await self._deliver(row)
        except SessionElsewhere:
            raise Fenced(
                f"outbox {row.id}: not sent: its session's lease is not held here"
            ) from None
        if done.status != "pending" and self._on_finished is not None:
            try:
                self._on_finished(done)
            except Exception:
                log.exception("outbox %s: telling of its end failed", done.id)
        return done

    async def _deliver(self, row: OutboxRow) -> OutboxRow:
        channel = self._channels[row.platform]
        dest = Destination(cast(Platform, row.platform), row.channel, row.thread, row.reply_to)
        upload = None if row.file is None else self._upload(row.file)
        if isinstance(upload, str):
            log.error("outbox %s: %s", row.id, upload)
            return await self._store.outbox_finish(row.id, "failed", error=upload)
        if upload is not None:
            # A file goes as one message, its caption one part at most (send_file keeps
            # captions short).
            texts = (channel.render(row.text) if row.text.strip() else [])[:1] or [""]
        else:
            texts = channel.render(row.text) or ["(empty answer)"]
        # A spoken answer is one more part, after the text.
        speaking = self._speaking if row.speech is not None and upload is None else None
        count = len(texts) + (speaking is not None)
        # Begun by the commit that wrote the row, in this process, and not sent yet: neither
        # a lookup nor a blind resend, just the send.
        begun = row.id in self._begun
        self._begun.discard(row.id)
        for index, text in enumerate(texts):
            if index in row.sent_parts:
                continue
            # The first part replaces the answer's streamed preview, if it had one.
            edit_of = (row.preview or None) if index == 0 and upload is None else None
            part = OutboundPart(
                dest,
                text,
                part_key(row.id, index),
                index,
                len(texts),
                edit_of=edit_of,
                file=upload,
            )
            row = await self._deliver_part(
                channel, row, part, last=index == count - 1, begun=begun and index == 0
            )
            if row.status != "pending":
                return row
        if speaking is not None and len(texts) not in row.sent_parts:
            return await self._deliver_speech(channel, speaking, row, dest, len(texts))
        # Reached only when every part was recorded as sent before this pass.
        return await self._store.outbox_finish(row.id, "sent")

    async def _deliver_speech(
        self, channel: Channel, speaking: Speaking, row: OutboxRow, dest: Destination, index: int
    ) -> OutboxRow:
        """The row's last part: its speech, as a voice message. A speech service that fails
        for longer than a platform would be waited for costs the voice message, not the
        answer (its text went already): the row ends sent, its error saying so."""
        failures = 0
        while True:
            try:
                row, spoken, speech = await speaking.audio(row)
                break
            except AudioError as exc:
                failures += 1
                if exc.permanent or failures >= MAX_ATTEMPTS:
                    log.error("outbox %s: no spoken answer: %s", row.id, exc)
                    return await self._store.outbox_finish(
                        row.id, "sent", error=f"no spoken answer: {exc}"[:300]
                    )
                pause = min(exc.retry_after or 2.0**failures, 60.0)
                log.warning(
                    "outbox %s: speech failed (%s); trying again in %.1f s", row.id, exc, pause
                )
                await self._sleep(pause)
        voice = self._upload(spoken, voice=True)
        if isinstance(voice, str):
            log.error("outbox %s: no spoken answer: %s", row.id, voice)
            return await self._store.outbox_finish(
                row.id, "sent", error=f"no spoken answer: {voice}"
            )
        note = cut_note(speech, speaking.max_chars)
        caption = (channel.render(note) if note else [])[:1] or [""]
        part = OutboundPart(dest, caption[0], part_key(row.id, index), index, index + 1, file=voice)
        return await self._deliver_part(channel, row, part, last=True, begun=False)

    def _upload(self, stored: StoredFile, *, voice: bool = False) -> OutboundFile | str:
        """A file of the store to upload (a row's, or its spoken answer), or why it cannot be
        sent."""
        if self._files is None:
            return "this daemon keeps no file store, so the file cannot be sent"
        try:
            path = self._files.path(stored.sha256)
        except StoreError as exc:
            return str(exc)
        if not path.is_file():
            return f"the file {stored.name} is gone from the file store"
        return OutboundFile(path, stored.name, stored.media_type, stored.size, voice=voice)

    async def _deliver_part(
        self, channel: Channel, row: OutboxRow, part: OutboundPart, *, last: bool, begun: bool
    ) -> OutboxRow:
        """Send one part not recorded as sent: at once if just begun or an edit (repeating an
        edit is harmless), else after looking up an open outcome: resent if the platform says
        it did not arrive, resent blindly at most MAX_BLIND_RESENDS times where the platform
        cannot say."""
        if begun or part.edit_of is not None:
            return await self._send_part(channel, row, part, last=last, begun=begun)
        if row.in_flight == part.index:
            found = await self._reconciled(channel, row, part, last=last)
            if found:
                return await self._refresh(row)
            if found is None:
                # Not a lookup's "not there": a resend may make a second copy.
                if row.blind_resends >= MAX_BLIND_RESENDS:
                    return await self._store.outbox_finish(
                        row.id, "failed", error="delivery outcome unknown; not resent again"
                    )
                row = await self._store.outbox_note_blind_resend(row.id)
        return await self._send_part(channel, row, part, last=last)

    async def _reconciled(
        self, channel: Channel, row: OutboxRow, part: OutboundPart, *, last: bool
    ) -> bool | None:
        """After an open outcome: True if the part arrived (recorded as sent now), False if
        the platform says it did not, None where the platform cannot say."""
        if not isinstance(channel, Lookups):
            return None
        try:
            found = await channel.find_sent(part)
        except NotImplementedError:
            return None
        except ChannelError as exc:
            log.warning("outbox %s: lookup of part %s failed: %s", row.id, part.index, exc)
            raise _Later from exc
        if found is None:
            return False
        await self._store.outbox_part_sent(row.id, part.index, found.message_id, last=last)
        return True

    async def _send_part(
        self,
        channel: Channel,
        row: OutboxRow,
        part: OutboundPart,
        *,
        last: bool,
        begun: bool = False,
    ) -> OutboxRow:
        failures = 0
        while True:
            if not begun:
                row = await self._store.outbox_begin_part(row.id, part.index)
            begun = False  # a retry begins the part again, as any send does
            if not self._owner.holds(row.session_id):
                raise Fenced(f"outbox {row.id}: not sent: its session's lease is lost")
            try:
                sent = await channel.send(part)
            except SendUnknown as exc:
                log.warning("outbox %s part %s: outcome unknown: %s", row.id, part.index, exc)
                raise _Later from exc
            except ChannelError as exc:
                if exc.permanent:
                    log.error("outbox %s: %s gave up: %s", row.id, row.platform, exc)
                    # Refused, so not sent: a replay (chat/deadletters.py) sends the part
                    # plainly instead of as an open outcome.
                    await self._store.outbox_part_unsent(row.id, part.index)
                    return await self._store.outbox_finish(row.id, "failed", error=str(exc)[:300])
                if exc.retry_after is not None:
                    # A rate limit says nothing about the message; it was not sent.
                    await self._store.outbox_part_unsent(row.id, part.index)
                    await self._sleep(min(exc.retry_after, MAX_RETRY_AFTER_S))
                    continue
                failures += 1
                await self._store.outbox_part_unsent(row.id, part.index)
                if failures >= MAX_ATTEMPTS:
                    log.error("outbox %s: still failing after %s tries: %s", row.id, failures, exc)
                    raise _Later from exc
                pause = min(2.0**failures, 60.0) * random.uniform(0.8, 1.2)
                log.warning(
                    "outbox %s part %s: %s; trying again in %.1f s", row.id, part.index, exc, pause
                )
                await self._sleep(pause)
                continue
            return await self._note_sent(row, part, sent.message_id, last=last)

    async def _note_sent(
        self, row: OutboxRow, part: OutboundPart, message_id: str, *, last: bool
    ) -> OutboxRow:
        """Record a part the platform took. Only this process knows it went out: if the store
        refuses the record, it is kept trying (not dropped, which would make the part look
        unknown and be sent a second time where the platform cannot be asked)."""
        pause = STORE_RETRY_FIRST_S
        while True:
            try:
                return await self._store.outbox_part_sent(row.id, part.index, message_id, last=last)
            except OutboxRowFinished as exc:
                # Another delivery of the row finished it, so this part went out twice; the
                # row's own record stands, and trying again could never succeed.
                log.error(
                    "outbox %s part %s: sent as %s, but not recorded: %s",
                    row.id,
                    part.index,
                    message_id,
                    exc,
                )
                return exc.row
            except Fenced as exc:
                log.warning(
                    "outbox %s part %s: sent as %s after the session went to another "
                    "replica (%s); waiting for that one's record of it",
                    row.id,
                    part.index,
                    message_id,
                    exc,
                )
                task = asyncio.create_task(self._settle_copy(row, part, message_id))
                self._copies.add(task)
                task.add_done_callback(self._copies.discard)
                raise
            except StoreError as exc:
                log.error(
                    "outbox %s part %s: sent, but not recorded yet (%s); trying again in %.1f s",
                    row.id,
                    part.index,
                    exc,
                    pause,
                )
            await self._sleep(pause)
            pause = min(pause * 2, STORE_RETRY_MAX_S)

    async def _settle_copy(self, row: OutboxRow, part: OutboundPart, message_id: str) -> None:
        """A part this replica sent after it lost the session (paused, or cut off, between
        its lease check and the request). The new holder found the part open and looked it
        up before this message reached the platform, or could not look (Telegram): then it
        sent the part itself, and this message is a second copy, which is deleted once the
        holder's record shows another message. If the holder recorded this one (its lookup
        found it), gave the row up, or records nothing in time, the message stays: a second
        copy is better than none."""
        wait_s = min(max(self._owner.takeover_s, COPY_WAIT_MIN_S), COPY_WAIT_MAX_S)
        deadline = asyncio.get_running_loop().time() + wait_s
        channel = self._channels[row.platform]
        while True:
            try:
                current = await self._store.get_outbox(row.id)
            except StoreError as exc:
                log.warning("outbox %s: cannot read it: %s", row.id, exc)
                current = None
            recorded = None if current is None else current.sent_parts.get(part.index)
            if recorded is not None:
                if recorded != message_id:
                    await self._delete_copy(channel, row, part, message_id, recorded)
                return
            if current is not None and current.status != "pending":
                return
            if asyncio.get_running_loop().time() >= deadline:
                log.warning(
                    "outbox %s part %s: no record of it after %.0f s; message %s stays",
                    row.id,
                    part.index,
                    wait_s,
                    message_id,
                )
                return
            await asyncio.sleep(COPY_CHECK_S)

    async def _delete_copy(
        self, channel: Channel, row: OutboxRow, part: OutboundPart, copy: str, kept: str
    ) -> None:
        try:
            if not isinstance(channel, Edits):
                raise ChannelError(f"{row.platform} cannot delete a message")
            await channel.delete(part.destination, copy)
        except ChannelError as exc:
            log.error("outbox %s part %s: second copy %s left: %s", row.id, part.index, copy, exc)
            return
        log.warning(
            "outbox %s part %s: deleted %s, a second copy of %s sent by this replica after it "
            "lost the session",
            row.id,
            part.index,
            copy,
            kept,
        )

    async def _refresh(self, row: OutboxRow) -> OutboxRow:
        fresh = await self._store.get_outbox(row.id)
        return fresh if fresh is not None else row


class _Later(Exception):
    """Stop delivering to this chat for now; the row stays pending."""
