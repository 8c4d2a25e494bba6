"""The daemon's lease, when replicas share a database (store/leases.py).

Every replica serves: it takes in what its platforms spread over all replicas and runs the
turns of the sessions it holds (replicas/leases.py). What only one replica at a time may do is
done by the holder of this lease, the leader: Telegram's poller (or its webhook registration)
and Discord's gateway. The others are members, and one of them takes over once the leader
stops renewing. (The scheduler runs on every replica: a fire's claim, made under its job's
session lease, decides who runs it; see scheduler/job_scheduler.py.)

The leader renews the lease every third of its time to live, and what it does under the lease
is fenced with it (``Store.fenced``), so after a takeover nothing of that commits. It also
keeps its own deadline on the
local monotonic clock (the time to live from just before its last successful renewal): past
it, the replica cannot know whether another one took over, so :meth:`DaemonLease.valid` turns
false and the lease counts as lost. A process paused past its deadline (SIGSTOP, a frozen
VM) finds that out the moment it runs again, before it sends anything on a platform.

Leading or not, a replica also says it is there every third of the time to live
(store/replicas.py) and removes itself when it stops: status pages list its peers from that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol, Self

from geodebot.engine.lanes import cancel_and_wait
from geodebot.store.protocol import LeaseStore, ReplicaStore
from geodebot.store.records import Lease, ReplicaRecord, StoreError

__all__ = ["LEAD_MARK", "LEASE_NAME", "MEMBER_MARK", "DaemonLease"]

log = logging.getLogger(__name__)

LEASE_NAME = "daemon"
# Logged when a replica finds another one leading, and when it leads itself (tests wait for
# these).
MEMBER_MARK = "replica: member"
LEAD_MARK = "replica: leading"
LEADER, MEMBER = "leader", "member"


class DaemonLeaseStore(LeaseStore, ReplicaStore, Protocol):
    """The lease and the replicas' roll call."""


class DaemonLease:
    """``async with`` after :meth:`acquire`: renews the lease until the block ends, then lets
    it go. ``on_lost`` is called once, with why, if the lease is lost meanwhile."""

    def __init__(
        self,
        store: DaemonLeaseStore,
        replica_id: str,
        *,
        ttl_s: float,
        on_lost: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._clock = clock
        self.lease: Lease | None = None
        self._deadline = 0.0
        self._lost: str | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._host = socket.gethostname()
        self._pid = os.getpid()
        # When this replica last said it was there, on the local clock, and as what.
        self._seen: tuple[float, str] | None = None

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, once it was."""
        return self._lost

    def figures(self) -> dict[str, object]:
        """What status, /healthz and /metrics show of it."""
        lease = self.lease
        return {
            "name": LEASE_NAME,
            "holder": lease.holder if lease is not None else None,
            "epoch": lease.epoch if lease is not None else None,
            "leading": self.valid(),
            # Changes of holder since the database began: each one a takeover or a handover.
            "takeovers": lease.epoch - 1 if lease is not None else None,
            "ttl_s": self.ttl_s,
            "deadline_in_s": round(self._deadline - self._clock(), 1) if lease else None,
            "lost": self._lost,
        }

    def valid(self) -> bool:
        """Whether this replica may still act as the lease's holder: held, not lost, and its
        local deadline not passed."""
        return self.lease is not None and self._lost is None and self._clock() < self._deadline

    async def acquire(self, on_member: Callable[[Lease], None] | None = None) -> Lease:
        """Wait until this replica holds the lease (what it then does, the caller fences
        with it). ``on_member`` is called each time another holder is found (a new one, or a
        new epoch). A store that cannot be reached is tried again; cancelling stops the wait."""
        seen: tuple[str, int] | None = None
        # A look a second at most: one query a second per member, and a lease let go (a
        # clean stop of the leader) is taken within it.
        pause = min(1.0, self.ttl_s / 3)
        while True:
            asked = self._clock()
            try:
                lease = await self._store.lease_acquire(LEASE_NAME, self.replica_id, self.ttl_s)
            except StoreError as exc:
                log.warning("replica %s: cannot reach the lease: %s", self.replica_id, exc)
                await asyncio.sleep(pause)
                continue
            if lease.holder == self.replica_id:
                self._hold(lease, asked)
                await self._say(LEADER)
                log.info(
                    "%s: replica %s holds lease %r (epoch %d)",
                    LEAD_MARK,
                    self.replica_id,
                    LEASE_NAME,
                    lease.epoch,
                )
                return lease
            if seen != (lease.holder, lease.epoch):
                seen = (lease.holder, lease.epoch)
                log.info(
                    "%s: replica %s serves; lease %r is held by %s (epoch %d) for %.1f s more",
                    MEMBER_MARK,
                    self.replica_id,
                    LEASE_NAME,
                    lease.holder,
                    lease.epoch,
                    max(0.0, lease.remaining_s),
                )
                if on_member is not None:
                    on_member(lease)
            await self._say(MEMBER)
            # Just after it would expire if its holder stopped renewing, but never longer than
            # a renewal period: a holder that lets it go is followed soon.
            await asyncio.sleep(min(pause, max(0.05, lease.remaining_s + 0.05)))

    def _hold(self, lease: Lease, asked: float) -> None:
        self.lease = lease
        # From just before the request: the database counted the time to live from later.
        self._deadline = asked + self.ttl_s

    async def __aenter__(self) -> Self:
        if self.lease is None:
            raise RuntimeError("acquire() the lease before entering it")
        self._renewing = asyncio.create_task(self._renew(), name="lease-renewal")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._renewing is not None:
            await cancel_and_wait(self._renewing)
        lease, self.lease = self.lease, None
        if lease is not None and self._lost is None:
            # A member takes over at once instead of waiting for the lease to expire.
            try:
                await self._store.lease_release(lease)
            except StoreError as error:
                log.warning("replica %s: cannot release the lease: %s", self.replica_id, error)
        await self.leave()

    async def leave(self) -> None:
        """This replica stops: it is no one's peer any more."""
        try:
            await self._store.replica_gone(self.replica_id)
        except StoreError as error:
            log.warning(
                "replica %s: cannot remove itself from the replicas: %s", self.replica_id, error
            )

    async def peers(self) -> list[dict[str, object]]:
        """The other replicas of the database, as each last said it was there."""
        rows: list[ReplicaRecord] = await self._store.replicas()
        return [
            {
                "id": row.replica_id,
                "role": row.role,
                "host": row.host,
                "pid": row.pid,
                "seen_s_ago": round(row.seen_s_ago, 1),
                # Each says it is there every third of the time to live.
                "silent": row.seen_s_ago > self.ttl_s,
                "up_s": round(row.read_at - row.started_at, 1),
            }
            for row in rows
            if row.replica_id != self.replica_id
        ]

    async def _say(self, role: str) -> None:
        """Tell the database this replica is there, as ``role``: at once when the role
        changes, else at most every quarter of the time to live (so at every renewal, which
        come a third apart)."""
        now = self._clock()
        if (
            self._seen is not None
            and self._seen[1] == role
            and now - self._seen[0] < self.ttl_s / 4
        ):
            return
        try:
            await self._store.replica_seen(
                self.replica_id, role=role, host=self._host, pid=self._pid
            )
        except StoreError as error:
            log.warning("replica %s: cannot say it is there: %s", self.replica_id, error)
            return
        self._seen = (now, role)

    async def _renew(self) -> None:
        period = self.ttl_s / 3
        # The deadline counts from before the acquire's request, which may have waited (on
        # the row lock of a holder paused mid-transaction, until the database ended that
        # transaction): renewed at once if less than two periods are left, not lost unrenewed.
        wait = min(period, max(0.0, self._deadline - self._clock() - 2 * period))
        while self._lost is None:
            await asyncio.sleep(wait)
            wait = period
            lease = self.lease
            assert lease is not None
            asked = self._clock()
            if asked >= self._deadline:
                # Not renewed within its time to live, or this process did not run (paused):
                # another replica may hold it now.
                self._lose(f"not renewed within {self.ttl_s:g} s")
                return
            try:
                renewed = await self._store.lease_renew(lease, self.ttl_s)
            except StoreError as exc:
                log.warning("replica %s: cannot renew the lease: %s", self.replica_id, exc)
                continue
            if renewed is None:
                current = await _current(self._store)
                self._lose(f"taken over by {current}")
                return
            self.lease = renewed
            self._deadline = asked + self.ttl_s
            await self._say(LEADER)

    def _lose(self, why: str) -> None:
        self._lost = why
        log.error("replica %s lost lease %r: %s", self.replica_id, LEASE_NAME, why)
        self._on_lost(why)


async def _current(store: LeaseStore) -> str:
    try:
        lease = await store.lease(LEASE_NAME)
    except StoreError:
        return "another replica"
    return "nobody" if lease is None else f"{lease.holder} (epoch {lease.epoch})"
