"""``geodebot serve``: the long-running process and its lifecycle."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import AsyncExitStack

from geodebot.app import App, build_app
from geodebot.channels.ipc import IPCServer
from geodebot.config import Config
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, TurnResult
from geodebot.engine.tools.spec import Approver

log = logging.getLogger(__name__)


def ipc_handler(app: App) -> IPCServer:
    tools = app.config.tools.ipc_tools

    async def on_turn(session_id: str, text: str, approver: Approver) -> TurnResult:
        spec = SessionSpec(session_id, tools=tools, approver=approver)
        return await app.run_turn(Mode.IPC, spec, text)

    return IPCServer(app.socket_path, on_turn)


async def serve(config: Config) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with AsyncExitStack() as stack:
            app = await build_app(config, stack)
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
            ipc = ipc_handler(app)
            await ipc.start()
            stack.push_async_callback(ipc.close)
            log.info(
                "geodebot serving: state in %s, chat socket %s", app.state_dir, app.socket_path
            )
            await stop.wait()
            log.info("shutting down")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
