"""What a running daemon says of itself: ``geodebot status`` (over the chat socket), the line
systemd shows, and the parts of ``/healthz`` (ops/health.py) that read the same figures.

The composition root (app/daemon.py) hands in a :class:`Serving`, the running daemon's parts
as these read them; with replicas, a :class:`ReplicaState` of the leases it holds
(replicas/), which this package does not import.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from geodebot.channels.base import Channel
from geodebot.channels.factory import ChannelSupervisor
from geodebot.chat.approvals import ChatApprovals
from geodebot.chat.bindings import BindingIndex
from geodebot.chat.deadletters import DeadLetters
from geodebot.chat.router import ChatRouter
from geodebot.chat.stored_bindings import StoredBindings
from geodebot.config.schema import Config
from geodebot.engine.session import COMPUTER_USE_SWITCH, EngineServices
from geodebot.engine.spend import utc_day
from geodebot.ops.procstat import process_figures
from geodebot.relay.tools import ThreadRelay
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.scheduler.status import job_lines
from geodebot.store.protocol import DeadLetterStore, SpendStore

__all__ = ["ReplicaState", "Serving", "StatusLine", "status_report", "unanswered", "usage_today"]

# What the status command is answered with (channels/ipc.py's StatusHandler).
StatusReport = Callable[[], Awaitable[dict[str, Any]]]


class ReplicaState(Protocol):
    """What a replica sharing the store shows of its leases (replicas/daemon_lease.py and
    replicas/leases.py)."""

    @property
    def lost(self) -> str | None:
        """Why the daemon's lease was lost, once it was (the replica then stops)."""

    def lease_figures(self) -> dict[str, object]:
        """The daemon's lease: holder, epoch, whether this replica leads, its deadline."""

    def session_figures(self) -> dict[str, object]:
        """The session leases held here."""

    async def peers(self) -> list[dict[str, object]]:
        """The other replicas, as each last said it was there."""


class ConfigFacts(Protocol):
    """The config in force (app/reload.py ConfigInForce): what a reload applied of the file
    is in ``config``; ``facts`` is what status shows of it."""

    @property
    def config(self) -> Config: ...

    def facts(self) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Serving:
    """The running daemon's parts, as status and health read them."""

    config: Config
    services: EngineServices
    bindings: BindingIndex
    # This process's name among the replicas, and the store they share (no password).
    replica_id: str
    store_facts: Mapping[str, Any]
    channels: Mapping[str, Channel]
    supervisor: ChannelSupervisor
    router: ChatRouter
    scheduler: JobScheduler
    approvals: ChatApprovals
    deadletters: DeadLetters
    relay: ThreadRelay | None = None
    # The bindings stored at run time, kept current in ``bindings``.
    stored: StoredBindings | None = None
    # The config file in force: its hash and when it was read (a reload changes them).
    in_force: ConfigFacts | None = None
    # With replicas: the leases this one holds.
    replicas: ReplicaState | None = None


async def unanswered(store: DeadLetterStore, alert_s: float) -> dict[str, Any]:
    """Messages accepted longer than ``alert_s`` ago and still without an answer."""
    late = await store.inbox_unanswered(alert_s)
    age = None if late.oldest_age_s is None else round(late.oldest_age_s, 1)
    return {"count": late.count, "oldest_age_s": age, "alert_s": alert_s}


async def usage_today(store: SpendStore, now: float) -> dict[str, Any]:
    """The model calls of the UTC day of ``now`` and what they used."""
    rows = await store.usage_report(by="all", since_day=utc_day(now))
    if not rows:
        return {"calls": 0}
    row = rows[0]
    return {
        "calls": row.calls,
        "input_tokens": row.input_tokens,
        "output_tokens": row.output_tokens,
        "cache_read_tokens": row.cache_read_tokens,
        "cache_write_tokens": row.cache_write_tokens,
        "cost_usd": round(row.cost_usd, 6),
    }


def status_report(serving: Serving) -> StatusReport:
    """The answer to ``geodebot status``: counted from when this is called (the start)."""
    started = time.time()
    store = serving.services.store
    supervisor, router, channels = serving.supervisor, serving.router, serving.channels
    cache = serving.services.context_cache
    replicas = serving.replicas
    replica = {"replica_id": serving.replica_id, "store": dict(serving.store_facts)}
    daemon = serving.config.daemon

    async def report() -> dict[str, Any]:
        running, queued = router.load()
        switch = await store.get_switch(COMPUTER_USE_SWITCH)
        now = time.time()
        return {
            "pid": os.getpid(),
            **replica,
            "lease": replicas.lease_figures() if replicas is not None else None,
            "sessions": replicas.session_figures() if replicas is not None else None,
            "peers": await replicas.peers() if replicas is not None else None,
            "uptime_s": round(now - started, 1),
            "ready": all(event.is_set() for event in supervisor.ready.values()),
            "channels": {
                name: {"connected": state.connected, "detail": state.detail}
                for name, state in ((n, c.status()) for n, c in sorted(channels.items()))
            },
            "turns_running": running,
            "queued": queued,
            # What the router did with chat messages: accepted, duplicate, throttled, ...
            "messages": dict(sorted(router.counters.items())),
            "max_concurrent_sessions": daemon.max_concurrent_sessions,
            "inbox": await store.inbox_counts(),
            "outbox": await store.outbox_counts(),
            "unanswered": await unanswered(store, daemon.unanswered_alert_s),
            "deadletters": await store.deadletter_count(),
            "computer_use": {
                "enabled": switch is not None and switch.active(now),
                "expires_at": None if switch is None else switch.expires_at,
            },
            "jobs": [
                {"id": line.job.id, "next": line.next_fire, "last": line.last_outcome}
                for line in await job_lines(store)
            ],
            "process": process_figures(),
            # Decoded histories kept between turns: bounded, so it grows only until it is full.
            "context_cache": cache.figures() if cache is not None else None,
            "model_usage_today": await usage_today(store, now),
            "config": serving.in_force.facts() if serving.in_force is not None else None,
            "bindings": {
                "config": len(serving.bindings.configured()),
                "stored": len(serving.bindings.stored()),
                "shadowed": len(serving.bindings.shadowed()),
            },
        }

    return report


class StatusLine:
    """The one-line summary systemd shows (``systemctl status``): "starting" until the
    daemon is :attr:`serving`."""

    def __init__(self) -> None:
        self.serving: Serving | None = None

    def line(self) -> str:
        if self.serving is None:
            return "starting"
        ready = self.serving.supervisor.ready
        connected = sum(event.is_set() for event in ready.values())
        running, queued = self.serving.router.load()
        return (
            f"serving: {connected}/{len(ready)} channels connected, "
            f"{running} turns running, {queued} queued"
        )
