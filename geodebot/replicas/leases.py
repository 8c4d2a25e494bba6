"""Which sessions this replica runs, when replicas share the store: one lease per session.

Every replica takes in messages (Slack spreads them over all, Telegram's webhooks too) and runs
turns, but a session's turns run on one replica at a time: the one that holds its lease,
``session:<id>`` (store/leases.py). A replica takes the lease when it finds work for a session
nobody holds (a message it committed, or one the pick-up loop found), keeps it while it has
work there and for :data:`LINGER_S` after, renewing every lease it holds in one statement
every third of the time to live, then lets it go, so that sessions spread over the replicas
as their traffic comes and goes.

Which replica should take a session nobody holds: its *home*, the live replica that ranks
first for it by rendezvous hashing (:meth:`SessionLeases.home`), so sessions spread evenly
however their messages come in (Telegram's poller, on one replica, takes in every message).
A replica that takes a message in for a session it is not the home of leaves it to the home,
which it wakes; any replica takes it after a moment if the home does not (replicas/pickup.py).

Each lease has its own local deadline, as the daemon's has (replicas/daemon_lease.py): past it the
replica can no longer know whether another took the session over, so :meth:`SessionLeases.lease`
no longer returns it and the session's work stops. Everything a turn writes is fenced with its
session's lease (``Store.fenced``), so a replica that was paused while another took over
commits nothing for that session when it resumes, and sends nothing: the outbox, previews and
approval cards check :meth:`SessionLeases.valid` first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from geodebot.engine.lanes import cancel_and_wait
from geodebot.engine.tools.authority import report_uncertain
from geodebot.store.leases import SESSION_PREFIX
from geodebot.store.protocol import LeaseStore, ReceiptStore, ReplicaStore
from geodebot.store.records import Lease, StoreError

__all__ = ["LINGER_S", "SessionLeases", "lease_name"]

log = logging.getLogger(__name__)

# A session's lease is kept this long after its last work, so a conversation's next message
# finds it here instead of moving the session (and its warm context cache) to another replica.
LINGER_S = 60.0


def lease_name(session_id: str) -> str:
    return f"{SESSION_PREFIX}{session_id}"


@dataclass(slots=True)
class _Held:
    lease: Lease
    # On the local monotonic clock: the time to live from just before the last successful
    # acquire or renewal.
    deadline: float
    last_used: float


class SessionLeaseStore(LeaseStore, ReplicaStore, ReceiptStore, Protocol):
    """The session leases, the replicas they are spread over, and the receipts of calls a
    lost session left open."""


class SessionLeases:
    """``async with`` it: renews the leases it holds until the block ends, then lets them go.

    Each ``on_lost(session_id, why)`` subscribed is called once for a lease lost meanwhile
    (another replica took it over, or it was not renewed in time); each ``in_use(session_id)``
    says whether the session still has work here (running or queued turns, replies being
    sent), which keeps its lease past :data:`LINGER_S`.
    """

    def __init__(
        self,
        store: SessionLeaseStore,
        replica_id: str,
        *,
        ttl_s: float,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self._on_lost: list[Callable[[str, str], None]] = []
        self._in_use: list[Callable[[str], bool]] = []
        self._linger_s = linger_s
        self._clock = clock
        self._held: dict[str, _Held] = {}
        # One acquire at a time per session: two messages of one session arriving together
        # ask the store once.
        self._taking: dict[str, asyncio.Future[Lease | None]] = {}
        self._renewing: asyncio.Task[None] | None = None
        # The replicas heard of within a time to live (store/replicas.py), this one among
        # them: where sessions nobody holds belong (home()).
        self._members: tuple[str, ...] = (replica_id,)
        # Work running here per session (using()): its lease is kept however long it takes.
        self._using: collections.Counter[str] = collections.Counter()
        self.taken = 0
        self.lost = 0

    def subscribe_lost(self, on_lost: Callable[[str, str], None]) -> None:
        """Have ``on_lost(session_id, why)`` told of each lease lost from now on."""
        self._on_lost.append(on_lost)

    def subscribe_in_use(self, in_use: Callable[[str], bool]) -> None:
        """Have ``in_use(session_id)`` asked before an idle session's lease is let go."""
        self._in_use.append(in_use)

    # -- asking ---------------------------------------------------------------------------
    def lease(self, session_id: str) -> Lease | None:
        """The session's lease if this replica holds it and its local deadline has not
        passed; None otherwise."""
        held = self._held.get(session_id)
        if held is None or self._clock() >= held.deadline:
            return None
        return held.lease

    def valid(self, session_id: str) -> bool:
        return self.lease(session_id) is not None

    def held(self) -> list[str]:
        return sorted(self._held)

    def home(self, session_id: str) -> str:
        """The live replica a session nobody holds belongs to: the one whose hash with the
        session's id ranks first, so each replica is home to an even share, and a replica
        joining or leaving moves only its own share."""
        return max(self._members, key=lambda member: _rank(member, session_id))

    def is_home(self, session_id: str) -> bool:
        return self.home(session_id) == self.replica_id

    async def refresh_members(self) -> None:
        """Read which replicas are there now (each says so every quarter time to live)."""
        try:
            rows = await self._store.replicas()
        except StoreError as exc:
            log.warning("cannot read the replicas: %s", exc)
            return
        live = {row.replica_id for row in rows if row.seen_s_ago <= self.ttl_s}
        self._members = tuple(sorted(live | {self.replica_id}))

    async def hold(self, session_id: str) -> Lease | None:
        """This replica's lease on the session, taken now if nobody else holds it; None if
        another replica does (or the store cannot be reached: the work waits for a look)."""
        lease = self.lease(session_id)
        if lease is not None:
            self._held[session_id].last_used = self._clock()
            return lease
        if session_id in self._using:
            # Lost here while its work still runs (being stopped): taken again only once
            # that work ended. Taken again at once, the lease could come back at the same
            # epoch, and nothing the stale work still wrote would be fenced.
            return None
        pending = self._taking.get(session_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
        self._taking[session_id] = future
        try:
            lease = await self._take(session_id)
            future.set_result(lease)
            return lease
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here: the waiters, if any, get it too
            raise
        finally:
            del self._taking[session_id]

    async def hold_many(self, session_ids: Sequence[str]) -> dict[str, Lease]:
        """:meth:`hold` for several sessions in one claim (``Store.lease_acquire_many``:
        rows another replica is claiming at the same moment are skipped, not waited for);
        the leases this replica holds afterwards, by session."""
        held = {sid: lease for sid in session_ids if (lease := self.lease(sid)) is not None}
        for sid in held:
            self._held[sid].last_used = self._clock()
        wanted = [
            sid for sid in dict.fromkeys(session_ids) if sid not in held and sid not in self._using
        ]
        if not wanted:
            return held
        asked = self._clock()
        try:
            taken = await self._store.lease_acquire_many(
                self.replica_id, [lease_name(sid) for sid in wanted], self.ttl_s
            )
        except StoreError as exc:
            log.warning("cannot take %d session lease(s): %s", len(wanted), exc)
            return held
        by_name = {lease.name: lease for lease in taken}
        for sid in wanted:
            lease = by_name.get(lease_name(sid))
            if lease is None:
                self._held.pop(sid, None)
            elif await self._kept(sid, lease, asked) is not None:
                held[sid] = lease
        return held

    async def _take(self, session_id: str) -> Lease | None:
        asked = self._clock()
        try:
            lease = await self._store.lease_acquire(
                lease_name(session_id), self.replica_id, self.ttl_s
            )
        except StoreError as exc:
            log.warning("session %s: cannot take its lease: %s", session_id, exc)
            return None
        if lease.holder != self.replica_id:
            self._held.pop(session_id, None)
            return None
        return await self._kept(session_id, lease, asked)

    async def _kept(self, session_id: str, lease: Lease, asked: float) -> Lease | None:
        """Hold ``lease``, taken by a request made at ``asked``; a fresh take first sweeps
        the session's admitted calls."""
        fresh = session_id not in self._held or self._held[session_id].lease.epoch != lease.epoch
        self._held[session_id] = _Held(lease, asked + self.ttl_s, asked)
        if fresh:
            self.taken += 1
            log.info(
                "session %s: replica %s holds its lease (epoch %d)",
                session_id,
                self.replica_id,
                lease.epoch,
            )
            if not await self._sweep(session_id, lease):
                # Nothing of the session runs here before its calls are swept: the next
                # look takes it again.
                del self._held[session_id]
                return None
        return lease

    async def _sweep(self, session_id: str, lease: Lease) -> bool:
        """A call admitted in the session and not finished was begun by a holder that is
        gone (no other can run one while this lease holds): it may or may not have run, so
        it is uncertain (``geodebot receipts resolve``), and a continued turn does not run it
        again."""
        try:
            with self._store.fenced(lease):
                uncertain = await self._store.mark_admitted_uncertain(
                    "the replica running the call stopped", session_id=session_id
                )
        except StoreError as exc:
            log.warning("session %s: cannot sweep its admitted calls: %s", session_id, exc)
            return False
        report_uncertain(uncertain)
        return True

    # -- keeping --------------------------------------------------------------------------
    async def __aenter__(self) -> SessionLeases:
        self._renewing = asyncio.create_task(self._keep(), name="session-leases")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._renewing is not None:
            await cancel_and_wait(self._renewing)
        names = [lease_name(sid) for sid in self._held]
        self._held.clear()
        if names:
            # Another replica takes these sessions at once instead of waiting for expiry.
            try:
                await self._store.lease_release_many(self.replica_id, names)
            except StoreError as exc:
                log.warning("cannot release the sessions' leases: %s", exc)

    async def _keep(self) -> None:
        period = self.ttl_s / 3
        await self.refresh_members()
        while True:
            await asyncio.sleep(period)
            await self.renew()
            await self.refresh_members()

    async def renew(self) -> None:
        """Renew every lease held (one statement), drop the lost ones, let idle ones go."""
        now = self._clock()
        for session_id, held in list(self._held.items()):
            if now >= held.deadline:
                self._lose(session_id, f"not renewed within {self.ttl_s:g} s")
        await self._let_idle_go(now)
        if self._held:
            await self._renew_held()

    async def _let_idle_go(self, now: float) -> None:
        idle = [
            sid
            for sid, held in self._held.items()
            if now - held.last_used >= self._linger_s
            and sid not in self._using
            and not any(in_use(sid) for in_use in self._in_use)
        ]
        if not idle:
            return
        for session_id in idle:
            del self._held[session_id]
        try:
            await self._store.lease_release_many(self.replica_id, [lease_name(s) for s in idle])
        except StoreError as exc:
            # They expire by themselves a time to live from now.
            log.warning("cannot release %d idle session lease(s): %s", len(idle), exc)

    async def _renew_held(self) -> None:
        asked = self._clock()
        names = {lease_name(sid): sid for sid in self._held}
        try:
            renewed = await self._store.lease_renew_many(self.replica_id, list(names), self.ttl_s)
        except StoreError as exc:
            log.warning("cannot renew the sessions' leases: %s", exc)
            return
        for lease in renewed:
            held = self._held.get(names[lease.name])
            if held is not None:
                held.lease, held.deadline = lease, asked + self.ttl_s
        kept = {lease.name for lease in renewed}
        for name, session_id in names.items():
            if name not in kept and session_id in self._held:
                self._lose(session_id, "taken over by another replica")

    @contextlib.contextmanager
    def using(self, session_id: str) -> Iterator[None]:
        """While inside, the session has work running here (a turn, a job's run, a reply
        going out): its lease is not let go, and lingers from when the work ends."""
        self._using[session_id] += 1
        self.touch(session_id)
        try:
            yield
        finally:
            self._using[session_id] -= 1
            if self._using[session_id] <= 0:
                del self._using[session_id]
            self.touch(session_id)

    def touch(self, session_id: str) -> None:
        """The session had work here now: its lease lingers from now."""
        held = self._held.get(session_id)
        if held is not None:
            held.last_used = self._clock()

    def _lose(self, session_id: str, why: str) -> None:
        self._held.pop(session_id, None)
        self.lost += 1
        log.error("session %s: replica %s lost its lease: %s", session_id, self.replica_id, why)
        for on_lost in self._on_lost:
            on_lost(session_id, why)

    def figures(self) -> dict[str, object]:
        """What status and /healthz show of it."""
        return {
            "held": len(self._held),
            "members": len(self._members),
            "taken": self.taken,
            "lost": self.lost,
            "ttl_s": self.ttl_s,
            "linger_s": self._linger_s,
        }


def _rank(member: str, session_id: str) -> bytes:
    return hashlib.sha256(f"{member}\0{session_id}".encode()).digest()
