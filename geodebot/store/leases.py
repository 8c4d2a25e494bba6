"""Leases, a mixin of both stores (see rows.py): one holder at a time for a named piece of
work, taken over only once it expires, and fencing for the holder's writes (migration 0013).

A lease is held until ``expires_at`` and renewed before then by its holder. Another holder
takes it only once it has expired, and the takeover raises ``epoch``. Every time here is the
database's clock (``Tx.now``), so replicas on machines whose clocks disagree still agree on
who holds what.

Fencing: a store told to write under a lease checks, inside every write's own transaction,
that the lease is still its holder's at the same epoch, and refuses the write
(:class:`Fenced`) otherwise. So a replica that was paused or cut off while another took its
lease over commits nothing after it comes back, whatever it was in the middle of. The lease
is the whole process's (``Store.fence``), or the work's own, for the writes issued from one
context (``Store.fenced``: a session's turn under ``session:<id>``, a channel's poller under
``channel:<name>``), or both (:class:`Fences`). Which leases a write is checked against is
read when the write is asked for, in the caller's context, and goes with the write: a group
commit runs the writes of many callers in a context of its own.
On PostgreSQL the check reads the lease row ``FOR KEY SHARE`` (postgres_commit.py): a takeover,
which reads the row ``FOR UPDATE`` first, waits for the holder's writes in flight, and they
cannot commit after it. The holder's renewals (an UPDATE of ``expires_at`` alone) do not wait
for them: under ``FOR SHARE`` a steady stream of overlapping writes kept the row share-locked
without a gap, and the renewal waited behind them until the lease expired. A bulk claim
(:meth:`Leases.lease_acquire_many`) locks the rows it would take over ``FOR UPDATE SKIP
LOCKED``: a lease with a write of its old holder in flight is not waited for but left for a
later claim, so the fencing holds there too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from geodebot.store.records import Fenced, Lease, StoreError
from geodebot.store.rows import Row, Transactions, Tx

__all__ = [
    "FENCE",
    "SESSION_PREFIX",
    "Fences",
    "LeaseStore",
    "Leases",
    "check_fence",
    "fence_holds",
    "refusal",
]

# A session's lease is named this and its id: one replica at a time runs its turns.
SESSION_PREFIX = "session:"
_COLUMNS = "name, holder, epoch, expires_at, acquired_at"
_READ = f"SELECT {_COLUMNS} FROM leases WHERE name = ?"
# The lease row as the fencing check reads it: (holder, epoch), or no row.
FENCE = "SELECT holder, epoch FROM leases WHERE name = ?"


class Fences:
    """The leases one store's writes are made under: the process's (:meth:`fence`), and the
    one of the context a write is asked for from (:meth:`fenced`). Each store has its own:
    its context variable is this object's, never a module's."""

    __slots__ = ("_context", "_process")

    def __init__(self) -> None:
        self._process: Lease | None = None
        self._context: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
            "geodebot.store.fenced", default=None
        )

    def fence(self, lease: Lease | None) -> None:
        self._process = lease

    @contextlib.contextmanager
    def fenced(self, lease: Lease) -> Iterator[None]:
        """Inside, the writes of this context, and of the tasks created in it meanwhile (they
        copy it), are made under ``lease``; an inner block's lease replaces an outer one's."""
        token = self._context.set(lease)
        try:
            yield
        finally:
            self._context.reset(token)

    def current(self) -> tuple[Lease, ...]:
        """The leases a write asked for now, from this context, is checked against."""
        process, context = self._process, self._context.get()
        if context is None:
            return () if process is None else (process,)
        if process is None or _same(process, context):
            return (context,)
        return (process, context)


def _same(one: Lease, other: Lease) -> bool:
    return (one.name, one.holder, one.epoch) == (other.name, other.holder, other.epoch)


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


class LeaseStore(Protocol):
    """Leases, the fences that check writes against them, and the sessions waiting for a holder."""

    def fence(self, lease: Lease | None) -> None:
        """From now on, refuse every write (:class:`Fenced`) unless ``lease`` is still its
        holder's at its epoch, checked in the write's own transaction; None: write freely."""

    def fenced(self, lease: Lease) -> contextlib.AbstractContextManager[None]:
        """While inside (a plain ``with``), refuse each write issued from this context, and
        from the tasks created in it meanwhile, unless ``lease`` is still its holder's at its
        epoch, checked in the write's own transaction as :meth:`fence`'s lease is (and that
        one too, if set). The lease is read when the write is asked for; an inner block's
        replaces an outer one's. Reads and the leases' own writes are never fenced."""

    async def lease_acquire(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Take the lease if free or expired, or renew it if ``holder``'s already; the lease
        as it then stands (held by someone else when it could not be taken)."""

    async def lease_renew(self, lease: Lease, ttl_s: float) -> Lease | None:
        """Extend a held lease from now; None if another holder has taken it over."""

    async def lease_release(self, lease: Lease) -> bool:
        """Let the lease go at once; False if it was no longer ``lease``'s."""

    async def lease(self, name: str) -> Lease | None: ...

    async def leases(self) -> list[Lease]: ...

    async def lease_renew_many(
        self, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """Extend by ``ttl_s`` from the database's clock each of ``names`` that ``holder``
        still holds (at its current epoch, even if expired meanwhile), in one statement; the
        renewed leases, by name: a name missing from them was lost. No names: no query."""

    async def lease_acquire_many(
        self, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """In one transaction, take each of ``names`` that is absent, expired or ``holder``'s
        already (renewed, epoch kept), leaving those another holder holds unexpired; a
        takeover raises the epoch. The leases ``holder`` holds afterwards, by name. Never
        waits for another claimer's locks: a row locked by another transaction (a claimer,
        or a write in flight under its holder) is not taken this time."""

    async def lease_release_many(self, holder: str, names: Sequence[str]) -> int:
        """End now each of ``names`` that ``holder`` still holds unexpired; how many."""

    async def leases_held(self, holder: str, prefix: str = "") -> list[Lease]:
        """The unexpired leases of ``holder`` whose names start with ``prefix``, by name."""

    async def sessions_waiting(self, holder: str) -> list[str]:
        """Ids of the sessions with work nobody else is doing: an inbox row pending or
        running, or an outbox row pending, and a lease ``session:<id>`` that is absent,
        expired or ``holder``'s; the session with the oldest such row first. One query, on
        the status indexes: cheap however many finished rows there are."""


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
                inserted = await db.run(
                    f"INSERT INTO leases ({_COLUMNS}) VALUES (?, ?, 1, ?, ?) "
                    "ON CONFLICT (name) DO NOTHING",
                    (name, holder, now + ttl, now),
                )
                if inserted:
                    return Lease(name, holder, 1, now + ttl, now, now)
                # A bulk claim (which takes no named lock) inserted it meanwhile.
                row = await db.one(_READ, (name,), lock=True)
                if row is None:  # nothing deletes a lease's row
                    raise StoreError(f"lease {name!r} was inserted and is gone")
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

    # -- many leases at once: the work a replica serves (``session:<id>``, ``channel:<name>``)

    async def lease_renew_many(
        self: Transactions, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """Extend by ``ttl_s`` from now each of ``names`` still held by ``holder`` (even
        expired, as :meth:`lease_renew`: nobody took it in between), in one statement; the
        renewed leases, by name. A name missing from the result was lost."""
        ttl = _ttl(ttl_s)
        wanted = sorted(set(names))
        if not wanted:
            return []

        async def body(db: Tx) -> list[Lease]:
            now = await db.now()
            # An UPDATE of expires_at alone: the holder's own writes in flight, which hold the
            # rows FOR KEY SHARE, do not hold it up (see the module's docstring).
            rows = await db.all(
                f"UPDATE leases SET expires_at = ? WHERE holder = ? AND name IN ({_marks(wanted)}) "
                "RETURNING name, epoch, acquired_at",
                (now + ttl, holder, *wanted),
            )
            renewed = (Lease(r[0], holder, int(r[1]), now + ttl, float(r[2]), now) for r in rows)
            return sorted(renewed, key=_by_name)

        return await self._write(f"renewing {len(wanted)} leases", body, fenced=False)

    async def lease_acquire_many(
        self: Transactions, holder: str, names: Sequence[str], ttl_s: float
    ) -> list[Lease]:
        """In one transaction, take each of ``names`` that is absent or expired, and renew
        those ``holder`` holds already, for ``ttl_s``; leave those another holder holds
        unexpired. The leases ``holder`` holds afterwards, by name. A takeover raises the
        epoch, as :meth:`lease_acquire`'s does.

        Replicas claim overlapping names at once without waiting for each other's
        transactions: an expired row another transaction has locked (a claimer, or a write
        in flight under its old holder) is skipped (``FOR UPDATE SKIP LOCKED``), and an absent
        name another claimer inserted first is not taken (``ON CONFLICT DO NOTHING``, in name
        order so two claimers never wait on each other in a cycle): not this time."""
        ttl = _ttl(ttl_s)
        wanted = sorted(set(names))
        if not wanted:
            return []

        async def body(db: Tx) -> list[Lease]:
            now = await db.now()
            until = now + ttl
            values = ", ".join("(?, ?, 1, ?, ?)" for _ in wanted)
            inserted = await db.all(
                f"INSERT INTO leases ({_COLUMNS}) VALUES {values} "
                "ON CONFLICT (name) DO NOTHING RETURNING name",
                [value for name in wanted for value in (name, holder, until, now)],
            )
            held = {row[0]: Lease(row[0], holder, 1, until, now, now) for row in inserted}
            rest = [name for name in wanted if name not in held]
            if rest:
                # Its own, even expired, as lease_acquire: the epoch stays. Not locked first:
                # an UPDATE of expires_at alone does not wait for its own writes in flight.
                renewed = await db.all(
                    f"UPDATE leases SET expires_at = ? WHERE holder = ? AND name IN "
                    f"({_marks(rest)}) RETURNING name, epoch, acquired_at",
                    (until, holder, *rest),
                )
                for row in renewed:
                    held[row[0]] = Lease(row[0], holder, int(row[1]), until, float(row[2]), now)
                rest = [name for name in rest if name not in held]
            if rest:
                # Others' expired ones, locked FOR UPDATE as lease_acquire's takeover is, so
                # none is taken while a write of its old holder is in flight; but a row locked
                # already is skipped rather than waited for.
                free = await db.all(
                    f"SELECT name FROM leases WHERE name IN ({_marks(rest)}) "
                    "AND holder <> ? AND expires_at <= ?",
                    (*rest, holder, now),
                    lock=True,
                    skip_locked=True,
                )
                if free:
                    taken = [row[0] for row in free]
                    rows = await db.all(
                        "UPDATE leases SET holder = ?, epoch = epoch + 1, expires_at = ?, "
                        f"acquired_at = ? WHERE name IN ({_marks(taken)}) RETURNING name, epoch",
                        (holder, until, now, *taken),
                    )
                    for row in rows:
                        held[row[0]] = Lease(row[0], holder, int(row[1]), until, now, now)
            return sorted(held.values(), key=_by_name)

        return await self._write(f"acquiring {len(wanted)} leases", body, fenced=False)

    async def lease_release_many(self: Transactions, holder: str, names: Sequence[str]) -> int:
        """End now each of ``names`` that ``holder`` still holds unexpired; how many it did."""
        wanted = sorted(set(names))
        if not wanted:
            return 0

        async def body(db: Tx) -> int:
            now = await db.now()
            return await db.run(
                "UPDATE leases SET expires_at = ? WHERE holder = ? AND expires_at > ? "
                f"AND name IN ({_marks(wanted)})",
                (now, holder, now, *wanted),
            )

        return await self._write(f"releasing {len(wanted)} leases", body, fenced=False)

    async def leases_held(self: Transactions, holder: str, prefix: str = "") -> list[Lease]:
        """The unexpired leases of ``holder`` whose names start with ``prefix``, by name."""

        async def body(db: Tx) -> list[Lease]:
            now = await db.now()
            rows = await db.all(
                f"SELECT {_COLUMNS} FROM leases WHERE holder = ? AND expires_at > ? "
                "AND name LIKE ? ESCAPE '\\' ORDER BY name",
                (holder, now, _like_prefix(prefix)),
            )
            # SQLite's LIKE ignores the case of ASCII letters; a name's prefix is exact.
            return [_lease(row, now) for row in rows if row[0].startswith(prefix)]

        return await self._read(f"reading the leases of {holder!r}", body)

    async def sessions_waiting(self: Transactions, holder: str) -> list[str]:
        """Sessions with work nobody else is doing, oldest work first: see the protocol."""

        async def body(db: Tx) -> list[str]:
            now = await db.now()
            rows = await db.tuples(_SESSIONS_WAITING, {"holder": holder, "now": now})
            return [row[0] for row in rows]

        return await self._read("reading the sessions waiting", body)


# Each part of the union reads its table through its status index (inbox_by_status,
# outbox_by_status), so finished rows, however many, are never looked at; the lease of each
# session found is a primary-key lookup (or, while the leases are few, one pass over them).
# One equality per part: with statistics (ANALYZE), SQLite reads ``status IN (...)`` of a
# column of a few values by scanning the whole table instead.
_SESSIONS_WAITING = f"""
SELECT work.session_id FROM (
    SELECT session_id, received_at AS since FROM inbox WHERE status = 'pending'
    UNION ALL
    SELECT session_id, received_at AS since FROM inbox WHERE status = 'running'
    UNION ALL
    SELECT session_id, created_at AS since FROM outbox WHERE status = 'pending'
) AS work
LEFT JOIN leases ON leases.name = '{SESSION_PREFIX}' || work.session_id
WHERE leases.name IS NULL OR leases.expires_at <= :now OR leases.holder = :holder
GROUP BY work.session_id
ORDER BY MIN(work.since), work.session_id
"""


def _marks(names: Sequence[str]) -> str:
    return ", ".join("?" for _ in names)


def _by_name(lease: Lease) -> str:
    return lease.name


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) for the names that start with ``prefix``."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"{escaped}%"
