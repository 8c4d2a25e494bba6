"""The real app, built in-process with the test tools of :mod:`tests.support.tools`."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

from geodebot.app.build import App, build_app
from geodebot.config.schema import Config
from geodebot.engine.session import Observer
from tests.support.tools import tool_registry


async def open_app(
    config: Config,
    stack: AsyncExitStack,
    marker: Path,
    observers: tuple[Observer, ...] = (),
) -> App:
    return await build_app(config, stack, registry=tool_registry(marker), observers=observers)
