"""An adapter whose provider SDK loads when first needed, on a worker thread.

Importing the anthropic SDK takes over a second of CPU (thousands of modules), which the daemon
would otherwise spend before it connects to any platform and tells systemd it is ready.
``geodebot serve`` loads it right after READY (``App.load_models``); a turn that needs the
model before that waits for it, and a broken SDK fails that turn (and the warm-up's log line)
with the import's own error rather than the daemon's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
from collections.abc import Callable

from geodebot.engine.llm.types import LLMAdapter, LLMRequest, LLMResponse, StreamListener

log = logging.getLogger(__name__)


async def import_aside(module: str) -> None:
    """Import ``module`` on a daemon thread of its own. Not on the loop's executor: a stop
    that comes during the import (seconds, on a busy machine) would wait for it, as
    ``asyncio.run`` joins the executor's threads before the process can exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def work() -> None:
        error: BaseException | None = None
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting task, which raises it)
            error = exc
        # The loop is closed if the daemon stopped meanwhile: nobody waits any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=work, name=f"import {module}", daemon=True).start()
    await done


class DeferredAdapter:
    def __init__(
        self, provider: str, model: str, module: str, build: Callable[[], LLMAdapter]
    ) -> None:
        self._provider = provider
        self._model = model
        self._module = module
        self._build = build
        self._inner: LLMAdapter | None = None
        self._lock = asyncio.Lock()

    @property
    def provider(self) -> str:
        return self._provider

    @property
    def model(self) -> str:
        return self._model

    async def adapter(self) -> LLMAdapter:
        """The real adapter, importing its module first if that has not happened yet."""
        if self._inner is None:
            async with self._lock:
                if self._inner is None:
                    await import_aside(self._module)
                    self._inner = self._build()
        return self._inner

    async def warm(self) -> bool:
        """Load now; False (and the error in the log) if the SDK cannot be loaded."""
        try:
            await self.adapter()
        except Exception:
            log.exception("loading the %s SDK failed; turns will fail until fixed", self.provider)
            return False
        return True

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        return await (await self.adapter()).complete(request, on_stream=on_stream)

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()
