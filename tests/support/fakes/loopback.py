"""What every fake server shares: an aiohttp application on 127.0.0.1, on an ephemeral port
unless one is given, started and stopped (or used with ``async with``); ``_stopping`` is set
while it stops, for handlers that hold a request to notice."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

from aiohttp import web

__all__ = ["LoopbackServer"]


class LoopbackServer:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    def _application(self) -> web.Application:
        """The application with the fake's routes."""
        raise NotImplementedError

    @property
    def root(self) -> str:
        """``http://127.0.0.1:<port>`` while running."""
        if self._runner is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return f"http://{self._host}:{self._port}"

    async def start(self) -> Self:
        if self._runner is not None:
            return self
        # Handlers that hold a request notice the stop flag within a poll, so cleanup never
        # waits long.
        runner = web.AppRunner(self._application(), access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._port = runner.addresses[0][1]
        self._stopping.clear()
        self._runner = runner
        return self

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stopping.set()
        await runner.cleanup()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
