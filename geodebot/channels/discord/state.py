"""What the roles of one Discord adapter share: its settings, the client once logged in, the
bound channels, the counters, the interactions awaiting an answer and the work in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp
import discord

from geodebot.channels.base import ChannelError, CursorStore, PressSink
from geodebot.config.schema import DiscordConfig


class DiscordState:
    """One adapter's shared state; each role object holds the same instance."""

    def __init__(
        self,
        config: DiscordConfig,
        token: str,
        *,
        bound_channels: Sequence[str],
        cursor_store: CursorStore | None,
    ) -> None:
        self.config, self.token = config, token
        self.bound = frozenset(bound_channels)
        self.cursors = cursor_store
        self.client: discord.Client | None = None
        self.presses: PressSink | None = None
        self.ingesting = False
        self.runner: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.attempted: dict[str, float] = {}  # part key -> first send, for find_sent
        # interaction id -> (token, when, acknowledged)
        self.interactions: dict[str, tuple[str, float, asyncio.Future[bool]]] = {}
        self.last_error = ""
        self.downloads: aiohttp.ClientSession | None = None  # opened on the first download
        self.counters: dict[str, int] = {
            "received": 0,
            "sent": 0,
            "downloaded": 0,
            "caught_up": 0,
            "malformed": 0,
            "presses": 0,
        }

    def bot_id(self) -> int | None:
        user = self.client.user if self.client is not None else None
        return user.id if user is not None else None

    async def messageable(self, channel: str) -> Any:
        if self.client is None:
            raise ChannelError("discord channel is not started")
        found = self.client.get_channel(int(channel))
        # Uncached (a DM): fetched, so that history knows it is a DM.
        return found if found is not None else await self.client.fetch_channel(int(channel))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
