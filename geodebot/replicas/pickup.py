"""How a replica finds the sessions whose work it should take up, when replicas share the store.

Every replica takes in messages and commits them; the replica holding the session's lease
(replicas/leases.py) runs them. One that commits a message for a session another replica holds
wakes the others (``LISTEN/NOTIFY`` on PostgreSQL) about that session and leaves the row to
that holder. Each replica's :class:`SessionPickUps` then takes up at once the sessions a
wake-up names that it holds, or that nobody holds and it is home to; the others ignore it, so
a message costs one replica's look, not every replica's. Every :data:`PICKUP_POLL_S`, and after
a wake-up that named nothing (a listening connection made again: some may have been missed),
a replica looks for all sessions with work nobody else is doing (``Store.sessions_waiting``):
unanswered messages, or replies not yet sent, of sessions it holds or that nobody holds, such
as those of a replica that died. It takes each such session's lease and takes its work up:
the messages are answered (a turn a dead replica had begun continues) and the replies are
sent, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from geodebot.replicas.leases import SessionLeases
from geodebot.store.protocol import LeaseStore, WakeStore
from geodebot.store.records import StoreError

__all__ = ["PICKUP_POLL_S", "PICKUP_TOPIC", "SessionPickUps"]

log = logging.getLogger(__name__)

# A commit for a session held elsewhere wakes the other replicas at once (LISTEN/NOTIFY on
# PostgreSQL); each also looks this often by itself, for a wake-up that was lost and for
# sessions a replica that died left behind (once their leases expire).
PICKUP_POLL_S = 2.0
PICKUP_TOPIC = "inbox_pickup"
# A session nobody holds is taken at once by its home replica (replicas/leases.py); any other
# leaves it this long first, to the home or to the replica that took its message in and is
# taking the lease at that moment: replicas racing for it would only move the session.
CLAIM_AFTER_S = 1.0


class PickUpStore(LeaseStore, WakeStore, Protocol):
    """Which sessions have work nobody does, and the wake-ups that say so."""


class SessionPickUps:
    """A replica's look for sessions with work it should do; ``take_up(session_id)`` (the
    router's) handles the session's unfinished messages once its lease is held here, and
    ``kick()`` (the outbox's) has its unsent replies read and sent."""

    def __init__(
        self,
        store: PickUpStore,
        leases: SessionLeases,
        take_up: Callable[[str], Awaitable[int]],
        kick: Callable[[], None],
        *,
        poll_s: float = PICKUP_POLL_S,
        claim_after_s: float = CLAIM_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._leases = leases
        self._take_up = take_up
        self._kick = kick
        self._poll_s = poll_s
        self._claim_after_s = claim_after_s
        self._clock = clock
        # Sessions nobody held when last looked at: when each was first seen so.
        self._unheld: dict[str, float] = {}
        self.picked = 0

    async def run(self) -> None:
        async with self._store.wakeups(PICKUP_TOPIC) as woken:
            look_all_at = self._clock()
            while True:
                named, unnamed = woken.take()
                try:
                    if unnamed or self._clock() >= look_all_at:
                        look_all_at = self._clock() + self._poll_s
                        await self.poll()
                    elif named:
                        await self.look_at(named)
                except StoreError as exc:
                    log.error("cannot look for sessions with work waiting: %s", exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, look_all_at - self._clock())):
                        await woken.wait()

    async def poll(self) -> int:
        """Take up what is waiting; returns how many messages were taken up."""
        sessions = await self._store.sessions_waiting(self._leases.replica_id)
        now = self._clock()
        self._unheld = {sid: self._unheld.get(sid, now) for sid in sessions}
        # A session whose home is another replica is left to it for a moment first.
        due = [
            sid
            for sid in sessions
            if self._leases.valid(sid)
            or self._leases.is_home(sid)
            or now - self._unheld[sid] >= self._claim_after_s
        ]
        return await self._take(due, kick=True)

    async def look_at(self, sessions: set[str]) -> int:
        """Take up the sessions a wake-up named that are this replica's: held here, or held
        by nobody with this replica their home (:meth:`poll` finds the rest, if any)."""
        mine = sorted(
            sid for sid in sessions if self._leases.valid(sid) or self._leases.is_home(sid)
        )
        # Replies wait only in a session taken just now (a dead holder's unsent ones): the
        # outbox sends a held session's own as they are written.
        fresh = any(not self._leases.valid(sid) for sid in mine)
        return await self._take(mine, kick=fresh)

    async def _take(self, sessions: list[str], *, kick: bool) -> int:
        # One claim for them all; what another replica claims at the same moment is its.
        held = await self._leases.hold_many(sessions) if sessions else {}
        taken = 0
        for session_id, lease in held.items():
            with self._store.fenced(lease):
                taken += await self._take_up(session_id)
        if held and kick:
            # Replies of the sessions held now (a dead replica's unsent ones among them).
            self._kick()
        self.picked += taken
        return taken
