"""Approvals in the chat: a card with two buttons for each call that needs a person.

A turn whose call needs approval, in a binding that names approvers, gets a :class:`ChatDesk`
(see ``ChatRouter``). The engine opens the durable request (bound to the exact call) and
hands it to the desk, which posts the card once, records where it went, and waits until the
request is decided or expires. A press goes through :meth:`ChatApprovals.press`: nothing in
it is trusted, so it counts only for a listed approver, in the card's own chat, on a pending
request that has not expired, and only the first one counts; every other press is answered
privately and changes nothing. The request, not the waiting turn, is what lasts: after a
restart the resumed turn finds it (and its card, or its decision) again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from geodebot.channels.base import (
    ApprovalCard,
    Cards,
    Channel,
    ChannelError,
    Destination,
    Platform,
    Press,
    PressAnswer,
    utc_minute,
)
from geodebot.config.schema import BindingConfig
from geodebot.engine.lanes import cancel_and_wait
from geodebot.logs.redact import Redactor
from geodebot.store.protocol import ApprovalStore, WakeStore
from geodebot.store.records import ApprovalRecord, Fenced, InboxRow, StoreError

log = logging.getLogger(__name__)

# Posting a card: attempts, and the longest Retry-After waited between them. A card that
# cannot be shown cannot be decided, so the request is expired instead of waiting unseen.
CARD_ATTEMPTS = 4
MAX_CARD_RETRY_AFTER_S = 60.0
NOT_VALID = "This button is not valid."
# Replicas: a waiting turn reads its request again this often, for a wake-up that was lost.
RECHECK_S = 5.0
APPROVALS_TOPIC = "approvals"


@dataclass(frozen=True, slots=True)
class ChatDesk:
    """One turn's approvers and the chat their cards go to (an ``ApprovalDesk``)."""

    approvals: ChatApprovals
    destination: Destination
    approvers: tuple[str, ...]
    timeout_s: float
    # Told what the turn waits for, and then how it went (the streamed preview shows it).
    on_wait: Callable[[str], None] | None = None

    async def settle(self, request: ApprovalRecord) -> ApprovalRecord:
        self._note(f"waiting for approval of {request.tool}")
        settled = await self.approvals.settle(self.destination, request)
        if settled.status == "approved":
            self._note(f"running {request.tool}…")
        else:
            self._note(f"{request.tool} was not approved")
        return settled

    def _note(self, text: str) -> None:
        if self.on_wait is not None:
            self.on_wait(text)


class ApprovalsStore(ApprovalStore, WakeStore, Protocol):
    """What the chat's approval cards keep and wake one another with."""


class ChatApprovals:
    """``async with`` it: leaving stops the card edits still under way."""

    def __init__(
        self,
        store: ApprovalsStore,
        channels: Mapping[str, Channel],
        *,
        redactor: Redactor | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_change: Callable[[ApprovalRecord], None] | None = None,
        may_send: Callable[[str], bool] | None = None,
        shared: bool = False,
    ) -> None:
        self._store = store
        # As the outbox's: false for a session whose lease this replica may no longer hold
        # (replicas/leases.py). A card goes on the platform outside the outbox; the replica that
        # took the session over shows it.
        self._may_send = may_send
        # Replicas share the store: a press taken in by one decides a request another's turn
        # waits on, which a wake-up between them tells at once (LISTEN/NOTIFY).
        self._shared = shared
        self._listening: asyncio.Task[None] | None = None
        # Told when a request is shown or settled here (the console's open pages follow it).
        self._on_change = on_change
        # The platforms that show cards; a turn elsewhere has no desk.
        self._cards = {name: c for name, c in channels.items() if isinstance(c, Cards)}
        self._redactor = redactor if redactor is not None else Redactor()
        self._clock = clock
        self._sleep = sleep
        # Per request a turn waits on: set when a press (or the console) decided it here.
        self._waiters: dict[str, asyncio.Event] = {}
        self._edits: set[asyncio.Task[None]] = set()
        self._parking = asyncio.Event()

    async def __aenter__(self) -> ChatApprovals:
        if self._shared:
            self._listening = asyncio.create_task(self._listen(), name="approval-wakeups")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._listening is not None:
            await cancel_and_wait(self._listening)
        for task in list(self._edits):
            task.cancel()
        await asyncio.gather(*self._edits, return_exceptions=True)

    def desk(
        self,
        row: InboxRow,
        binding: BindingConfig,
        on_wait: Callable[[str], None] | None = None,
    ) -> ChatDesk | None:
        """The desk for a turn answering ``row``; None when no card can be shown there. Its
        approvers are the binding's (maybe nobody); a call only the asker may approve
        (ToolSpec.asks_caller) goes to ``row.user`` alone."""
        if row.platform not in self._cards:
            return None
        # Where the reply goes: in its thread, answering the message (Slack threads a
        # channel's reply under the message it answers).
        destination = Destination(
            cast(Platform, row.platform), row.channel, row.thread, row.message_id
        )
        return ChatDesk(self, destination, binding.approvers, binding.approval_timeout_s, on_wait)

    async def _listen(self) -> None:
        """Requests decided on other replicas: every turn waiting here reads its own again
        (the wake-up does not say which; a turn whose request is still pending waits on)."""
        async with self._store.wakeups(APPROVALS_TOPIC) as woken:
            while True:
                await woken.wait()
                woken.clear()
                for waiter in list(self._waiters.values()):
                    waiter.set()

    def decided(self, request_id: str) -> None:
        """A request was decided elsewhere in this process (the console): its turn goes on."""
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            waiter.set()

    def decided_elsewhere(self, request: ApprovalRecord) -> None:
        """``request`` was decided (or expired) outside the chat, by the console: its turn
        goes on, and its card shows the outcome instead of buttons."""
        self.decided(request.id)
        self._edit_later(request)

    # -- the waiting turn -------------------------------------------------------------------
    async def settle(self, destination: Destination, request: ApprovalRecord) -> ApprovalRecord:
        # Listening before the request is read again: a press between that read and the
        # wait still wakes it.
        waiter = self._waiters.setdefault(request.id, asyncio.Event())
        try:
            request = await self._show(destination, request)
            self._changed(request)
            while request.status == "pending":
                left = request.expires_at - self._clock()
                if left <= 0:
                    request = await self._expire(request)
                    break
                # With replicas a decision elsewhere comes as a wake-up, which may be lost:
                # the request is read again now and then all the same.
                await self._wait(waiter, min(left, RECHECK_S) if self._shared else left)
                request = await self._store.get_approval(request.id) or request
        except asyncio.CancelledError:
            if not self._parking.is_set():
                # The turn was stopped (/stop): nobody waits for this decision any more.
                await asyncio.shield(self._expire(request))
            raise
        finally:
            self._waiters.pop(request.id, None)
        if self._shared and request.status in ("approved", "denied"):
            # Decided by a press that any replica may have taken in: the card is this
            # turn's, shown here, and its outcome is shown from here too.
            self._edit_later(request)
        self._changed(request)
        return request

    def _changed(self, request: ApprovalRecord) -> None:
        if self._on_change is not None:
            self._on_change(request)

    async def _wait(self, waiter: asyncio.Event, left: float) -> None:
        """Until a decision here, the expiry, or the daemon stopping: a waiting turn is then
        cancelled at once (its request stays pending, and the resumed turn waits again)
        rather than holding up the shutdown for its whole grace."""
        parking = asyncio.ensure_future(self._parking.wait())
        decided = asyncio.ensure_future(waiter.wait())
        try:
            await asyncio.wait(
                (parking, decided), timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            parking.cancel()
            decided.cancel()
        waiter.clear()
        if self._parking.is_set():
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)

    def park(self) -> None:
        """The daemon is stopping: turns waiting for a person stop now, requests kept."""
        self._parking.set()

    async def _show(self, destination: Destination, request: ApprovalRecord) -> ApprovalRecord:
        """Post the request's card unless it is up already (a resumed turn's request)."""
        if request.card.get("message_id"):
            return request
        # Marked first: a card posted by a run that then crashed is posted again once, which
        # is harmless (both cards decide the same request); one never shown is worse.
        address: dict[str, Any] = {
            "platform": destination.platform,
            "channel": destination.channel,
            "thread": destination.thread,
        }
        await self._store.approval_card(request.id, {**address, "state": "posting"})
        if not self._sending(request.session_id):
            raise Fenced(f"approval {request.id}: no card shown: the session's lease is lost")
        message_id = await self._post(destination, self._card(request))
        if message_id is None:
            return await self._expire(request)
        stored = await self._store.approval_card(request.id, {**address, "message_id": message_id})
        return stored if stored is not None else request

    async def _post(self, destination: Destination, card: ApprovalCard) -> str | None:
        channel = self._cards[destination.platform]
        for attempt in range(1, CARD_ATTEMPTS + 1):
            try:
                return (await channel.send_card(destination, card)).message_id
            except ChannelError as exc:
                log.warning(
                    "approval %s: the card could not be posted (attempt %s): %s",
                    card.approval_id,
                    attempt,
                    exc,
                )
                if exc.permanent:
                    break
                await self._sleep(min(exc.retry_after or 2.0**attempt, MAX_CARD_RETRY_AFTER_S))
        log.error("approval %s: no card could be shown; the request expires", card.approval_id)
        return None

    async def _expire(self, request: ApprovalRecord) -> ApprovalRecord:
        ended = await self._store.approval_expire(request.id)
        ended = ended if ended is not None else request
        self._edit_later(ended)
        return ended

    # -- presses ----------------------------------------------------------------------------
    async def press(self, press: Press) -> PressAnswer:
        request = await self._store.get_approval(press.approval_id)
        # Bound to the card's chat: an id shown in one chat decides nothing from another.
        if (
            request is None
            or request.card.get("platform") != press.platform
            or request.card.get("channel") != press.channel
        ):
            return PressAnswer(False, NOT_VALID)
        if press.user not in request.approvers:
            log.info("approval %s: a press by %s, who is not an approver", request.id, press.user)
            return PressAnswer(False, f"Only {', '.join(request.approvers)} may decide this.")
        counted = False
        if request.status == "pending":
            decided, counted = await self._store.approval_decide(
                request.id, press.approve, by=press.user, via="chat"
            )
            if decided is None:
                return PressAnswer(False, NOT_VALID)
            request = decided
            if counted or request.status == "expired":
                self.decided(request.id)
                if not self._shared:
                    self._edit_later(request)
                elif counted:
                    # The turn waiting for it may run on another replica: woken, it shows
                    # the outcome on the card itself (settle).
                    await self._wake_others()
        if press.message_id and press.message_id != request.card.get("message_id"):
            # A second copy of the card (posted again over a crash, or its id not recorded
            # yet) was pressed: it shows the outcome too, not buttons that do nothing.
            self._edit_later(request, press.message_id)
        if counted:
            return PressAnswer(True, "Approved." if press.approve else "Denied.")
        return PressAnswer(False, _already(request))

    # -- the card ---------------------------------------------------------------------------
    def _card(self, request: ApprovalRecord) -> ApprovalCard:
        return ApprovalCard(
            approval_id=request.id,
            tool=request.tool,
            safety=request.safety,
            summary=self._redactor.redact(request.summary),
            approvers=tuple(request.approvers),
            expires_at=request.expires_at,
            outcome=None if request.status == "pending" else _outcome(request),
        )

    def _edit_later(self, request: ApprovalRecord, message_id: str | None = None) -> None:
        """Show the outcome on the card (or on the card ``message_id``), without holding up
        the press's answer."""
        message_id = message_id or request.card.get("message_id")
        if not message_id or not request.card.get("platform"):
            return
        task = asyncio.create_task(self._edit(request, str(message_id)))
        self._edits.add(task)
        task.add_done_callback(self._edits.discard)

    async def _wake_others(self) -> None:
        try:
            await self._store.wake(APPROVALS_TOPIC)
        except StoreError as exc:
            # Decided all the same: the waiting turn reads it at its expiry, or sooner if
            # another wake-up comes.
            log.warning("the other replicas were not told of a decision: %s", exc)

    def _sending(self, session_id: str) -> bool:
        return self._may_send is None or self._may_send(session_id)

    async def _edit(self, request: ApprovalRecord, message_id: str) -> None:
        card = request.card
        channel = self._cards.get(str(card.get("platform")))
        # Any replica may show an outcome: the one that took the press in does (the card's
        # session may run on another), and showing it twice changes nothing.
        if channel is None:
            return
        destination = Destination(
            cast(Platform, card["platform"]), str(card["channel"]), card.get("thread")
        )
        for attempt in range(1, CARD_ATTEMPTS + 1):
            try:
                await channel.edit_card(destination, message_id, self._card(request))
                return
            except ChannelError as exc:
                if exc.permanent or attempt == CARD_ATTEMPTS:
                    log.warning("approval %s: the card was not updated: %s", request.id, exc)
                    return
                await self._sleep(min(exc.retry_after or 2.0**attempt, MAX_CARD_RETRY_AFTER_S))


def _outcome(request: ApprovalRecord) -> str:
    at = utc_minute(request.decided_at) if request.decided_at is not None else ""
    if request.status == "approved":
        return f"Approved by {request.decided_by}, {at}"
    if request.status == "denied":
        return f"Denied by {request.decided_by}, {at}: not run"
    return f"Expired, {at}: nobody decided in time, not run"


def _already(request: ApprovalRecord) -> str:
    if request.status == "expired":
        return "This request expired; the call was not run."
    return f"This was decided already: {_outcome(request)}."
