"""An adapter whose provider SDK loads when first needed, on a worker thread.

Importing the anthropic SDK takes over a second of CPU (thousands of modules), which the daemon
would otherwise spend before it connects to any platform and tells systemd it is ready.
``geodebot serve`` loads it right after READY (``App.load_models``); a turn that needs the
model before that waits for it, and a broken SDK fails that turn (and the warm-up's log line)
with the import's own error rather than the daemon's start.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable

from geodebot.engine.llm.types import LLMAdapter, LLMRequest, LLMResponse, StreamListener

log = logging.getLogger(__name__)


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
                    await asyncio.to_thread(importlib.import_module, self._module)
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
