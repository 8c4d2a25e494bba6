"""Leases, a mixin of both stores (see rows.py): one holder at a time for a named piece of
work, taken over only once it expires, and fencing for the holder's writes (migration 0013).

A lease is held until ``expires_at`` and renewed before then by its holder. Another holder
takes it only once it has expired, and the takeover raises ``epoch``. Every time here is the
database's clock (``Tx.now``), so replicas on machines whose clocks disagree still agree on
who holds what.

Fencing: a store told to write under a lease (:meth:`Leases.fence`) checks, inside every
write's own transaction, that the lease is still its holder's at the same epoch, and refuses
the write (:class:`Fenced`) otherwise. So a replica that was paused or cut off while another
took its lease over commits nothing after it comes back, whatever it was in the middle of.
On PostgreSQL the check reads the lease row ``FOR KEY SHARE`` (postgres_commit.py): a takeover,
which reads the row ``FOR UPDATE`` first, waits for the holder's writes in flight, and they
cannot commit after it. The holder's renewals (an UPDATE of ``expires_at`` alone) do not wait
for them: under ``FOR SHARE`` a steady stream of overlapping writes kept the row share-locked
without a gap, and the renewal waited behind them until the lease expired.
"""

from __future__ import annotations

from typing import Any

from geodebot.store.records import Fenced, Lease
from geodebot.store.rows import Row, Transactions, Tx

__all__ = ["FENCE", "Leases", "check_fence", "fence_holds", "refusal"]

_COLUMNS = "name, holder, epoch, expires_at, acquired_at"
_READ = f"SELECT {_COLUMNS} FROM leases WHERE name = ?"
# The lease row as the fencing check reads it: (holder, epoch), or no row.
FENCE = "SELECT holder, epoch FROM leases WHERE name = ?"


def _lease(row: Row, now: float) -> Lease:
    return Lease(row[0], row[1], int(row[2]), float(row[3]), float(row[4]), now)


def _ttl(ttl_s: float) -> float:
    if not ttl_s > 0:
        raise ValueError("a lease's ttl_s must be positive")
    return float(ttl_s)


async def check_fence(db: Tx, lease: Lease) -> None:
    """Raise :class:`Fenced` unless ``lease`` is still its holder's, at its epoch. Run inside
    the write's transaction, first."""
    row = await db.one(FENCE, (lease.name,), share=True)
    if not fence_holds(lease, row):
        raise refusal(lease, row)


def fence_holds(lease: Lease, row: Row | tuple[Any, ...] | None) -> bool:
    """Whether ``lease`` is still its holder's at its epoch, given the lease row :data:`FENCE`
    read in the write's transaction."""
    return row is not None and (row[0], int(row[1])) == (lease.holder, lease.epoch)


def refusal(lease: Lease, row: Row | tuple[Any, ...] | None) -> Fenced:
    """What refuses a write under ``lease`` that :func:`fence_holds` says is no longer its
    holder's."""
    now_held = "nobody" if row is None else f"{row[0]!r} (epoch {row[1]})"
    return Fenced(
        f"writes of {lease.holder!r} under lease {lease.name!r} (epoch {lease.epoch}) "
        f"refused: the lease is held by {now_held} now"
    )


class Leases:
    async def lease_acquire(self: Transactions, name: str, holder: str, ttl_s: float) -> Lease:
        """Take or renew the lease ``name`` for ``holder`` for ``ttl_s`` seconds, if it is free,
        expired or ``holder``'s already; return the lease as it then stands (its holder says
        whether it was taken). A takeover raises the epoch; a renewal keeps it."""
        ttl = _ttl(ttl_s)

        async def body(db: Tx) -> Lease:
            # Two candidates for a lease that does not exist yet: one after the other.
            await db.exclusive(f"lease:{name}")
            now = await db.now()
            row = await db.one(_READ, (name,), lock=True)
            if row is None:
                await db.run(
                    f"INSERT INTO leases ({_COLUMNS}) VALUES (?, ?, 1, ?, ?)",
                    (name, holder, now + ttl, now),
                )
                return Lease(name, holder, 1, now + ttl, now, now)
            current = _lease(row, now)
            if current.holder == holder:
                # Its own lease, even expired: nobody held it in between (the holder would
                # say so), so the epoch stays and nothing it wrote is fenced.
                await db.run("UPDATE leases SET expires_at = ? WHERE name = ?", (now + ttl, name))
                return Lease(name, holder, current.epoch, now + ttl, current.acquired_at, now)
            if current.expires_at > now:
                return current
            epoch = current.epoch + 1
            await db.run(
                "UPDATE leases SET holder = ?, epoch = ?, expires_at = ?, acquired_at = ? "
                "WHERE name = ?",
                (holder, epoch, now + ttl, now, name),
            )
            return Lease(name, holder, epoch, now + ttl, now, now)

        return await self._write(f"acquiring lease {name!r}", body, fenced=False)

    async def lease_renew(self: Transactions, lease: Lease, ttl_s: float) -> Lease | None:
        """Extend ``lease`` by ``ttl_s`` from now, if it is still its holder's at its epoch;
        None if it is not (another holder took it over)."""
        ttl = _ttl(ttl_s)

        async def body(db: Tx) -> Lease | None:
            now = await db.now()
            changed = await db.run(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND epoch = ?",
                (now + ttl, lease.name, lease.holder, lease.epoch),
            )
            if not changed:
                return None
            return Lease(lease.name, lease.holder, lease.epoch, now + ttl, lease.acquired_at, now)

        return await self._write(f"renewing lease {lease.name!r}", body, fenced=False)

    async def lease_release(self: Transactions, lease: Lease) -> bool:
        """End ``lease`` now, so another holder need not wait for it to expire; False if it was
        not its holder's any more. The row keeps the holder and epoch: the next one raises it."""

        async def body(db: Tx) -> bool:
            now = await db.now()
            changed = await db.run(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND epoch = ? "
                "AND expires_at > ?",
                (now, lease.name, lease.holder, lease.epoch, now),
            )
            return changed > 0

        return await self._write(f"releasing lease {lease.name!r}", body, fenced=False)

    async def leases(self: Transactions) -> list[Lease]:
        """Every lease, by name, as the database's clock reads now."""

        async def body(db: Tx) -> list[Lease]:
            now = await db.now()
            rows = await db.all(f"SELECT {_COLUMNS} FROM leases ORDER BY name")
            return [_lease(row, now) for row in rows]

        return await self._read("reading the leases", body)

    async def lease(self: Transactions, name: str) -> Lease | None:
        async def body(db: Tx) -> Lease | None:
            now = await db.now()
            row = await db.one(_READ, (name,))
            return None if row is None else _lease(row, now)

        return await self._read(f"reading lease {name!r}", body)
