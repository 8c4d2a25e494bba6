"""``geodebot serve``: the long-running process and its lifecycle."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from geodebot.app.build import App, build_app
from geodebot.channels.base import Channel, Destination
from geodebot.channels.factory import ChannelSupervisor, build_channels
from geodebot.channels.ipc import IPCServer, StatusHandler
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.router import ChatRouter
from geodebot.config.schema import Config, ConfigError, resolve_secret
from geodebot.engine.modes import Mode
from geodebot.engine.session import COMPUTER_USE_SWITCH, SessionSpec, TurnResult
from geodebot.engine.tools.spec import Approver
from geodebot.ops.procstat import process_figures
from geodebot.ops.sdnotify import SystemdNotifier
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.scheduler.refusals import RefusalWatch
from geodebot.scheduler.status import JobStatus, job_lines

if TYPE_CHECKING:
    from geodebot.ops.health import EngineMetrics, HealthServer

log = logging.getLogger(__name__)


def ipc_handler(app: App, on_status: StatusHandler | None = None) -> IPCServer:
    tools = app.config.tools.ipc_tools

    async def on_turn(session_id: str, text: str, approver: Approver) -> TurnResult:
        spec = SessionSpec(session_id, tools=tools, approver=approver)
        return await app.run_turn(Mode.IPC, spec, text)

    return IPCServer(app.socket_path, on_turn, on_status)


async def _sweep_receipts(app: App) -> None:
    # No call can still be running after a restart: what was admitted is uncertain.
    uncertain = await app.services.store.mark_admitted_uncertain(
        "geodebot restarted while the call ran"
    )
    for receipt in uncertain:
        log.warning(
            "effect receipt %s (%s in session %s) is uncertain; reconcile it with "
            "geodebot receipts resolve",
            receipt.id,
            receipt.tool,
            receipt.session_id,
        )


async def serve(config: Config, notifier: SystemdNotifier | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    grace = config.daemon.shutdown_grace_s
    notifier = notifier or SystemdNotifier()
    status = _Status()
    try:
        async with AsyncExitStack() as stack:
            stack.callback(notifier.close)
            # From the start: systemd only counts pings once READY=1 was sent.
            watchdog = asyncio.create_task(notifier.run_watchdog(status.line))
            stack.push_async_callback(_stop_task, watchdog)
            metrics = _metrics(config)
            refusals = RefusalWatch()
            observers = (refusals, metrics) if metrics else (refusals,)
            app = await build_app(config, stack, observers=observers)
            if metrics is not None:
                metrics.known_tools = _known_tools(config, app)
            await _sweep_receipts(app)
            store = app.services.store
            channels = build_channels(config, store)

            async def typing(destination: Destination) -> None:
                await channels[destination.platform].typing(destination)

            outbox = OutboxSender(store, channels)
            max_chars = {
                name: table.max_message_chars
                for name, table in (
                    ("telegram", config.channels.telegram),
                    ("slack", config.channels.slack),
                    ("discord", config.channels.discord),
                )
                if table is not None
            }
            router = ChatRouter(
                app,
                app.bindings,
                outbox,
                max_chars=max_chars,
                typing=typing,
                job_status=JobStatus(store).for_binding,
            )
            scheduler = JobScheduler(app, app.bindings, outbox.kick, refusals=refusals)
            if metrics is not None:
                health = _health_server(config, app, channels, router, scheduler, metrics)
                await health.start()
                stack.push_async_callback(health.stop)
            recovered = await router.recover()
            if recovered:
                log.info("answering %s message(s) accepted before the restart", recovered)
            sender = asyncio.create_task(outbox.run())
            supervisor = ChannelSupervisor(channels, router.accept)
            # Callbacks run last-pushed first: running turns drain, their replies go out,
            # and only then do the platform connections close.
            stack.push_async_callback(supervisor.stop)
            stack.push_async_callback(_stop_task, sender)
            stack.push_async_callback(outbox.stop, grace)
            stack.push_async_callback(router.drain, grace)
            # Pushed after the router's drain, so it runs before it: no new fires, running
            # job turns get the grace, and their results still reach the outbox.
            stack.push_async_callback(scheduler.stop, grace)
            await supervisor.start()
            status.supervisor, status.router = supervisor, router
            # After the channels: a catch-up run's answer can go out as soon as it is ready.
            await scheduler.start()

            ipc = ipc_handler(app, _status_report(app, supervisor, router, channels))
            await ipc.start()
            stack.push_async_callback(ipc.close)
            log.info(
                "geodebot serving: state in %s, chat socket %s, channels: %s",
                app.state_dir,
                app.socket_path,
                ", ".join(channels) or "none",
            )
            ready = asyncio.create_task(_ready_when_connected(notifier, supervisor, status, app))
            stack.push_async_callback(_stop_task, ready)
            await stop.wait()
            log.info("shutting down (grace %s s)", grace)
            notifier.stopping(f"stopping: draining turns for up to {grace:g} s")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _metrics(config: Config) -> EngineMetrics | None:
    """The engine's counters, kept only for the health endpoint, so only when it is on.

    Its modules (prometheus_client, aiohttp's server) are imported then too: a daemon without
    the endpoint does not carry them.
    """
    if not config.daemon.http:
        return None
    from geodebot.ops.health import EngineMetrics

    return EngineMetrics()


def _known_tools(config: Config, app: App) -> frozenset[str]:
    """Every tool name a session's plan can hold: the registry's, and what the config lists
    (MCP tools among them). Metrics count any other proposed name as ``other``."""
    listed = [
        *config.tools.ipc_tools,
        *config.tools.headless_tools,
        *(name for binding in config.bindings for name in binding.tools),
        *(name for job in config.jobs for name in job.tools),
    ]
    return frozenset(app.services.tools.registry.names()) | frozenset(listed)


def _health_server(
    config: Config,
    app: App,
    channels: Mapping[str, Channel],
    router: ChatRouter,
    scheduler: JobScheduler,
    metrics: EngineMetrics,
) -> HealthServer:
    from geodebot.ops.health import HealthServer, Probe

    token = None
    if config.daemon.http_token_env:
        token = resolve_secret(config.daemon.http_token_env)
        if not token:
            source = str(config.source or "<config>")
            name = config.daemon.http_token_env
            raise ConfigError(source, [f"daemon.http_token_env: {name} is not set"])
    store = app.services.store

    async def computer_use() -> tuple[bool, dict[str, Any]]:
        switch = await store.get_switch(COMPUTER_USE_SWITCH)
        if switch is None:
            return True, {"enabled": False}
        return True, {
            "enabled": switch.active(time.time()),
            "set_by": switch.set_by,
            "set_at": switch.set_at,
            "expires_at": switch.expires_at,
            "reason": switch.reason,
        }

    async def jobs() -> tuple[bool, dict[str, Any]]:
        return scheduler.running, {"jobs": scheduler.registered()}

    probe = Probe(
        store,
        channels,
        router_counters=lambda: router.counters,
        load=router.load,
        fire_counts=store.fire_counts,
        extra={"computer_use": computer_use, "scheduler": jobs},
    )
    assert config.daemon.http is not None
    return HealthServer(config.daemon.http, probe, metrics, token=token)


def _status_report(
    app: App, supervisor: ChannelSupervisor, router: ChatRouter, channels: Mapping[str, Channel]
) -> StatusHandler:
    started = time.time()
    store = app.services.store

    async def report() -> dict[str, Any]:
        running, queued = router.load()
        switch = await store.get_switch(COMPUTER_USE_SWITCH)
        now = time.time()
        return {
            "pid": os.getpid(),
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
            "max_concurrent_sessions": app.config.daemon.max_concurrent_sessions,
            "inbox": await store.inbox_counts(),
            "outbox": await store.outbox_counts(),
            "computer_use": {
                "enabled": switch is not None and switch.active(now),
                "expires_at": None if switch is None else switch.expires_at,
            },
            "jobs": [
                {"id": line.job.id, "next": line.next_fire, "last": line.last_outcome}
                for line in await job_lines(store)
            ],
            "process": process_figures(),
        }

    return report


class _Status:
    """The one-line summary systemd shows (``systemctl status``)."""

    def __init__(self) -> None:
        self.supervisor: ChannelSupervisor | None = None
        self.router: ChatRouter | None = None

    def line(self) -> str:
        if self.supervisor is None or self.router is None:
            return "starting"
        connected = sum(event.is_set() for event in self.supervisor.ready.values())
        running, queued = self.router.load()
        return (
            f"serving: {connected}/{len(self.supervisor.ready)} channels connected, "
            f"{running} turns running, {queued} queued"
        )


async def _ready_when_connected(
    notifier: SystemdNotifier, supervisor: ChannelSupervisor, status: _Status, app: App
) -> None:
    """READY=1 once the store is open (it is by now) and every enabled channel connected;
    then the model SDKs load, unless a turn needed them first."""
    waiting = [name for name, event in supervisor.ready.items() if not event.is_set()]
    if waiting:
        notifier.status(f"starting: waiting for {', '.join(waiting)} to connect")
        await asyncio.gather(*(event.wait() for event in supervisor.ready.values()))
    notifier.ready(status.line())
    log.info("ready: every enabled channel is connected")
    await app.load_models()


async def _stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
