"""The session owner of replicas sharing a store: a session's work runs where its lease is.

:class:`LeasedOwner` answers the chat and job paths' questions (chat/ownership.py) with the
session leases (replicas/leases.py): a session is held here while this replica holds its
lease, its work's writes are fenced with that lease (``Store.fenced``), and the work counts
as the lease's use, so the lease is kept while it runs. A message committed for a session
nobody holds is taken by its home replica; before the first message at a new lease epoch is
handled, what the session had waiting is taken up (replicas/takeup.py), in order.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol

from geodebot.chat.ownership import InUse, LostCallback, SessionElsewhere
from geodebot.replicas.leases import SessionLeases
from geodebot.replicas.pickup import PICKUP_TOPIC
from geodebot.store.records import Lease, StoreError

__all__ = ["LeasedOwner"]

log = logging.getLogger(__name__)

# A session's take-up under way in this task: the rows it hands to the router are admitted
# without waiting for it (it is what they would wait for).
_TAKING_UP: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "geodebot_taking_up", default=None
)


class _Fencing(Protocol):
    def fenced(self, lease: Lease) -> contextlib.AbstractContextManager[None]: ...

    async def wake(self, topic: str, payload: str) -> None: ...


class LeasedOwner:
    """:class:`~geodebot.chat.ownership.SessionOwner` over this replica's session leases."""

    def __init__(self, store: _Fencing, leases: SessionLeases) -> None:
        self._store = store
        self.leases = leases
        # Told of a session held here at a new epoch, before its first admitted row is
        # handled (the take-up); None until one is subscribed.
        self._on_taken: Callable[[str, int], Awaitable[None]] | None = None

    @property
    def replica_id(self) -> str:
        return self.leases.replica_id

    @property
    def takeover_s(self) -> float:
        return self.leases.ttl_s

    def holds(self, session_id: str) -> bool:
        return self.leases.valid(session_id)

    async def hold(self, session_id: str) -> bool:
        return await self.leases.hold(session_id) is not None

    async def admit(self, session_id: str) -> bool:
        # A session not held here goes to its home replica (replicas/leases.py); this one
        # takes it only if it is the home, or once the home left it waiting (the pick-up).
        fresh = not self.leases.valid(session_id)
        lease = (
            await self.leases.hold(session_id)
            if not fresh or self.leases.is_home(session_id)
            else None
        )
        if lease is None:
            await self.wake_holder(session_id)
            return False
        if self._on_taken is not None and _TAKING_UP.get() != session_id:
            with self._store.fenced(lease):
                # Held just now (here, or by the pick-up loop, whose take-up may be under
                # way): what the session had waiting goes first, in order.
                await self._on_taken(session_id, lease.epoch)
        return True

    @contextlib.asynccontextmanager
    async def running(self, session_id: str, *, take: bool = True) -> AsyncIterator[None]:
        lease = await self.leases.hold(session_id) if take else self.leases.lease(session_id)
        if lease is None:
            raise SessionElsewhere(session_id)
        # Everything the work writes, and the tasks it starts write, is fenced.
        with self._store.fenced(lease), self.leases.using(session_id):
            yield

    @contextlib.contextmanager
    def taking_up(self, session_id: str) -> Iterator[None]:
        """While inside (the session's take-up), rows admitted in this task do not wait for
        the take-up."""
        token = _TAKING_UP.set(session_id)
        try:
            yield
        finally:
            _TAKING_UP.reset(token)

    async def wake_holder(self, session_id: str) -> None:
        try:
            await self._store.wake(PICKUP_TOPIC, session_id)
        except StoreError as exc:
            # Committed all the same: the holder's next look finds it.
            log.warning("the replica holding the session was not woken: %s", exc)

    def subscribe_lost(self, callback: LostCallback) -> None:
        self.leases.subscribe_lost(callback)

    def subscribe_in_use(self, in_use: InUse) -> None:
        self.leases.subscribe_in_use(in_use)

    def subscribe_taken(self, on_taken: Callable[[str, int], Awaitable[None]]) -> None:
        """Have ``on_taken(session_id, epoch)`` awaited before the first row admitted for a
        session held at a new epoch (the take-up, which decides itself what it still owes)."""
        self._on_taken = on_taken
