"""Which process runs a session's work: the seam between the chat and job paths and replicas.

A session's turns, job fires and replies run in one process at a time. With one process (the
embedded SQLite store) that is always this one: :class:`LocalOwner` says so and does nothing
else. Replicas sharing a PostgreSQL store hold a lease per session instead (the leased owner
in ``geodebot/replicas/``): there a session may be held by another replica, and everything a
session's work writes is fenced with its lease, so a replica that lost the session commits
nothing more for it.

The chat router, the scheduler, the fire runner, the outbox and the IPC server take a
required owner and ask it the same things whichever it is:

* :meth:`SessionOwner.hold`: may this process run the session's work now (taking it if
  nobody holds it)? :meth:`SessionOwner.holds`: is it held here now (nothing asked)?
* :meth:`SessionOwner.admit`: a message was just committed for the session; is handling it
  this process's work (the session's earlier work taken up first)?
* :meth:`SessionOwner.running`: while inside, the session's work runs here, its writes (and
  those of the tasks it starts) fenced, and the session counts as in use (its lease is kept).
  Raises :class:`SessionElsewhere` when another process holds it.
* :meth:`SessionOwner.subscribe_lost`: be told when a session held here is lost (another
  replica took it over), so its work here stops; :meth:`SessionOwner.subscribe_in_use`: be
  asked whether a session still has work here before it is let go.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = ["InUse", "LocalOwner", "LostCallback", "SessionElsewhere", "SessionOwner"]

# Told (session id, why) once for each session lost meanwhile.
LostCallback = Callable[[str, str], None]
# Whether the session still has work here (queued turns, replies being sent).
InUse = Callable[[str], bool]


class SessionElsewhere(Exception):
    """Another process holds the session: its work is that one's to do."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} is held by another replica")
        self.session_id = session_id


class SessionOwner(Protocol):
    @property
    def replica_id(self) -> str | None:
        """This process's name among the replicas sharing the store; None when it is the only
        one (nothing it claims needs to say who claimed it)."""

    @property
    def takeover_s(self) -> float:
        """How long a session held by a process that is gone may stay held before another
        can take it (a lease's time to live); 0 with one process."""

    def holds(self, session_id: str) -> bool:
        """Whether the session is held here now, without asking the store: false once this
        process may no longer know that nobody took it over (nothing more may go out)."""

    async def hold(self, session_id: str) -> bool:
        """Whether this process may run the session's work now: held here already, or taken
        now because nobody holds it. False: another process holds it (or the store could not
        be asked; the work waits for a later look)."""

    async def admit(self, session_id: str) -> bool:
        """A message was committed here for the session: whether handling it is this
        process's work now. True once what the session had waiting before it was taken up;
        False: it is another process's (which is woken to look)."""

    def running(self, session_id: str, *, take: bool = True) -> AbstractAsyncContextManager[None]:
        """While inside, the session's work runs here: held (taken now if nobody holds it and
        ``take``, else :class:`SessionElsewhere` is raised on entry), its writes fenced, and
        in use."""

    async def wake_holder(self, session_id: str) -> None:
        """Have the process holding the session look at its work (a message committed here
        that is that one's to answer)."""

    def subscribe_lost(self, callback: LostCallback) -> None:
        """Have ``callback`` told of each session this process loses from now on."""

    def subscribe_in_use(self, in_use: InUse) -> None:
        """Have ``in_use`` asked whether a session has work here before it is let go."""


class LocalOwner:
    """The only process using the store: every session is held here, nothing is fenced, and
    no session is ever lost."""

    @property
    def replica_id(self) -> None:
        return None

    @property
    def takeover_s(self) -> float:
        return 0.0

    def holds(self, session_id: str) -> bool:
        return True

    async def hold(self, session_id: str) -> bool:
        return True

    async def admit(self, session_id: str) -> bool:
        return True

    @contextlib.asynccontextmanager
    async def running(self, session_id: str, *, take: bool = True) -> AsyncIterator[None]:
        yield

    async def wake_holder(self, session_id: str) -> None:
        """Nobody else holds a session: there is no one to wake."""

    def subscribe_lost(self, callback: LostCallback) -> None:
        """Nothing is ever lost: the callback is never called."""

    def subscribe_in_use(self, in_use: InUse) -> None:
        """Nothing is ever let go: the predicate is never asked."""
