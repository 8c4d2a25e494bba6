"""The replicas sharing a database, a mixin of both stores (see rows.py; migration 0014).

Each replica says it is there every few seconds (:meth:`Replicas.replica_seen`, with its role:
leader or member) and removes itself when it stops, so any of them can list its peers
and how long ago each was last heard of. Times are the database's clock, like the leases':
replicas whose clocks disagree still agree on who was seen when. Not fenced: a replica that
lost the daemon's lease still says what it is until it has stopped.
"""

from __future__ import annotations

from typing import Protocol

from geodebot.store.records import ReplicaRecord
from geodebot.store.rows import Transactions, Tx

__all__ = [
    "PRUNE_AFTER_S",
    "ReplicaStore",
    "Replicas",
]

# A replica not heard of for this long (killed, its machine gone) is forgotten.
PRUNE_AFTER_S = 3600.0

_COLUMNS = "replica_id, role, host, pid, started_at, seen_at"


class ReplicaStore(Protocol):
    """The replicas sharing the store, as they last said they were there."""

    async def replica_seen(self, replica_id: str, *, role: str, host: str, pid: int) -> None:
        """Record that ``replica_id`` is there now, in ``role`` (leader, member)."""

    async def replica_gone(self, replica_id: str) -> None: ...

    async def replicas(self) -> list[ReplicaRecord]:
        """Every replica heard of in the last hour, with how long ago."""


class Replicas:
    async def replica_seen(
        self: Transactions, replica_id: str, *, role: str, host: str, pid: int
    ) -> None:
        """Record that ``replica_id`` is there now, in ``role``; its first call sets its start.
        Rows not seen for :data:`PRUNE_AFTER_S` go at the same time."""

        async def body(db: Tx) -> None:
            now = await db.now()
            await db.run(
                f"INSERT INTO replicas ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (replica_id) DO UPDATE SET role = excluded.role, "
                "host = excluded.host, pid = excluded.pid, seen_at = excluded.seen_at",
                (replica_id, role, host, pid, now, now),
            )
            await db.run("DELETE FROM replicas WHERE seen_at < ?", (now - PRUNE_AFTER_S,))

        await self._write(f"recording replica {replica_id!r}", body, fenced=False)

    async def replica_gone(self: Transactions, replica_id: str) -> None:
        """``replica_id`` stopped: it is no one's peer any more."""

        async def body(db: Tx) -> None:
            await db.run("DELETE FROM replicas WHERE replica_id = ?", (replica_id,))

        await self._write(f"removing replica {replica_id!r}", body, fenced=False)

    async def replicas(self: Transactions) -> list[ReplicaRecord]:
        """Every replica heard of, by id, as the database's clock reads now."""

        async def body(db: Tx) -> list[ReplicaRecord]:
            now = await db.now()
            rows = await db.all(f"SELECT {_COLUMNS} FROM replicas ORDER BY replica_id")
            return [
                ReplicaRecord(r[0], r[1], r[2], int(r[3]), float(r[4]), float(r[5]), now)
                for r in rows
            ]

        return await self._read("listing the replicas", body)
