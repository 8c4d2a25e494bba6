"""The take-up: a session's unfinished messages, handled once by the replica that holds it now.

A replica that takes a session's lease (a message another replica committed, or one a replica
that died left) finds the session's unfinished inbox rows and hands each to its router, as if
accepted here: a row never handled is refused, answered as a command or queued; a row whose
turn had begun continues it. Per session it remembers the lease epoch whose take-up is done,
and holds a lock that makes every other row of the session wait for it: a row queued before
the session's earlier rows were taken up would run first, and a turn a replica left begun
would then be started over (its tool run a second time).
"""

from __future__ import annotations

import asyncio

from geodebot.chat.router import ChatRouter
from geodebot.replicas.owner import LeasedOwner
from geodebot.store.protocol import InboxOutboxStore

__all__ = ["SessionTakeUp"]


class SessionTakeUp:
    """Subscribes itself to ``owner``: run before a session's first row at a new epoch, and
    forgets a session lost."""

    def __init__(self, store: InboxOutboxStore, router: ChatRouter, owner: LeasedOwner) -> None:
        self._store = store
        self._router = router
        self._owner = owner
        self._taken_up: dict[str, int] = {}
        self._taking_up: dict[str, asyncio.Lock] = {}
        owner.subscribe_taken(self._taken)
        owner.subscribe_lost(self._lost)

    async def take_up(self, session_id: str) -> int:
        """The session's unfinished rows, now that this replica holds its lease: each handled
        once, as if accepted here; how many were handed over."""
        lease = self._owner.leases.lease(session_id)
        if lease is None:
            return 0  # not held here (any more): its holder takes it up
        return await self._take_up(session_id, lease.epoch, again=True)

    async def _taken(self, session_id: str, epoch: int) -> None:
        if self._taken_up.get(session_id) != epoch:
            await self._take_up(session_id, epoch, again=False)

    async def _take_up(self, session_id: str, epoch: int, *, again: bool) -> int:
        """:meth:`take_up` under the session's lock; ``again``: even if done at ``epoch``
        already (a look for rows other replicas committed since)."""
        lock = self._taking_up.setdefault(session_id, asyncio.Lock())
        async with lock:
            if not again and self._taken_up.get(session_id) == epoch:
                return 0
            with self._owner.taking_up(session_id):
                taken = await self._take_up_rows(session_id)
            self._taken_up[session_id] = epoch
            return taken

    async def _take_up_rows(self, session_id: str) -> int:
        rows = await self._store.inbox_unfinished(session_id)
        # A turn already begun goes first: messages another replica took in may be older
        # than it, yet it is the session's open turn, whose saved tool batch any later turn
        # would otherwise run as its own and then leave this one to start over.
        rows.sort(key=lambda row: (row.status != "running", row.id))
        taken = 0
        for row in rows:
            if self._router.holds_row(row.id):
                continue
            if row.status == "pending":
                # Never handled (taken in elsewhere), or queued by a replica that is gone:
                # refused, answered as a command or queued, as if accepted here.
                taken += await self._router.pick_up(row)
            elif self._router.take(row):
                taken += 1
            else:
                await self._store.inbox_finish(row.id, "dropped", detail="binding removed")
        return taken

    def _lost(self, session_id: str, why: str) -> None:
        self._taken_up.pop(session_id, None)
        lock = self._taking_up.get(session_id)
        if lock is not None and not lock.locked():
            del self._taking_up[session_id]
