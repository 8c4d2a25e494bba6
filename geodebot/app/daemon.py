"""``geodebot serve``: the long-running process and its lifecycle."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager, closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from geodebot.app.build import App, build_app
from geodebot.app.reload import ConfigInForce, ConfigReloader
from geodebot.app.store import store_facts, store_place
from geodebot.channels.base import Destination, Typing
from geodebot.channels.factory import ChannelSupervisor, build_channels
from geodebot.channels.ipc import IPCServer, StatusHandler
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.ownership import LocalOwner, SessionElsewhere, SessionOwner
from geodebot.chat.pipeline import ChatHooks, build_chat
from geodebot.chat.router import ChatRouter
from geodebot.config.schema import Config, resolve_secret
from geodebot.engine.lanes import Grace, cancel_and_wait
from geodebot.engine.llm.audio import build_audio
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, TurnResult
from geodebot.engine.tools.authority import report_uncertain
from geodebot.engine.tools.spec import Approver
from geodebot.memory.recall import Recall
from geodebot.ops.heap import HeapKeeper
from geodebot.ops.sdnotify import SystemdNotifier
from geodebot.ops.status import Serving, StatusLine, status_report
from geodebot.replicas.daemon_lease import DaemonLease
from geodebot.replicas.leases import SessionLeases
from geodebot.replicas.owner import LeasedOwner
from geodebot.replicas.pickup import SessionPickUps
from geodebot.replicas.takeup import SessionTakeUp
from geodebot.scheduler.definitions import config_jobs
from geodebot.scheduler.fire_runner import ignore_fire
from geodebot.scheduler.job_scheduler import JobScheduler
from geodebot.scheduler.status import JobStatus
from geodebot.store.protocol import LeaseStore, ReceiptStore, Store
from geodebot.store.records import InboxRow, OutboxRow, StoreError

if TYPE_CHECKING:
    from geodebot.ops.console.live import LiveFeed
    from geodebot.ops.health import EngineMetrics

log = logging.getLogger(__name__)


def ipc_handler(app: App, owner: SessionOwner, on_status: StatusHandler | None = None) -> IPCServer:
    """The local chat socket. A turn runs here only while this process runs its session
    (chat/ownership.py), as a chat's does."""
    tools = app.config.tools.ipc_tools
    run_turn = app.run_turn

    async def on_turn(session_id: str, text: str, approver: Approver) -> TurnResult:
        spec = SessionSpec(session_id, tools=tools, approver=approver)
        try:
            async with owner.running(session_id):
                return await run_turn(Mode.IPC, spec, text)
        except SessionElsewhere:
            busy = f"Session {session_id} is running on another replica; ask that one."
            return TurnResult(session_id, "", "store_error", busy, error="SessionElsewhere")

    return IPCServer(app.config.socket_path, on_turn, on_status)


async def _sweep_receipts(store: ReceiptStore) -> None:
    # No call can still be running after a restart: what was admitted is uncertain.
    report_uncertain(await store.mark_admitted_uncertain("geodebot restarted while the call ran"))


async def serve(config: Config, notifier: SystemdNotifier | None = None) -> str | None:
    """Run until SIGTERM or SIGINT; or until it must stop at once, which it returns the reason
    of (the process then exits non-zero): with a shared store, this replica lost the daemon's
    lease; on SQLite, the store could not sync its log to disk.

    Every part that owns I/O is entered on one stack in the order it depends on the others,
    so leaving unwinds it backwards: the IPC socket closes, no new job fires and running
    turns (jobs and chats alike) get ``shutdown_grace_s`` once, their replies go out, and only
    then do the platform connections, the model clients and the store close.

    With ``[store] url`` several replicas may share the database, and every one serves: it
    takes in what its platforms bring it, runs the turns and job fires of the sessions it
    holds, and runs the scheduler (each fire's claim decides who runs it). What only one may
    take in (Telegram's poller, Discord's gateway) is the leader's, under the daemon's lease
    (replicas/daemon_lease.py); another replica takes that over when the leader stops.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _log_tasks, "asked for the tasks (SIGUSR1)")
    grace = config.daemon.shutdown_grace_s
    notifier = notifier or SystemdNotifier()
    status = StatusLine()
    lost: list[str] = []
    watch: asyncio.Task[None] | None = None
    try:
        async with AsyncExitStack() as stack:
            stack.enter_context(closing(notifier))
            # From the start: systemd only counts pings once READY=1 was sent.
            await stack.enter_async_context(_running(notifier.run_watchdog(status.line)))
            metrics = _metrics(config)
            live = _live_feed(config)
            observers = tuple(o for o in (metrics, live) if o is not None)
            app = await build_app(config, stack, observers=observers)
            if metrics is not None:
                metrics.known_tools = _known_tools(config, app)
            store = app.services.store

            def stop_now(why: str) -> None:
                lost.append(why)
                stop.set()

            # Nothing can be made durable any more, so nothing may be acked or sent: a restart
            # recovers what is on disk, and the platforms bring the rest again.
            store.on_broken(lambda exc: stop_now(f"the store cannot make writes durable: {exc}"))
            shared = await _shared(config, app, stack, stop_now)
            if shared is None:
                # No call can still be running: one process uses this store. With replicas,
                # a session's calls are swept by whoever takes the session over.
                await _sweep_receipts(store)
            turns_grace, sends_grace = Grace(grace), Grace(grace)
            daemon = await _enter_daemon(
                config,
                app,
                stack,
                metrics,
                turns_grace,
                live,
                shared=shared,
                sends_grace=sends_grace,
            )
            status.serving = daemon.serving
            reloads: set[asyncio.Task[bool]] = set()

            def reload() -> None:
                # systemd (Type=notify) shows the reload until READY=1 comes again.
                notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
                task = asyncio.create_task(_reload(daemon.reloader, notifier, status))
                reloads.add(task)
                task.add_done_callback(reloads.discard)

            loop.add_signal_handler(signal.SIGHUP, reload)
            ipc = ipc_handler(app, daemon.owner, status_report(daemon.serving))
            await stack.enter_async_context(ipc)
            log.info(
                "geodebot serving: replica %s, store %s, state in %s, chat socket %s, channels: %s",
                app.replica_id,
                store_place(config),
                config.state_dir,
                config.socket_path,
                ", ".join(daemon.serving.channels) or "none",
            )
            ready = _ready_when_connected(notifier, daemon.serving.supervisor, status, app)
            await stack.enter_async_context(_running(ready))
            await stop.wait()
            if lost:
                # Nothing a turn or the outbox does now can commit or be sent: no waiting.
                turns_grace.end_now()
                sends_grace.end_now()
                log.info("shutting down at once: %s", lost[0])
                notifier.stopping(f"stopping: {lost[0]}")
            else:
                log.info("shutting down (grace %s s)", grace)
                notifier.stopping(f"stopping: draining turns for up to {grace:g} s")
            # Turns, then sends, may each use the grace; past that the stop is stuck.
            expected = 0.0 if lost else 2 * grace
            watch = asyncio.create_task(_slow_shutdown(expected + SLOW_SHUTDOWN_S))
    finally:
        if watch is not None:
            watch.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return lost[0] if lost else None


async def _reload(reloader: ConfigReloader, notifier: SystemdNotifier, status: StatusLine) -> bool:
    log.info("reloading the config (SIGHUP)")
    try:
        return await reloader.reload()
    except Exception:
        log.exception("config reload failed; the config in force stays")
        return False
    finally:
        notifier.ready(status.line())


# A stop still unwinding this long after its graces ran out names what it waits for.
SLOW_SHUTDOWN_S = 10.0


async def _slow_shutdown(after_s: float) -> None:
    """Log the tasks a stop still waits for once it has taken ``after_s``: a stop that never
    ends (systemd then kills it) leaves the operator, and the next fix, its reason."""
    await asyncio.sleep(after_s)
    _log_tasks(f"still stopping after {after_s:.0f} s")


def _log_tasks(why: str) -> None:
    """Every task of the daemon and where it waits (also on SIGUSR1: a daemon that seems
    stuck tells what it is doing, without a debugger)."""
    me = asyncio.current_task()
    stuck = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    lines = []
    for task in stuck:
        frames = task.get_stack(limit=8)
        where = " <- ".join(
            f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
            for f in reversed(frames)
        )
        lines.append(f"  {task.get_name()}: {where or repr(task.get_coro())}")
    log.warning("%s; %d task(s) running:\n%s", why, len(stuck), "\n".join(lines))


@dataclass(frozen=True, slots=True)
class _Shared:
    """What replicas sharing a store hold (replicas/daemon_lease.py, replicas/leases.py)."""

    # The daemon's lease: its holder takes in what one replica at a time may (Telegram's
    # poller or webhook registration, Discord's gateway).
    lease: DaemonLease
    # The sessions whose turns run here.
    sessions: SessionLeases
    # Stops the replica (exit non-zero), saying why: the daemon's lease was lost, or leading
    # failed.
    stop: Callable[[str], None]

    # What status and health show of it (ops/status.py ReplicaState).
    @property
    def lost(self) -> str | None:
        return self.lease.lost

    def lease_figures(self) -> dict[str, object]:
        return self.lease.figures()

    def session_figures(self) -> dict[str, object]:
        return self.sessions.figures()

    async def peers(self) -> list[dict[str, object]]:
        return await self.lease.peers()


async def _shared(
    config: Config, app: App, stack: AsyncExitStack, stop_now: Callable[[str], None]
) -> _Shared | None:
    """With a shared store, the leases this replica will hold; None on SQLite, which one
    process uses at a time. Every replica serves: it takes in what its platforms spread over
    all of them, runs the turns of the sessions it holds and sends their replies. The loss of
    the daemon's lease stops the replica (it was paused or cut off: the process exits non-zero
    and its supervisor starts it afresh)."""
    if config.store.url is None:
        return None

    def on_lost(why: str) -> None:
        stop_now(f"the daemon's lease was lost: {why}")

    store = app.services.store
    ttl = config.store.lease_ttl_s
    lease = DaemonLease(store, app.replica_id, ttl_s=ttl, on_lost=on_lost)
    sessions = SessionLeases(store, app.replica_id, ttl_s=ttl)
    # Left after everything that runs turns: the sessions are let go once their work stopped.
    await stack.enter_async_context(sessions)
    return _Shared(lease, sessions, stop_now)


async def _lead(shared: _Shared, store: LeaseStore, supervisor: ChannelSupervisor) -> None:
    """Wait for the daemon's lease, then, fenced by it, take in what only its holder may,
    until cancelled. (The scheduler runs on every replica: each fire's claim decides who
    runs it, under the job's session lease.) If leading fails (a write refused because the
    lease was lost meanwhile, say), the replica stops: a replica that took in as the leader
    and no longer renews its lease must not run on."""
    try:
        await _leading(shared, store, supervisor)
    except Exception as exc:
        log.error("leading failed: %s", exc, exc_info=not isinstance(exc, StoreError))
        shared.stop(f"leading failed: {exc}")


async def _leading(shared: _Shared, store: LeaseStore, supervisor: ChannelSupervisor) -> None:
    daemon_lease = shared.lease
    try:
        lease = await daemon_lease.acquire()
    except asyncio.CancelledError:
        await daemon_lease.leave()
        raise
    async with daemon_lease:
        # The poller's and the gateway's tasks start in here, and keep the fence: a holder
        # that lost the lease commits no cursor.
        with store.fenced(lease):
            await supervisor.start_ingest()
            await asyncio.Event().wait()


@dataclass(frozen=True, slots=True)
class _Daemon:
    # The running daemon's parts, as status and health read them (ops/status.py).
    serving: Serving
    # Which process runs each session's work (chat/ownership.py).
    owner: SessionOwner
    # Reads the config file again on SIGHUP (app/reload.py).
    reloader: ConfigReloader


async def _enter_daemon(
    config: Config,
    app: App,
    stack: AsyncExitStack,
    metrics: EngineMetrics | None,
    turns_grace: Grace,
    live: LiveFeed | None = None,
    *,
    shared: _Shared | None = None,
    sends_grace: Grace,
) -> _Daemon:
    """Build the chat and job paths and enter them on ``stack``, connections first (so they
    close last), then the outbox, the router and the scheduler."""
    store = app.services.store
    owner: SessionOwner = LocalOwner() if shared is None else LeasedOwner(store, shared.sessions)
    # With replicas the channels take in only what every replica may until this one holds
    # the daemon's lease (see _lead).
    channels = build_channels(config, store, ingest_later=shared is not None)

    async def typing(destination: Destination) -> None:
        channel = channels[destination.platform]
        if isinstance(channel, Typing):
            await channel.typing(destination)

    # The audio services [voice] names (engine/llm/audio.py), closed after the chat path.
    transcriber, speaker = build_audio(config.voice, resolve_secret, config.voice_model_dir)
    for service in (transcriber, speaker):
        if service is not None:
            stack.push_async_callback(service.aclose)
    chat = build_chat(
        app.run_turn,
        store,
        app.bindings,
        channels,
        config,
        owner=owner,
        files=app.files,
        redactor=app.services.redactor,
        turns_grace=turns_grace,
        # The outbox's window is its own: replies of turns that used the whole grace still go.
        sends_grace=sends_grace,
        hooks=ChatHooks(
            typing=typing,
            job_status=JobStatus(store).for_binding,
            # A reply given up on is a new dead letter; a replayed one sent at last changes
            # what the decisions show (and a row sent like any other costs one check while no
            # page follows).
            on_reply_finished=(
                None
                if live is None
                else lambda row: live.publish("deadletters", session=row.session_id)
            ),
            on_approval_change=(
                None
                if live is None
                else lambda request: live.publish("approvals", session=request.session_id)
            ),
        ),
        # One process uses the store: what it left unanswered is its own. Replicas take up
        # each session's rows when they take the session (replicas/takeup.py).
        recover=shared is None,
        transcriber=transcriber,
        speaker=speaker,
        spend=app.services.spend,
        recall=Recall(store, store, config.memory) if config.memory.recall else None,
    )
    router, outbox = chat.router, chat.outbox
    scheduler = JobScheduler(
        app.run_turn,
        store,
        app.bindings,
        outbox.kick,
        config_jobs=functools.partial(config_jobs, config),
        grace=turns_grace,
        # A fire's start, end and delivery's outcome, shown on open /jobs pages at once.
        on_fire=(
            ignore_fire if live is None else lambda fire: live.publish("jobs", job=fire.job_id)
        ),
        owner=owner,
    )
    pickups = _pickups(store, owner, router, outbox)
    if app.relay is not None:

        def delivered(post: OutboxRow, message: InboxRow) -> None:
            outbox.submit(post)
            router.take(message)

        app.relay.connect(delivered)
    supervisor = ChannelSupervisor(channels, router.accept, chat.approvals.press)
    in_force = ConfigInForce(config, time.time())
    reloader = ConfigReloader(app, in_force, pairing=chat.pairing, jobs=store)
    serving = Serving(
        config=config,
        services=app.services,
        bindings=app.bindings,
        replica_id=app.replica_id,
        store_facts=store_facts(config),
        channels=channels,
        supervisor=supervisor,
        router=router,
        scheduler=scheduler,
        approvals=chat.approvals,
        deadletters=chat.deadletters,
        relay=app.relay,
        stored=chat.stored,
        in_force=in_force,
        replicas=shared,
    )
    if metrics is not None:
        # Both are made exactly when [daemon] http is set.
        assert live is not None
        from geodebot.ops.health import health_server

        await stack.enter_async_context(health_server(serving, metrics, live))
    await stack.enter_async_context(supervisor)
    await stack.enter_async_context(chat)
    if pickups is not None:
        # Sessions with work nobody does: left by a replica that stopped, or committed by
        # another replica for a session held here.
        await stack.enter_async_context(_running(pickups.run()))
    await supervisor.start()
    if shared is not None:
        await stack.enter_async_context(_running(_lead(shared, store, supervisor)))
    # After the channels: a catch-up run's answer can go out as soon as it is ready. On every
    # replica: each fire's claim, made under its job's session lease, decides who runs it.
    await stack.enter_async_context(scheduler)
    return _Daemon(serving, owner, reloader)


def _pickups(
    store: Store, owner: SessionOwner, router: ChatRouter, outbox: OutboxSender
) -> SessionPickUps | None:
    """With replicas: the look for sessions with work this replica should take up."""
    if not isinstance(owner, LeasedOwner):
        return None
    take_up = SessionTakeUp(store, router, owner)
    return SessionPickUps(store, owner.leases, take_up.take_up, outbox.kick)


def _metrics(config: Config) -> EngineMetrics | None:
    """The engine's counters, kept only for the health endpoint, so only when it is on.

    Its modules (prometheus_client, aiohttp's server) are imported then too: a daemon without
    the endpoint does not carry them.
    """
    if not config.daemon.http:
        return None
    from geodebot.ops.health import EngineMetrics

    return EngineMetrics()


def _live_feed(config: Config) -> LiveFeed | None:
    """What feeds the console's open pages, an engine observer; only with the endpoint on."""
    if not config.daemon.http:
        return None
    from geodebot.ops.console.live import LiveFeed

    return LiveFeed()


def _known_tools(config: Config, app: App) -> frozenset[str]:
    """Every tool name a session's plan can hold: the registry's, and what the config lists
    (MCP tools among them). Metrics count any other proposed name as ``other``."""
    listed = [
        *config.tools.ipc_tools,
        *config.tools.headless_tools,
        *(name for binding in config.bindings for name in binding.tools),
        *config.pairing.tools,
        *(name for job in config.jobs for name in job.tools),
    ]
    return frozenset(app.services.tools.registry.names()) | frozenset(listed)


async def _ready_when_connected(
    notifier: SystemdNotifier, supervisor: ChannelSupervisor, status: StatusLine, app: App
) -> None:
    """READY=1 once the store is open (it is by now) and every enabled channel connected;
    then the model SDKs load, unless a turn needed them first, and the heap keeper runs
    (ops/heap.py) until the daemon stops."""
    waiting = [name for name, event in supervisor.ready.items() if not event.is_set()]
    if waiting:
        notifier.status(f"starting: waiting for {', '.join(waiting)} to connect")
        await asyncio.gather(*(event.wait() for event in supervisor.ready.values()))
    notifier.ready(status.line())
    log.info("ready: every enabled channel is connected")
    await app.load_models()
    # The model SDKs were the last of start-up's long-lived objects.
    router = status.serving.router if status.serving is not None else None
    await HeapKeeper(busy=lambda: router is not None and any(router.load())).run()


@asynccontextmanager
async def _running(work: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """``work`` as a task for as long as the context lasts."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        await cancel_and_wait(task)
