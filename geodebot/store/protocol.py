"""The Store protocol: the union of its roles, each declared beside the mixin that implements
it (sessions.py, chat.py, ...), and of the lifecycle each backend provides itself (its record
types are in records.py).

Rules every implementation keeps:

* Messages and timeline events are append-only. A checkpoint inserts rows and updates one
  session row; it never rewrites or re-reads history, so its cost does not grow with history.
* Each method that writes is one transaction: it either happens whole or raises
  :class:`StoreError` and changes nothing.
* JSON payloads (``content``, ``state``, ``data``) are plain ``dict``/``list`` values; the store
  serialises them, callers never see SQL or driver types. One read gives a context's message
  contents as their JSON text (``load_context_json``), for the engine's one-pass decoding.
* SQL stays portable (no SQLite-only functions in queries) so a PostgreSQL implementation can
  follow with the same tests.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from geodebot.store.approvals import ApprovalStore
from geodebot.store.chat import InboxOutboxStore
from geodebot.store.deadletters import DeadLetterStore
from geodebot.store.jobs import JobStore
from geodebot.store.leases import LeaseStore
from geodebot.store.memory import MemoryStore
from geodebot.store.pairing import PairingStore
from geodebot.store.receipts import ReceiptStore
from geodebot.store.records import StoreError
from geodebot.store.relay import RelayStore
from geodebot.store.replicas import ReplicaStore
from geodebot.store.sessions import SessionStore
from geodebot.store.spend import SpendStore
from geodebot.store.wakeups import Wakeups

__all__ = [
    "ApprovalStore",
    "DeadLetterStore",
    "InboxOutboxStore",
    "JobStore",
    "LeaseStore",
    "MemoryStore",
    "PairingStore",
    "ReceiptStore",
    "RelayStore",
    "ReplicaStore",
    "SessionStore",
    "SpendStore",
    "Store",
    "StoreLifecycle",
    "SyncStore",
    "WakeStore",
]


class WakeStore(Protocol):
    """Wake-ups between processes sharing the store (pg_wakeups.py)."""

    async def wake(self, topic: str, about: str = "") -> None:
        """Tell other processes sharing the store to look at ``topic`` now (PostgreSQL:
        NOTIFY), at ``about`` (a session id, say) if given. A hint only: nothing on SQLite,
        whose one process needs none."""

    def wakeups(self, topic: str) -> AbstractAsyncContextManager[Wakeups]:
        """An event set whenever another process calls :meth:`wake` for ``topic`` (on
        SQLite: never), with what the wake-ups named. Waiters look by themselves now and then
        too: a wake-up may be lost."""


class SyncStore(Protocol):
    """Durability on demand, for writes made without it."""

    async def sync(self, *, within_s: float = 0.0) -> None:
        """Return once every write committed so far is as durable as a durable write's (for
        the writes made with ``durable=False`` where a method offers it, before the outside
        acts on them). ``within_s``: the store may take up to this much longer, to make the
        durable writes asked for meanwhile durable with the same sync."""


class StoreLifecycle(WakeStore, SyncStore, Protocol):
    """What each backend provides itself: opening, migrating, durability, wake-ups."""

    async def open(self) -> None:
        """Open the store and apply pending migrations."""

    async def close(self) -> None: ...

    async def schema_version(self) -> int: ...

    def on_broken(self, callback: Callable[[StoreError], None]) -> None:
        """Have ``callback`` called (once, on the event loop) if the store can no longer make
        any write durable, with why: the process should stop, and a restart recovers what is
        on disk. (SQLite: a sync of its log failed. PostgreSQL keeps its own durability and
        never calls it: a lost connection fails writes, and they are tried again.)"""

    version_found: int
    """The schema version :meth:`open` found, before it applied the pending migrations (0 for
    a new store): with :meth:`schema_version` after it, what this open migrated."""


class Store(
    SessionStore,
    ReceiptStore,
    ApprovalStore,
    InboxOutboxStore,
    DeadLetterStore,
    JobStore,
    LeaseStore,
    MemoryStore,
    PairingStore,
    RelayStore,
    ReplicaStore,
    SpendStore,
    StoreLifecycle,
    Protocol,
):
    """The whole store: every role (each declared beside the mixin that implements it) and
    the backend's lifecycle. A consumer that needs only some roles takes those."""
