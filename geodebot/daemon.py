"""``geodebot serve``: the long-running process and its lifecycle."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack

from geodebot.app import App, build_app
from geodebot.channels.base import Destination
from geodebot.channels.factory import ChannelSupervisor, build_channels
from geodebot.channels.ipc import IPCServer
from geodebot.channels.outbox import OutboxSender
from geodebot.channels.router import ChatRouter
from geodebot.config import Config
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, TurnResult
from geodebot.engine.tools.spec import Approver
from geodebot.scheduler.refusals import RefusalWatch
from geodebot.scheduler.service import JobScheduler
from geodebot.scheduler.status import JobStatus

log = logging.getLogger(__name__)


def ipc_handler(app: App) -> IPCServer:
    tools = app.config.tools.ipc_tools

    async def on_turn(session_id: str, text: str, approver: Approver) -> TurnResult:
        spec = SessionSpec(session_id, tools=tools, approver=approver)
        return await app.run_turn(Mode.IPC, spec, text)

    return IPCServer(app.socket_path, on_turn)


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


async def serve(config: Config) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    grace = config.daemon.shutdown_grace_s
    try:
        async with AsyncExitStack() as stack:
            refusals = RefusalWatch()
            app = await build_app(config, stack, observers=(refusals,))
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
                config.bindings,
                outbox,
                max_chars=max_chars,
                typing=typing,
                job_status=JobStatus(store).for_binding,
            )
            recovered = await router.recover()
            if recovered:
                log.info("answering %s message(s) accepted before the restart", recovered)
            scheduler = JobScheduler(app, config.bindings, outbox.kick, refusals=refusals)
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
            # After the channels: a catch-up run's answer can go out as soon as it is ready.
            await scheduler.start()

            ipc = ipc_handler(app)
            await ipc.start()
            stack.push_async_callback(ipc.close)
            log.info(
                "geodebot serving: state in %s, chat socket %s, channels: %s",
                app.state_dir,
                app.socket_path,
                ", ".join(channels) or "none",
            )
            await stop.wait()
            log.info("shutting down (grace %s s)", grace)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
