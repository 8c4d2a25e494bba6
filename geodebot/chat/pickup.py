"""Messages a standing-by replica receives, and how the serving replica takes them up.

Some platforms spread a bot's traffic over every replica: Slack over all of an app's open
Socket Mode connections, Telegram in webhook mode over the listeners behind its proxy. So
every replica keeps those open, standing by or not. A standing-by replica only commits what
they bring (:class:`StandbyIngress`: the same gate as the router's, then the inbox with
``pickup`` set to its id) so that the platform is acknowledged; it answers nothing. The
serving replica takes those rows up (:class:`PickUps`: woken by the standby's commit, and
looking now and then by itself) and does with each what it does after its own commit:
throttle, refuse, answer a command or queue the turn (:meth:`ChatRouter.pick_up`). The
inbox's ``(platform, event_id)`` key makes an event that two replicas took in one row.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from geodebot.channels.base import Inbound, Press, PressAnswer
from geodebot.chat.bindings import BindingIndex
from geodebot.chat.gate import commit
from geodebot.config.schema import BindingConfig
from geodebot.store.protocol import Store
from geodebot.store.records import InboxRow, StoreError

__all__ = ["PICKUP_POLL_S", "PICKUP_TOPIC", "STANDBY_PRESS", "PickUps", "StandbyIngress"]

log = logging.getLogger(__name__)

# A standing-by replica's commit wakes the serving one at once (LISTEN/NOTIFY on PostgreSQL);
# it also looks this often by itself, for a wake-up that was lost.
PICKUP_POLL_S = 2.0
PICKUP_TOPIC = "inbox_pickup"
STANDBY_PRESS = "That press reached a replica that is standing by; please press again."


class StandbyIngress:
    """The inbound sink of a standing-by replica's channels: commit, never answer."""

    def __init__(
        self,
        store: Store,
        bindings: BindingIndex | Sequence[BindingConfig],
        replica_id: str,
        max_chars: Mapping[str, int],
    ) -> None:
        self._store = store
        self._index = BindingIndex.of(bindings)
        self._replica_id = replica_id
        self._max_chars = max_chars
        self.counters: collections.Counter[str] = collections.Counter()

    async def accept(self, inbound: Inbound) -> None:
        """Returns once the message is committed (the adapter then acknowledges it)."""
        committed = await commit(
            self._store,
            self._index,
            self._max_chars,
            inbound,
            self.counters,
            pickup=self._replica_id,
        )
        if committed is None:
            return
        _, _, new = committed
        self.counters["committed" if new else "duplicate"] += 1
        if new:
            try:
                await self._store.wake(PICKUP_TOPIC)
            except StoreError as exc:
                # Committed all the same: the serving replica's next look finds it.
                log.warning("standby ingress: the serving replica was not woken: %s", exc)

    async def press(self, press: Press) -> PressAnswer:
        """A card's button pressed on this replica's connection: the waiting turn runs on
        the serving replica, which alone can decide it."""
        self.counters["presses"] += 1
        return PressAnswer(counted=False, text=STANDBY_PRESS)


class PickUps:
    """The serving replica's look, every ``poll_s``, for rows standing-by replicas
    committed; each is handed to ``pick_up`` (the router's, which handles a row once)."""

    def __init__(
        self,
        store: Store,
        pick_up: Callable[[InboxRow], Awaitable[bool]],
        *,
        poll_s: float = PICKUP_POLL_S,
    ) -> None:
        self._store = store
        self._pick_up = pick_up
        self._poll_s = poll_s
        self.picked = 0

    async def run(self) -> None:
        async with self._store.wakeups(PICKUP_TOPIC) as woken:
            while True:
                woken.clear()
                try:
                    await self.poll()
                except StoreError as exc:
                    log.error("cannot read the messages other replicas received: %s", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await woken.wait()

    async def poll(self) -> int:
        """Hand over what is waiting; returns how many rows were found."""
        rows = await self._store.inbox_to_pick_up()
        for row in rows:
            if await self._pick_up(row):
                self.picked += 1
        return len(rows)
